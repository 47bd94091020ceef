"""DiLoCo and Streaming DiLoCo: against their oracle, their invariants, and on gloo.

The oracle runs (``tests/oracles/diloco.py``) use the least-squares problem of
``tests/test_oracle_local_sgd.py``: 4 workers, a float64 ``Linear(3, 1)``, data that depend on
the worker and the step, a warm-up then cosine learning rate. After every inner step each
worker's parameters must match the oracle's to 1e-6, and the steps that synchronised must be
the oracle's exactly.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from oracles import diloco as oracle
from oracles import local_sgd as local_oracle
from test_oracle_local_sgd import DIM, LRS, STEPS, X0, _data, _grad
from torch import nn

import gossamer
from gossamer.algorithms import AllReduce, LocalSGD, create
from gossamer.algorithms.diloco import DiLoCo
from gossamer.algorithms.streaming_diloco import ScatteredMean, StreamingDiLoCo, split_fragments
from gossamer.comm import SimWorld
from gossamer.comm.network import NetworkModel
from gossamer.compress.lowbit import LowBit

N = 4
ATOL = 1e-6


def _library(algorithm, lrs=LRS, optimizer="sgd", momentum=0.0, weight_decay=0.0,
             n=N) -> local_oracle.Run:
    """The library's run in SimWorld, recorded as the oracle records its own; the final
    state after ``finish()`` is one more trajectory entry when the runtime's finish stepped."""

    def worker(comm):
        model = nn.Linear(DIM, 1, dtype=torch.float64)
        with torch.no_grad():
            model.weight.copy_(X0[:DIM].view(1, DIM))
            model.bias.copy_(X0[DIM:])
        if optimizer == "adamw":
            inner = torch.optim.AdamW(model.parameters(), lr=lrs[0], weight_decay=weight_decay)
        else:
            inner = torch.optim.SGD(model.parameters(), lr=lrs[0], momentum=momentum)
        opt = gossamer.distribute(model, inner, algorithm, comm, total_steps=len(lrs))
        runtime = opt.runtime
        trajectory, syncs = [], []

        def flat():
            return torch.cat([model.weight.detach().flatten(), model.bias.detach()]).clone()

        for k, lr in enumerate(lrs):
            for group in opt.param_groups:
                group["lr"] = lr
            a, b = _data(comm.rank, k)
            opt.zero_grad()
            (0.5 * (model(a).squeeze(1) - b).pow(2).mean()).backward()
            before = runtime.synchronizations
            opt.step()
            if runtime.synchronizations > before:
                syncs.append(k)
            trajectory.append(flat())
        before = runtime.synchronizations
        opt.finish()
        if runtime.synchronizations > before:
            syncs.append(-1)
            trajectory.append(flat())
        return trajectory, syncs, list(getattr(runtime, "periods", []))

    results = SimWorld(n).run(worker)
    for _, syncs, _ in results[1:]:
        assert syncs == results[0][1]
    return local_oracle.Run(trajectory=[[r[0][k] for r in results]
                                        for k in range(len(results[0][0]))],
                            syncs=results[0][1], periods=results[0][2])


def _assert_match(library: local_oracle.Run, expected: local_oracle.Run) -> None:
    assert library.syncs == expected.syncs
    assert len(library.trajectory) == len(expected.trajectory)
    for k, (got, want) in enumerate(zip(library.trajectory, expected.trajectory, strict=True)):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            err = (g - w).abs().max().item()
            assert err <= ATOL, f"step {k}, worker {i}: library and oracle differ by {err:g}"


ALPHA = 0.06  # with LRS: H = 2 at the peak, then 3, 7 and the end's 4 (see the local SGD test)
DILOCO_CASES = {
    # name: (library algorithm, oracle period rule, oracle settings)
    "H 4, Nesterov outer, momentum inner": (
        DiLoCo(period=4), local_oracle.constant_period(4), {"momentum": 0.9}),
    "H 3, outer SGD without Nesterov": (
        DiLoCo(period=3, outer_lr=0.5, outer_momentum=0.8, outer_nesterov=False),
        local_oracle.constant_period(3),
        {"outer_lr": 0.5, "outer_momentum": 0.8, "nesterov": False}),
    "inner AdamW (the paper's), H 5": (
        DiLoCo(period=5), local_oracle.constant_period(5),
        {"optimizer": "adamw", "weight_decay": 0.01}),
    "the period from the QSR rule and the inner lr, after a synchronous warm-up": (
        DiLoCo(period=2, alpha=ALPHA, warmup_steps=4),
        local_oracle.qsr_period(2, ALPHA, warmup_steps=4),
        {"momentum": 0.9, "warmup_steps": 4}),
    "groups of 2 that all-reduce gradients": (
        DiLoCo(period=4, group_size=2), local_oracle.constant_period(4),
        {"momentum": 0.9, "group_size": 2}),
}


