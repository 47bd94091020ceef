"""Gossip: push-sum averaging, SGP, Overlap SGP, D-PSGD, AD-PSGD."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from default_runs import default_run
from torch import nn

import gossamer
from gossamer.algorithms import ADPSGD, DPSGD, OSGP, SGP, create
from gossamer.algorithms.pushsum import push_message, push_sum_average, push_sum_round
from gossamer.comm import ComputeModel, SimWorld
from gossamer.topology import (
    butterfly_groups,
    exponential,
    from_matrix,
    random_regular,
    ring,
)

# ---------------------------------------------------------------------------- push-sum


def _values(comm) -> torch.Tensor:
    g = torch.Generator().manual_seed(comm.rank)
    return torch.randn(5, generator=g, dtype=torch.float64) * (comm.rank + 1)


@pytest.mark.parametrize("topology", [
    lambda n: exponential(n), lambda n: ring(n), lambda n: random_regular(n, 3, seed=1),
])
def test_push_sum_conserves_mass_and_converges(topology):
    n, rounds = 10, 300

    def worker(comm):
        topo = topology(comm.world_size)
        message = push_message(_values(comm), 1.0)
        history = [message]
        for r in range(rounds):
            message = push_sum_round(comm, topo, r, message)
            history.append(message)
        return history

    histories = SimWorld(n).run(worker)
    initial = sum(h[0] for h in histories)
    for r in range(rounds + 1):
        total = sum(h[r] for h in histories)
        assert torch.allclose(total, initial, rtol=0, atol=1e-12)  # numerators and weights
    mean = initial[:-1] / n
    for h in histories:
        assert torch.allclose(h[-1][:-1] / h[-1][-1], mean, atol=1e-9)


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_push_sum_exact_after_one_period_of_exponential_graph(n):
    def worker(comm):
        topo = exponential(comm.world_size)
        return push_sum_average(comm, _values(comm), topo, rounds=topo.period), _values(comm)

    results = SimWorld(n).run(worker)
    mean = sum(v for _, v in results) / n
    for estimate, _ in results:
        assert torch.allclose(estimate, mean, rtol=0, atol=1e-12)


def test_push_sum_average_refuses_a_graph_that_is_not_strongly_connected():
    """Two pairs that never talk would each converge to their own mean ([0.5, 0.5, 2.5, 2.5]
    instead of 1.5 everywhere): the graph is refused, naming the argument."""
    pairs = from_matrix([[0.5, 0.5, 0, 0], [0.5, 0.5, 0, 0], [0, 0, 0.5, 0.5],
                         [0, 0, 0.5, 0.5]])

    def worker(comm):
        with pytest.raises(ValueError, match="topology: .* not strongly connected"):
            push_sum_average(comm, torch.tensor([float(comm.rank)]), pairs, rounds=10)
        return True

    assert SimWorld(4).run(worker) == [True] * 4


def test_push_sum_average_refuses_an_integer_tensor():
    def worker(comm):
        with pytest.raises(ValueError, match="tensor: .*floating-point.*int64"):
            push_sum_average(comm, torch.tensor([comm.rank]), exponential(4), rounds=2)
        return True

    assert SimWorld(4).run(worker) == [True] * 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_push_sum_average_of_low_precision_values_does_not_drift(dtype):
    """float16 and bfloat16 values are mixed in float32: after 200 rounds of a ring of 5
    (shares of 1/3, which neither dtype holds exactly) every estimate is the mean of the
    values rounded once to their dtype (mixed in their own dtype, they drifted by 0.4%)."""
    n = 5

    def worker(comm):
        value = torch.tensor([comm.rank + 0.1, 10.0 * comm.rank - 7.3], dtype=dtype)
        return push_sum_average(comm, value, ring(n), rounds=200), value

    results = SimWorld(n).run(worker)
    mean = sum(v.double() for _, v in results) / n
    for estimate, _ in results:
        assert estimate.dtype == dtype
        assert torch.equal(estimate, mean.to(dtype))


# ---------------------------------------------------------------------------- training parity

STEPS = 20


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _train(comm, algorithm, steps: int = STEPS, lr: float = 0.1):
    model = _model()
    opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                              algorithm, comm)
    g = torch.Generator().manual_seed(100 + comm.rank)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


ALGORITHMS = {
    "sgp": SGP(average_at_end=False),
    "dpsgd": DPSGD(average_at_end=False),
}


def gloo_train(name: str):
    from gossamer.comm import TorchCommunicator

    comm = TorchCommunicator.from_env(timeout=60)
    try:
        return _train(comm, ALGORITHMS[name])
    finally:
        comm.close()


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("name", ["sgp", "dpsgd"])
def test_simulator_and_gloo_give_the_same_parameters(name):
    from gossamer.testing import spawn_gloo

    sim = SimWorld(4).run(_train, ALGORITHMS[name])
    gloo = spawn_gloo(gloo_train, 4, args=(name,), timeout=180)
    for a, b in zip(sim, gloo, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    # gossip without a final average leaves the replicas different
    assert not torch.allclose(sim[0], sim[1], atol=1e-6)


def test_dpsgd_mixing_preserves_the_mean():
    def worker(comm):
        torch.manual_seed(comm.rank)  # different replicas, on purpose
        model = nn.Linear(6, 3).double()
        opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                  DPSGD(topology="ring", average_at_end=False), comm,
                                  broadcast=False)
        flat = [torch.cat([p.detach().flatten() for p in model.parameters()]).clone()]
        for _ in range(5):
            opt.zero_grad()
            model(torch.ones(1, 6, dtype=torch.float64)).sum().backward()
            opt.step()  # lr 0: only the mixing moves the parameters
            flat.append(torch.cat([p.detach().flatten() for p in model.parameters()]).clone())
        return flat

    results = SimWorld(5).run(worker)
    initial_mean = sum(r[0] for r in results) / 5
    for step in range(1, 6):
        mean = sum(r[step] for r in results) / 5
        assert torch.allclose(mean, initial_mean, rtol=0, atol=1e-12)
    spread = lambda s: max(float((r[s] - initial_mean).norm()) for r in results)  # noqa: E731
    assert spread(5) < spread(0)  # and it mixes


def test_sgp_state_holds_weight_and_messages_in_flight():
    def worker(comm):
        model = _model()
        opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  OSGP(tau=2), comm)
        x = torch.randn(4, 16)
        for _ in range(3):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        return opt.runtime.state_dict()

    state = SimWorld(4).run(worker)[0]
    assert state["weight"] > 0
    assert len(state["in_flight"]) == 2  # sent at steps 1 and 2, mixed at steps 3 and 4
    assert all(isinstance(t, torch.Tensor) for d in state["in_flight"] for t in d.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sgp", "osgp", "dpsgd", "adpsgd"])
def test_resume_equals_uninterrupted(tmp_path, monkeypatch, name):
    from resume_helpers import straight_and_resumed

    from gossamer.train import checkpoint as ckpt

    straight, stopped, _ = straight_and_resumed(
        monkeypatch, tmp_path, 15, sim=4, steps=30, eval_every=10, checkpoint_every=10,
        algorithm=name, quiet=True)
    for rank in range(4):
        a = ckpt.safe_load(ckpt.latest_checkpoint(straight) / f"rank-{rank:05d}.pt")
        b = ckpt.safe_load(ckpt.latest_checkpoint(stopped) / f"rank-{rank:05d}.pt")
        for key in a["model"]:
            assert torch.equal(a["model"][key], b["model"][key]), (rank, key)


# ---------------------------------------------------------------------------- AD-PSGD


def _timeline(comm, steps: int, delay: float = 0.0):
    """AD-PSGD training; the clock after each step; ``delay`` real seconds of extra work."""
    import time

    model = _model()
    opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.05),
                              ADPSGD(), comm)
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
    averagings = opt.runtime.averagings  # while training, not when settling at the end
    opt.finish()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return clocks, params, averagings


def _adpsgd_world():
    return SimWorld(8, compute=ComputeModel(step_time=0.01, jitter=0.2, stragglers={3: 4.0}),
                    seed=5)


def test_adpsgd_is_deterministic_in_the_simulator():
    first = _adpsgd_world().run(_timeline, 40)
    second = _adpsgd_world().run(_timeline, 40)
    for (c1, p1, a1), (c2, p2, a2) in zip(first, second, strict=True):
        assert c1 == c2 and a1 == a2
        assert torch.equal(p1, p2)
    assert all(a > 0 for _, _, a in first)  # everyone averaged with someone
    # the final exact average leaves every replica equal
    assert all(torch.allclose(first[0][1], p, atol=1e-6) for _, p, _ in first)


def test_adpsgd_fast_workers_are_not_held_by_a_straggler():
    steps = 40
    results = _adpsgd_world().run(_timeline, steps)
    slow = results[3][0]
    for rank, (clocks, _, _) in enumerate(results):
        if rank == 3:
            continue
        done_by_then = sum(1 for c in slow if c <= clocks[-1])
        assert steps >= 2 * done_by_then, (rank, done_by_then)


def test_allreduce_is_held_by_the_straggler():
    """The contrast: under AllReduce everybody moves at the straggler's pace."""
    def timeline(comm):
        model = _model()
        opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                  "allreduce", comm)
        clocks = []
        for _ in range(10):
            opt.zero_grad()
            model(torch.ones(2, 16)).sum().backward()
            opt.step()
            clocks.append(comm.clock())
        return clocks

    results = _adpsgd_world().run(timeline)
    slow = results[3]
    assert sum(1 for c in slow if c <= results[0][-1]) >= 9


