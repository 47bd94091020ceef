"""The sparse all-reduce (``aggregation="sparse_allreduce"``) against its oracle and invariants.

- The oracle (``tests/oracles/sparse_allreduce.py``, Ok-Topk's split-and-reduce and
  all-gather, gTop-k's selection of the sum and residual rule) is matched step by step by the
  library's trajectory in SimWorld: top-k with error feedback and momentum SGD, on 4 workers,
  on 3 (regions of unequal length), and hierarchical (2 nodes of 2).
- Conservation: what every worker's memory keeps plus ``n`` times the applied average is the
  sum of what the workers compensated (error feedback, and DGC's velocity with float32
  values), while the owners did drop entries.
- The global threshold (Ok-Topk's, reused from the previous reduction): every sum above it is
  kept, so the region where the large sums are keeps more than its quota.
- At density 1 it is the exact all-reduce.
- Bytes: each worker's bytes per step stay within a constant as n goes 4, 8, 16 (and below
  the formula's bound), while the all-gather's grow as n - 1.
- The flags ride on it; a compressor that is not sparse is refused, naming the argument.
- Backend parity (slow, gloo): the same run on 4 gloo processes, flat and in nodes of 2, sends
  the same bytes (in nodes, plus the shape headers that gloo's group all-gather sends) and ends
  with the same parameters as in SimWorld (1e-6: the dense biases are summed in gloo's ring
  order).
"""

from __future__ import annotations

import pytest
import torch
from oracles import compression as base_oracle
from oracles import sparse_allreduce as oracle
from torch import nn

import gossamer
from gossamer.algorithms import AllReduce
from gossamer.comm import SimWorld
from gossamer.compress import (
    QSGD,
    DGCCompressor,
    DGCMemory,
    ErrorFeedback,
    RandomK,
    TopK,
)
from gossamer.compress.reducer import CompressedReducer
from gossamer.compress.sparse_allreduce import keep_largest, region_bounds, region_quota

SPARSE = "sparse_allreduce"
D_IN, D_OUT, ROWS, STEPS, LR = 12, 8, 4, 8, 0.05


# ---------------------------------------------------------------------------- the oracle


def _data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    a = torch.randn(ROWS, D_IN, generator=g, dtype=torch.float64)
    return a, torch.randn(ROWS, D_OUT, generator=g, dtype=torch.float64) * (rank + 1)


def _grad(rank: int, step: int, x: base_oracle.Params) -> base_oracle.Params:
    """The gradient of ``0.5 ||a W^T + c - b||^2 / ROWS``, by hand."""
    a, b = _data(rank, step)
    r = a @ x["weight"].T + x["bias"] - b
    return {"weight": r.T @ a / ROWS, "bias": r.sum(0) / ROWS}


def _x0() -> base_oracle.Params:
    g = torch.Generator().manual_seed(7)
    return {"weight": torch.randn(D_OUT, D_IN, generator=g, dtype=torch.float64) * 0.3,
            "bias": torch.randn(D_OUT, generator=g, dtype=torch.float64) * 0.3}


def _library(workers: int, algorithm: AllReduce) -> list[list[dict[str, torch.Tensor]]]:
    x0 = _x0()

    def worker(comm):
        model = nn.Linear(D_IN, D_OUT, dtype=torch.float64)
        with torch.no_grad():
            model.weight.copy_(x0["weight"])
            model.bias.copy_(x0["bias"])
        opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=LR,
                                                         momentum=0.5), algorithm, comm,
                                  broadcast=False)
        out = []
        for step in range(STEPS):
            a, b = _data(comm.rank, step)
            opt.zero_grad()
            (0.5 * (model(a) - b).pow(2).sum() / ROWS).backward()
            opt.step()
            out.append({k: p.detach().clone() for k, p in model.named_parameters()})
        return out

    results = SimWorld(workers).run(worker)
    return [[results[w][k] for w in range(workers)] for k in range(STEPS)]


@pytest.mark.parametrize(("workers", "node_size"), [(4, 1), (3, 1), (4, 2)],
                         ids=["4-workers", "3-workers", "2-nodes-of-2"])