@pytest.mark.parametrize("case", list(DILOCO_CASES))
def test_diloco_matches_oracle_step_by_step(case):
    algorithm, period, settings = DILOCO_CASES[case]
    inner = {k: settings[k] for k in ("optimizer", "momentum", "weight_decay") if k in settings}
    library = _library(algorithm, **inner)
    expected = oracle.diloco(X0, N, _grad, LRS, period, **settings)
    _assert_match(library, expected)
    assert len(expected.syncs) >= 5


def test_qsr_case_changes_the_period():
    run = oracle.diloco(X0, N, _grad, LRS, local_oracle.qsr_period(2, ALPHA, warmup_steps=4),
                        warmup_steps=4)
    assert len({h for s, h in run.periods if s >= 4}) >= 3
    assert run.syncs[-1] == STEPS - 1


# tensor 0 is the weight (flat indices 0..2), tensor 1 the bias (index 3)
STREAMING_CASES = {
    "2 fragments, tau 1, alpha 0.5": (
        StreamingDiLoCo(period=4, fragments=2, tau=1, mixing=0.5, precision="float32"),
        4, [[0, 1, 2], [3]], 1, 0.5),
    "2 fragments, no overlap, alpha 0": (
        StreamingDiLoCo(period=6, fragments=2, tau=0, mixing=0.0, precision="float32"),
        6, [[0, 1, 2], [3]], 0, 0.0),
    "1 fragment, tau 2, alpha 0.3": (
        StreamingDiLoCo(period=5, fragments=1, tau=2, mixing=0.3, precision="float32"),
        5, [[0, 1, 2, 3]], 2, 0.3),
    "after a synchronous warm-up of 5 steps": (
        StreamingDiLoCo(period=4, fragments=2, tau=1, mixing=0.5, precision="float32",
                        warmup_steps=5),
        4, [[0, 1, 2], [3]], 1, 0.5),
}


@pytest.mark.parametrize("case", list(STREAMING_CASES))
def test_streaming_diloco_matches_oracle_step_by_step(case):
    algorithm, period, fragments, tau, mixing = STREAMING_CASES[case]
    library = _library(algorithm, momentum=0.9)
    expected = oracle.streaming_diloco(X0, N, _grad, LRS, period, fragments, tau, mixing,
                                       momentum=0.9, warmup_steps=algorithm.warmup_steps)
    _assert_match(library, expected)
    assert len(expected.syncs) >= 8


# ---------------------------------------------------------------------------- invariants


def _close(a: local_oracle.Run, b: local_oracle.Run, atol: float) -> None:
    assert a.syncs == b.syncs
    for got, want in zip(a.trajectory, b.trajectory, strict=True):
        for g, w in zip(got, want, strict=True):
            assert (g - w).abs().max().item() <= atol


def test_outer_sgd_with_lr_1_and_no_momentum_is_local_sgd():
    """theta - mean(theta - theta_i) = mean(theta_i): the outer step is the average."""
    plain = DiLoCo(period=4, outer_lr=1.0, outer_momentum=0.0, outer_nesterov=False)
    local = _library(LocalSGD(period=4), momentum=0.9)
    _close(_library(plain, momentum=0.9), local, 1e-12)


def test_period_1_plain_outer_step_is_allreduce_sgd():
    plain = DiLoCo(period=1, outer_lr=1.0, outer_momentum=0.0, outer_nesterov=False)
    diloco, allreduce = _library(plain), _library(AllReduce())
    for got, want in zip(diloco.trajectory, allreduce.trajectory, strict=True):
        for g, w in zip(got, want, strict=True):
            assert (g - w).abs().max().item() <= 1e-12


def test_one_fragment_without_overlap_or_mixing_is_diloco():
    streaming = StreamingDiLoCo(period=4, fragments=1, tau=0, mixing=0.0, precision="float32",
                                average_at_end=False)
    diloco = _library(DiLoCo(period=4, average_at_end=False), momentum=0.9)
    _close(_library(streaming, momentum=0.9), diloco, 1e-12)


