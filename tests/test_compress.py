"""Gradient compression: round-trip bounds, error feedback, DGC's selection and momentum
correction, the wire format on the simulator and gloo, and AllReduce with a compressor."""

from __future__ import annotations

import dataclasses
import io
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gossamer
from gossamer.algorithms import (
    DGC,
    AllReduce,
    FP16AllReduce,
    PowerSGDAllReduce,
    QSGDAllReduce,
    RandomKAllReduce,
    TopKAllReduce,
    create,
)
from gossamer.comm import SimulationError, SimWorld
from gossamer.compress import (
    BF16,
    FP16,
    QSGD,
    CompressedReducer,
    DGCCompressor,
    DGCMemory,
    ErrorFeedback,
    NoCompression,
    PowerSGD,
    RandomK,
    SparsePayload,
    TopK,
    take_over_momentum,
    warmup_density,
)
from gossamer.compress.dgc import default_warmup_steps
from gossamer.compress.payloads import pack_bytes, unpack_bytes
from gossamer.compress.qsgd import CHUNK, DITHER_PERIOD, dither, pack_codes, unpack_codes

SEED = 1234


def _gen(seed: int = SEED) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def roundtrip(compressor, x: torch.Tensor, key: str = "w", memory=None):
    """What one worker alone gets back, every round 'summed' over a world of one, with the
    memory updated as the reducer does. Returns (the last round's payload, what it sent)."""
    payload = compressor.compress(x, key)
    for _ in range(1, compressor.rounds):
        payload = compressor.next_round(payload, key)
    sent = compressor.decompress(payload, key)
    if memory is not None:
        memory.update(key, x, payload, compressor)
    compressor.decompress_sum(payload, key)
    return payload, sent


# ------------------------------------------------------------------------ round-trip bounds


def test_dense_compressors_round_trip():
    x = torch.randn(300, 70, generator=_gen())
    _, y = roundtrip(NoCompression(), x)
    assert torch.equal(y, x)
    payload, y = roundtrip(FP16(), x)
    assert payload.nbytes == 2 * x.numel()
    assert torch.all((y - x).abs() <= 2**-11 * x.abs() + 6e-8)
    payload, y = roundtrip(BF16(), x)
    assert payload.nbytes == 2 * x.numel()
    assert torch.all((y - x).abs() <= 2**-8 * x.abs())
    # out of float16's range: clamped, never inf
    _, big = roundtrip(FP16(), torch.tensor([1e6, -1e6]))
    assert torch.equal(big, torch.tensor([65504.0, -65504.0]))


def test_topk_round_trip_is_exact_top_k():
    x = torch.randn(200, 50, generator=_gen())
    compressor = TopK(ratio=0.01)
    payload, y = roundtrip(compressor, x)
    k = math.ceil(0.01 * x.numel())
    assert payload.indices.numel() == k and payload.indices.dtype == torch.int32
    assert payload.nbytes == 8 * k
    kept = y != 0
    assert int(kept.sum()) == k
    assert torch.equal(y[kept], x[kept])  # float32 values: exact
    assert x.abs()[kept].min() >= x.abs()[~kept].max()
    # ||x - topk(x)||^2 <= (1 - k/d) ||x||^2
    assert (x - y).pow(2).sum() <= (1 - k / x.numel()) * x.pow(2).sum()


def test_randomk_positions_shared_by_workers_and_new_each_step():
    x = torch.randn(100, 100, generator=_gen())
    a, b = RandomK(ratio=0.02, seed=3).for_worker(0), RandomK(ratio=0.02, seed=3).for_worker(1)
    pa, ya = roundtrip(a, x)
    pb, _ = roundtrip(b, x)
    assert torch.equal(pa.indices, pb.indices)  # shared: only the values travel
    assert pa.nbytes == 4 * pa.values.numel()
    assert 0.95 * 200 <= pa.values.numel() <= 200
    kept = ya != 0
    assert torch.equal(ya[kept], x[kept])
    assert (x - ya).pow(2).sum() < x.pow(2).sum()
    a.set_step(1)
    assert not torch.equal(a.compress(x, "w").indices, pa.indices)


def test_qsgd_error_bound_and_unbiased():
    x = torch.randn(5000, generator=_gen())
    compressor = QSGD(levels=7, bucket_size=512)
    payload, y = roundtrip(compressor, x)
    assert payload.codes.numel() == math.ceil(5000 / 2)  # 4 bits per element
    norms = torch.cat([torch.full((512,), float(n)) for n in payload.norms])[:5000]
    assert torch.all((y - x).abs() <= norms / 7 + 1e-5)  # off by less than one level
    # unbiased: the average of many independent roundings approaches x
    total = torch.zeros_like(x)
    draws = 300
    for step in range(draws):
        compressor.set_step(step)
        total += roundtrip(compressor, x)[1]
    level = float(payload.norms.max()) / 7
    assert (total / draws - x).abs().max() < 6 * level / (2 * math.sqrt(draws))
    assert (total / draws - x).norm() < 0.15 * (y - x).norm()


def test_qsgd_draws_are_uniform_and_distinct_within_a_period():
    g = torch.Generator().manual_seed(3)
    u = dither(10 * DITHER_PERIOD, g)
    assert u.numel() == DITHER_PERIOD and u.dtype == torch.float64
    assert 0 <= float(u.min()) and float(u.max()) < 1
    # one draw in each 1/p of [0, 1): a permutation, shifted by one amount
    cells = torch.floor(u * DITHER_PERIOD).long()
    assert torch.equal(torch.sort(cells).values, torch.arange(DITHER_PERIOD))
    assert dither(5, g).numel() == 5
    # each position's draw is uniform over calls
    first = torch.tensor([float(dither(1000, g)[7]) for _ in range(4000)])
    assert abs(float(first.mean()) - 0.5) < 0.015
    assert abs(float((first < 0.25).float().mean()) - 0.25) < 0.02


@pytest.mark.parametrize("levels", [7, 127, 1000])
def test_qsgd_across_chunks_matches_the_papers_quantizer(levels):
    """A tensor of several chunks whose last bucket is partial, against the oracle's Q_s in
    float64: every element on the same level, but for float32's rounding next to a level's
    edge (one level, very rarely)."""
    from tests.oracles.compression import qsgd as oracle_qsgd

    n = CHUNK + 3 * DITHER_PERIOD + 700
    x = torch.randn(n, generator=_gen()) * torch.linspace(0.1, 3, n)
    compressor = QSGD(levels=levels, bucket_size=512)
    mine = compressor.decompress(compressor.compress(x, "w"), "w")
    sent, _ = oracle_qsgd(levels, 512, seed=0)("w", 0, [x])
    step = torch.cat([torch.full((512,), float(v)) for v in
                      torch.linalg.vector_norm(torch.cat([x, x.new_zeros(-n % 512)]).view(-1, 512),
                                               dim=1)])[:n] / levels
    off = ((mine - sent[0]).abs() / step).round()
    assert float(off.max()) <= 1
    assert int((off > 0).sum()) <= n * 1e-4


