"""DES-LOC: against an oracle written from the paper's Algorithm 1, its invariants, and on
gloo.

The oracle (``tests/oracles/desloc.py``) is a plain sequential Local Adam with three periods;
the library runs in SimWorld (4 workers, float64, a least-squares ``Linear(3, 2)`` whose data
depend on the worker and the step) and must match it after every step to 1e-9 in the
parameters and in both moments, read from AdamW's state, and average each of the three after
exactly the oracle's steps. The invariants: equal periods are local SGD with
``average_optimizer_state=True`` bit for bit (parameters, moments, bytes, synchronisations);
period 1 for everything averages the three after every step; every average conserves the
replicas' sums of the parameters and of each moment. SimWorld and gloo send the same bytes
in the same number of synchronisations.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from oracles import desloc as oracle
from oracles.least_squares import LeastSquares
from oracles.local_sgd import constant_period, qsr_period
from torch import nn

import gossamer
from gossamer.algorithms import DESLOC, LocalSGD, create
from gossamer.comm import SimWorld
from gossamer.train.config import TrainConfig
from gossamer.train.run import run_training

N = 4
STEPS = 24
PROBLEM = LeastSquares(3, 2, rows=5)
# a decaying learning rate, so that QSR lengthens the parameters' rounds
LRS = [0.05 * (0.93 ** t) for t in range(STEPS)]
STATES = ("exp_avg", "exp_avg_sq")


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()


def _grad(rank: int, step: int, x: torch.Tensor) -> torch.Tensor:
    """The oracle's gradient, flat: the least-squares problem's on (W, b)."""
    shapes = [p.shape for p in PROBLEM.x0()]
    parts = list(torch.split(x, [math.prod(s) for s in shapes]))
    return _flat(PROBLEM.grad(rank, step, [p.view(s) for p, s in zip(parts, shapes,
                                                                     strict=True)]))


def _worker(comm, algorithm, lrs=LRS, optimizer="adamw"):
    """Each step's parameters and moments of this worker, and the synchronisations."""
    model = PROBLEM.model()
    if optimizer == "adamw":
        inner = torch.optim.AdamW(model.parameters(), lr=lrs[0], weight_decay=0.01)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=lrs[0])
    opt = gossamer.distribute(model, inner, algorithm, comm, total_steps=len(lrs))
    params = list(model.parameters())
    records = []
    for step, lr in enumerate(lrs):
        for group in opt.param_groups:
            group["lr"] = lr
        a, y = PROBLEM.data(comm.rank, step)
        opt.zero_grad()
        (0.5 * (model(a) - y).pow(2).sum(1).mean()).backward()
        opt.step()
        records.append([_flat(params)] + [_flat(inner.state[p][key] for p in params)
                                          for key in STATES])
    return records, opt.runtime.synchronizations, comm.stats.total_bytes_sent


def _averaged_steps(runs, which: int) -> list[int]:
    """The steps after which record ``which`` (0 parameters, 1 and 2 the moments) was equal
    on every worker (the data differ per worker: equal only after an average)."""
    return [k for k in range(len(runs[0][0]))
            if all(torch.equal(r[0][k][which], runs[0][0][k][which]) for r in runs)]


