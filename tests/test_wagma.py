"""WAGMA-SGD: groups, bounded staleness, wait-avoidance, and the usual guarantees."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from default_runs import default_run
from torch import nn

import gossamer
from gossamer.algorithms import DPSGD, WAGMA
from gossamer.algorithms.wagma import WAGMARuntime
from gossamer.comm import ComputeModel, SimWorld
from gossamer.train.config import TrainConfig
from gossamer.train.run import run_training


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _timeline(comm, algorithm, steps: int, delay: float = 0.0, finish: bool = True):
    """Train ``steps`` steps; the clock after each step, the final parameters, the runtime.
    ``delay``: real seconds of extra work per step (a straggler on gloo)."""
    import time

    model = _model()
    opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.05),
                              algorithm, comm)
    g = torch.Generator().manual_seed(comm.rank)
    clocks = []
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if delay:
            time.sleep(delay)
        opt.step()
        clocks.append(comm.clock())
    if finish:
        opt.finish()
    runtime = opt.runtime
    stats = {"ages": dict(getattr(runtime, "ages", {})), "waits": getattr(runtime, "waits", 0),
             "skipped": getattr(runtime, "rounds_skipped", 0),
             "group_averages": getattr(runtime, "group_averages", 0)}
    return clocks, _flat(model), stats


def _straggler_world(n: int = 8, seed: int = 1) -> SimWorld:
    return SimWorld(n, compute=ComputeModel(step_time=0.01, jitter=0.1, stragglers={3: 4.0}),
                    seed=seed)


# ---------------------------------------------------------------------------- groups


@pytest.mark.parametrize("n, g", [(4, 2), (8, 2), (8, 4), (16, 4), (32, 4), (27, 3), (12, 4)])
def test_groups_partition_the_ranks_at_every_round(n, g):
    runtime_groups = WAGMA(group_size=g).make_topology(n).groups
    reached = {i: {i} for i in range(n)}  # who has information from whom
    for r in range(40):
        groups = runtime_groups(r)
        members = sorted(m for group in groups for m in group)
        assert members == list(range(n)), (r, groups)  # disjoint and covering
        assert all(len(group) == g for group in groups)
        merged = {i: set().union(*(reached[j] for group in groups if i in group
                                     for j in group)) for i in range(n)}
        reached = merged
    assert all(len(seen) == n for seen in reached.values())  # information crosses all


def test_groups_change_every_round():
    topo = WAGMA(group_size=4).make_topology(16)
    assert topo.groups(0) != topo.groups(1)


# ---------------------------------------------------------------------------- semantics


def test_synchronous_whole_world_groups_equal_dpsgd_on_the_complete_graph():
    """tau = 0 with one group of everybody: each round averages the models exactly, then
    each worker applies its own gradient (x_{t+1} = mean(x_t) - lr g_i(x_t)), which is D-PSGD
    on the complete graph."""
    wagma = SimWorld(4).run(_timeline, WAGMA(group_size=4, tau=0, allreduce_every=0), 10,
                            finish=False)
    reference = SimWorld(4).run(_dpsgd_complete, 10)
    for (_, params, _), expected in zip(wagma, reference, strict=True):
        assert torch.allclose(params, expected, atol=1e-6)
    assert not torch.allclose(wagma[0][1], wagma[1][1], atol=1e-6)  # each its own gradient


def _dpsgd_complete(comm, steps: int):
    model = _model()
    opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.05),
                              DPSGD(topology="complete", average_at_end=False), comm)
    g = torch.Generator().manual_seed(comm.rank)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return _flat(model)


def test_synchronous_groups_average_exactly_within_each_group():
    """tau = 0, groups of 2, no global rounds: two steps; after the second each member holds
    its pair's mean of the models after the first step, minus its own gradient step."""
    def two_steps(comm):
        model = _model()
        opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                  WAGMA(group_size=2, tau=0, allreduce_every=0), comm)
        g = torch.Generator().manual_seed(comm.rank)
        seen = []
        for _ in range(2):
            seen.append(_flat(model))
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            step = 0.05 * torch.cat([p.grad.flatten() for p in model.parameters()])
            opt.step()
        return seen[1], step, _flat(model), opt.runtime.groups(1)

    results = SimWorld(4).run(two_steps)
    for group in results[0][3]:
        mean = torch.stack([results[i][0] for i in group]).mean(0)
        for i in group:
            assert torch.allclose(results[i][2], mean - results[i][1], atol=1e-6)
    assert not torch.allclose(results[0][0], results[1][0], atol=1e-6)  # a real average


