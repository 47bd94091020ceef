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
from resume_helpers import saved_mid_run, state_dict_round_trip
from test_oracle_local_sgd import DIM, LRS, STEPS, X0, _data, _grad
from torch import nn

import gossamer
from gossamer.algorithms import AllReduce, LocalSGD, create
from gossamer.algorithms.diloco import DiLoCo
from gossamer.algorithms.streaming_diloco import StreamingDiLoCo
from gossamer.comm import SimWorld
from gossamer.comm.network import NetworkModel
from gossamer.compress.lowbit import LowBit
from gossamer.patterns.fragments import split_fragments
from gossamer.patterns.scattered import ScatteredMean

N = 4
ATOL = 1e-6


class _Affine(nn.Module):
    """``Linear(DIM, 1)`` whose weight and bias are two modules, so two units of layers: a
    Streaming DiLoCo of two fragments puts the weight in one and the bias in the other."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, 1, bias=False, dtype=torch.float64)
        self.shift = nn.Module()
        self.shift.bias = nn.Parameter(torch.zeros(1, dtype=torch.float64))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return self.linear(a) + self.shift.bias


def _library(algorithm, lrs=LRS, optimizer="sgd", momentum=0.0, weight_decay=0.0,
             n=N, model_class=None) -> local_oracle.Run:
    """The library's run in SimWorld, recorded as the oracle records its own; the final
    state after ``finish()`` is one more trajectory entry when the runtime's finish stepped.
    ``model_class``: a module of DIM weights then a bias, ``X0``'s layout (default
    ``Linear(DIM, 1)``)."""

    def worker(comm):
        if model_class is None:
            model = nn.Linear(DIM, 1, dtype=torch.float64)
        else:
            model = model_class()
        with torch.no_grad():
            for p, value in zip(model.parameters(), X0.split([DIM, 1]), strict=True):
                p.copy_(value.view_as(p))
        if optimizer == "adamw":
            inner = torch.optim.AdamW(model.parameters(), lr=lrs[0], weight_decay=weight_decay)
        else:
            inner = torch.optim.SGD(model.parameters(), lr=lrs[0], momentum=momentum)
        opt = gossamer.distribute(model, inner, algorithm, comm, total_steps=len(lrs))
        runtime = opt.runtime
        trajectory, syncs = [], []

        def flat():
            return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()

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
        DiLoCo(period=4, replica_size=2), local_oracle.constant_period(4),
        {"momentum": 0.9, "replica_size": 2}),
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


# the weight (flat indices 0..2) and the bias (index 3) of _Affine are two units of layers;
# with 2 fragments the weight is in fragment 0 and the bias in fragment 1. The 40 steps end
# in each way a run can: a fragment synchronised at the last step with mixing > 0 and one with
# steps since (the first), two with steps since (the second), the only fragment synchronised
# at the last step (the third), an exchange in flight and a fragment with steps since (the
# fourth)
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
    library = _library(algorithm, momentum=0.9, model_class=_Affine)
    expected = oracle.streaming_diloco(X0, N, _grad, LRS, period, fragments, tau, mixing,
                                       momentum=0.9, warmup_steps=algorithm.warmup_steps)
    _assert_match(library, expected)
    assert len(expected.syncs) >= 8 and expected.syncs[-1] == -1


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
    """Its end included: the 40 steps end with an outer step, and neither method takes
    another (on a pseudo-gradient of zero, Nesterov's momentum would still move them)."""
    streaming = StreamingDiLoCo(period=4, fragments=1, tau=0, mixing=0.0, precision="float32")
    diloco = _library(DiLoCo(period=4), momentum=0.9)
    assert diloco.syncs[-1] == STEPS - 1 and len(diloco.trajectory) == STEPS
    _close(_library(streaming, momentum=0.9), diloco, 1e-12)


def test_the_outer_step_moves_further_than_the_average():
    """Nesterov's outer momentum is used: DiLoCo's default differs from local SGD."""
    diloco = _library(DiLoCo(period=4), momentum=0.9)
    local = _library(LocalSGD(period=4), momentum=0.9)
    assert (diloco.trajectory[-1][0] - local.trajectory[-1][0]).abs().max() > 1e-3


def _named_sizes(model: nn.Module) -> tuple[list[str], list[int]]:
    return ([name for name, _ in model.named_parameters()],
            [p.numel() for p in model.parameters()])


class _Blocks(nn.Module):
    """An embedding, 8 identical blocks and a head: the paper's strided layout."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)  # 320 elements
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16))
                                    for _ in range(8))  # 304 each
        self.head = nn.Linear(16, 20)  # 340


def _models() -> dict[str, nn.Module]:
    from gossamer.train.models import MLP, CharTransformer, ResNet20

    torch.manual_seed(0)
    return {"character transformer": CharTransformer(96, 64), "resnet20": ResNet20(),
            "mlp": MLP(64, 10), "8 blocks": _Blocks(),
            "mlp of sequential layers": nn.Sequential(nn.Linear(8, 16), nn.Tanh(),
                                                      nn.Linear(16, 4))}


@pytest.mark.parametrize("pattern", ["strided", "sequential"])
def test_fragments_are_made_of_whole_modules(pattern):
    """Every parameter in exactly one fragment, the parameters of a module (a weight and its
    bias) always in the same one; sequential fragments are consecutive in the model."""
    for name, model in _models().items():
        names, sizes = _named_sizes(model)
        for count in (1, 2, 3, 4, 5):
            fragments = split_fragments(names, sizes, count, pattern)
            assert len(fragments) == count
            assert sorted(i for f in fragments for i in f) == list(range(len(names))), name
            where = {names[i]: p for p, f in enumerate(fragments) for i in f}
            for module, _ in model.named_modules():
                owned = {where[f"{module}.{n}" if module else n]
                         for n, _ in model.get_submodule(module).named_parameters(
                             recurse=False)}
                assert len(owned) <= 1, (name, count, module)
            if pattern == "sequential":
                order = [p for p, f in enumerate(fragments) for _ in f]
                assert [i for f in fragments for i in f] == list(range(len(names)))
                assert order == sorted(order)
            assert split_fragments(names, sizes, count, pattern) == fragments  # deterministic


@pytest.mark.parametrize("pattern", ["strided", "sequential"])
def test_the_character_transformers_fragments_are_about_equal(pattern):
    """Its 2 blocks are larger than a quarter of the model each: split into their layers,
    they let 4 fragments balance (tensor i in fragment i mod P would make 254208, 9568,
    164224 and 1664 elements: the largest 2.4 / P of the model, a weight and its bias
    apart)."""
    names, sizes = _named_sizes(_models()["character transformer"])
    count = 4
    elements = [sum(sizes[i] for i in f) for f in split_fragments(names, sizes, count, pattern)]
    assert sum(elements) == sum(sizes) == 429664
    # strided: [96224, 103040, 115200, 115200]; sequential: [87040, 131968, 132352, 78304]
    assert max(elements) <= 1.3 * sum(sizes) / count, elements
    assert min(elements) > 0


@pytest.mark.parametrize("count, elements", [(2, [1556, 1536]), (3, [1232, 912, 948]),
                                             (4, [948, 928, 608, 608])])
def test_strided_puts_block_i_in_fragment_i_mod_p(count, elements):
    """Then the head, the larger, and the embedding, each into the fragment with the fewest
    elements so far."""
    model = _Blocks()
    names, sizes = _named_sizes(model)
    fragments = split_fragments(names, sizes, count, "strided")
    where = {names[i]: p for p, f in enumerate(fragments) for i in f}
    for block in range(8):
        for n, _ in model.blocks[block].named_parameters():
            assert where[f"blocks.{block}.{n}"] == block % count
    assert [sum(sizes[i] for i in f) for f in fragments] == elements


def test_sequential_fragments_have_the_smallest_largest_one():
    """Against every way of cutting consecutive units: none has a smaller largest fragment;
    and no fragment is empty while there are units enough."""
    import itertools

    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        n, count = 1 + trial % 7, 1 + trial % 4
        sizes = torch.randint(1, 30, (n,), generator=g).tolist()
        names = [f"layer{i}.weight" for i in range(n)]
        fragments = split_fragments(names, sizes, count, "sequential")
        largest = max(sum(sizes[i] for i in f) for f in fragments)
        best = min(max(sum(sizes[a:b]) for a, b in zip((0, *cuts), (*cuts, n), strict=True))
                   for cuts in itertools.combinations_with_replacement(range(n + 1),
                                                                       count - 1))
        assert largest == best, (sizes, count, fragments)
        assert sum(1 for f in fragments if f) == min(n, count)
    assert split_fragments(["a.weight", "b.weight"], [3, 1], 4, "sequential") == [[0], [1],
                                                                                 [], []]


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


def _timed(algorithm, steps: int = 16, network: NetworkModel | None = None,
           steps_only: bool = False) -> tuple[float, int]:
    """(virtual seconds, bytes rank 0 sent after the set-up) of a run on a slow network
    (``network``, default 5 MB/s) where a step computes 10 ms; ``steps_only``: the seconds of
    the steps alone, from after the set-up to before ``finish()``."""
    from gossamer.comm import ComputeModel

    def worker(comm):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 4))
        opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                  algorithm, comm, total_steps=steps)
        start = comm.stats.total_bytes_sent  # after the initial broadcast
        began = comm.clock()
        g = torch.Generator().manual_seed(comm.rank)
        for _ in range(steps):
            opt.zero_grad()
            F.cross_entropy(model(torch.randn(8, 64, generator=g)),
                            torch.randint(0, 4, (8,), generator=g)).backward()
            opt.step()
        took = comm.clock() - began
        opt.finish()
        return took if steps_only else comm.clock(), comm.stats.total_bytes_sent - start

    world = SimWorld(N, network=network or NetworkModel(latency=1e-3, bandwidth=5e6),
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

    for algorithm in algorithms:
        straight = SimWorld(N).run(state_dict_round_trip, algorithm, None, DIM)
        resumed = SimWorld(N).run(state_dict_round_trip, algorithm, 8, DIM)
        for a, b in zip(straight, resumed, strict=True):
            assert torch.equal(a, b), algorithm.name


@pytest.mark.parametrize("stop", [2, 7, 10, 11])
def test_a_state_saved_with_an_exchange_in_flight_resumes_the_same_run(stop):
    """Saved (through torch.save) while a fragment's exchange travels and loaded on every
    worker into fresh objects, the exchange starts again at once with the vector each worker
    sent and its errors as they were before: the same payloads, the same mean at the
    scheduled step, and the run ends bit for bit where the uninterrupted one does, having
    counted the same bytes (what was sent before the save, in either exchange of the mean,
    is sent again uncounted)."""
    # slots of 4 steps: fragment 0 in flight after steps 1 and 2, fragment 1 after 5 and 6,
    # fragment 0 after 9 and 10 (0-based); "stop": saved before that step
    algorithm = StreamingDiLoCo(period=8, fragments=2, tau=2, mixing=0.5, precision="int4",
                                average_optimizer_state=True)

    def run(stop):
        return SimWorld(N).run(saved_mid_run, algorithm, stop, DIM, 16,
                               lambda runtime: runtime.in_flight is not None)

    for (a, _, runtime, sent), (b, in_flight, resumed, sent_too) in zip(
            run(None), run(stop), strict=True):
        assert in_flight
        assert torch.equal(a, b) and runtime.fragment_syncs == resumed.fragment_syncs == [2, 2]
        assert sent_too == sent


def test_the_averaging_options_apply_at_each_fragments_synchronisation():
    """average_optimizer_state: the inner momentum of a fragment's parameters is the same on
    every worker right after the fragment's synchronisation (the other fragment's stays each
    worker's own); average_buffers: BatchNorm's statistics too, at every synchronisation."""
    algorithm = StreamingDiLoCo(period=4, fragments=2, tau=1, precision="int8",
                                average_optimizer_state=True, average_buffers=True)

    def worker(comm):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(DIM, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt = gossamer.distribute(model, inner, algorithm, comm, total_steps=12)
        runtime = opt.runtime
        g = torch.Generator().manual_seed(comm.rank)
        seen = []
        for _ in range(12):
            before = list(runtime.fragment_syncs)
            opt.zero_grad()
            x, y = torch.randn(6, DIM, generator=g), torch.randint(0, 2, (6,), generator=g)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            synced = [p for p in range(2) if runtime.fragment_syncs[p] > before[p]]
            if synced:
                momenta = [torch.cat([inner.state[runtime.trained[i]]["momentum_buffer"]
                                      .flatten() for i in runtime.fragment_indices[p]])
                           for p in range(2)]
                seen.append((synced[0], momenta, [b.clone() for b in model.buffers()
                                                  if b.is_floating_point()]))
        return runtime.fragment_indices, seen

    results = SimWorld(N).run(worker)
    assert results[0][0] == [[0, 1, 4, 5], [2, 3]]  # Linear, BatchNorm, Linear: 0, 1, 0
    assert [s[0] for s in results[0][1]] == [0, 1, 0, 1, 0, 1]
    for k, (fragment, momenta, buffers) in enumerate(results[0][1]):
        other = 1 - fragment
        for _, seen in results[1:]:
            assert torch.equal(seen[k][1][fragment], momenta[fragment])
            assert not torch.equal(seen[k][1][other], momenta[other])
            assert all(torch.equal(a, b) for a, b in zip(seen[k][2], buffers, strict=True))


@pytest.mark.parametrize("kwargs, name", [
    ({"outer": "nope"}, "outer"),
    ({"outer_lr": -1}, "outer_lr"),
    ({"outer": "adam", "outer_momentum": 0.5}, "outer_momentum"),
    ({"replica_size": 0}, "replica_size"),
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
])
def test_bad_streaming_options_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        StreamingDiLoCo(**kwargs)


@pytest.mark.parametrize("option, value", [("alpha", 0.1), ("warmup_period", 2),
                                           ("compression", "topk")])
def test_diloco_options_streaming_diloco_does_not_take_are_no_options(option, value, capsys):
    # not inherited and refused: not options at all; by name, a file or the command line
    # gets an error that names it and says why
    assert option not in {f.name for f in dataclasses.fields(StreamingDiLoCo)}
    with pytest.raises(TypeError, match=option):
        StreamingDiLoCo(**{option: value})
    with pytest.raises(ValueError, match=f"{option}=.*not taken"):
        create("streaming-diloco", {option: str(value)})
    # at the value it had to hold, as a file written when it was an option says: a note
    default = dataclasses.fields(DiLoCo)[[f.name for f in dataclasses.fields(DiLoCo)].index(
        option)].default
    assert create("streaming-diloco", {option: default}) == StreamingDiLoCo()
    assert f"{option!r} is no longer read" in capsys.readouterr().err
    # QSR's rule options had no effect on it: any value is dropped, with the note
    assert create("streaming-diloco", {"power": "3", "warmup": "rising_lr"}) == StreamingDiLoCo()


def test_replica_size_must_divide_the_world():
    with pytest.raises(ValueError, match="replica_size"):
        DiLoCo(replica_size=3).resolve(4)


def test_any_torch_optimizer_is_the_outer_one():
    adam = DiLoCo(period=4, outer="adam", outer_lr=0.01)
    factory = DiLoCo(period=4, outer_optimizer=lambda p: torch.optim.Adam(p, lr=0.01))
    _close(_library(adam, momentum=0.9), _library(factory, momentum=0.9), 0.0)
    assert isinstance(adam.outer_step.make([nn.Parameter(torch.zeros(2))]), torch.optim.Adam)


def test_registry_names_and_options():
    assert create("diloco", {"period": "8", "outer": "adamw"}) == DiLoCo(period=8,
                                                                         outer="adamw")
    streaming = create("streaming-diloco", {"fragments": "2", "precision": "int8"})
    assert dataclasses.replace(streaming) == StreamingDiLoCo(fragments=2, precision="int8")


@pytest.mark.slow
def test_replica_size_flag_sets_the_option(tmp_path, capsys):
    import yaml

    from gossamer.cli import main

    assert main(["train", "--algorithm", "diloco", "--replica-size", "2", "--steps", "8",
                 "--option", "period=4", "--run-dir", str(tmp_path), "--quiet"]) == 0
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())["algorithm"]
    assert written["options"]["replica_size"] == 2 and written["options"]["period"] == 4
    assert "note" not in capsys.readouterr().err
    assert main(["train", "--algorithm", "sgp", "--replica-size", "2", "--steps", "8"]) == 2
    assert "no option 'replica_size'" in capsys.readouterr().err
    # --group-size is WAGMA's (averaging groups), and no other method's
    assert main(["train", "--algorithm", "sgp", "--group-size", "2", "--steps", "8"]) == 2
    assert "no option 'group_size'" in capsys.readouterr().err


@pytest.mark.slow
def test_the_old_group_size_of_diloco_still_works_with_a_note(tmp_path, capsys):
    """--group-size and the option group_size were DiLoCo's replicas before they were named
    apart from WAGMA's groups: read for one release, with a note naming the new name."""
    import yaml

    from gossamer.cli import main

    assert main(["train", "--algorithm", "diloco", "--group-size", "2", "--steps", "4",
                 "--option", "period=2", "--run-dir", str(tmp_path / "flag"), "--quiet"]) == 0
    assert "--group-size for diloco is now --replica-size" in capsys.readouterr().err
    written = yaml.safe_load((tmp_path / "flag" / "config.yaml").read_text())["algorithm"]
    assert written["options"]["replica_size"] == 2 and "group_size" not in written["options"]
    assert main(["train", "--algorithm", "streaming-diloco", "--option", "group_size=2",
                 "--steps", "4", "--quiet"]) == 0
    assert "option 'group_size' is now 'replica_size'" in capsys.readouterr().err
    assert main(["train", "--algorithm", "diloco", "--group-size", "2", "--replica-size", "2",
                 "--steps", "4"]) == 2
    assert "give --replica-size only" in capsys.readouterr().err
    assert main(["train", "--algorithm", "diloco", "--option", "group_size=2", "--option",
                 "replica_size=2", "--steps", "4"]) == 2
    assert "keep 'replica_size'" in capsys.readouterr().err


@pytest.mark.slow
def test_a_recipe_and_a_run_directory_saved_with_group_size_still_load(tmp_path, capsys):
    """A recipe and a run's config.yaml as gossamer wrote them before the rename (DiLoCo's
    replicas under ``group_size``): both load, the run resumes."""
    from gossamer.cli import main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("algorithm: diloco\noptions:\n  group_size: 2\n  period: 2\n"
                      "steps: 4\neval_every: 0\n")
    assert main(["train", "--config", str(recipe), "--quiet", "--run-dir",
                 str(tmp_path / "run"), "--checkpoint-every", "2"]) == 0
    assert "option 'group_size' is now 'replica_size'" in capsys.readouterr().err
    config = tmp_path / "run" / "config.yaml"
    config.write_text(config.read_text().replace("replica_size", "group_size"))
    assert main(["train", "--config", str(recipe), "--resume", "--run-dir",
                 str(tmp_path / "run"), "--steps", "6", "--quiet"]) == 0
    assert "option 'group_size' is now 'replica_size'" in capsys.readouterr().err