@pytest.mark.parametrize("levels", [1, 7, 127, 1000])
def test_qsgd_code_packing(levels):
    bits = QSGD(levels=levels).bits
    assert bits == {1: 2, 7: 4, 127: 8, 1000: 16}[levels]
    codes = torch.randint(0, 2 * levels + 1, (1001,), generator=_gen())
    packed = pack_codes(codes, bits)
    assert packed.numel() == math.ceil(1001 * bits / 8)
    assert torch.equal(unpack_codes(packed, bits, 1001), codes.to(torch.int32))


def test_powersgd_exact_on_low_rank_and_converges_to_best_rank_r():
    g = _gen()
    low = torch.randn(60, 2, generator=g) @ torch.randn(2, 40, generator=g)
    payload, y = roundtrip(PowerSGD(rank=2), low)
    assert payload.nbytes == 4 * 40 * 2  # Q's round; P was 60 x 2
    assert torch.allclose(y, low, atol=1e-4)
    m = torch.randn(60, 40, generator=g)
    compressor = PowerSGD(rank=3)
    errors = []
    for step in range(15):  # warm start: power iteration over steps on the same matrix
        compressor.set_step(step)
        errors.append(float((roundtrip(compressor, m)[1] - m).norm()))
    s = torch.linalg.svdvals(m)
    best = float(s[3:].pow(2).sum().sqrt())
    assert errors[0] <= float(m.norm())  # a projection never adds
    assert errors[-1] <= 1.02 * best
    assert errors[-1] < errors[0]


def test_powersgd_sends_vectors_dense():
    assert not PowerSGD(rank=2).compresses(torch.zeros(10))
    assert not PowerSGD(rank=4).compresses(torch.zeros(3, 3))  # factors not smaller
    assert PowerSGD(rank=2).compresses(torch.zeros(16, 3, 3, 3))


