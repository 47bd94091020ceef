"""MuLoCo and its inner Muon: against an oracle written from the paper (and the authors'
code), its invariants, its composition with the rest, and on gloo.

The oracle (tests/oracles/muloco.py) runs the 4 workers as one sequential program: torch's
Muon and AdamW built by hand on each worker's parameters, the statistical quantiser element by
element, the error-feedback accumulator and the outer Nesterov SGD written out. The library's
run in SimWorld must hold the oracle's parameters on every worker after every step, to float32
tolerance (the quantiser's bin means are summed in another order).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from loco_helpers import assert_gloo_agrees, regression_batch, rounds_run
from oracles.muloco import muloco as oracle
from resume_helpers import assert_last_checkpoints_equal, straight_and_resumed
from torch import nn

import gossamer
from gossamer.algorithms import create
from gossamer.algorithms.diloco import DiLoCo
from gossamer.algorithms.muloco import MuLoCo
from gossamer.comm import SimWorld
from gossamer.compress import ErrorFeedback
from gossamer.optim import MuonWithAdamW, muon, muon_parameters
from gossamer.train.config import TrainConfig
from gossamer.train.run import run_training

N = 4
IN, HIDDEN, OUT = 8, 6, 4
STEPS, H, LR = 9, 3, 0.01
ATOL = 2e-5


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return regression_batch(rank, step, IN, OUT)


def _initial() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def _worker(comm, algorithm, inner=None):
    model = _initial()
    inner = muon(model, lr=LR) if inner is None else inner(model)
    return rounds_run(comm, model, inner, algorithm, _batch, STEPS)


def _library(algorithm, inner=None):
    return SimWorld(N).run(_worker, algorithm, inner)


def _expected(**kwargs):
    return oracle(_initial, _batch, F.mse_loss, workers=N, steps=STEPS, period=H,
                  inner_lr=LR, **kwargs)


def _match(results, expected, atol=ATOL):
    for rank, (trajectory, syncs, _) in enumerate(results):
        assert syncs == [H - 1 + H * j for j in range(STEPS // H)]
        for step, got in enumerate(trajectory):
            err = float((got - expected[step][rank]).abs().max())
            assert err <= atol, f"step {step}, worker {rank}: off by {err:g}"


# ---------------------------------------------------------------------------- the oracle

ORACLE_CASES = {
    "2 bits, the defaults": dict(bits=2, beta=0.9, outer_lr=0.8),
    "4 bits, beta 1": dict(bits=4, beta=1.0, outer_lr=0.7),
    "8 bits, beta 0.5": dict(bits=8, beta=0.5, outer_lr=0.8),
}


@pytest.mark.parametrize("case", list(ORACLE_CASES))
def test_muloco_matches_the_papers_algorithm_step_by_step(case):
    s = ORACLE_CASES[case]
    algorithm = MuLoCo(period=H, bits=s["bits"], error_decay=s["beta"],
                       outer_lr=s["outer_lr"])
    _match(_library(algorithm), _expected(**s))


def test_the_authors_code_is_outer_lr_squared():
    """The authors' code adds ``lr * Delta`` to the accumulator and steps the outer SGD with
    ``lr`` again: their 0.8 is ``outer_lr=0.64`` here (the quantiser scales with its input)."""
    expected = _expected(bits=2, beta=0.9, outer_lr=0.8, authors_code=True)
    _match(_library(MuLoCo(period=H, outer_lr=0.8 ** 2)), expected)


# ---------------------------------------------------------------------------- invariants


def test_32_bits_is_diloco_exactly():
    """Unquantised, nothing is kept back whatever beta: DiLoCo's run, bit for bit."""
    mu = _library(MuLoCo(period=H, bits=32, outer_lr=0.7))
    plain = _library(DiLoCo(period=H, outer_lr=0.7))
    for (a, syncs_a, bytes_a), (b, syncs_b, bytes_b) in zip(mu, plain, strict=True):
        assert syncs_a == syncs_b and bytes_a == bytes_b
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


@pytest.mark.parametrize("bits", [2, 8])
def test_error_feedback_loses_nothing_over_a_round(bits):
    """Per worker: what it sent plus what it remembers is its pseudo-gradient plus its decayed
    old memory; and the average is the mean of what the workers sent."""
    beta = 0.9

    def worker(comm):
        model = _initial()
        opt = gossamer.distribute(model, muon(model, lr=0.05),
                                  MuLoCo(period=2, bits=bits, error_decay=beta), comm)
        g = torch.Generator().manual_seed(comm.rank)
        for _ in range(5):  # two rounds, then one step into the third
            opt.zero_grad()
            model(torch.randn(4, IN, generator=g)).pow(2).mean().backward()
            opt.step()
        runtime = opt.runtime
        reducer = runtime.reducer
        memory, compressor = reducer.memory, reducer.compressor
        old = [memory.residual(name).clone() for name in runtime.names]
        assert any(float(o.abs().sum()) > 0 for o in old)  # earlier rounds left something
        sent = {}
        compress = compressor.compress

        def recording(tensor, key):
            payload = compress(tensor, key)
            sent[key] = compressor.decompress(payload, key)
            return payload

        object.__setattr__(compressor, "compress", recording)
        deltas = runtime.outer.pseudo_gradients(range(len(runtime.trained)))
        originals = [d.clone() for d in deltas]
        runtime.reduce(deltas)
        for name, delta, o in zip(runtime.names, originals, old, strict=True):
            left = memory.residual(name)
            assert torch.allclose(sent[name].view_as(left) + left, delta + beta * o,
                                  rtol=0, atol=1e-7)
        return [sent[name] for name in runtime.names], [d.clone() for d in deltas]

    results = SimWorld(N).run(worker)
    for i in range(len(results[0][0])):
        mean = sum(r[0][i] for r in results) / N
        for r in results:
            assert torch.allclose(r[1][i].reshape(-1), mean.reshape(-1), rtol=0, atol=1e-7)