def test_library_matches_oracle(workers, node_size):
    ratio = 0.1
    algorithm = AllReduce(compressor=TopK(ratio=ratio), memory=ErrorFeedback(),
                          aggregation=SPARSE, node_size=node_size)
    got = _library(workers, algorithm)
    want = oracle.topk_sparse_allreduce_sgd(
        _x0(), _grad, workers=workers, steps=STEPS, lr=LR, ratio=ratio, momentum=0.5,
        node_size=node_size)
    for step, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        for w in range(workers):
            for name, value in theirs[w].items():
                assert torch.allclose(mine[w][name], value, rtol=0, atol=1e-9), (
                    f"step {step + 1}, worker {w}, {name}: "
                    f"{float((mine[w][name] - value).abs().max()):.3g} from the oracle")
    # and it is not the all-gather's trajectory: the owners dropped entries
    gathered = _library(workers, AllReduce(compressor=TopK(ratio=ratio),
                                           memory=ErrorFeedback(), node_size=node_size))
    assert not torch.allclose(gathered[-1][0]["weight"], got[-1][0]["weight"])


def test_owner_rule():
    assert region_bounds(10, 3) == [0, 3, 6, 10]
    assert [region_quota(5, 10, k) for k in (3, 3, 4)] == [2, 2, 2]  # ceil(5 * len / 10)
    assert region_quota(5, 10, 0) == 0
    values = torch.tensor([0.0, -3.0, 2.0, 3.0, 0.0, 1.0])
    assert keep_largest(values, 2).tolist() == [1, 3]  # a tie: the lower position first
    assert keep_largest(values, 3).tolist() == [1, 2, 3]
    assert keep_largest(values, 10).tolist() == [1, 2, 3, 5]  # never a zero


# ---------------------------------------------------------------------------- invariants


def _gradients(rank: int, shapes, dtype=torch.float32) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    return [(f"t{i}", torch.randn(*shape, generator=g, dtype=dtype) * (1 + i))
            for i, shape in enumerate(shapes)]


SHAPES = [(64, 50), (30, 7), (5, 3)]


def _reduce(workers: int, compressor, memory, steps: int = 2, shapes=SHAPES, **options):
    """Each worker's (per-step [memory before, gradient, average, memory after], bytes sent,
    payload bytes, entries the owners kept at each step)."""
    def worker(comm):
        reducer = CompressedReducer(comm, compressor, memory, **options)
        record, kept = [], []
        for step in range(steps):
            grads = _gradients(comm.rank + 100 * step, shapes)
            before = [_unsent(reducer, key) for key, _ in grads]
            added = [g.clone() for _, g in grads]
            reducer.reduce(grads, step)
            record.append((before, added, [g.clone() for _, g in grads],
                           [_unsent(reducer, key) for key, _ in grads]))
            kept.append(reducer.kept_entries - sum(kept))
        return record, comm.stats.total_bytes_sent, reducer.payload_bytes, kept
    return SimWorld(workers).run(worker)


def _unsent(reducer: CompressedReducer, key: str) -> torch.Tensor:
    memory = reducer.memory
    kept = memory.residual(key) if isinstance(memory, ErrorFeedback) else memory.velocity_of(key)
    return torch.zeros(0) if kept is None else kept.clone()


@pytest.mark.parametrize("memory", [ErrorFeedback(), DGCMemory(momentum=0.0)],
                         ids=["error-feedback", "dgc-velocity"])
def test_nothing_is_lost(memory):
    """sum_w memory_after + n * average == sum_w (memory_before + gradient), every step and
    tensor, while the owners dropped some of the selected entries."""
    n = 4
    compressor = (TopK(ratio=0.05) if isinstance(memory, ErrorFeedback)
                  else DGCCompressor(ratio=0.05, fp16_values=False))
    results = _reduce(n, compressor, memory, steps=3, aggregation=SPARSE)
    for step in range(3):
        for t in range(len(SHAPES)):
            average = results[0][0][step][2][t]
            if compressor.compresses(average):
                total_in = sum(r[0][step][1][t] + (r[0][step][0][t] if r[0][step][0][t].numel()
                                                   else 0) for r in results)
                total_out = sum(r[0][step][3][t] for r in results) + n * average
                assert torch.allclose(total_out, total_in, rtol=0, atol=1e-4), (step, t)
    # at the first step (the quotas alone) the owners kept about the target, far fewer than
    # the union of the selections; later, at most the target per owner
    target = sum(compressor.target_count(s[0] * s[1]) for s in SHAPES
                 if compressor.compresses(torch.empty(s)))
    kept = results[0][3]
    assert kept[0] <= target + n - 1
    assert kept[0] < 2 * target  # so some selected entries were dropped, and kept
    assert all(k <= n * target for k in kept)


