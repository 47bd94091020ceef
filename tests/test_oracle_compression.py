"""Compressed AllReduce-SGD against its oracles: DGC and every compressor with error feedback.

Each test runs the library in SimWorld on a per-worker least-squares problem (float64, a weight
matrix and a bias, data that depends on the worker and the step), records every worker's
parameters after every step, and matches them to the oracle of ``tests/oracles/compression.py``
(a plain sequential program from the papers) to 1e-6. The oracle's gradients are written out by
hand. The invariants: at full density (ratio 1, a rank that holds the gradients, float32) the
compressors give AllReduce-SGD; what a worker sent plus its new residual is what it compensated,
at every step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from oracles import compression as oracle
from torch import nn

import gossamer
from gossamer.algorithms import (
    DGC,
    AllReduce,
    CompressionPreset,
    FP16AllReduce,
    PowerSGDAllReduce,
    QSGDAllReduce,
    RandomKAllReduce,
    TopKAllReduce,
    available,
    lookup,
)
from gossamer.comm import SimWorld
from gossamer.compress import (
    BF16,
    FP16,
    QSGD,
    DGCCompressor,
    DGCMemory,
    ErrorFeedback,
    NoCompression,
    PowerSGD,
    RandomK,
    TopK,
)

WORKERS = 4  # a power of two: dividing a float32 sum by it is exact
ROWS = 4
LR = 0.02
DECAY = 0.01
ATOL = 1e-6


def _data(rank: int, step: int, d_in: int, d_out: int, rows: int = ROWS, scale: float = 1.0
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``rank``'s batch at ``step``: inputs ``(rows, d_in)`` and targets, which differ
    in scale between workers (all of them times ``scale``)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    a = torch.randn(rows, d_in, generator=g, dtype=torch.float64)
    b = torch.randn(rows, d_out, generator=g, dtype=torch.float64) * (rank + 1) * scale
    return a, b


def _grad_fn(d_in: int, d_out: int, scale: float = 1.0) -> oracle.GradFn:
    """The gradient of ``0.5 ||a W^T + c - b||^2 / ROWS``, by hand."""
    def grad(rank: int, step: int, x: oracle.Params) -> oracle.Params:
        a, b = _data(rank, step, d_in, d_out, scale=scale)
        r = a @ x["weight"].T + x["bias"] - b
        return {"weight": r.T @ a / ROWS, "bias": r.sum(0) / ROWS}
    return grad


def _initial(d_in: int, d_out: int) -> oracle.Params:
    g = torch.Generator().manual_seed(7)
    return {"weight": torch.randn(d_out, d_in, generator=g, dtype=torch.float64) * 0.3,
            "bias": torch.randn(d_out, generator=g, dtype=torch.float64) * 0.3}


@dataclasses.dataclass(frozen=True)
class Sgd:
    """The torch.optim.SGD every worker wraps."""

    momentum: float = 0.5
    nesterov: bool = False
    weight_decay: float = DECAY
    lr: float = LR

    def build(self, model: nn.Module) -> torch.optim.SGD:
        return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=self.momentum,
                               nesterov=self.nesterov, weight_decay=self.weight_decay)

    def options(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def run_library(algorithm, sgd: Sgd, steps: int, *, d_in: int = 12, d_out: int = 8,
                rows: int = ROWS, dtype: torch.dtype = torch.float64, inspect=None,
                schedule=None, schedule_first: bool = True, workers: int = WORKERS,
                scale: float = 1.0, total_steps: int | None = None):
    """``trajectory[k][w]``: worker w's parameters after step k + 1 in SimWorld (of
    ``workers``, targets times ``scale``; ``total_steps``: what distribute is told);
    ``inspect(optimizer)`` runs after every step of every worker (its results are returned
    per worker). ``schedule(sgd)``: a learning-rate scheduler of the SGD, stepped after every
    step, built before ``gossamer.distribute`` (``schedule_first``) or after it."""
    x0 = _initial(d_in, d_out)

    def worker(comm):
        model = nn.Linear(d_in, d_out, dtype=dtype)
        with torch.no_grad():
            model.weight.copy_(x0["weight"])
            model.bias.copy_(x0["bias"])
        built = sgd.build(model)
        scheduler = schedule(built) if schedule is not None and schedule_first else None
        opt = gossamer.distribute(model, built, algorithm, comm, broadcast=False,
                                  total_steps=total_steps)
        if schedule is not None and not schedule_first:
            scheduler = schedule(built)
        out, seen = [], []
        for step in range(steps):
            a, b = _data(comm.rank, step, d_in, d_out, rows, scale)
            opt.zero_grad()
            (0.5 * (model(a.to(dtype)) - b.to(dtype)).pow(2).sum() / rows).backward()
            opt.step()
            if scheduler is not None:
                scheduler.step()
            out.append({k: p.detach().clone() for k, p in model.named_parameters()})
            if inspect is not None:
                seen.append(inspect(opt))
        return out, seen

    results = SimWorld(workers).run(worker)
    trajectory = [[results[w][0][k] for w in range(workers)] for k in range(steps)]
    return trajectory, [r[1] for r in results]


def distance(a, b) -> float:
    """The largest difference between two trajectories, over steps, workers and entries."""
    return max(float((x[w][k] - y[w][k]).abs().max())
               for x, y in zip(a, b, strict=True) for w in range(len(x)) for k in x[w])


STEPS = 12
GRAD = _grad_fn(12, 8)
X0 = _initial(12, 8)


def ef(exchange, sgd: Sgd, error_feedback: bool = True):
    return oracle.ef_sgd(X0, GRAD, exchange, workers=WORKERS, steps=STEPS, lr=sgd.lr,
                         momentum=sgd.momentum, nesterov=sgd.nesterov,
                         weight_decay=sgd.weight_decay, error_feedback=error_feedback)


def dgc(sgd: Sgd, **options):
    return oracle.dgc_sgd(X0, GRAD, workers=WORKERS, steps=STEPS, lr=sgd.lr,
                          momentum=sgd.momentum, nesterov=sgd.nesterov,
                          weight_decay=sgd.weight_decay, **options)


# id: (the library's algorithm, its optimizer, the oracle's trajectory for them)
CASES = {
    "dgc": (DGC(ratio=0.05, warmup_steps=6, warmup_stages=3), Sgd(momentum=0.9),
            lambda s: dgc(s, ratio=0.05, warmup_steps=6, warmup_stages=3)),
    "dgc-nesterov-clipped-unmasked": (
        DGC(ratio=0.1, clip_norm=1.0, momentum_masking=False, fp16_values=False),
        Sgd(momentum=0.9, nesterov=True),
        lambda s: dgc(s, ratio=0.1, clip_norm=1.0, masking=False, fp16_values=False)),
    "dgc-decay-in-gradient": (
        DGC(ratio=0.05, weight_decay_in_gradient=True), Sgd(momentum=0.9, weight_decay=0.05),
        lambda s: dgc(s, ratio=0.05, decay_in_gradient=True)),
    "topk": (TopKAllReduce(ratio=0.05), Sgd(), lambda s: ef(oracle.top_k(0.05), s)),
    "topk-fp16-values": (TopKAllReduce(ratio=0.1, fp16_values=True), Sgd(nesterov=True),
                         lambda s: ef(oracle.top_k(0.1, fp16_values=True), s)),
    "randomk": (RandomKAllReduce(ratio=0.25, seed=3), Sgd(momentum=0.9),
                lambda s: ef(oracle.random_k(0.25, seed=3), s)),
    "randomk-without-ef": (RandomKAllReduce(ratio=0.25, error_feedback=False), Sgd(),
                           lambda s: ef(oracle.random_k(0.25, seed=0), s, False)),
    # k <= numel / 4 (above): distinct uniform draws; half: a permutation's first k; 0.95: the
    # positions left out are drawn
    "randomk-half": (RandomKAllReduce(ratio=0.5, seed=2), Sgd(),
                     lambda s: ef(oracle.random_k(0.5, seed=2), s)),
    "randomk-most": (RandomKAllReduce(ratio=0.95, seed=2), Sgd(),
                     lambda s: ef(oracle.random_k(0.95, seed=2), s)),
    "qsgd": (QSGDAllReduce(levels=3, bucket_size=16), Sgd(),
             lambda s: ef(oracle.qsgd(3, 16, seed=0), s, False)),
    "qsgd-ef": (QSGDAllReduce(levels=7, bucket_size=32, error_feedback=True, seed=5), Sgd(),
                lambda s: ef(oracle.qsgd(7, 32, seed=5), s)),
    "powersgd": (PowerSGDAllReduce(rank=2), Sgd(), lambda s: ef(oracle.power_sgd(2, 0), s)),
    "powersgd-cold-start": (PowerSGDAllReduce(rank=1, warm_start=False, seed=4),
                            Sgd(momentum=0.0),
                            lambda s: ef(oracle.power_sgd(1, 4, warm_start=False), s)),
    "fp16": (FP16AllReduce(), Sgd(), lambda s: ef(oracle.half_precision(torch.float16), s,
                                                  False)),
    "bf16": (FP16AllReduce(dtype="bfloat16"), Sgd(),
             lambda s: ef(oracle.half_precision(torch.bfloat16), s, False)),
    "fp16-ef": (AllReduce(compressor=FP16(), memory=ErrorFeedback()), Sgd(),
                lambda s: ef(oracle.half_precision(torch.float16), s)),
    "bf16-ef": (AllReduce(compressor=BF16(), memory=ErrorFeedback()), Sgd(),
                lambda s: ef(oracle.half_precision(torch.bfloat16), s)),
}


def test_every_compressed_algorithm_has_a_case():
    """Every registered algorithm built on a compressor is matched to its oracle below."""
    compressed = {name for name in available() if isinstance(lookup(name), CompressionPreset)}
    assert compressed == {"dgc", "topk", "randomk", "qsgd", "powersgd", "fp16"}
    covered = {algorithm.label for algorithm, _, _ in CASES.values()}
    assert compressed <= covered


@pytest.mark.parametrize("case", list(CASES))
def test_library_matches_oracle(case):
    algorithm, sgd, make_oracle = CASES[case]
    got, _ = run_library(algorithm, sgd, STEPS)
    want = make_oracle(sgd)
    for step, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        for w in range(WORKERS):
            for name, value in theirs[w].items():
                error = float((mine[w][name] - value).abs().max())
                assert error <= ATOL, (case, step, w, name, error)
    # not vacuous: the parameters moved, and compression changed them more than the tolerance
    exact = ef(oracle.dense(), sgd, False)
    assert max(float((want[-1][0][k] - X0[k]).abs().max()) for k in X0) > 0.1
    assert distance(want, exact) > 10 * ATOL


def test_dgc_defaults_warm_up_as_the_oracle_over_the_first_quarter_of_the_run():
    """DGC with its defaults, told the run's length (12 steps), follows the oracle with the
    paper's warm-up fitted to the run (3 steps at densities 25%, 6.3%, 1.6%, then 0.1%); not
    told it, the oracle without warm-up. The two differ: the warm-up is not a no-op here."""
    sgd = Sgd(momentum=0.9)
    told, _ = run_library(DGC(), sgd, STEPS, total_steps=STEPS)
    fitted = dgc(sgd, ratio=0.001, warmup_steps=oracle.fitted_warmup_steps(STEPS))
    assert oracle.fitted_warmup_steps(STEPS) == 3
    assert distance(told, fitted) <= ATOL
    untold, _ = run_library(DGC(), sgd, STEPS)
    steady = dgc(sgd, ratio=0.001)
    assert distance(untold, steady) <= ATOL
    assert distance(fitted, steady) > 10 * ATOL


@pytest.mark.parametrize("max_adaptations", [3, 0])
def test_dgc_threshold_selection_matches_oracle(max_adaptations):
    """A weight of 4096 entries takes DGC's sampled threshold (not the exact top-k): the
    oracle replays the sample and the adaptation rule, and the library's optimized selection
    (block maxima, candidate blocks) selects the same entries, step after step, during the
    warm-up (25% density) and after it. Without adaptations a short count falls straight to
    the block maxima."""
    d_in, d_out, steps = 128, 32, 10
    compressor = DGCCompressor(ratio=0.02, warmup_steps=4, warmup_stages=2, seed=11,
                               max_adaptations=max_adaptations)
    algorithm = AllReduce(compressor=compressor, memory=DGCMemory())
    sgd = Sgd(momentum=0.9)

    def selection(opt):
        last = opt.runtime.reducer.compressor.last_selection  # the weight: the bias is dense
        return last.path, last.adaptations

    got, seen = run_library(algorithm, sgd, steps, d_in=d_in, d_out=d_out, inspect=selection)
    want = oracle.dgc_sgd(_initial(d_in, d_out), _grad_fn(d_in, d_out), workers=WORKERS,
                          steps=steps, lr=sgd.lr, momentum=sgd.momentum,
                          weight_decay=sgd.weight_decay, ratio=0.02, warmup_steps=4,
                          warmup_stages=2, seed=11, max_adaptations=max_adaptations)
    assert distance(got, want) <= ATOL
    # every path of the rule was taken: sampled threshold, lowered, refined to the top k
    seen = {s for worker in seen for s in worker}
    assert {path for path, _ in seen} == {"threshold", "refined"}
    assert any(adaptations for _, adaptations in seen)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_follows_ddp_on_three_workers_near_float16s_top(dtype):
    """Three workers (the division by 3 rounds in the narrow type) and gradients in the tens of
    thousands, whose float16 sum passes 65504 where their average fits: the library casts,
    divides by n in the narrow type and sums the shares, as DDP's ``fp16_compress_hook`` does,
    and matches that oracle step by step, with and without error feedback, finite throughout
    (summed first and divided afterwards, float16's sum would be inf)."""
    workers, scale, sgd, steps = 3, 1.8e4, Sgd(lr=1e-6), 6
    grad = _grad_fn(12, 8, scale)
    grads = [grad(w, 0, X0)["weight"] for w in range(workers)]
    peak = float(max(g.abs().max() for g in grads))
    assert float(sum(grads).abs().max()) > 65504 > float((sum(grads) / workers).abs().max())
    assert peak < 65504  # every worker's value fits: nothing is clamped
    for memory in (None, ErrorFeedback()):
        compressor = FP16() if dtype == torch.float16 else BF16()
        got, _ = run_library(AllReduce(compressor=compressor, memory=memory), sgd, steps,
                             workers=workers, scale=scale)
        want = oracle.ef_sgd(X0, grad, oracle.half_precision(dtype), workers=workers,
                             steps=steps, lr=sgd.lr, momentum=sgd.momentum,
                             weight_decay=sgd.weight_decay, error_feedback=memory is not None)
        assert all(bool(torch.isfinite(t).all()) for x in got for xw in x for t in xw.values())
        assert distance(got, want) <= 1e-12, memory
        exact = oracle.ef_sgd(X0, grad, oracle.dense(), workers=workers, steps=steps,
                              lr=sgd.lr, momentum=sgd.momentum, weight_decay=sgd.weight_decay,
                              error_feedback=False)
        assert distance(want, exact) > 1e-9  # the narrow type's rounding shows


# -- invariants -------------------------------------------------------------------------------

FULL = {
    "none": AllReduce(compressor=NoCompression()),
    "none-ef": AllReduce(compressor=NoCompression(), memory=ErrorFeedback()),
    "topk": TopKAllReduce(ratio=1.0),
    "topk-without-ef": TopKAllReduce(ratio=1.0, error_feedback=False),
    "randomk": RandomKAllReduce(ratio=1.0),
    "randomk-gathered": AllReduce(compressor=RandomK(ratio=1.0), memory=ErrorFeedback(),
                                  aggregation="allgather"),
    "dgc-without-momentum": DGC(ratio=1.0, fp16_values=False),
}


@pytest.mark.parametrize("case", list(FULL))
def test_full_density_is_allreduce_exactly(case):
    """Nothing dropped, float32 values: the same float32 sums in the same order as
    AllReduce-SGD, so the same parameters bit for bit (momentum and weight decay in SGD, or,
    for DGC without momentum, its dense local decay)."""
    momentum = 0.0 if case.startswith("dgc") else 0.9
    sgd = Sgd(momentum=momentum, weight_decay=0.0 if case.startswith("dgc") else DECAY)
    got, _ = run_library(FULL[case], sgd, 6, dtype=torch.float32)
    exact, _ = run_library(AllReduce(), sgd, 6, dtype=torch.float32)
    for mine, theirs in zip(got, exact, strict=True):
        for w in range(WORKERS):
            for name, value in theirs[w].items():
                assert torch.equal(mine[w][name], value), (case, name)


def test_dgc_at_full_density_is_momentum_sgd_with_weight_decay():
    """DGC at density 1 without masking, float64 values: every velocity is sent, so the
    average of the workers' ``u`` is SGD's momentum buffer, and the dense local decay adds the
    decay's own momentum: momentum SGD with weight decay, Nesterov too."""
    for nesterov in (False, True):
        sgd = Sgd(momentum=0.9, nesterov=nesterov, weight_decay=0.05)
        dgc, _ = run_library(DGC(ratio=1.0, momentum_masking=False, fp16_values=False), sgd, 8)
        exact, _ = run_library(AllReduce(), sgd, 8)
        assert distance(dgc, exact) <= 1e-12


@pytest.mark.parametrize("schedule_first", [True, False], ids=["before", "after"])
def test_dgc_at_full_density_follows_a_momentum_schedule(schedule_first):
    """OneCycleLR cycles the momentum, writing it into the optimizer every step (before or
    after DGC took it over): DGC takes each scheduled value over, so at density 1 without
    masking it is still momentum SGD with weight decay under the same schedule, and the
    optimizer never applies momentum a second time. With Nesterov, DGC's form ``u = m (u + g)``
    equals SGD's only at a constant ``m``: there, each step's ``m`` is the scheduled one."""
    def one_cycle(sgd):
        return torch.optim.lr_scheduler.OneCycleLR(sgd, max_lr=0.05, total_steps=10,
                                                   base_momentum=0.5, max_momentum=0.95)

    def momenta(opt):  # the step's m, and what the scheduler wrote for the next step
        return opt.runtime.reducer.memory.momentum, opt.param_groups[0]["momentum"]

    algorithm = DGC(ratio=1.0, momentum_masking=False, fp16_values=False)
    sgd = Sgd(momentum=0.9, weight_decay=0.05)
    dgc, _ = run_library(algorithm, sgd, 8, schedule=one_cycle, schedule_first=schedule_first)
    exact, _ = run_library(AllReduce(), sgd, 8, schedule=one_cycle)
    constant, _ = run_library(AllReduce(), sgd, 8,
                              schedule=lambda s: torch.optim.lr_scheduler.OneCycleLR(
                                  s, max_lr=0.05, total_steps=10, cycle_momentum=False))
    assert distance(dgc, exact) <= 1e-12
    assert distance(exact, constant) > 1e-4  # the momentum schedule matters here
    _, seen = run_library(algorithm, Sgd(momentum=0.9, nesterov=True), 8, schedule=one_cycle,
                          schedule_first=schedule_first, inspect=momenta)
    for worker in seen:
        used = [m for m, _ in worker]
        assert used == [0.95] + [written for _, written in worker[:-1]]
        assert len(set(used)) == len(used)  # it moved every step


def test_powersgd_of_rank_enough_is_allreduce():
    """Rank-one gradients on 4 workers span 4 dimensions: PowerSGD of rank 4 (which still
    compresses an 8 x 12 matrix) recovers their average, and the residuals stay zero."""
    sgd = Sgd()
    got, residuals = run_library(
        PowerSGDAllReduce(rank=4), sgd, 8, rows=1,
        inspect=lambda opt: float(opt.runtime.reducer.memory.residual("weight").abs().max()))
    exact, _ = run_library(AllReduce(), sgd, 8, rows=1)
    assert distance(got, exact) <= 1e-9  # the orthogonalization's rounding, conditioned
    assert max(max(r) for r in residuals) <= 1e-9
    assert PowerSGD(rank=4).compresses(torch.zeros(8, 12))


class Recording:
    """A memory that keeps, for every update, what was compensated, what was sent and what the
    memory kept (error feedback's residual, DGC's velocity)."""

    log: list

    def kept(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def update(self, key, compensated, payload, compressor):
        before = compensated.clone()
        sent = compressor.decompress(payload, key).reshape(before.shape).to(before.dtype)
        super().update(key, compensated, payload, compressor)
        self.log.append((key, before, sent, self.kept(key).clone()))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecordingFeedback(Recording, ErrorFeedback):
    log: list = dataclasses.field(default_factory=list, init=False, repr=False, compare=False)

    def kept(self, key: str) -> torch.Tensor:
        return self.residual(key)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecordingDGCMemory(Recording, DGCMemory):
    log: list = dataclasses.field(default_factory=list, init=False, repr=False, compare=False)

    def kept(self, key: str) -> torch.Tensor:
        return self.velocity_of(key)


IDENTITY = {
    "topk": (TopK(ratio=0.1), RecordingFeedback()),
    "topk-fp16-values": (TopK(ratio=0.1, fp16_values=True), RecordingFeedback()),
    "randomk": (RandomK(ratio=0.2), RecordingFeedback()),
    "qsgd": (QSGD(levels=3, bucket_size=16), RecordingFeedback()),
    "powersgd": (PowerSGD(rank=1), RecordingFeedback()),
    "fp16": (FP16(), RecordingFeedback()),
    "bf16": (BF16(), RecordingFeedback()),
    "dgc": (DGCCompressor(ratio=0.1, fp16_values=False), RecordingDGCMemory()),
    "dgc-fp16-values": (DGCCompressor(ratio=0.1), RecordingDGCMemory()),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("case", list(IDENTITY))
def test_error_feedback_identity_every_step(case, dtype):
    """What a worker sent plus its new residual (DGC: velocity) is what it compensated, at
    every step, for every tensor, up to the one rounding of the residual's subtraction; the
    sparse compressors keep it exactly."""
    compressor, memory = IDENTITY[case]
    steps = 5
    _, logs = run_library(AllReduce(compressor=compressor, memory=memory), Sgd(), steps,
                          dtype=dtype, inspect=lambda opt: list(opt.runtime.reducer.memory.log))
    eps = torch.finfo(dtype).eps
    exact = case in ("topk", "randomk", "dgc")
    for log in logs:
        assert len(log[-1]) == 2 * steps  # weight and bias, every step
        for key, before, sent, residual in log[-1]:
            error = (before - (sent + residual)).abs()
            if exact:
                assert torch.equal(before, sent + residual), (case, key)
            else:
                assert bool((error <= 2 * eps * (before.abs() + sent.abs())).all()), (case, key)
            assert bool((sent != 0).any()), (case, key)  # something was sent
