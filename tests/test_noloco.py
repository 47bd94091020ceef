"""NoLoCo: against the paper's equations and the authors' outer step, its invariants, on gloo.

The oracle (:mod:`oracles.noloco`) is the paper's outer update (arXiv 2506.10911) written as
one sequential program over the workers, with the authors' seeded pairing drawn by itself;
the library's run in SimWorld must hold the oracle's parameters on every worker after every
step. The model is a float64 least-squares problem, so what differs is only the order of
float64 operations (torch's SGD keeps ``-Delta / beta`` where the paper keeps ``Delta``):
``ATOL`` = 1e-12 (1.4e-16 measured), where one outer step moves a parameter by up to 0.1.

The authors' code (jkolehm/noloco at 37d1a8a11adf5070ec544d63d0d0e6d97e6c5b08,
``src/noloco/sparse_optimizer_c.py``, ``outer_step``) is transcribed in
:func:`oracles.noloco.authors_outer_step`; the library matches it too, with its defaults
(``consensus`` 1: the code's ``gamma = beta``).
"""

from __future__ import annotations

import math

import pytest
import torch
from oracles.least_squares import LeastSquares
from oracles.noloco import authors_outer_step, noloco, pairing, paper_outer_step
from resume_helpers import state_dict_round_trip
from torch import nn

import gossamer
from gossamer.algorithms import create
from gossamer.algorithms.noloco import NoLoCo
from gossamer.comm import SimWorld
from gossamer.topology import RandomPairs
from gossamer.train.config import TrainConfig
from gossamer.train.run import run_training

PROBLEM = LeastSquares(5, 3, rows=6)
STEPS, LR = 12, 0.05
ATOL = 1e-12


def _worker(comm, algorithm, steps=STEPS):
    model = PROBLEM.model()
    opt = gossamer.distribute(
        model, torch.optim.SGD(model.parameters(), lr=LR), algorithm, comm, total_steps=steps
    )
    comm.stats.reset()  # the outer steps' bytes, not the initial broadcast's
    trajectory, syncs = [], []
    for step in range(steps):
        a, y = PROBLEM.data(comm.rank, step)
        opt.zero_grad()
        (0.5 * (model(a) - y).pow(2).sum(1).mean()).backward()
        before = opt.runtime.synchronizations
        opt.step()
        if opt.runtime.synchronizations > before:
            syncs.append(step)
        trajectory.append([p.detach().clone() for p in model.parameters()])
    opt.finish()
    return trajectory, syncs, comm.stats.total_bytes_sent, dict(comm.stats.operations)