def test_two_bits_send_a_sixteenth_of_dilocos_bytes():
    """2 bits an element and 20 bytes a tensor, all-gathered by 4 workers, against DiLoCo's
    float32 all-reduce (2 (n-1)/n x 4 bytes an element)."""

    def worker(comm, algorithm):
        model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 4))
        opt = gossamer.distribute(model, muon(model, lr=1e-3), algorithm, comm)
        comm.stats.reset()  # the rounds' bytes, not the initial broadcast's
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(4, 64)).pow(2).mean().backward()
            opt.step()
        return comm.stats.total_bytes_sent

    quantised = SimWorld(N).run(worker, MuLoCo(period=2))[0]
    dense = SimWorld(N).run(worker, DiLoCo(period=2))[0]
    assert quantised < dense / 6, (quantised, dense)


def test_options_are_checked_naming_them():
    for kwargs, name in [({"bits": 3}, "bits"), ({"error_decay": 1.5}, "error_decay"),
                         ({"range_in_sigmas": 0}, "range_in_sigmas"),
                         ({"outer_lr": -1}, "outer_lr"), ({"replica_size": 0}, "replica_size"),
                         ({"period": 0}, "period")]:
        with pytest.raises(ValueError, match=name):
            MuLoCo(**kwargs)
    assert create("muloco", {"bits": "4", "error_decay": "1"}) == MuLoCo(bits=4, error_decay=1)
    with pytest.raises(ValueError, match="decay"):
        ErrorFeedback(decay=1.5)
    with pytest.raises(ValueError, match="compressor"):  # its compression is its own
        gossamer.with_compression(MuLoCo(), "topk")


def test_another_inner_optimizer_is_warned_about():
    model = _initial()
    with pytest.warns(UserWarning, match="muloco: the inner optimizer is SGD, not Muon"):
        SimWorld(1).run(lambda comm: gossamer.distribute(
            model, torch.optim.SGD(model.parameters(), lr=0.1), MuLoCo(), comm) and None)


def test_sharded_models_are_refused_with_the_reason():
    assert "orthogonalises whole matrices" in MuLoCo().sharding_refusal()


# ----------------------------------------------------------- Muon as an inner optimizer


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8),
                          nn.Linear(8, 10))
    matrices, rest = muon_parameters(model)
    assert [tuple(p.shape) for p in matrices] == [(8, 8)]
    assert len(rest) == 6  # the embedding, a bias, the norm's two, the head's two
    optimizer = muon(model, lr=1e-3)
    assert [g["muon"] for g in optimizer.param_groups] == [True, False]
    with pytest.raises(ValueError, match="muon_params"):
        MuonWithAdamW([model[2].weight], [], lr=1e-3)
    with pytest.raises(ValueError, match="param_group"):  # both groups are fixed
        optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


@pytest.mark.slow
def test_muon_is_the_inner_optimizer_of_every_local_method():
    """localsgd, qsr, diloco, streaming-diloco, sparta, sparseloco take it like any torch
    optimizer: finite runs whose parameters moved."""
    for name in ("localsgd", "qsr", "diloco", "streaming-diloco", "sparta", "sparseloco",
                 "muloco"):
        options = {"sparta": {}, "streaming-diloco": {"period": "4", "fragments": "2"}}
        algorithm = create(name, options.get(name, {"period": "4"}))
        results = _library(algorithm)
        start = torch.cat([p.detach().flatten() for p in _initial().parameters()])
        for trajectory, _, _ in results:
            assert torch.isfinite(trajectory[-1]).all(), name
            assert not torch.equal(trajectory[-1], start), name


@pytest.mark.slow
def test_muon_on_the_command_line_and_its_checkpoint_resume_bit_equal(monkeypatch, tmp_path):
    """``--optimizer muon``: a run stopped at step 3 and resumed from its checkpoint (Muon's
    momentum and AdamW's moments included) ends where the straight run ends."""
    settings = dict(algorithm="muloco", optimizer="muon", lr=0.01, sim=2, steps=6,
                    batch_size=8, eval_every=0, checkpoint_every=2, quiet=True,
                    options={"period": 3})
    straight, stopped, _ = straight_and_resumed(monkeypatch, tmp_path, 3, **settings)
    assert_last_checkpoints_equal(straight, stopped, 2, optimizer_state=True)  # Muon's, AdamW's


@pytest.mark.slow
def test_the_survivors_go_on_after_a_crash():
    result = run_training(TrainConfig(algorithm="muloco", optimizer="muon", lr=0.01, sim=4,
                                      quiet=True, timeout=3, steps=6, faults=("1:3:crash",),
                                      on_failure="continue", options={"period": 2}))
    assert result["membership"][-1]["members"] == [0, 2, 3] and result["world_size"] == 3
    assert result["step"] == 6 and math.isfinite(result["eval_loss"])


def test_replicas_of_two_hold_the_same_parameters():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Muon inside: no warning
        results = _library(MuLoCo(period=H, replica_size=2))
    for trajectory, syncs, _ in results:
        assert syncs == [2, 5, 8] and all(torch.isfinite(t).all() for t in trajectory)
    assert torch.equal(results[0][0][-1], results[1][0][-1])


# ------------------------------------------------------------------------- SimWorld = gloo


@pytest.mark.gloo
def test_simworld_and_gloo_agree_in_bytes_and_synchronisations():
    assert_gloo_agrees(_worker, {"muloco": MuLoCo(period=H)}, N, [2, 5, 8])