def test_payload_bytes_round_trip():
    x = torch.randn(33, 7, generator=_gen())
    compressors = [NoCompression(), FP16(), TopK(ratio=0.1, fp16_values=True),
                   RandomK(ratio=0.1), QSGD(levels=1), DGCCompressor(ratio=0.05)]
    payloads = [c.compress(x, "w") for c in compressors]
    packed = pack_bytes(payloads)
    assert packed.dtype == torch.uint8
    # the header and every payload padded to 4 bytes, nothing more
    assert packed.numel() == 4 * len(payloads) + sum(-(-p.nbytes // 4) * 4 for p in payloads)
    for c, p, q in zip(compressors, payloads, unpack_bytes(packed.clone(), payloads),
                       strict=True):
        assert torch.equal(c.decompress(q, "w"), c.decompress(p, "w"))
    with pytest.raises(ValueError, match="header"):
        unpack_bytes(torch.cat([packed, torch.zeros(4, dtype=torch.uint8)]), payloads)


# ------------------------------------------------------------------------ error feedback


@pytest.mark.parametrize("compressor", [
    TopK(ratio=0.05), TopK(ratio=0.05, fp16_values=True), RandomK(ratio=0.05), FP16(),
    QSGD(levels=3), PowerSGD(rank=1), DGCCompressor(ratio=0.05),
], ids=lambda c: type(c).__name__)
def test_error_feedback_identity(compressor):
    """compensated == sent + new residual, to float precision, every step."""
    memory = ErrorFeedback()
    g = _gen()
    for step in range(4):
        compressor.set_step(step)
        grad = torch.randn(40, 30, generator=g)
        before = memory.residual("w")
        expected = grad + (before if before is not None else 0)
        compensated = memory.compensate("w", grad)
        assert torch.allclose(compensated, expected, atol=1e-6)
        kept = compensated.clone()
        _, sent = roundtrip(compressor, compensated, memory=memory)
        assert torch.allclose(sent.view_as(kept) + memory.residual("w"), kept,
                              rtol=0, atol=1e-6 * float(kept.abs().max()))
        assert memory.residual("w").abs().max() > 0  # something was kept back


# ------------------------------------------------------------------------ DGC


def _kinds(n: int) -> dict[str, torch.Tensor]:
    g = _gen(7)
    return {
        "normal": torch.randn(n, generator=g),
        "heavy-tailed": torch.randn(n, generator=g) / torch.rand(n, generator=g).clamp_min(1e-6),
        "many ties": torch.randint(-2, 3, (n,), generator=g).float(),
        "all zeros": torch.zeros(n),
        "fewer non-zeros than k": torch.randn(n, generator=g) * (torch.rand(n, generator=g)
                                                                < 0.0004),
    }


@pytest.mark.parametrize("numel", [300_000, 2_000_003])
def test_dgc_density_within_bounds(numel):
    compressor = DGCCompressor(ratio=0.001)
    for kind, x in _kinds(numel).items():
        k = math.ceil(0.001 * numel)
        for step in range(3):
            compressor.set_step(step)
            payload = compressor.compress(x.view(-1, 1), kind)
            selected = payload.indices.numel()
            nonzero = int((x != 0).sum())
            target = min(k, nonzero)  # zeros are never sent
            assert 0.8 * target <= selected <= 1.3 * max(target, 1), (kind, selected, k)
            chosen = torch.zeros(numel, dtype=torch.bool)
            chosen[payload.indices.long()] = True
            if 0 < selected < numel:  # a threshold: nothing left out is larger
                assert x.abs()[chosen].min() >= x.abs()[~chosen].max(), kind
            limit = torch.finfo(torch.float16).max
            assert torch.equal(payload.values,
                               x[payload.indices.long()].clamp(-limit, limit).half())
    assert compressor.last_selection is not None


def test_dgc_paths_and_wire_format():
    x = torch.randn(1000, 1000, generator=_gen())
    compressor = DGCCompressor(ratio=0.001)
    payload = compressor.compress(x, "big")
    assert compressor.last_selection.path in ("threshold", "refined")
    assert payload.indices.dtype == torch.int32 and payload.values.dtype == torch.float16
    assert payload.nbytes == 6 * payload.indices.numel()
    ties = torch.ones(1000, 1000)
    assert compressor.compress(ties, "ties").indices.numel() == 1000
    assert compressor.last_selection.path == "refined"
    # fewer non-zeros than k: every non-zero, and nothing else
    sparse = torch.zeros(1_000_000)
    sparse[::1500] = torch.randn(667, generator=_gen())
    assert compressor.compress(sparse.view(1000, 1000), "sparse").indices.numel() == 667
    # 1% non-zeros: the sample's threshold is sometimes too high and is lowered
    g = _gen()
    spiky = torch.randn(100_000, generator=g) * (torch.rand(100_000, generator=g) < 0.01)
    adapted = 0
    for step in range(6):
        compressor.set_step(step)
        selected = compressor.compress(spiky.view(100, 1000), "spiky").indices.numel()
        assert 80 <= selected <= 130
        adapted += compressor.last_selection.adaptations
    assert adapted >= 1
    small = torch.randn(20, 20, generator=_gen())
    compressor.compress(small, "small")
    assert compressor.last_selection.path == "exact"
    assert not compressor.compresses(torch.zeros(100)) and compressor.compresses(x)


def test_dgc_warmup_density():
    densities = [warmup_density(0.001, step, 40, 4) for step in (0, 10, 20, 30, 40, 99)]
    expected = [0.25, 0.25 * 0.004**0.25, 0.25 * 0.004**0.5, 0.25 * 0.004**0.75, 0.001, 0.001]
    assert densities == pytest.approx(expected)
    assert densities[3] == pytest.approx(0.00398, rel=1e-2)  # the paper's 0.4%
    compressor = DGCCompressor(ratio=0.001, warmup_steps=40)
    x = torch.randn(100, 100, generator=_gen())
    assert 0.8 * 2500 <= compressor.compress(x, "w").indices.numel() <= 1.3 * 2500
    compressor.set_step(40)
    assert compressor.compress(x, "w").indices.numel() == 10


def test_dgc_default_warmup_is_the_papers_schedule_over_the_first_quarter_of_the_run():
    """By default (warmup_steps None) the paper's warm-up, sparsity 75%, 93.75%, 98.4375%,
    99.6%, then 99.9%, is spread over the first quarter of the run, once its length is known:
    400 steps warm up for 100, in 4 stages of 25 steps."""
    compressor = DGCCompressor(ratio=0.001)
    assert compressor.warmup_steps is None
    compressor.set_total_steps(400)
    assert compressor.warmup_length == default_warmup_steps(400) == 100
    densities = [compressor.density(step) for step in (0, 24, 25, 49, 50, 74, 75, 99, 100, 399)]
    paper = [0.25, 0.0625, 0.015625, 0.004]  # 1 - the paper's sparsities
    assert densities[0:8:2] == pytest.approx(paper, rel=0.02)
    assert densities[1:8:2] == densities[0:8:2]  # each stage holds for its 25 steps
    assert densities[8:] == [0.001, 0.001]
    # a short run warms up as much of it, a run of 1 step for its only step
    assert default_warmup_steps(10) == 2 and default_warmup_steps(1) == 1
    # the copy each worker uses knows the run's length too
    assert compressor.for_worker(3).warmup_length == 100
    # given, warmup_steps is kept whatever the run's length; 0 is none
    explicit = DGCCompressor(ratio=0.001, warmup_steps=40)
    explicit.set_total_steps(400)
    assert explicit.warmup_length == 40 and explicit.density(40) == 0.001
    none = DGCCompressor(ratio=0.001, warmup_steps=0)
    none.set_total_steps(400)
    assert none.density(0) == 0.001
    with pytest.raises(ValueError, match="warmup_steps"):
        DGCCompressor(warmup_steps=-1)


def test_dgc_without_the_runs_length_sends_the_steady_state_density():
    """Where the loop does not tell the run's length (the planner's few timed steps, the DDP
    hooks, distribute() without total_steps) the default has no warm-up: the density is
    ratio from the first step, as warmup_steps=0."""
    compressor = DGCCompressor(ratio=0.001)
    assert compressor.total_steps is None and compressor.warmup_length == 0
    x = torch.randn(100, 100, generator=_gen())
    assert compressor.density(0) == 0.001
    assert compressor.compress(x, "w").indices.numel() == 10
    compressor.set_total_steps(40)  # told: step 0 is the warm-up's 25%
    assert 0.8 * 2500 <= compressor.compress(x, "w").indices.numel() <= 1.3 * 2500


@pytest.mark.parametrize("total_steps", [None, 8])
def test_dgc_learns_the_runs_length_from_distribute(total_steps):
    """distribute(total_steps=N) reaches the compressor of DGC's runtime: its first step
    sends the warm-up's 25% of the weight; without it, 0.1%."""
    def worker(comm):
        model = nn.Linear(100, 100, bias=False)
        opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1,
                                                         momentum=0.9), DGC(), comm,
                                  total_steps=total_steps)
        model(torch.randn(4, 100, generator=_gen(comm.rank))).square().sum().backward()
        opt.step()
        compressor = opt.runtime.reducer.compressor
        return compressor.total_steps, compressor.warmup_length, compressor.last_selection

    for told, length, selection in SimWorld(2).run(worker):
        assert told == total_steps
        if total_steps is None:
            assert length == 0 and selection.target == 10
        else:
            assert length == 2 and selection.target == 2500


@pytest.mark.parametrize("nesterov,masking", [(False, True), (True, True), (False, False)])
def test_momentum_correction_equals_the_papers_equations(nesterov, masking):
    """DGCMemory + exact top-k against Lin et al. section 3.2 written out directly."""
    m, k, steps = 0.9, 6, 8
    g = _gen(5)
    grads = [torch.randn(12, 10, generator=g) for _ in range(steps)]
    grads[3] = torch.zeros(12, 10)  # a step with no gradient: the momentum still moves
    memory = DGCMemory(momentum=m, nesterov=nesterov, masking=masking)
    compressor = DGCCompressor(ratio=k / 120, fp16_values=False)
    u, v = torch.zeros(12, 10), torch.zeros(12, 10)
    for grad in grads:
        # the paper: u = m u + g; v = v + u; send top-k of v; clear v (and u) where sent
        if nesterov:
            u = m * (u + grad)
            v = v + u + grad
        else:
            u = m * u + grad
            v = v + u
        mask = torch.zeros(120, dtype=torch.bool)
        mask[torch.topk(v.abs().view(-1), k).indices] = True
        mask = mask.view(12, 10)
        expected_sent = torch.where(mask, v, torch.zeros_like(v))
        v = torch.where(mask, torch.zeros_like(v), v)
        if masking:
            u = torch.where(mask, torch.zeros_like(u), u)

        compensated = memory.compensate("w", grad)
        payload = compressor.compress(compensated, "w")
        sent = compressor.decompress(payload, "w")
        memory.update("w", compensated, payload, compressor)
        assert torch.allclose(sent, expected_sent, atol=1e-6)
        assert torch.allclose(memory.velocity_of("w"), v, atol=1e-6)
        assert torch.allclose(memory.momentum_of("w"), u, atol=1e-6)