def test_the_threshold_lets_a_region_keep_more_than_its_share():
    """Ok-Topk's global threshold, reused: at the second reduction each region keeps its
    quota and its sums of magnitude at least the target-th largest kept at the first (at most
    the target), so the region where the large gradients are (the first quarter, 1.5 times
    larger) keeps more than its quota (a quota alone keeps the same count everywhere)."""
    n, shape, ratio = 4, (40, 10), 0.1
    target = 40  # ratio * 400; each of the 4 regions of 100 positions has a quota of 10

    def worker(comm):
        reducer = CompressedReducer(comm, TopK(ratio=ratio), ErrorFeedback(),
                                    aggregation=SPARSE)
        out = []
        for step in range(2):
            g = torch.Generator().manual_seed(10 * comm.rank + step)
            grad = torch.randn(shape, generator=g, dtype=torch.float64)
            grad.view(-1)[:100] *= 1.5
            compensated = grad + (reducer.memory.residual("w") if step else 0)
            chosen = torch.topk(compensated.view(-1).abs(), target).indices
            sent = torch.zeros(400, dtype=torch.float64)
            sent[chosen] = compensated.view(-1)[chosen]
            reducer.reduce([("w", grad)], step)
            out.append((sent, grad.view(-1) * n))  # this worker's entries; the kept sums
        restored = CompressedReducer(comm, TopK(ratio=ratio), ErrorFeedback(),
                                     aggregation=SPARSE)
        restored.load_state_dict(reducer.state_dict())  # the threshold is checkpointed
        assert restored.state_dict()["thresholds"] == reducer.state_dict()["thresholds"] != []
        return out

    results = SimWorld(n).run(worker)
    kept_sums = results[0][0][1]
    assert int((kept_sums != 0).sum()) == target  # the quotas at the first reduction
    threshold = float(kept_sums.abs().topk(target).values[-1])
    sums = sum(r[1][0] for r in results)  # the second step's sums of the selected entries
    applied = results[0][1][1] != 0
    assert torch.equal(applied, applied & (sums != 0))
    counts = [int(applied[j * 100:(j + 1) * 100].sum()) for j in range(n)]
    above = [int((sums[j * 100:(j + 1) * 100].abs() >= threshold).sum()) for j in range(n)]
    assert counts[0] > 10, counts  # more than the quota, where the large sums are
    for j in range(n):  # its quota, and its sums above the threshold, at most the target
        assert max(10, min(above[j], target)) <= counts[j] <= max(10, above[j]), (counts, above)


def test_density_one_is_the_exact_allreduce():
    n = 4
    results = _reduce(n, TopK(ratio=1.0), ErrorFeedback(), steps=1, aggregation=SPARSE)
    grads = [_gradients(r, SHAPES) for r in range(n)]
    for t in range(len(SHAPES)):
        exact = sum(g[t][1] for g in grads) / n
        for r in range(n):
            assert torch.allclose(results[r][0][0][2][t], exact, rtol=0, atol=1e-6)


def test_every_worker_gets_the_same_average():
    results = _reduce(4, DGCCompressor(ratio=0.01), DGCMemory(momentum=0.9), steps=2,
                      aggregation=SPARSE)
    for step in range(2):
        for t in range(len(SHAPES)):
            assert all(torch.equal(r[0][step][2][t], results[0][0][step][2][t])
                       for r in results)