# ---------------------------------------------------------------------------- bad input


def test_bad_input():
    with pytest.raises(ValueError, match="topology"):  # column- but not row-stochastic
        DPSGD(topology=from_matrix([[0.5, 1.0, 0.0], [0.5, 0.0, 1.0], [0.0, 0.0, 0.0]]))\
            .validate(3)
    with pytest.raises(ValueError, match="topology"):  # never connects the groups
        SGP(topology=butterfly_groups(4, group_size=2).__class__(
            "pairs", 4, [[{0: 0.5, 1: 0.5}, {0: 0.5, 1: 0.5}, {2: 0.5, 3: 0.5},
                          {2: 0.5, 3: 0.5}]])).validate(4)
    with pytest.raises(ValueError, match="tau"):
        OSGP(tau=-1)
    with pytest.raises(ValueError, match="peers_per_step"):
        SGP(peers_per_step=4).validate(4)
    with pytest.raises(ValueError, match="topology"):  # world size differs
        SGP(topology=exponential(8)).validate(4)
    with pytest.raises(ValueError, match="topology"):  # not bipartite
        ADPSGD(topology="complete").validate(4)
    with pytest.raises(ValueError, match="peers_per_step"):
        create("sgp", {"peers_per_step": "0"})


def test_bad_input_from_the_command_line(capsys):
    from gossamer.cli import main

    assert main(["train", "--sim", "4", "--algorithm", "sgp", "--option",
                 "peers_per_step=4", "--steps", "2"]) == 2
    assert "peers_per_step" in capsys.readouterr().err
    assert main(["train", "--sim", "6", "--algorithm", "dpsgd", "--option",
                 "topology=hypercube", "--steps", "2"]) == 2
    assert "power of two" in capsys.readouterr().err