def test_dgc_local_clipping():
    memory = DGCMemory(momentum=0.0, clip_norm=1.0)
    grad = torch.full((4, 4), 3.0)
    v = memory.compensate("w", grad)
    assert float(v.norm()) == pytest.approx(1.0, rel=1e-5)
    assert torch.equal(grad, torch.full((4, 4), 3.0))  # the input is not modified


def test_take_over_momentum():
    a, b = nn.Linear(3, 3), nn.Linear(3, 1)
    opt = torch.optim.SGD([{"params": a.parameters(), "weight_decay": 1e-3},
                           {"params": b.parameters()}], lr=0.1, momentum=0.9, nesterov=True)
    momentum, nesterov, decays = take_over_momentum(opt, list(a.parameters())
                                                    + list(b.parameters()))
    assert (momentum, nesterov) == (0.9, True)
    assert {id(p): d for p, d in decays.items()} == {id(a.weight): 1e-3, id(a.bias): 1e-3}
    assert all(g["momentum"] == 0 and g["weight_decay"] == 0 for g in opt.param_groups)
    adam = torch.optim.Adam(a.parameters())
    assert take_over_momentum(adam, a.parameters()) == (0.0, False, {})
    mixed = torch.optim.SGD([{"params": a.parameters(), "momentum": 0.5},
                             {"params": b.parameters()}], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="one momentum"):
        take_over_momentum(mixed, list(a.parameters()) + list(b.parameters()))


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("make", [
    lambda r: TopK(ratio=r), lambda r: RandomK(ratio=r), lambda r: DGCCompressor(ratio=r),
    lambda r: DGC(ratio=r), lambda r: TopKAllReduce(ratio=r), lambda r: RandomKAllReduce(ratio=r),
])
@pytest.mark.parametrize("ratio", [0, -0.1, 1.5, float("nan")])
def test_ratio_outside_unit_interval(make, ratio):
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\], got"):
        make(ratio)


def test_bad_options_name_the_argument():
    with pytest.raises(ValueError, match="ratio must be in \\(0, 1\\], got 0"):
        create("topk", {"ratio": "0"})
    with pytest.raises(ValueError, match="rank must be an int >= 1, got 0"):
        PowerSGD(rank=0)
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        create("powersgd", {"rank": "0"})
    with pytest.raises(ValueError, match="levels must be an int >= 1, got 0"):
        QSGD(levels=0)
    with pytest.raises(ValueError, match="levels must be an int >= 1"):
        create("qsgd", {"levels": "0"})
    with pytest.raises(ValueError, match="levels must be <= 32767"):
        QSGD(levels=40000)
    with pytest.raises(ValueError, match="sample_ratio must be in"):
        DGCCompressor(sample_ratio=0)
    with pytest.raises(ValueError, match="momentum must be in"):
        DGCMemory(momentum=1.0)
    with pytest.raises(ValueError, match="clip_norm must be > 0"):
        DGC(clip_norm=0.0)
    with pytest.raises(ValueError, match="dtype must be"):
        FP16AllReduce(dtype="int8")
    with pytest.raises(ValueError, match="bucket_mb"):
        QSGDAllReduce(bucket_mb=0)


def test_sparse_compressor_cannot_be_all_reduced():
    with pytest.raises(ValueError, match="aggregation='allreduce' cannot carry TopK's sparse"):
        AllReduce(compressor=TopK(), aggregation="allreduce")
    with pytest.raises(ValueError, match="aggregation='allreduce' cannot carry DGCCompressor"):
        AllReduce(compressor=DGCCompressor(), memory=DGCMemory(), aggregation="allreduce")
    with pytest.raises(ValueError, match="aggregation='allgather' cannot carry PowerSGD"):
        AllReduce(compressor=PowerSGD(), aggregation="allgather")
    with pytest.raises(ValueError, match="aggregation must be one of"):
        AllReduce(compressor=FP16(), aggregation="ring")
    with pytest.raises(SimulationError) as info:
        SimWorld(1).run(lambda comm: CompressedReducer(comm, QSGD(), aggregation="allreduce"))
    assert isinstance(info.value.failures[0], ValueError)
    assert "aggregation='allreduce' cannot carry QSGD's" in str(info.value.failures[0])
    with pytest.raises(ValueError, match="memory=.* needs a compressor"):
        AllReduce(memory=ErrorFeedback())
    with pytest.raises(ValueError, match="compressor must be a Compressor"):
        AllReduce(compressor="topk")
    with pytest.raises(ValueError, match="node_size=3 must divide the world size 4"):
        AllReduce(compressor=FP16(), node_size=3).validate(4)
    # the legal combinations build
    assert AllReduce(compressor=RandomK(), aggregation="allgather").aggregation == "allgather"
    assert AllReduce(compressor=FP16(), aggregation="allreduce").compressor == FP16()


def test_memory_momentum_applied_twice_is_refused():
    def worker(comm):
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        gossamer.distribute(model, opt, AllReduce(compressor=DGCCompressor(),
                                                  memory=DGCMemory(momentum=0.9)), comm)

    with pytest.raises(Exception, match="applied twice"):
        SimWorld(1).run(worker)

    def scheduled(comm):  # a scheduler writes momentum into the optimizer after binding
        model = nn.Linear(4, 2)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = gossamer.distribute(model, sgd, AllReduce(compressor=DGCCompressor(),
                                                        memory=DGCMemory(momentum=0.9)), comm)
        torch.optim.lr_scheduler.OneCycleLR(sgd, max_lr=0.1, total_steps=4)
        opt.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        opt.step()

    with pytest.raises(Exception, match="applied twice.*cycle_momentum=False"):
        SimWorld(1).run(scheduled)