@pytest.mark.slow
def test_no_contribution_is_older_than_tau_and_the_bound_is_reached():
    for tau in (1, 2, 3):
        results = _straggler_world().run(_timeline, WAGMA(tau=tau), 40)
        ages = [age for _, _, stats in results for age in stats["ages"]]
        assert max(ages) <= tau, (tau, ages)
        assert max(ages) == tau  # the straggler made the bound matter
        if tau == 1:
            assert sum(stats["waits"] for _, _, stats in results) > 0  # ... by waiting


def test_deterministic_in_the_simulator_and_equal_at_the_end():
    first = _straggler_world().run(_timeline, WAGMA(tau=2), 30)
    second = _straggler_world().run(_timeline, WAGMA(tau=2), 30)
    for (c1, p1, s1), (c2, p2, s2) in zip(first, second, strict=True):
        assert c1 == c2 and s1 == s2 and torch.equal(p1, p2)
    assert all(torch.allclose(first[0][1], p, atol=1e-6) for _, p, _ in first)
    assert first[3][2]["skipped"] > 0  # the straggler skipped rounds to keep up


def _fast_steps_per_second(algorithm, steps: int = 60) -> float:
    results = _straggler_world().run(_timeline, algorithm, steps)
    return steps / max(clocks[-1] for rank, (clocks, _, _) in enumerate(results) if rank != 3)


@pytest.mark.slow
def test_fast_workers_are_twice_as_fast_as_under_allreduce_with_a_straggler():
    """One worker 4x slower: fast workers run ahead of its last published parameters by
    up to tau rounds, so a 4x straggler is hidden for tau >= 3 and mostly for tau = 2;
    with tau = 1 at most half (the bound: tau + 1 steps per straggler step)."""
    allreduce = _fast_steps_per_second("allreduce")
    assert _fast_steps_per_second(WAGMA(tau=2)) >= 2 * allreduce
    assert _fast_steps_per_second(WAGMA(tau=3, allreduce_every=0)) >= 3 * allreduce
    assert _fast_steps_per_second(WAGMA(tau=1)) > 1.3 * allreduce


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, n, name", [
    ({"group_size": 3}, 8, "group_size"), ({"group_size": 0}, 8, "group_size"),
    ({"tau": -1}, 8, "tau"), ({"allreduce_every": -1}, 8, "allreduce_every"),
    ({"group_size": 4}, 6, "group_size"),
])
def test_bad_input(kwargs, n, name):
    with pytest.raises(ValueError, match=name):
        WAGMA(**kwargs).validate(n)


def test_bad_group_size_fails_before_any_worker_starts():
    with pytest.raises(ValueError, match="group_size=3 does not divide"):
        run_training(TrainConfig(sim=4, algorithm="wagma", options={"group_size": "3"},
                                 quiet=True))


# ---------------------------------------------------------------------------- training


@pytest.mark.slow
def test_train_on_digits():
    result = default_run("wagma")
    assert result["eval_accuracy"] >= 0.85


# ---------------------------------------------------------------------------- pausing


def _steps(opt, model, generator, steps: int) -> None:
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,),
                                                                      generator=generator)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def _paused_midway(comm, pause: bool):
    """Six steps with equal speeds (round 3, the next after three steps, is a global one);
    with ``pause``, a pause after the third (twice). Returns what the pause changed."""
    model = _model()
    opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.05),
                              WAGMA(group_size=2, tau=1, allreduce_every=4,
                                    average_at_end=False), comm)
    runtime, g = opt.runtime, torch.Generator().manual_seed(comm.rank)
    _steps(opt, model, g, 3)
    before = (_flat(model), runtime.round, runtime.synchronizations,
              {m: sorted(known) for m, known in runtime.models.items()})
    sent = comm.stats.total_bytes_sent
    if pause:
        runtime.pause()
        sent = comm.stats.total_bytes_sent
        runtime.pause()  # after the same step: nothing more
    again = comm.stats.total_bytes_sent - sent
    after = (_flat(model), runtime.round, runtime.synchronizations,
             {m: sorted(known) for m, known in runtime.models.items()})
    _steps(opt, model, g, 3)
    opt.finish()
    return before, after, again, _flat(model), runtime.synchronizations