def _assert_matches(results, expected, period):
    for rank, (trajectory, syncs, _, _) in enumerate(results):
        assert syncs == [period - 1 + period * j for j in range(STEPS // period)]
        for step, got in enumerate(trajectory):
            for g, e in zip(got, expected[step][rank], strict=True):
                err = float((g - e).abs().max())
                assert err <= ATOL, f"step {step}, worker {rank}: off by {err:g}"


ORACLE_CASES = {
    "4 workers, the authors' defaults": dict(n=4, period=3, alpha=0.5, beta=0.7, consensus=1.0),
    "5 workers: a group of three": dict(n=5, period=2, alpha=0.5, beta=0.7, consensus=1.0),
    "gamma = beta / 2, momentum 0.9": dict(n=6, period=3, alpha=0.9, beta=0.5, consensus=0.5),
    "no pull, no momentum": dict(n=4, period=4, alpha=0.0, beta=1.0, consensus=0.0),
}


@pytest.mark.parametrize("case", list(ORACLE_CASES))
def test_noloco_matches_the_papers_equations_step_by_step(case):
    c = ORACLE_CASES[case]
    algorithm = NoLoCo(
        period=c["period"], outer_lr=c["beta"], outer_momentum=c["alpha"], consensus=c["consensus"]
    )
    results = SimWorld(c["n"]).run(_worker, algorithm)
    expected = noloco(
        c["n"],
        STEPS,
        c["period"],
        LR,
        c["alpha"],
        c["beta"],
        c["consensus"] * c["beta"],
        PROBLEM.x0(),
        PROBLEM.grad,
    )
    _assert_matches(results, expected, c["period"])
    # each outer step: the slow weights and the pseudo-gradient to each other member of the
    # worker's group (one peer; two in a group of three), float64
    numel = sum(t.numel() for t in PROBLEM.x0())
    for rank, (_, syncs, sent, _) in enumerate(results):
        peers = sum(len(next(g for g in pairing(c["n"], s + 1) if rank in g)) - 1 for s in syncs)
        assert sent == peers * 2 * numel * 8
        if c["n"] % 2 == 0:
            assert peers == len(syncs)


def test_noloco_matches_the_authors_outer_step():
    """The defaults against ``outer_step`` of the authors' ``sparse_optimizer_c.py``."""
    algorithm = NoLoCo(period=3)
    assert (algorithm.outer_lr, algorithm.outer_momentum, algorithm.consensus) == (0.7, 0.5, 1.0)
    results = SimWorld(4).run(_worker, algorithm)
    expected = noloco(4, STEPS, 3, LR, 0.5, 0.7, 0.7, PROBLEM.x0(), PROBLEM.grad, authors=True)
    _assert_matches(results, expected, 3)


def test_the_papers_step_is_the_authors_code_with_gamma_equal_to_beta():
    """The two transcriptions of the oracle, on random states of a pair and of a triple."""
    g = torch.Generator().manual_seed(0)
    for group in ([1, 0], [2, 0, 1]):

        def state():
            return [[torch.randn(7, generator=g, dtype=torch.float64)] for _ in range(3)]

        phi, theta, momentum = state(), state(), state()
        ours = [[[t.clone() for t in w] for w in x] for x in (phi, theta, momentum)]
        paper_outer_step(group, *ours, alpha=0.5, beta=0.7, gamma=0.7)
        authors_outer_step(group, theta, phi, momentum, outer_lr=0.7, outer_momentum=0.5)
        for i in group:
            assert torch.allclose(ours[0][i][0], phi[i][0], rtol=0, atol=1e-14)
            assert torch.allclose(ours[1][i][0], theta[i][0], rtol=0, atol=1e-14)
            assert torch.allclose(ours[2][i][0], momentum[i][0], rtol=0, atol=1e-14)


# ---------------------------------------------------------------------------- invariants


def test_the_pairing_is_the_authors_and_two_workers_always_pair():
    for n in (2, 3, 4, 7, 8, 64):
        pairs = RandomPairs(n)
        for step in (1, 2, 50, 100, 12345):
            groups = pairs.groups(step)
            assert groups == pairing(n, step)
            assert sorted(r for g in groups for r in g) == list(range(n))  # a partition
            assert sorted(map(len, groups)) == [2] * (n // 2 - 1) + [2 + n % 2]
    assert {tuple(sorted(RandomPairs(2).group(0, s))) for s in range(200)} == {(0, 1)}
    assert RandomPairs(1).groups(5) == [[0]]


def test_the_mean_over_workers_moves_as_dilocos_global_parameters():
    """Summed over a group, the consensus terms cancel: at every outer step the mean of the
    workers' slow weights and momenta moves exactly as DiLoCo's (heavy-ball outer SGD) on the
    mean of every worker's pseudo-gradient, ``Delta = alpha Delta - beta mean(delta)``,
    ``phi = phi + Delta``; while the pull makes the replicas' slow weights differ less than
    without it."""
    alpha, beta = 0.5, 0.7

    def worker(comm, consensus):
        model = PROBLEM.model()
        opt = gossamer.distribute(
            model,
            torch.optim.SGD(model.parameters(), lr=LR),
            NoLoCo(period=2, outer_lr=beta, outer_momentum=alpha, consensus=consensus),
            comm,
        )
        runtime, records = opt.runtime, []
        outer_step = runtime._average

        def recorded():
            phi = [g.detach().clone() for g in runtime.outer.global_params]
            delta = [g - p.detach() for g, p in zip(phi, runtime.trained, strict=True)]
            buffers = [
                runtime.outer.optimizer.state[g]["momentum_buffer"].clone()
                for g in runtime.outer.global_params
            ]
            outer_step()
            records.append(
                (
                    phi,
                    delta,
                    [-beta * b for b in buffers],
                    [g.detach().clone() for g in runtime.outer.global_params],
                    [
                        -beta * runtime.outer.optimizer.state[g]["momentum_buffer"]
                        for g in runtime.outer.global_params
                    ],
                )
            )

        runtime._average = recorded
        for step in range(STEPS):
            a, y = PROBLEM.data(comm.rank, step)
            opt.zero_grad()
            (0.5 * (model(a) - y).pow(2).sum(1).mean()).backward()
            opt.step()
        return records

    def mean(records, k, field):
        return [torch.stack([r[k][field][t] for r in records]).mean(0) for t in range(2)]

    n = 6
    pulled = SimWorld(n).run(worker, 1.0)
    for k in range(STEPS // 2):
        phi, delta, m, phi_new, m_new = (mean(pulled, k, f) for f in range(5))
        for t in range(2):
            assert torch.allclose(m_new[t], alpha * m[t] - beta * delta[t], rtol=0, atol=ATOL)
            assert torch.allclose(phi_new[t], phi[t] + m_new[t], rtol=0, atol=ATOL)
    free = SimWorld(n).run(worker, 0.0)

    def spread(records):  # the slow weights' distance to their mean, after the last step
        last = [r[-1][3] for r in records]
        centre = [torch.stack([w[t] for w in last]).mean(0) for t in range(2)]
        return sum(float((w[t] - centre[t]).pow(2).sum()) for w in last for t in range(2))

    assert spread(pulled) < spread(free)


@pytest.mark.slow
def test_bytes_per_worker_do_not_depend_on_the_number_of_workers():
    """Two outer steps of a 10-parameter float32 model: each worker sends its slow weights and
    its pseudo-gradient to one peer, 2 x 2 x 10 x 4 = 160 bytes, from 8 to 256 workers (an
    all-reduce's bytes per worker would grow towards twice the model, its latency with log n
    or n)."""

    def worker(comm):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = gossamer.distribute(
            model, torch.optim.SGD(model.parameters(), lr=0.1), NoLoCo(period=1), comm
        )
        comm.stats.reset()
        x = torch.full((2, 4), float(comm.rank))
        for _ in range(2):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        return comm.stats.total_bytes_sent, comm.stats.operations["exchange"]

    for n in (8, 256):
        assert set(SimWorld(n).run(worker)) == {(160, 2)}, n


def test_only_the_peer_waits_for_a_straggler():
    """One outer step of 4 workers, rank 3 four times slower: its peer waits for it, the other
    pair does not (DiLoCo's all-reduce makes everybody wait)."""
    from gossamer.comm import ComputeModel

    def worker(comm, algorithm):
        model = nn.Linear(4, 2)
        opt = gossamer.distribute(
            model, torch.optim.SGD(model.parameters(), lr=0.1), algorithm, comm, total_steps=3
        )
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
        return comm.idle_time

    def idle(algorithm):
        world = SimWorld(4, compute=ComputeModel(step_time=0.01, stragglers={3: 4.0}))
        return world.run(worker, algorithm)

    peer = next(r for g in RandomPairs(4).groups(3) if 3 in g for r in g if r != 3)
    noloco, diloco = idle(NoLoCo(period=3)), idle(gossamer.DiLoCo(period=3))
    for rank in range(3):
        assert diloco[rank] > 0.08  # 3 steps of 0.03 s behind: everybody waits
        assert (noloco[rank] > 0.08) == (rank == peer), (rank, peer, noloco)


def test_one_worker_is_dilocos_outer_step_with_heavy_ball_momentum():
    """Alone, a worker's group is itself: NoLoCo is DiLoCo with outer SGD without Nesterov."""
    a = SimWorld(1).run(_worker, NoLoCo(period=3))[0]
    b = SimWorld(1).run(
        _worker, gossamer.DiLoCo(period=3, outer_lr=0.7, outer_momentum=0.5, outer_nesterov=False)
    )[0]
    assert a[1] == b[1] and a[2] == b[2] == 0
    for x, y in zip(a[0], b[0], strict=True):
        for s, t in zip(x, y, strict=True):
            assert torch.allclose(s, t, rtol=0, atol=ATOL)


def test_a_cut_round_ends_with_an_outer_step_and_synchronize_averages_exactly():
    """A run of unknown length (7 steps, H = 5): finish() takes the outer step of the last
    two steps with the pair (``average_at_end``); ``synchronize()`` then makes every
    replica the exact average, slow weights and momentum too."""

    def worker(comm):
        model = PROBLEM.model()
        opt = gossamer.distribute(
            model, torch.optim.SGD(model.parameters(), lr=LR), NoLoCo(period=5), comm
        )
        for step in range(7):
            a, y = PROBLEM.data(comm.rank, step)
            opt.zero_grad()
            (0.5 * (model(a) - y).pow(2).sum(1).mean()).backward()
            opt.step()
        opt.finish()
        finished = (opt.runtime.synchronizations, comm.stats.operations["exchange"])
        opt.synchronize()
        runtime = opt.runtime
        state = [g.detach().clone() for g in runtime.outer.global_params]
        state += [
            runtime.outer.optimizer.state[g]["momentum_buffer"].clone()
            for g in runtime.outer.global_params
        ]
        return finished, [p.detach().clone() for p in model.parameters()], state

    results = SimWorld(4).run(worker)
    for finished, params, state in results:
        assert finished == (2, 2)  # step 5's outer step and the end's
        for x, y in zip(params + state, results[0][1] + results[0][2], strict=True):
            assert torch.equal(x, y)


def test_options_are_checked_naming_them():
    for kwargs, name in [
        ({"period": 0}, "period"),
        ({"consensus": -1.0}, "consensus"),
        ({"outer_lr": -0.1}, "outer_lr"),
        ({"outer_momentum": -0.5}, "outer_momentum"),
        ({"replica_size": 0}, "replica_size"),
        ({"warmup": "x"}, "warmup"),
    ]:
        with pytest.raises(ValueError, match=name):
            NoLoCo(**kwargs)
    with pytest.raises(ValueError, match="outer_nesterov"):  # the paper's form: heavy-ball
        create("noloco", {"outer_nesterov": "true"})
    with pytest.raises(ValueError, match="replica_size"):
        NoLoCo(replica_size=3).validate(4)
    assert create("noloco", {"period": "20", "consensus": "0.5"}) == NoLoCo(
        period=20, consensus=0.5
    )


# ------------------------------------------------------------------- composition, resume


def test_two_replicas_always_pair_and_are_dilocos_heavy_ball_run():
    """Two replicas of two workers: each replica's group is always the other, the pull
    vanishes (their slow weights stay equal), and the run is DiLoCo's with outer SGD without
    Nesterov between the same replicas."""
    results = SimWorld(4).run(_worker, NoLoCo(period=3, replica_size=2))
    diloco = SimWorld(4).run(
        _worker,
        gossamer.DiLoCo(
            period=3, replica_size=2, outer_lr=0.7, outer_momentum=0.5, outer_nesterov=False
        ),
    )
    for (trajectory, syncs, _, _), (other, _, _, _) in zip(results, diloco, strict=True):
        assert syncs == [2, 5, 8, 11]
        for x, y in zip(trajectory[-1], results[0][0][-1], strict=True):
            assert torch.equal(x, y)
        for got, want in zip(trajectory, other, strict=True):
            for x, y in zip(got, want, strict=True):
                assert torch.allclose(x, y, rtol=0, atol=ATOL)


def test_a_resumed_run_ends_bit_equal():
    """Stopped after 8 of 16 steps and resumed from the state dicts on fresh objects: each
    worker's slow weights and outer momentum travel in its runtime's state."""
    algorithm = NoLoCo(period=3)
    straight = SimWorld(4).run(state_dict_round_trip, algorithm, None, 6)
    resumed = SimWorld(4).run(state_dict_round_trip, algorithm, 8, 6)
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(straight[0], straight[1])  # the replicas differ: a real check


@pytest.mark.slow
def test_a_run_stopped_and_resumed_from_its_checkpoint_ends_bit_equal(tmp_path, monkeypatch):
    """``gossamer train``'s checkpoints: each worker's own slow weights and momentum are in
    its shard of the checkpoint (they differ between workers)."""
    from resume_helpers import straight_and_resumed

    from gossamer.train import checkpoint as ckpt

    straight, stopped, _ = straight_and_resumed(
        monkeypatch,
        tmp_path,
        15,
        sim=4,
        steps=30,
        eval_every=10,
        checkpoint_every=10,
        algorithm="noloco",
        options={"period": 4},
        quiet=True,
    )
    models = []
    for rank in range(4):
        a = ckpt.safe_load(ckpt.latest_checkpoint(straight) / f"rank-{rank:05d}.pt")
        b = ckpt.safe_load(ckpt.latest_checkpoint(stopped) / f"rank-{rank:05d}.pt")
        for key in a["model"]:
            assert torch.equal(a["model"][key], b["model"][key]), (rank, key)
        models.append(a["model"])
    assert not all(torch.equal(models[0][k], models[1][k]) for k in models[0])  # apart


def _tiny(fault: str, **settings) -> dict:
    """6 steps of 4 simulated workers at H = 2 with ``fault`` (virtual timeout 3 s)."""
    return run_training(
        TrainConfig(
            algorithm="noloco",
            sim=4,
            quiet=True,
            timeout=3,
            steps=6,
            faults=(fault,),
            options={"period": 2},
            **settings,
        )
    )


def test_the_survivors_go_on_after_a_crash():
    result = _tiny("1:3:crash", on_failure="continue")
    assert result["membership"][-1]["members"] == [0, 2, 3] and result["world_size"] == 3
    assert result["step"] == 6 and math.isfinite(result["eval_loss"])


def test_a_nan_stops_its_worker_is_skipped_or_left_behind():
    """Rank 1's parameters turn NaN at step 3: it stops at its outer step before sending
    (its peer then stops waiting for it), skips the update under ``nonfinite="skip"``, and
    under ``continue`` the others go on without it."""
    from gossamer.comm import CommError, SimulationError

    with pytest.raises(SimulationError) as error:
        _tiny("1:3:nan")
    failures = error.value.failures
    assert isinstance(failures[1], FloatingPointError) and "rank 1:" in str(failures[1])
    assert all(isinstance(failures[r], CommError) for r in (0, 2, 3))
    assert _tiny("1:3:nan", nonfinite="skip")["skipped_steps"] >= 1
    assert _tiny("1:3:nan", on_failure="continue")["membership"][-1]["members"] == [0, 2, 3]


# ------------------------------------------------------------------------- SimWorld = gloo


def _gloo_run(comm, algorithm):
    comm.stats.reset()  # run_in_turn opens each run with a barrier
    trajectory, syncs, sent, operations = _worker(comm, algorithm)
    return trajectory[-1], syncs, sent, operations


@pytest.mark.slow
@pytest.mark.gloo
def test_simworld_and_gloo_agree_in_bytes_and_synchronisations():
    from gossamer.testing import collect, run_in_turn, spawn_gloo

    algorithm = NoLoCo(period=3)
    runs = [("noloco", (algorithm,))]
    gloo = collect(spawn_gloo(run_in_turn, 4, args=(_gloo_run, runs), timeout=120), "noloco")
    sim = SimWorld(4).run(_gloo_run, algorithm)
    for s, g in zip(sim, gloo, strict=True):
        assert s[1] == g[1] == [2, 5, 8, 11]
        assert s[2] == g[2] and s[3] == g[3]
        for x, y in zip(s[0], g[0], strict=True):
            assert torch.allclose(x, y, rtol=0, atol=ATOL)


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.timing
def test_gloo_survivors_go_on_as_in_the_simulator(tmp_path, capsys):
    """Rank 2 of 4 gloo processes crashes at step 20 (H = 5): its peer of that outer step
    fails, the others when they next wait for a member that has left to regroup; the
    survivors agree, average exactly once and finish every step, exit 0, with the
    simulator's membership history."""
    import json

    from gossamer.launch import launch

    out, steps, crash = tmp_path / "result.json", 40, "2:20:crash"
    args = [
        "--algorithm",
        "noloco",
        "--option",
        "period=5",
        "--steps",
        str(steps),
        "--eval-every",
        str(steps),
        "--quiet",
        "--fault",
        crash,
        "--on-failure",
        "continue",
        "--timeout",
        "3",
    ]
    code = launch([*args, "--json", str(out)], nproc=4)
    err = capsys.readouterr().err
    assert code == 0, err
    assert "rank 2 exited with code 17; the others went on without it" in err
    result = json.loads(out.read_text())["result"]
    assert result["world_size"] == 3 and result["step"] == steps
    simulated = run_training(
        TrainConfig(
            algorithm="noloco",
            options={"period": 5},
            sim=4,
            steps=steps,
            eval_every=steps,
            timeout=3,
            quiet=True,
            on_failure="continue",
            faults=(crash,),
        )
    )
    assert result["membership"] == simulated["membership"]
    assert math.isfinite(result["eval_loss"])