def test_dgc_checkpoint_keeps_a_scheduled_momentum():
    """A checkpoint of DGC under OneCycleLR holds the momentum the schedule reached (the
    optimizer's groups hold 0 while DGC applies it), and a fresh worker loads it."""
    def worker(comm):
        def bound():
            model = nn.Linear(4, 2)
            sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            return model, gossamer.distribute(model, sgd, DGC(ratio=0.5), comm)

        model, opt = bound()
        scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=8,
                                                        base_momentum=0.5, max_momentum=0.95)
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
            scheduler.step()
        opt.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        opt.step()  # takes over what the scheduler wrote last
        reached = opt.runtime.reducer.memory.momentum
        _, fresh = bound()
        fresh.runtime.load_state_dict(opt.runtime.state_dict())
        return reached, fresh.runtime.reducer.memory.momentum

    for reached, loaded in SimWorld(2).run(worker):
        assert reached != pytest.approx(0.9)
        assert loaded == reached


# ------------------------------------------------------------------------ registry


def test_registry_names_and_string_options():
    assert create("dgc", {"ratio": "0.01", "clip_norm": "none", "fp16_values": "false",
                          "warmup_steps": "12", "node_size": "2"}) == DGC(
        ratio=0.01, fp16_values=False, warmup_steps=12, node_size=2)
    assert create("topk", {"ratio": "0.05", "error_feedback": "no"}) == TopKAllReduce(
        ratio=0.05, error_feedback=False)
    assert create("randomk", {"seed": "3"}) == RandomKAllReduce(seed=3)
    assert create("qsgd", {"levels": "7", "bucket_size": "128"}) == QSGDAllReduce(
        levels=7, bucket_size=128)
    assert create("powersgd", {"rank": "4", "warm_start": "off"}) == PowerSGDAllReduce(
        rank=4, warm_start=False)
    assert create("fp16", {"dtype": "bfloat16"}) == FP16AllReduce(dtype="bfloat16")
    compressor, memory = DGC(clip_norm=2.0).compressor_and_memory(4)
    assert isinstance(compressor, DGCCompressor)
    assert memory.clip_norm == pytest.approx(4.0)  # scaled by workers ** 0.5


def test_dgc_clip_norm_is_the_threshold_of_the_average():
    """Lin et al., Algorithm 1 and Section 3.2: node k's share g_k / n of the averaged gradient
    is clipped at clip_norm / sqrt(n), so a worker's own mean gradient g_k at clip_norm *
    sqrt(n); with the hierarchy the compressed exchange averages the nodes' means."""
    assert DGC(clip_norm=2.0).compressor_and_memory(16)[1].clip_norm == pytest.approx(8.0)
    assert DGC(clip_norm=2.0).compressor_and_memory(1)[1].clip_norm == pytest.approx(2.0)
    _, memory = DGC(clip_norm=2.0, node_size=4).compressor_and_memory(16)
    assert memory.clip_norm == pytest.approx(4.0)
    _, memory = AllReduce(compression="dgc:clip_norm=2.0",
                          node_size=4).compressor_and_memory(16)
    assert memory.clip_norm == pytest.approx(4.0)
    _, memory = AllReduce(compression="dgc:clip_norm=2.0").compressor_and_memory(16)
    assert memory.clip_norm == pytest.approx(8.0)


def _clip_run(comm, algorithm, steps: int = 3):
    """Each worker's gradient of the weight is a fixed tensor of norm 1.5 (its own direction):
    the loss is linear in the weight."""
    torch.manual_seed(0)
    model = nn.Linear(6, 4, bias=False)
    opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                              algorithm, comm, broadcast=False)
    direction = torch.randn(4, 6, generator=_gen(comm.rank))
    direction *= 1.5 / float(direction.norm())
    for _ in range(steps):
        opt.zero_grad()
        (model.weight * direction).sum().backward()
        opt.step()
    return model.weight.detach().clone()


def test_dgc_clipping_leaves_gradients_below_the_scaled_threshold():
    """4 workers whose gradients' norm (1.5) lies between clip_norm (1) and clip_norm *
    sqrt(4): at ratio 1 without masking nothing is clipped, and the run is the unclipped one;
    at clip_norm 0.5 (a threshold of 1 per worker) it is clipped."""
    options = dict(ratio=1.0, momentum_masking=False, fp16_values=False)
    clipped = SimWorld(4).run(lambda comm: _clip_run(comm, DGC(clip_norm=1.0, **options)))
    plain = SimWorld(4).run(lambda comm: _clip_run(comm, DGC(**options)))
    tighter = SimWorld(4).run(lambda comm: _clip_run(comm, DGC(clip_norm=0.5, **options)))
    for rank in range(4):
        assert torch.equal(clipped[rank], plain[rank])
    assert not torch.allclose(tighter[0], plain[0], atol=1e-3)


def test_dgc_fp16_rounding_stays_in_the_velocity():
    """With float16 values only fp16(v) is sent: v keeps the rounding error, and a selected
    value too small for float16 (2e-8, sent as 0) is not lost; sent + kept is what was
    accumulated."""
    g = torch.full((64, 64), 2e-8)
    g[0, :8] = torch.tensor([1e-7, 3e-7, 1e-6, 3e-6, 1e-5, 3e-5, 5e-5, 1e-4])
    compressor, memory = DGCCompressor(ratio=0.01), DGCMemory(momentum=0.0)
    v = memory.compensate("w", g)
    before = v.clone()
    payload = compressor.compress(v, "w")
    memory.update("w", v, payload, compressor)
    sent = compressor.decompress(payload, "w")
    kept = memory.velocity_of("w")
    assert torch.equal(sent + kept, before)
    positions = payload.indices.to(torch.int64)
    tiny = positions[payload.values == 0]
    assert tiny.numel() > 0  # selected, but float16 has no 2e-8
    assert torch.equal(kept.view(-1)[tiny], torch.full((tiny.numel(),), 2e-8))
    assert bool((kept.view(-1)[positions[:8]] != 0).any())  # rounding errors kept
    assert bool((memory.momentum_of("w").view(-1)[positions] == 0).all())  # masked
    memory = DGCMemory(momentum=0.0)  # float32 values: the sent entries of v become 0
    compressor = DGCCompressor(ratio=0.01, fp16_values=False)
    v = memory.compensate("w", g)
    payload = compressor.compress(v, "w")
    memory.update("w", v, payload, compressor)
    assert bool((v.view(-1)[payload.indices.to(torch.int64)] == 0).all())


# ------------------------------------------------------------------------ in the simulator