# ---------------------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sgp", "osgp", "dpsgd", "adpsgd"])
def test_train_reaches_85_percent_on_digits(name):
    result = default_run(name)
    assert result["eval_accuracy"] >= 0.85
    assert result["bytes_sent"] > 0


@pytest.mark.slow
def test_compare_all_gossip_methods(tmp_path):
    from gossamer.cli import main

    out = tmp_path / "cmp"
    assert main(["compare", "--algorithms", "allreduce,sgp,osgp,dpsgd,adpsgd", "--workers", "4",
                 "--steps", "30", "--eval-every", "10", "--out", str(out), "--quiet"]) == 0
    report = (out / "report.md").read_text()
    for name in ("allreduce", "sgp", "osgp", "dpsgd", "adpsgd"):
        assert f"| {name} " in report


def gloo_adpsgd(steps: int):
    from gossamer.comm import TorchCommunicator

    comm = TorchCommunicator.from_env(timeout=60)
    try:
        # 10 ms of work per step, rank 1 straggles with 30 ms
        return _timeline(comm, steps, delay=0.03 if comm.rank == 1 else 0.01)
    finally:
        comm.close()


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.timing
def test_adpsgd_runs_asynchronously_on_gloo():
    from gossamer.testing import spawn_gloo

    results = spawn_gloo(gloo_adpsgd, 4, args=(30,), timeout=180)
    # the active workers average while they train (a reply is there a step or two after its
    # request), not only when the run settles at the end
    assert all(results[rank][2] >= 5 for rank in (0, 2)), [a for _, _, a in results]
    for _, params, _ in results[1:]:
        assert torch.allclose(params, results[0][1], atol=1e-6)  # the final exact average
    # rank 0 (fast, active) did not wait for rank 1's 30 ms per step
    fast_duration = results[0][0][-1] - results[0][0][0]
    slow_duration = results[1][0][-1] - results[1][0][0]
    assert fast_duration < slow_duration / 2