def test_the_outer_step_moves_further_than_the_average():
    """Nesterov's outer momentum is used: DiLoCo's default differs from local SGD."""
    diloco = _library(DiLoCo(period=4), momentum=0.9)
    local = _library(LocalSGD(period=4), momentum=0.9)
    assert (diloco.trajectory[-1][0] - local.trajectory[-1][0]).abs().max() > 1e-3


def test_fragments_partition_the_tensors():
    sizes = [10, 1, 30, 3, 20, 2]
    for pattern in ("strided", "sequential"):
        for count in (1, 2, 3):
            fragments = split_fragments(sizes, count, pattern)
            assert sorted(i for f in fragments for i in f) == list(range(len(sizes)))
    assert split_fragments(sizes, 2, "strided") == [[0, 2, 4], [1, 3, 5]]
    assert split_fragments(sizes, 2, "sequential") == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "int8", "int4"])
def test_scattered_mean_keeps_every_error_and_sends_the_precisions_bytes(precision):
    """What each worker sent plus what it kept is what it had (error feedback loses
    nothing), every worker gets the same mean, and each sends 2 (n - 1) chunks of the
    precision's width: a ring all-reduce's bytes."""
    numel, n = 50, 4
    codec = LowBit(precision)

    def worker(comm):
        g = torch.Generator().manual_seed(comm.rank)
        vector = torch.randn(numel, generator=g)
        residuals: dict = {}
        mean = ScatteredMean(comm, vector, codec, residuals, key=0).wait()
        return vector, mean, residuals, comm.stats.total_bytes_sent

    results = SimWorld(n).run(worker)
    chunk = -(-numel // n)
    for _, mean, _, sent in results:
        assert torch.equal(mean, results[0][1])  # the same everywhere
        assert sent == 2 * (n - 1) * codec.nbytes(chunk)
    vectors = torch.stack([r[0] for r in results])
    # each worker's share went out as (vector - sent error); the owners' means as (mean - error)
    sent = torch.stack([F.pad(r[0], (0, n * chunk - numel)) - r[2][(0, "sent")]
                        for r in results])
    mean_error = torch.cat([r[2][(0, "mean")] for r in results])[:numel]
    assert torch.allclose(sent.mean(0)[:numel] - mean_error, results[0][1], atol=1e-6)
    exact = vectors.mean(0)
    bound = {"float32": 0, "bfloat16": 2e-2, "int8": 5e-2, "int4": 0.8}[precision]
    assert (results[0][1] - exact).abs().max() <= bound + 1e-7
    if precision == "float32":
        assert torch.allclose(results[0][1], exact, atol=1e-6)


def test_low_precision_trains_like_float32():
    float32 = _library(StreamingDiLoCo(period=4, fragments=2, precision="float32"), momentum=0.9)
    int8 = _library(StreamingDiLoCo(period=4, fragments=2, precision="int8"), momentum=0.9)
    assert int8.syncs == float32.syncs
    gap = (int8.trajectory[-1][0] - float32.trajectory[-1][0]).abs().max().item()
    assert 0 < gap < 1e-2


def _timed(algorithm, steps: int = 16) -> tuple[float, int]:
    """(virtual seconds, bytes rank 0 sent after the set-up) of a run on a slow network
    where a step computes 10 ms."""
    from gossamer.comm import ComputeModel

    def worker(comm):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 4))
        opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                  algorithm, comm, total_steps=steps)
        start = comm.stats.total_bytes_sent  # after the initial broadcast
        g = torch.Generator().manual_seed(comm.rank)
        for _ in range(steps):
            opt.zero_grad()
            F.cross_entropy(model(torch.randn(8, 64, generator=g)),
                            torch.randint(0, 4, (8,), generator=g)).backward()
            opt.step()
        opt.finish()
        return comm.clock(), comm.stats.total_bytes_sent - start

    world = SimWorld(N, network=NetworkModel(latency=1e-3, bandwidth=5e6),
                     compute=ComputeModel(step_time=0.01))
    results = world.run(worker)
    return max(r[0] for r in results), results[0][1]


def test_the_exchange_overlaps_the_next_tau_steps():
    """The same bytes, but with tau 2 the workers compute while a fragment travels."""
    blocking, sent = _timed(StreamingDiLoCo(period=8, fragments=2, tau=0, precision="float32"))
    overlapped, sent_too = _timed(StreamingDiLoCo(period=8, fragments=2, tau=2,
                                                  precision="float32"))
    assert sent == sent_too
    assert overlapped < 0.9 * blocking