class _Net(nn.Module):
    """Two linear layers registered in an order that may depend on the rank."""

    def __init__(self, reverse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        first, second = nn.Linear(16, 24), nn.Linear(24, 4)
        if reverse:
            self.second, self.first = second, first
        else:
            self.first, self.second = first, second

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def _batches(rank: int, steps: int):
    g = _gen(100 + rank)
    return torch.randn(steps, 8, 16, generator=g), torch.randint(0, 4, (steps, 8), generator=g)


def _train(comm, algorithm, steps: int, reverse_on_odd: bool = False, momentum: float = 0.9,
           weight_decay: float = 1e-3):
    model = _Net(reverse=reverse_on_odd and comm.rank % 2 == 1)
    # broadcast=False: every rank builds the same model, in its own registration order
    opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1,
                                                     momentum=momentum,
                                                     weight_decay=weight_decay),
                              algorithm, comm, broadcast=False)
    xs, ys = _batches(comm.rank, steps)
    for x, y in zip(xs, ys, strict=True):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}, opt


@pytest.mark.parametrize("algorithm", [
    DGC(ratio=0.05), TopKAllReduce(ratio=0.05), QSGDAllReduce(levels=3),
    PowerSGDAllReduce(rank=1), RandomKAllReduce(ratio=0.05), FP16AllReduce(),
], ids=lambda a: a.name)
def test_registration_order_does_not_matter(algorithm):
    """Without overlap (buckets in the order of the names), ranks that register parameters
    in different orders still agree exactly, and with it (DDP's buckets, in reverse
    registration order) ranks that share the order end where they do."""
    by_name = dataclasses.replace(algorithm, overlap=False)
    mixed = SimWorld(4).run(lambda comm: _train(comm, by_name, 4, reverse_on_odd=True)[0])
    same = SimWorld(4).run(lambda comm: _train(comm, by_name, 4)[0])
    overlapped = SimWorld(4).run(lambda comm: _train(comm, algorithm, 4)[0])
    for params in mixed + overlapped:
        for name, value in params.items():
            assert torch.equal(value, same[0][name]), name
    assert not torch.equal(same[0]["first.weight"], _Net(False).first.weight)


def test_dgc_at_full_density_is_sgd_with_momentum():
    """ratio 1 without masking sends every velocity: exactly momentum SGD on the average."""
    dgc = SimWorld(3).run(lambda comm: _train(
        comm, DGC(ratio=1.0, momentum_masking=False, fp16_values=False), 5)[0])
    exact = SimWorld(3).run(lambda comm: _train(comm, AllReduce(), 5)[0])
    for name, value in exact[0].items():
        assert torch.allclose(dgc[0][name], value, atol=1e-5), name
        assert torch.equal(dgc[1][name], dgc[0][name])


DECAY_LR, DECAY = 0.1, 0.1


def _decay_run(comm, algorithm, *, momentum: float, nesterov: bool = False,
               optimizer_decay: float = DECAY, penalty: float = 0.0, steps: int = 4):
    """Least squares on one float64 Linear(32, 16) per worker (512 weights: at ratio 1e-3
    each worker sends one a step); the weight after each step, the initial one first.
    ``penalty`` adds ``0.5 * penalty * ||params||^2`` to the loss (decay inside the gradient)."""
    torch.manual_seed(0)
    model = nn.Linear(32, 16, dtype=torch.float64)
    sgd = torch.optim.SGD(model.parameters(), lr=DECAY_LR, momentum=momentum,
                          nesterov=nesterov, weight_decay=optimizer_decay)
    opt = gossamer.distribute(model, sgd, algorithm, comm, broadcast=False)
    g = torch.Generator().manual_seed(comm.rank)
    history = [model.weight.detach().clone()]
    for _ in range(steps):
        x = torch.randn(8, 32, generator=g, dtype=torch.float64)
        y = torch.randn(8, 16, generator=g, dtype=torch.float64)
        opt.zero_grad()
        loss = 0.5 * (model(x) - y).pow(2).sum(1).mean()
        if penalty:
            loss = loss + 0.5 * penalty * sum(p.pow(2).sum() for p in model.parameters())
        loss.backward()
        opt.step()
        history.append(model.weight.detach().clone())
    return history


@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_dgc_weight_decay_is_dense_and_local(momentum, nesterov):
    """By default every weight decays every step, though almost none is sent: with b = m b +
    wd x (b = wd x without momentum), each step moves every weight that no worker sent by
    exactly lr * b (Nesterov: lr * (wd x + m b)), as momentum SGD moves it under decay alone."""
    workers = 4
    algorithm = DGC(ratio=1e-3, fp16_values=False)
    history = SimWorld(workers).run(lambda comm: _decay_run(
        comm, algorithm, momentum=momentum, nesterov=nesterov))[0]
    buffer = torch.zeros_like(history[0])
    for before, after in itertools.pairwise(history):
        buffer = momentum * buffer + DECAY * before
        step = DECAY * before + momentum * buffer if nesterov else buffer
        off = (after - (before - DECAY_LR * step)).abs() > 1e-15
        assert int(off.sum()) <= workers  # only where a worker sent its one element
        assert bool((after != before).all())  # every weight moved


def test_dgc_weight_decay_in_gradient_is_sparsified_with_it():
    """weight_decay_in_gradient=True keeps the former behaviour: the decay is added to the
    gradient before momentum correction, exactly as an L2 penalty in the loss with DGC's own
    momentum, so a weight that is not sent does not move."""
    workers = 4
    option = SimWorld(workers).run(lambda comm: _decay_run(
        comm, DGC(ratio=1e-3, fp16_values=False, weight_decay_in_gradient=True),
        momentum=0.9))[0]
    compressor = DGCCompressor(ratio=1e-3, fp16_values=False)
    penalty = SimWorld(workers).run(lambda comm: _decay_run(
        comm, AllReduce(compressor=compressor, memory=DGCMemory(momentum=0.9)),
        momentum=0.0, optimizer_decay=0.0, penalty=DECAY))[0]
    for got, want in zip(option, penalty, strict=True):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)
    for before, after in itertools.pairwise(option):
        assert int((after != before).sum()) <= workers  # the others wait in v


def test_hierarchy_averages_exactly_when_nothing_is_dropped():
    flat = SimWorld(4).run(lambda comm: _train(comm, AllReduce(), 3, momentum=0.0)[0])
    tiered = SimWorld(4).run(lambda comm: _train(
        comm, AllReduce(compressor=NoCompression(), node_size=2), 3, momentum=0.0)[0])
    sparse = SimWorld(4).run(lambda comm: _train(comm, DGC(ratio=0.1, node_size=2), 3)[0])
    for name, value in flat[0].items():
        for rank in range(4):
            assert torch.allclose(tiered[rank][name], value, atol=1e-6), name
            assert torch.equal(sparse[rank][name], sparse[0][name]), name