def test_a_pause_with_no_worker_in_a_global_round_averages_nothing():
    """The pause's all-reduce is then only the workers' agreement: parameters, round, the
    models kept and the count of synchronisations stay as they were, and the run goes on
    exactly as one without the pause."""
    paused = SimWorld(4).run(_paused_midway, True)
    straight = SimWorld(4).run(_paused_midway, False)
    for (before, after, again, final, syncs), other in zip(paused, straight, strict=True):
        assert torch.equal(before[0], after[0]) and before[1:] == after[1:]
        assert again == 0
        assert torch.equal(final, other[3]) and syncs == other[4] == 1
    assert not torch.equal(paused[0][3], paused[1][3])  # distinct replicas: nothing averaged


def test_paused_workers_take_part_in_a_global_round_that_a_worker_is_in():
    """Rank 1 runs ahead into global round 3 and waits there for the others: they finish
    their step (round 2), pause, and join round 3 with their current parameters, which they
    then hold; rank 1 applies its gradient to that same average."""
    def worker(comm):
        model = _model()
        opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                  WAGMA(group_size=2, tau=1, allreduce_every=4), comm)
        runtime, g = opt.runtime, torch.Generator().manual_seed(comm.rank)
        _steps(opt, model, g, 2)
        if comm.rank == 1:
            runtime.round += 1  # its next round is the global round 3
        runtime.events = []
        start = _flat(model)  # rank 1's model for round 3
        _steps(opt, model, g, 1)
        stepped = _flat(model)
        runtime.pause()
        return (start, stepped, _flat(model), runtime.round, runtime.synchronizations,
                runtime.events)

    results = SimWorld(4).run(worker)
    assert [r[5][0][1:3] for r in results] == [(2, "group"), (3, "global"), (2, "group"),
                                               (2, "group")]
    paused = [results[i] for i in (0, 2, 3)]
    mean = torch.stack([r[1] for r in paused] + [results[1][0]]).mean(0)
    assert all(torch.allclose(r[2], mean, atol=1e-6, rtol=0) for r in paused)
    assert all(torch.equal(r[2], paused[0][2]) for r in paused)  # the same average on each
    assert torch.equal(results[1][1], results[1][2])  # rank 1 paused after its own step
    assert not torch.allclose(results[1][2], mean, atol=1e-6)  # ... its gradient applied
    assert all(r[3] == 4 and r[4] == 1 for r in results)  # round 3 done once, by everybody


@pytest.mark.parametrize("options", [
    {"tau": "0"},  # synchronous: nothing to pause
    {"tau": "1", "allreduce_every": "5"},
    {"tau": "2", "allreduce_every": "0", "group_size": "2"},
])
def test_evaluating_changes_neither_the_training_nor_its_counted_traffic(options):
    """With equal speeds an evaluation every 5 steps leaves the run as one evaluated only
    at the end: the same parameters on every worker, bytes, messages and synchronisations
    (the pause of an asynchronous run is the evaluation's, not counted)."""
    def run(every: int):
        finals = {}
        original = WAGMARuntime.finish

        def finish(runtime):
            original(runtime)
            finals[runtime.comm.rank] = runtime.read_parameters()

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(WAGMARuntime, "finish", finish)
            result = run_training(TrainConfig(
                sim=4, steps=20, eval_every=every, quiet=True, algorithm="wagma",
                options={**options, "average_at_end": "false"}))
        return result, finals

    (once, first), (often, second) = run(0), run(5)
    assert len(often["history"]) == 4 and len(once["history"]) == 1
    for key in ("bytes_sent", "messages_sent", "synchronizations", "eval_loss",
                "consensus_distance_before_finish"):
        assert once[key] == often[key], key
    assert all(torch.equal(first[r], second[r]) for r in range(4))
    assert not torch.equal(first[0], first[1])  # replicas apart: nothing averaged them


def test_the_consensus_distance_before_finish_is_the_drift_before_settling(monkeypatch):
    """finish() settles before it measures; settling averages nothing (no worker is in a
    global round), so the figure is the replicas' drift after the last step, not 0."""
    seen = []
    original = WAGMARuntime.settle

    def settle(runtime, restart=False):
        if runtime.open and not seen:  # the first settle: finish()'s, collective
            seen.append(gossamer.metrics.consensus_distance(runtime.model, runtime.comm))
        original(runtime, restart)

    monkeypatch.setattr(WAGMARuntime, "settle", settle)
    result = run_training(TrainConfig(sim=4, steps=25, eval_every=0, quiet=True,
                                      algorithm="wagma", options={"allreduce_every": "10"}))
    assert result["synchronizations"] == 3  # rounds 9 and 19, and the average at the end
    assert seen[0] > 0 and result["consensus_distance_before_finish"] == seen[0]