def test_bytes_per_worker_do_not_grow_with_n():
    """DGC at 1% of a 200k-element bucket: the sparse all-reduce's bytes per worker at n = 4, 8
    and 16 within 1.5x of each other and under the bound (counts + 6-byte entries to owners +
    8-byte kept entries through the ring), while the all-gather's grow as n - 1."""
    shapes = [(500, 400)]
    k = 2000
    sparse, gathered = {}, {}
    for n in (4, 8, 16):
        results = _reduce(n, DGCCompressor(ratio=0.01), DGCMemory(momentum=0.9), steps=1,
                          shapes=shapes, aggregation=SPARSE)
        sparse[n] = max(r[1] for r in results)
        bound = 4 * (n - 1) + 6 * 1.3 * k + 8 * (k + n) * (n - 1) / n
        assert sparse[n] <= bound, (n, sparse[n], bound)
        results = _reduce(n, DGCCompressor(ratio=0.01), DGCMemory(momentum=0.9), steps=1,
                          shapes=shapes)
        gathered[n] = max(r[1] for r in results)
    assert max(sparse.values()) <= 1.5 * min(sparse.values()), sparse
    assert gathered[16] > 5 * sparse[16], (gathered, sparse)


def test_flags_ride_on_it():
    def worker(comm):
        reducer = CompressedReducer(comm, TopK(ratio=0.1), ErrorFeedback(), aggregation=SPARSE)
        flags = torch.tensor([float(comm.rank + 1)])
        reducer.reduce(_gradients(comm.rank, SHAPES), 0, flags=flags)
        return float(flags), comm.stats.operations["all_reduce"]
    results = SimWorld(4).run(worker)
    assert [f for f, _ in results] == [10.0] * 4
    assert all(ops == 0 for _, ops in results)  # no collective of their own


@pytest.mark.parametrize("compressor", [RandomK(ratio=0.1), QSGD()], ids=["randomk", "qsgd"])
def test_a_compressor_that_is_not_sparse_is_refused(compressor):
    with pytest.raises(ValueError, match="aggregation='sparse_allreduce' needs a compressor"):
        AllReduce(compressor=compressor, aggregation=SPARSE)
    with pytest.raises(ValueError, match="aggregation"):
        AllReduce(compression="randomk", aggregation=SPARSE)


# ---------------------------------------------------------------------------- gloo parity


PARITY = {
    "dgc-flat": AllReduce(compression="dgc:ratio=0.02", aggregation=SPARSE),
    "topk-nodes-of-2": AllReduce(compression="topk:ratio=0.05", aggregation=SPARSE,
                                 node_size=2),
}


STEPS_PARITY = 6


def _parity_run(comm, case: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1,
                                                     momentum=0.9), PARITY[case], comm)
    g = torch.Generator().manual_seed(100 + comm.rank)
    for _ in range(STEPS_PARITY):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.finish()
    return (torch.cat([p.detach().flatten() for p in model.parameters()]),
            comm.stats.total_bytes_sent)


@pytest.mark.slow
@pytest.mark.gloo
def test_simulator_and_gloo_agree():
    from gossamer.testing import collect, run_in_turn, spawn_gloo

    runs = [(case, (case,)) for case in PARITY]
    gloo = spawn_gloo(run_in_turn, 4, args=(_parity_run, runs), timeout=120)
    for case in PARITY:
        real = collect(gloo, case)
        sim = SimWorld(4).run(_parity_run, case)
        for rank, ((p_sim, b_sim), (p_gloo, b_gloo)) in enumerate(zip(sim, real, strict=True)):
            # on gloo the nodes' group (a P2PGroup over exchanges) sends each all-gather's
            # shape header around its ring too; as a communicator's own all-gather, it counts
            # only the payloads, which the simulator counts
            assert b_gloo == b_sim, (case, rank, b_sim, b_gloo)
            # the dense biases' all-reduce adds in gloo's ring order: float32's last bits
            assert torch.allclose(p_sim, p_gloo, rtol=0, atol=1e-6), (
                case, rank, float((p_sim - p_gloo).abs().max()))
        assert not torch.equal(sim[0][0], _parity_initial()), case  # it trained


def _parity_initial() -> torch.Tensor:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return torch.cat([p.detach().flatten() for p in model.parameters()])