def test_compressed_bytes_are_counted():
    """The communicator's stats carry the compressed bytes: far fewer than AllReduce's."""
    def bytes_sent(algorithm):
        def worker(comm):
            _train(comm, algorithm, 2)
            return comm.stats.total_bytes_sent
        return SimWorld(4).run(worker)[0]

    dense = bytes_sent(AllReduce())
    assert bytes_sent(FP16AllReduce()) < 0.52 * dense
    assert bytes_sent(DGC(ratio=0.01)) < 0.2 * dense
    assert bytes_sent(QSGDAllReduce(levels=1, bucket_size=4096)) < 0.25 * dense


def test_state_dict_resumes_exactly():
    algorithm = DGC(ratio=0.05, warmup_steps=4)

    def straight(comm):
        return _train(comm, algorithm, 6)[0]

    def resumed(comm):
        model = _Net(False)
        opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1,
                                                         momentum=0.9, weight_decay=1e-3),
                                  algorithm, comm)
        xs, ys = _batches(comm.rank, 6)
        for step in range(6):
            if step == 3:  # a new process: rebuild everything, load the checkpoint
                buffer = io.BytesIO()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
                buffer.seek(0)
                saved = torch.load(buffer, weights_only=True)
                model = _Net(False)
                model.load_state_dict(saved["model"])
                opt = gossamer.distribute(model, torch.optim.SGD(
                    model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3),
                    algorithm, comm, broadcast=False)
                opt.load_state_dict(saved["opt"])
                assert saved["opt"]["algorithm"]["compression"]["memory"]["velocity"]
            opt.zero_grad()
            F.cross_entropy(model(xs[step]), ys[step]).backward()
            opt.step()
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    a, b = SimWorld(2).run(straight), SimWorld(2).run(resumed)
    for name, value in a[0].items():
        assert torch.equal(b[0][name], value), name


# ------------------------------------------------------------------------ on gloo


def _sparse_inputs(rank: int) -> torch.Tensor:
    """Rank 0: zeros (selects nothing); rank 1: dense; rank 2: a few non-zeros."""
    if rank == 0:
        return torch.zeros(600, 500)
    x = torch.randn(600, 500, generator=_gen(rank))
    return x if rank == 1 else x * (torch.rand(600, 500, generator=_gen(9)) < 0.0005)


def gather_worker(comm=None):
    from gossamer.comm import TorchCommunicator

    own = comm is None
    if own:
        comm = TorchCommunicator.from_env(timeout=60)
    try:
        compressor = DGCCompressor(ratio=0.002)
        x = _sparse_inputs(comm.rank)
        payload = compressor.compress(x, "w")
        local = compressor.decompress(payload, "w")
        reducer = CompressedReducer(comm, DGCCompressor(ratio=0.002))
        grad = x.clone()
        before = comm.stats.total_bytes_sent
        reducer.reduce([("w", grad)], step=0)
        return (grad, local, payload.indices.numel(), comm.stats.total_bytes_sent - before,
                reducer.payload_bytes)
    finally:
        if own:
            comm.close()


def _check_gather(results):
    n = len(results)
    expected = sum(r[1] for r in results) / n
    sizes = [r[4] for r in results]
    assert results[0][2] == 0 and results[1][2] > 0  # rank 0 selected nothing
    for rank, (grad, _, _, sent, _) in enumerate(results):
        assert torch.allclose(grad, expected, atol=1e-7)
        assert sent == sum(sizes) - sizes[(rank + 1) % n]  # a ring all-gather of payloads
    assert sizes[0] == 4  # the header alone


def test_variable_size_all_gather_in_simulator():
    _check_gather(SimWorld(3).run(gather_worker))


@pytest.mark.slow
@pytest.mark.gloo
def test_variable_size_all_gather_on_gloo():
    from gossamer.testing import spawn_gloo

    gloo = spawn_gloo(gather_worker, 3, timeout=120)
    _check_gather(gloo)
    sim = SimWorld(3).run(gather_worker)
    for g, s in zip(gloo, sim, strict=True):
        assert torch.equal(g[0], s[0])


def hierarchy_worker(comm=None):
    """DGC with nodes of 2 ranks: dense inside, sparse between; two steps with memory."""
    from gossamer.comm import TorchCommunicator

    own = comm is None
    if own:
        comm = TorchCommunicator.from_env(timeout=60)
    try:
        reducer = CompressedReducer(comm, DGCCompressor(ratio=0.01), DGCMemory(momentum=0.9),
                                    node_size=2)
        out = []
        for step in range(2):
            grads = [("a", torch.randn(200, 300, generator=_gen(10 * comm.rank + step))),
                     ("b", torch.randn(300, generator=_gen(99 + comm.rank)))]
            reducer.reduce(grads, step)
            out.append(torch.cat([g.reshape(-1) for _, g in grads]))
        return torch.stack(out), comm.stats.total_bytes_sent
    finally:
        if own:
            comm.close()