def test_int4_sends_about_an_eighth_of_float32():
    _, float32 = _timed(StreamingDiLoCo(period=8, fragments=2, precision="float32",
                                        average_at_end=False))
    _, int4 = _timed(StreamingDiLoCo(period=8, fragments=2, precision="int4",
                                     average_at_end=False))
    assert 0.12 < int4 / float32 < 0.14


def test_state_dict_round_trip_continues_the_same_run():
    """Stopped after 8 of 16 steps and resumed from the runtime's and optimizers' state
    dicts on fresh objects, a run ends where the uninterrupted one does (the global
    parameters, the outer momentum, the quantisation errors travel)."""
    algorithms = [DiLoCo(period=3, compression="topk:ratio=0.5"),
                  StreamingDiLoCo(period=4, fragments=2, tau=1, precision="int4")]

    def worker(comm, algorithm, stop):
        torch.manual_seed(0)
        model = nn.Linear(DIM, 2)
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt = gossamer.distribute(model, inner, algorithm, comm, total_steps=16)
        g = torch.Generator().manual_seed(comm.rank)
        batches = [(torch.randn(5, DIM, generator=g), torch.randint(0, 2, (5,), generator=g))
                   for _ in range(16)]
        for k, (x, y) in enumerate(batches):
            if k == stop:
                saved = ({n: t.clone() for n, t in model.state_dict().items()},
                         opt.state_dict())
                model = nn.Linear(DIM, 2)
                model.load_state_dict(saved[0])
                inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
                opt = gossamer.distribute(model, inner, algorithm, comm, broadcast=False,
                                          total_steps=16)
                opt.load_state_dict(saved[1])
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        opt.finish()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    for algorithm in algorithms:
        straight = SimWorld(N).run(worker, algorithm, None)
        resumed = SimWorld(N).run(worker, algorithm, 8)
        for a, b in zip(straight, resumed, strict=True):
            assert torch.equal(a, b), algorithm.name


@pytest.mark.parametrize("kwargs, name", [
    ({"outer": "nope"}, "outer"),
    ({"outer_lr": -1}, "outer_lr"),
    ({"outer": "adam", "outer_momentum": 0.5}, "outer_momentum"),
    ({"group_size": 0}, "group_size"),
    ({"compression": "dgc"}, "compression"),
    ({"period": 0}, "period"),
    ({"outer_optimizer": 3}, "outer_optimizer"),
])
def test_bad_diloco_options_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DiLoCo(**kwargs)


@pytest.mark.parametrize("kwargs, name", [
    ({"period": 6, "fragments": 4}, "period"),
    ({"tau": 4}, "tau"),
    ({"mixing": 1.5}, "mixing"),
    ({"precision": "int2"}, "precision"),
    ({"pattern": "random"}, "pattern"),
    ({"alpha": 0.1}, "alpha"),
    ({"warmup_period": 2}, "warmup_period"),
    ({"compression": "topk"}, "compression"),
])
def test_bad_streaming_options_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        StreamingDiLoCo(**kwargs)


def test_group_size_must_divide_the_world():
    with pytest.raises(ValueError, match="group_size"):
        DiLoCo(group_size=3).resolve(4)


def test_any_torch_optimizer_is_the_outer_one():
    adam = DiLoCo(period=4, outer="adam", outer_lr=0.01)
    factory = DiLoCo(period=4, outer_optimizer=lambda p: torch.optim.Adam(p, lr=0.01))
    _close(_library(adam, momentum=0.9), _library(factory, momentum=0.9), 0.0)
    assert isinstance(adam.make_outer([nn.Parameter(torch.zeros(2))]), torch.optim.Adam)


def test_registry_names_and_options():
    assert create("diloco", {"period": "8", "outer": "adamw"}) == DiLoCo(period=8,
                                                                         outer="adamw")
    streaming = create("streaming-diloco", {"fragments": "2", "precision": "int8"})
    assert dataclasses.replace(streaming) == StreamingDiLoCo(fragments=2, precision="int8")


def test_group_size_flag_sets_the_option(tmp_path, capsys):
    import yaml

    from gossamer.cli import main

    assert main(["train", "--algorithm", "diloco", "--group-size", "2", "--steps", "8",
                 "--option", "period=4", "--run-dir", str(tmp_path), "--quiet"]) == 0
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())["algorithm"]
    assert written["options"]["group_size"] == 2 and written["options"]["period"] == 4
    assert main(["train", "--algorithm", "sgp", "--group-size", "2", "--steps", "8"]) == 2
    assert "no option 'group_size'" in capsys.readouterr().err