@pytest.mark.slow
def test_evaluations_and_checkpoints_pause_and_resume(tmp_path, monkeypatch):
    """Evaluation and checkpoints pause the rounds; resume continues the run."""
    from resume_helpers import straight_and_resumed

    from gossamer.train import checkpoint as ckpt

    straight_and_resumed(
        monkeypatch, tmp_path, 30, sim=4, steps=60, eval_every=20, checkpoint_every=20,
        algorithm="wagma", options={"group_size": "2", "tau": "2"}, quiet=True)
    a = ckpt.safe_load(ckpt.latest_checkpoint(tmp_path / "a") / "rank-00000.pt")
    b = ckpt.safe_load(ckpt.latest_checkpoint(tmp_path / "b") / "rank-00000.pt")
    assert a["algorithm"]["round"] == b["algorithm"]["round"] > 0
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key])


# ---------------------------------------------------------------------------- gloo


def gloo_wagma(steps: int):
    from gossamer.comm import TorchCommunicator

    comm = TorchCommunicator.from_env(timeout=60)
    try:  # rank 3 straggles: 40 ms of extra work per step, the others 10 ms
        return _timeline(comm, WAGMA(tau=3, allreduce_every=0), steps,
                         delay=0.04 if comm.rank == 3 else 0.01)
    finally:
        comm.close()


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.timing
def test_wagma_does_not_wait_for_the_straggler_on_gloo():
    from gossamer.testing import spawn_gloo

    results = spawn_gloo(gloo_wagma, 4, args=(30,), timeout=180)
    for _, params, _ in results[1:]:
        assert torch.allclose(params, results[0][1], atol=1e-6)  # the final exact average
    assert all(stats["group_averages"] > 0 for _, _, stats in results)
    slow = results[3][0][-1] - results[3][0][0]
    for rank in (0, 1, 2):
        fast = results[rank][0][-1] - results[rank][0][0]
        assert fast < 0.6 * slow, (rank, fast, slow)
    assert max(age for _, _, stats in results for age in stats["ages"]) <= 3


@pytest.mark.slow
def test_a_resumed_run_skips_as_the_uninterrupted_one(tmp_path, monkeypatch):
    """Whether a worker waited in its last round decides whether its next may skip to the
    front: the checkpoint keeps it. A 3x straggler in groups of 2 (it skips, the others
    wait), a checkpoint at step 10 and a crash at step 15: the resumed run is the same."""
    from resume_helpers import straight_and_resumed

    from gossamer.train import checkpoint as ckpt

    straight, stopped, _ = straight_and_resumed(
        monkeypatch, tmp_path, 15, sim=4, steps=20, eval_every=10, checkpoint_every=10,
        stragglers=("3:3",), algorithm="wagma", quiet=True,
        options={"group_size": "2", "tau": "1", "allreduce_every": "0",
                 "average_at_end": "false"})
    at_10 = ckpt.latest_checkpoint(straight).parent / "step-00000010"
    assert any(ckpt.safe_load(at_10 / f"rank-{r:05d}.pt")["algorithm"]["waited"]
               for r in range(4))  # some worker had waited in its last round there
    for rank in range(4):
        a = ckpt.safe_load(ckpt.latest_checkpoint(straight) / f"rank-{rank:05d}.pt")
        b = ckpt.safe_load(ckpt.latest_checkpoint(stopped) / f"rank-{rank:05d}.pt")
        for key in ("round", "rounds_skipped", "waits"):
            assert a["algorithm"][key] == b["algorithm"][key], (rank, key)
        for key in a["model"]:
            assert torch.equal(a["model"][key], b["model"][key]), (rank, key)
    assert a["algorithm"]["rounds_skipped"] > 0  # the straggler (rank 3) skipped


def test_a_checkpoint_from_before_waited_was_saved_loads_as_not_waited():
    def worker(comm):
        model = _model()
        opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                  WAGMA(group_size=2, tau=1), comm)
        state = opt.runtime.state_dict()
        opt.runtime._waited = True
        opt.runtime.load_state_dict({k: v for k, v in state.items() if k != "waited"})
        return "waited" in state, opt.runtime._waited

    assert SimWorld(2).run(worker) == [(True, False), (True, False)]