@pytest.mark.slow
@pytest.mark.gloo
def test_hierarchy_on_gloo_matches_simulator():
    from gossamer.testing import spawn_gloo

    gloo = spawn_gloo(hierarchy_worker, 4, timeout=180)
    sim = SimWorld(4).run(hierarchy_worker)
    for rank in range(4):
        assert torch.equal(gloo[rank][0], sim[rank][0])
        assert torch.equal(gloo[rank][0], gloo[0][0])  # every replica gets the same
        # the same bytes, up to the shape headers that gloo's subgroups send (and count)
        assert sim[rank][1] <= gloo[rank][1] <= 1.01 * sim[rank][1]
    # the sparse exchange drops most of the node average: not the exact mean
    exact = sum(torch.randn(200, 300, generator=_gen(10 * r)) for r in range(4)) / 4
    assert not torch.allclose(gloo[0][0][0, :60000], exact.reshape(-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compressors_on_cuda():
    x = torch.randn(512, 1024, device="cuda")
    for compressor in (FP16(), TopK(ratio=0.01), RandomK(ratio=0.01), QSGD(),
                       DGCCompressor(ratio=0.001), PowerSGD(rank=2)):
        payload, y = roundtrip(compressor, x)
        assert y.device == x.device
        restored = payload.from_bytes(payload.to_bytes())
        if not isinstance(compressor, PowerSGD):
            assert torch.equal(compressor.decompress(restored, "w"), y)
    assert isinstance(DGCCompressor().compress(x, "w"), SparsePayload)


# ------------------------------------------- fp16 shares, random-k's k positions, payload bytes


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("compressor", [FP16(), BF16()], ids=["fp16", "bf16"])
def test_half_precision_average_is_right_where_the_sum_would_overflow(compressor, n):
    """Worker r holds 40960, -40960, 1.5 and 30000 + 1000 r: each sum over the workers passes
    float16's 65504 while each average fits. Each worker sends its share, cast and then divided
    by n as DDP's ``fp16_compress_hook`` does, so the all-reduced sum is the average itself:
    finite, exact where the values are representable, within the narrow type's rounding
    elsewhere (summed first and divided afterwards, float16's sum would be inf)."""
    def worker(comm):
        g = torch.tensor([[40960.0, -40960.0, 1.5, 30000.0 + 1000 * comm.rank]]).repeat(2, 1)
        CompressedReducer(comm, compressor).reduce([("w", g)], step=0)
        return g

    mean = 30000.0 + 1000 * (n - 1) / 2
    eps = torch.finfo(compressor.dtype).eps
    for g in SimWorld(n).run(worker):
        assert bool(torch.isfinite(g).all())
        assert g[:, :3].tolist() == [[40960.0, -40960.0, 1.5]] * 2
        assert bool(((g[:, 3] - mean).abs() <= 2 * eps * mean).all()), g[:, 3]


def test_fp16_shares_cannot_overflow_and_the_residual_is_what_was_not_sent():
    """Three workers at float16's largest value: in DDP's order alone each share, 65504 / 3,
    rounds up to 21840 and three of them add up to inf. The shares are clamped to
    ``share_limit`` (21808), so the sum (65424, rounded to 65408 in float16) is finite. With
    error feedback each worker's residual is exactly what it did not contribute to the sum,
    ``c - 3 * share``: the cast's, the division's and the clamp's errors."""
    from gossamer.compress.cast import share_limit

    assert share_limit(torch.float16, 3) == 21808.0
    assert share_limit(torch.float16, 1) == 65504.0
    values = [65504.0, -65504.0, 3.0, 1e-7, 1000.3]

    def worker(comm):
        g = torch.tensor(values)
        reducer = CompressedReducer(comm, FP16(), ErrorFeedback())
        reducer.reduce([("w", g)], step=0)
        return g, reducer.memory.residual("w").clone()

    c = torch.tensor(values)
    share = (c.to(torch.float16) / 3).clamp(-21808.0, 21808.0)
    total = share + share + share  # float16, in rank order
    for g, residual in SimWorld(3).run(worker):
        assert bool(torch.isfinite(g).all())
        assert torch.equal(g, total.float())
        assert g[0] == 65408.0 and g[2] == 3.0
        assert torch.equal(residual, c - 3 * share.float())
        assert residual[0] == 65504.0 - 3 * 21808.0


@pytest.mark.parametrize("ratio", [0.1, 0.5, 0.999])
def test_randomk_sends_exactly_k_distinct_positions_shared_and_new_each_step(ratio):
    """k = ceil(ratio * numel) distinct positions (drawn by distinct draws at 0.1, a
    permutation at 0.5, their complement at 0.999), the same on every worker, other ones at
    the next step; through the reducer, the average is non-zero at exactly k positions, the
    same on every worker, and there it is the exact mean."""
    numel = 37_000
    k = math.ceil(ratio * numel)
    x = torch.randn(numel, generator=_gen())
    chosen = []
    for step in range(2):
        workers = [RandomK(ratio=ratio, seed=5).for_worker(w) for w in range(3)]
        for c in workers:
            c.set_step(step)
        payloads = [c.compress(x, "w") for c in workers]
        indices = payloads[0].indices
        assert indices.numel() == k == torch.unique(indices).numel()
        assert all(torch.equal(p.indices, indices) for p in payloads)
        assert torch.equal(payloads[0].values, x[indices])
        chosen.append(set(indices.tolist()))
    assert chosen[0] != chosen[1]

    def worker(comm):
        g = torch.randn(numel, generator=_gen(comm.rank)) + 5  # never 0
        CompressedReducer(comm, RandomK(ratio=ratio, seed=5)).reduce([("w", g)], step=0)
        return g

    results = SimWorld(3).run(worker)
    mean = sum(torch.randn(numel, generator=_gen(r)) + 5 for r in range(3)) / 3
    sent = results[0] != 0
    assert int(sent.sum()) == k
    assert set(sent.nonzero().view(-1).tolist()) == chosen[0]
    assert all(torch.equal(g, results[0]) for g in results)
    assert torch.allclose(results[0][sent], mean[sent], rtol=1e-6)


@pytest.mark.parametrize("numel, k", [(16, 2), (8, 4), (16, 15)],
                         ids=["draws", "permutation", "complement"])
def test_randomk_positions_are_a_uniform_k_subset(numel, k):
    """Over many steps every k-subset comes up about equally often (a chi-square statistic
    within six standard deviations of its mean), on each way of drawing it: a uniform random
    k-subset, not the smallest positions of a larger draw."""
    from collections import Counter

    from gossamer.compress.base import seeded_generator
    from gossamer.compress.sparse import random_positions

    subsets = math.comb(numel, k)
    draws = 40 * subsets
    counts = Counter(tuple(random_positions(numel, k, seeded_generator(1, "w", s)).tolist())
                     for s in range(draws))
    assert all(len(subset) == k == len(set(subset)) for subset in counts)
    assert len(counts) == subsets
    expected = draws / subsets
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    df = subsets - 1
    assert chi2 <= df + 6 * math.sqrt(2 * df), chi2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_nbytes_are_the_bytes_packed(dtype):
    """A payload's ``nbytes`` is what it puts on the wire, in the dtype it is sent in: QSGD's
    norms are float64 for a float64 tensor (8 bytes each), LowBit's ``float32`` format sends a
    float64 vector as float64."""
    from gossamer.compress.lowbit import PRECISIONS, LowBit

    x = torch.randn(4096 + 7, generator=_gen(), dtype=dtype)
    for compressor in (QSGD(levels=7, bucket_size=512), TopK(ratio=0.01), RandomK(ratio=0.01),
                       FP16(), NoCompression()):
        payload = compressor.compress(x, "w")
        assert -(-payload.nbytes // 4) * 4 == payload.to_bytes().numel(), compressor
    q = QSGD(levels=7, bucket_size=512).compress(x, "w")
    assert q.nbytes == q.norms.numel() * dtype.itemsize + q.codes.numel()
    for precision in PRECISIONS:
        codec = LowBit(precision)
        sent = codec.encode(x)
        assert codec.nbytes(x.numel(), dtype) == sent.numel() * sent.element_size(), precision