CASES = {
    # name: (library, oracle's parameter rule, K_u, K_v, cap_to_end)
    "the paper's ratios, K_u = 3 K_x, K_v = 6 K_x": (
        DESLOC(period=2), constant_period(2), 6, 12, False),
    "periods that are not multiples": (
        DESLOC(period=3, momentum_period=5, variance_period=7), constant_period(3), 5, 7,
        False),
    "moments more often than the parameters": (
        DESLOC(period=6, momentum_period=2, variance_period=4), constant_period(6), 2, 4,
        False),
    "QSR for K_x after a warm-up": (
        DESLOC(period=2, alpha=0.04, warmup_steps=3, momentum_period=4, variance_period=8),
        qsr_period(2, 0.04, warmup_steps=3), 4, 8, True),
    "period 1 for everything": (
        DESLOC(period=1, momentum_period=1, variance_period=1), constant_period(1), 1, 1,
        False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_desloc_matches_the_papers_algorithm_step_by_step(case):
    algorithm, rule, k_u, k_v, cap = CASES[case]
    runs = SimWorld(N).run(_worker, algorithm)
    expected = oracle.desloc(_flat(PROBLEM.x0()), N, _grad, LRS, rule, k_u, k_v,
                             cap_to_end=cap, weight_decay=0.01)
    for step in range(STEPS):
        for rank, (records, _, _) in enumerate(runs):
            got = records[step]
            want = [expected.trajectory[step][rank], expected.first[step][rank],
                    expected.second[step][rank]]
            for name, g, w in zip(("x", "u", "v"), got, want, strict=True):
                error = (g - w).abs().max().item()
                assert error <= 1e-9, f"step {step}, rank {rank}, {name}: off by {error:g}"
    for which, name in enumerate(("x", "u", "v")):
        assert _averaged_steps(runs, which) == expected.averages[name], name
    # one synchronisation per step that averaged anything
    averaged = set().union(*expected.averages.values())
    assert {r[1] for r in runs} == {len(averaged)}
    if case.startswith("QSR"):
        assert len({k for _, k in expected.periods}) >= 3  # the rule changed K_x


def test_equal_periods_are_local_adam_with_state_averaging_bit_for_bit():
    """K_u = K_v = K_x: the same all-reduces (one per round, the parameters then the two
    moments of each parameter, as local SGD orders them), the same values to the last bit."""
    desloc = SimWorld(N).run(_worker, DESLOC(period=3, momentum_period=3, variance_period=3))
    local = SimWorld(N).run(_worker, LocalSGD(period=3, average_optimizer_state=True))
    for (d, d_syncs, d_bytes), (s, s_syncs, s_bytes) in zip(desloc, local, strict=True):
        assert (d_syncs, d_bytes) == (s_syncs, s_bytes) == (STEPS // 3, d_bytes)
        for dk, sk in zip(d, s, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(dk, sk, strict=True))


def test_the_defaults_send_half_of_local_adams_bytes():
    """Parameters every K_x, moments every 3 K_x and 6 K_x: (1 + 1/3 + 1/6) / 3 of Local
    Adam's bytes at the same K_x (the paper's 2x); the defaults are K_x 16, K_u 48, K_v 96."""
    assert DESLOC().moment_periods == {"first": 48, "second": 96}
    lrs = [0.01] * 48
    desloc = SimWorld(N).run(_worker, DESLOC(period=4), lrs)
    local = SimWorld(N).run(_worker, LocalSGD(period=4, average_optimizer_state=True), lrs)
    set_up = SimWorld(N).run(_worker, DESLOC(period=100), lrs)[0][2]  # no average: the
    assert set_up > 0 and (desloc[0][2] - set_up) * 2 == local[0][2] - set_up  # broadcast
    assert desloc[0][1] == local[0][1] == 12  # the moments travel with the parameters


def _sums(comm, algorithm):
    """Before and after each step's average: this worker's parameters and moments (read in
    the optimizer's post-step hook, which runs before the method averages)."""
    model = PROBLEM.model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    params = list(model.parameters())

    def read():
        return [_flat(params)] + [_flat(inner.state[p][key] for p in params) for key in STATES]

    before = []
    inner.register_step_post_hook(lambda *_: before.append(read()))
    opt = gossamer.distribute(model, inner, algorithm, comm)
    after = []
    for step in range(STEPS):
        a, y = PROBLEM.data(comm.rank, step)
        opt.zero_grad()
        (0.5 * (model(a) - y).pow(2).sum(1).mean()).backward()
        opt.step()
        after.append(read())
    return before, after


def test_every_average_conserves_the_replicas_sums_of_parameters_and_moments():
    runs = SimWorld(N).run(_sums, DESLOC(period=2, momentum_period=3, variance_period=5))
    moved = 0
    for step in range(STEPS):
        for which in range(3):
            before = sum(r[0][step][which] for r in runs)
            after = sum(r[1][step][which] for r in runs)
            scale = max(before.abs().max().item(), 1e-300)
            assert (after - before).abs().max().item() <= 1e-12 * scale, (step, which)
            moved += not torch.equal(runs[0][0][step][which], runs[0][1][step][which])
    assert moved >= STEPS // 2 + STEPS // 3 + STEPS // 5  # the averages did change replicas


def test_an_optimizer_without_moments_is_refused_naming_the_argument():
    with pytest.raises(Exception, match=r"ValueError: optimizer: desloc .*SGD keeps none"):
        SimWorld(2).run(_worker, DESLOC(period=2), LRS[:2], "sgd")


def test_options_are_checked_naming_them():
    for options, name in (({"period": 0}, "period"), ({"momentum_period": 0},
                                                       "momentum_period"),
                          ({"variance_period": 1.5}, "variance_period"),
                          ({"alpha": -1.0}, "alpha"), ({"warmup": "never"}, "warmup")):
        with pytest.raises(ValueError, match=name):
            DESLOC(**options)
    assert create("desloc", {"variance_period": "none"}).moment_periods["second"] == 96


# ------------------------------------------------------------------- composition, resume


def _round_trip(comm, algorithm, stop):
    """16 steps of AdamW, stopped at ``stop`` (None: never) and resumed from the state
    dicts on fresh objects; the final parameters and moments, flat."""
    def build(state=None):
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        inner = torch.optim.AdamW(model.parameters(), lr=0.05)
        if state is not None:
            model.load_state_dict(state[0])
        opt = gossamer.distribute(model, inner, algorithm, comm, broadcast=state is None,
                                  total_steps=16)
        if state is not None:
            opt.load_state_dict(state[1])
        return model, inner, opt

    model, inner, opt = build()
    g = torch.Generator().manual_seed(comm.rank)
    for k in range(16):
        if k == stop:
            model, inner, opt = build(({n: t.clone() for n, t in model.state_dict().items()},
                                       opt.state_dict()))
        x, y = torch.randn(5, 3, generator=g), torch.randint(0, 2, (5,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    opt.finish()
    params = list(model.parameters())
    return [_flat(params)] + [_flat(inner.state[p][key] for p in params) for key in STATES]


def test_a_resumed_run_ends_bit_equal():
    """Stopped after 7 of 16 steps (inside every round: K_x 2, K_u 3, K_v 5) and resumed
    from the state dicts on fresh objects: each state's round goes on where it was."""
    algorithm = DESLOC(period=2, momentum_period=3, variance_period=5)
    straight = SimWorld(N).run(_round_trip, algorithm, None)
    resumed = SimWorld(N).run(_round_trip, algorithm, 7)
    for a, b in zip(straight, resumed, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_a_checkpointed_run_resumes_bit_equal(monkeypatch, tmp_path):
    """Through the training loop: stopped at step 7 (inside every round) and resumed from
    the checkpoint of step 5, the last checkpoint holds the straight run's model, moments
    and rounds."""
    from resume_helpers import straight_and_resumed

    from gossamer.train import checkpoint as ckpt

    straight, stopped, _ = straight_and_resumed(
        monkeypatch, tmp_path, 7, algorithm="desloc", optimizer="adamw", lr=0.003, sim=2,
        steps=10, eval_every=5, checkpoint_every=5, quiet=True,
        options={"period": 2, "momentum_period": 3, "variance_period": 4})
    a = ckpt.safe_load(ckpt.latest_checkpoint(straight) / "rank-00001.pt")
    b = ckpt.safe_load(ckpt.latest_checkpoint(stopped) / "rank-00001.pt")
    assert a["algorithm"]["moment_ends"] == b["algorithm"]["moment_ends"]
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key])
    for index, state in a["optimizer"]["state"].items():
        for key in STATES:
            assert torch.equal(state[key], b["optimizer"]["state"][index][key])


def test_the_survivors_go_on_after_a_crash():
    result = run_training(TrainConfig(algorithm="desloc", optimizer="adamw", lr=0.003, sim=4,
                                      quiet=True, timeout=3, steps=8, faults=("1:3:crash",),
                                      on_failure="continue",
                                      options={"period": 2, "momentum_period": 3}))
    assert result["membership"][-1]["members"] == [0, 2, 3] and result["world_size"] == 3
    assert result["step"] == 8 and math.isfinite(result["eval_loss"])


def test_a_sharded_model_is_refused_with_the_reason():
    assert "DTensors" in DESLOC().sharding_refusal()


# ------------------------------------------------------------------------- SimWorld = gloo


def _gloo_run(comm, algorithm):
    comm.stats.reset()  # run_in_turn opens each run with a barrier
    records, syncs, sent = _worker(comm, algorithm, LRS[:12])
    return records[-1], syncs, sent, dict(comm.stats.operations)


@pytest.mark.gloo
def test_simworld_and_gloo_agree_in_bytes_and_synchronisations():
    from gossamer.testing import collect, run_in_turn, spawn_gloo

    algorithm = DESLOC(period=2, momentum_period=3, variance_period=4)
    runs = [("desloc", (algorithm,))]
    gloo = collect(spawn_gloo(run_in_turn, N, args=(_gloo_run, runs), timeout=120), "desloc")
    sim = SimWorld(N).run(_gloo_run, algorithm)
    for s, g in zip(sim, gloo, strict=True):
        assert s[1] == g[1] == 8  # after steps 1, 2, 3, 5, 7, 8, 9 and 11
        assert s[2] == g[2] and s[3] == g[3]
        for a, b in zip(s[0], g[0], strict=True):
            assert torch.allclose(a, b, rtol=0, atol=1e-9)
