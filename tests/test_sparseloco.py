"""SparseLoCo: against an oracle written from the paper, its invariants, and on gloo.

The oracle is Algorithm 1 of Sarfi et al., "Communication Efficient LLM Pre-training with
SparseLoCo" (arXiv 2508.15706), written as one sequential program over the 4 workers, with
its own chunking, top-k and statistical quantiser: the library's run in SimWorld must hold
the oracle's parameters on every worker after every step, to float32 tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from loco_helpers import assert_gloo_agrees, regression_batch, rounds_run
from oracles.statistical import quantise
from resume_helpers import state_dict_round_trip
from torch import nn

import gossamer
from gossamer.algorithms import create
from gossamer.algorithms.diloco import DiLoCo
from gossamer.algorithms.sparseloco import SparseLoCo
from gossamer.comm import SimWorld
from gossamer.train.config import TrainConfig
from gossamer.train.run import run_training

N = 4
IN, OUT = 8, 4
STEPS, H, LR = 12, 3, 0.05
ATOL = 1e-5


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return regression_batch(rank, step, IN, OUT)


def _initial() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(IN, OUT)


# ---------------------------------------------------------------------------- the oracle


def _oracle_chunks(x: torch.Tensor, side: int) -> list[torch.Tensor]:
    """The flat positions of each chunk of ``x``: blocks of the largest divisors of each
    dimension not above ``side`` (a vector as one row)."""
    rows, cols = (1, x.numel()) if x.dim() == 1 else x.shape
    n1 = max(d for d in range(1, side + 1) if rows % d == 0)
    n2 = max(d for d in range(1, side + 1) if cols % d == 0)
    chunks = []
    for i in range(0, rows, n1):
        for j in range(0, cols, n2):
            chunks.append(torch.tensor([(i + a) * cols + j + b for a in range(n1)
                                        for b in range(n2)]))
    return chunks


def _oracle_compress(a: torch.Tensor, side: int, k: int, bits: int, sigmas: float
                     ) -> torch.Tensor:
    """Q(TopK(a)): the k largest magnitudes of each chunk, quantised over the tensor."""
    flat = a.reshape(-1)
    chosen = []
    for positions in _oracle_chunks(a, side):
        values = flat[positions]
        order = sorted(range(len(positions)), key=lambda i: -abs(float(values[i])))
        chosen += [int(positions[i]) for i in order[:k]]
    chosen_t = torch.tensor(chosen)
    values = flat[chosen_t]
    if bits != 32:
        values = quantise(values, bits, sigmas)
    out = torch.zeros_like(flat)
    out[chosen_t] = values
    return out.view_as(a)


def _oracle(beta: float, alpha: float, side: int, k: int, bits: int, sigmas: float = 6.0
            ) -> list[list[torch.Tensor]]:
    """Algorithm 1, every worker's parameters after every step."""
    model = _initial()
    theta = [p.detach().clone() for p in model.parameters()]
    errors = [[torch.zeros_like(t) for t in theta] for _ in range(N)]
    local = [[t.clone() for t in theta] for _ in range(N)]
    trajectory = []
    for step in range(STEPS):
        for r in range(N):  # one step of InnerOpt (SGD) on each worker's data
            params = [t.clone().requires_grad_() for t in local[r]]
            x, y = _batch(r, step)
            F.mse_loss(x @ params[0].T + params[1], y).backward()
            local[r] = [(p - LR * p.grad).detach() for p in params]
        if (step + 1) % H == 0:  # the round's end
            sent = []
            for r in range(N):
                mine = []
                for i, t in enumerate(theta):
                    delta = t - local[r][i]                   # Delta_r = theta - theta_r
                    a = beta * errors[r][i] + delta          # A_r = beta e_r + Delta_r
                    d = _oracle_compress(a, side, k, bits, sigmas)  # Q(TopK(A_r))
                    errors[r][i] = a - d                     # e_r = A_r - D_r
                    mine.append(d)
                sent.append(mine)
            for i in range(len(theta)):                      # theta -= alpha mean_r D_r
                theta[i] = theta[i] - alpha * sum(s[i] for s in sent) / N
            local = [[t.clone() for t in theta] for _ in range(N)]
        trajectory.append([torch.cat([t.flatten() for t in w]) for w in local])
    return trajectory


# --------------------------------------------------------------------------- the library


def _worker(comm, algorithm):
    model = _initial()
    return rounds_run(comm, model, torch.optim.SGD(model.parameters(), lr=LR), algorithm,
                      _batch, STEPS)


def _library(algorithm):
    return SimWorld(N).run(_worker, algorithm)


ORACLE_CASES = {
    "2 bits, k 3 of 4x4 chunks": dict(beta=0.95, alpha=1.0, side=4, k=3, bits=2),
    "4 bits, outer lr 0.7, beta 0.9": dict(beta=0.9, alpha=0.7, side=4, k=5, bits=4),
    "8 bits, chunks of 2x8": dict(beta=0.95, alpha=1.0, side=8, k=4, bits=8),
    "unquantised": dict(beta=0.5, alpha=1.0, side=4, k=2, bits=32),
}


@pytest.mark.parametrize("case", list(ORACLE_CASES))
def test_sparseloco_matches_the_papers_algorithm_step_by_step(case):
    s = ORACLE_CASES[case]
    algorithm = SparseLoCo(period=H, error_decay=s["beta"], outer_lr=s["alpha"],
                           chunk=s["side"], topk=s["k"], bits=s["bits"])
    results = _library(algorithm)
    expected = _oracle(s["beta"], s["alpha"], s["side"], s["k"], s["bits"])
    for rank, (trajectory, syncs, _) in enumerate(results):
        assert syncs == [H - 1 + H * j for j in range(STEPS // H)]
        for step, got in enumerate(trajectory):
            err = float((got - expected[step][rank]).abs().max())
            assert err <= ATOL, f"step {step}, worker {rank}: off by {err:g}"


# ---------------------------------------------------------------------------- invariants


def test_full_density_and_32_bits_is_diloco_without_momentum_exactly():
    """Every entry sent unquantised: the accumulator empties every round, whatever beta, and
    the outer step is DiLoCo's with outer SGD of momentum 0."""
    sparse = _library(SparseLoCo(period=H, topk=10**6, bits=32, error_decay=0.95,
                                 outer_lr=0.7))
    plain = _library(DiLoCo(period=H, outer_lr=0.7, outer_momentum=0.0,
                            outer_nesterov=False))
    for (a, syncs_a, _), (b, syncs_b, _) in zip(sparse, plain, strict=True):
        assert syncs_a == syncs_b
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


@pytest.mark.parametrize("bits", [2, 4, 8, 32])
def test_error_feedback_loses_nothing_over_a_round(bits):
    """Per worker: what it sends plus what it remembers is its pseudo-gradient plus its
    decayed old accumulator; and its payload decodes to what it sent."""

    def worker(comm):
        model = nn.Linear(64, 48)
        opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  SparseLoCo(period=2, chunk=16, topk=7, bits=bits), comm)
        g = torch.Generator().manual_seed(comm.rank)
        for _ in range(5):  # two rounds, then one step into the third
            opt.zero_grad()
            model(torch.randn(4, 64, generator=g)).pow(2).mean().backward()
            opt.step()
        runtime = opt.runtime
        old = [runtime.errors[name].clone() for name in runtime.names]
        deltas = runtime.outer.pseudo_gradients(range(len(runtime.trained)))
        payload, sent = runtime.compress(deltas)
        assert payload.numel() == runtime.payload_bytes()
        for i, name in enumerate(runtime.names):
            assert old[i].abs().sum() > 0  # earlier rounds left something
            left = runtime.errors[name]
            assert torch.allclose(sent[i] + left, deltas[i] + 0.95 * old[i], rtol=0,
                                  atol=1e-7)
            assert int((sent[i] != 0).sum()) <= 7 * runtime.chunking[i].chunks
        for got, want in zip(runtime.decompress(payload), sent, strict=True):
            assert torch.equal(got, want)

    SimWorld(N).run(worker)


def test_two_bits_send_a_small_share_of_dilocos_bytes():
    """The default k (64 of 4096) in 2 bits: about 2.25 bytes per sent entry with its
    position, against 4 per element for DiLoCo's float32 all-reduce."""

    def worker(comm, algorithm):
        model = nn.Linear(256, 128)
        opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  algorithm, comm)
        comm.stats.reset()  # the rounds' bytes, not the initial broadcast's
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(4, 256)).pow(2).mean().backward()
            opt.step()
        return comm.stats.total_bytes_sent

    sparse = SimWorld(N).run(worker, SparseLoCo(period=2))[0]
    dense = SimWorld(N).run(worker, DiLoCo(period=2))[0]
    assert sparse < 0.05 * dense, (sparse, dense)


def test_options_are_checked_naming_them():
    for kwargs, name in [({"bits": 3}, "bits"), ({"topk": 0}, "topk"), ({"chunk": 0}, "chunk"),
                         ({"error_decay": 1.5}, "error_decay"),
                         ({"range_in_sigmas": 0}, "range_in_sigmas"),
                         ({"replica_size": 0}, "replica_size")]:
        with pytest.raises(ValueError, match=name):
            SparseLoCo(**kwargs)
    with pytest.raises(ValueError, match="outer_momentum"):  # no outer momentum to set
        create("sparseloco", {"outer_momentum": "0.9"})
    assert create("sparseloco", {"topk": "32", "bits": "4"}) == SparseLoCo(topk=32, bits=4)


# ------------------------------------------------------------------- composition, resume


def test_replicas_of_two_send_half_the_pseudo_gradients():
    results = _library(SparseLoCo(period=H, replica_size=2, chunk=4, topk=2))
    for trajectory, syncs, _ in results:
        assert syncs == [2, 5, 8, 11] and all(torch.isfinite(t).all() for t in trajectory)
    # the members of a replica hold the same parameters
    assert torch.equal(results[0][0][-1], results[1][0][-1])


def test_a_resumed_run_ends_bit_equal():
    """Stopped after 8 of 16 steps and resumed from the state dicts on fresh objects: the
    accumulators travel with the global parameters."""

    algorithm = SparseLoCo(period=3, chunk=4, topk=2)
    straight = SimWorld(N).run(state_dict_round_trip, algorithm, None, IN)
    resumed = SimWorld(N).run(state_dict_round_trip, algorithm, 8, IN)
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b)


def test_the_survivors_go_on_after_a_crash():
    result = run_training(TrainConfig(algorithm="sparseloco", sim=4, quiet=True, timeout=3,
                                      steps=6, faults=("1:3:crash",), on_failure="continue",
                                      options={"period": 2}))
    assert result["membership"][-1]["members"] == [0, 2, 3] and result["world_size"] == 3
    assert result["step"] == 6 and math.isfinite(result["eval_loss"])


# ------------------------------------------------------------------------- SimWorld = gloo


@pytest.mark.gloo
def test_simworld_and_gloo_agree_in_bytes_and_synchronisations():
    assert_gloo_agrees(_worker, {"sparseloco": SparseLoCo(period=H, chunk=4, topk=3)}, N,
                       [2, 5, 8, 11])
