"""Local SGD, the Quadratic Synchronization Rule, Local AdamW."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from default_runs import default_run
from torch import nn

import gossamer
from gossamer.algorithms import QSR, AllReduce, LocalSGD
from gossamer.comm import SimWorld
from gossamer.train.config import TrainConfig, learning_rate
from gossamer.train.run import run_training


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _batches(rank: int, steps: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(steps)]


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _train(comm, algorithm, steps: int = 20, momentum: float = 0.0, schedule=None,
           optimizer: str = "sgd", finish: bool = False):
    model = _model()
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    opt = gossamer.distribute(model, opt, algorithm, comm)
    opt.runtime.total_steps = steps
    for step, (x, y) in enumerate(_batches(comm.rank, steps)):
        if schedule is not None:
            for group in opt.param_groups:
                group["lr"] = schedule(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    if finish:
        opt.finish()
    return _flat(model), opt.runtime


def closed_form_periods(total: int, warmup: int, h_base: int, alpha: float, power: float,
                        lr, warmup_period: int = 1, rising_lr: bool = False
                        ) -> list[tuple[int, int]]:
    """The QSR rounds (first step, H) computed directly from the rule, independently of the
    runtime: a round starting at step s lasts warmup_period steps while s < warmup, else
    max(h_base, floor((alpha / lr(s)) ** power)), capped by the steps left."""
    periods, s, previous = [], 0, None
    while s < total:
        if s < warmup:
            h = warmup_period
        elif rising_lr and (previous is None or lr(s) > previous):
            h = h_base
        else:
            h = max(h_base, math.floor((alpha / lr(s)) ** power))
        previous = lr(s)
        h = min(h, total - s)
        periods.append((s, h))
        s += h
    return periods


@pytest.mark.parametrize("schedule", ["cosine", "step"])
def test_qsr_periods_follow_the_rule(schedule):
    total = 200
    cfg = TrainConfig(lr=0.2, steps=total, schedule=schedule, milestones=(60, 120), gamma=0.2,
                      min_lr=0.001)
    qsr = QSR(period=2, alpha=0.1, power=2.0, warmup_steps=5)
    _, runtime = SimWorld(2).run(
        lambda comm: _train(comm, qsr, steps=total, schedule=lambda t: learning_rate(cfg, t))
    )[0]
    expected = closed_form_periods(total, 5, 2, 0.1, 2.0, lambda t: learning_rate(cfg, t))
    assert runtime.periods == expected
    assert expected[:5] == [(t, 1) for t in range(5)]  # the warm-up averages every step
    assert len({h for _, h in expected}) > 2  # the rule did vary H
    assert runtime.synchronizations == len(expected)  # one per round, the last step's too
    assert runtime.last_averaged == total - 1


def _warm_up_run(qsr: QSR, total: int = 120) -> tuple[list[tuple[int, int]], int, TrainConfig]:
    cfg = TrainConfig(lr=0.2, steps=total, schedule="cosine", warmup_steps=20, min_lr=0.001)
    _, runtime = SimWorld(2).run(
        lambda comm: _train(comm, qsr, steps=total, schedule=lambda t: learning_rate(cfg, t))
    )[0]
    return runtime.periods, runtime.synchronizations, cfg


def test_qsr_warm_up_is_keyed_on_warmup_steps():
    """The QSR code's rule: rounds starting in the first warmup_steps steps last
    warmup_period steps; the rule takes over after them."""
    periods, syncs, cfg = _warm_up_run(QSR(period=2, alpha=0.2, warmup_steps=20))
    assert periods[:20] == [(t, 1) for t in range(20)]
    assert periods[20][0] == 20 and max(h for _, h in periods) > 2  # H grows as the lr decays
    assert periods == closed_form_periods(120, 20, 2, 0.2, 2.0, lambda t: learning_rate(cfg, t))
    assert syncs == len(periods)
    periods, _, cfg = _warm_up_run(QSR(period=2, alpha=0.2, warmup_steps=20, warmup_period=3))
    assert periods[:7] == [(3 * k, 3) for k in range(7)]  # the 7th round starts at 18 < 20
    assert periods == closed_form_periods(120, 20, 2, 0.2, 2.0, lambda t: learning_rate(cfg, t),
                                          warmup_period=3)


def test_qsr_without_warmup_steps_applies_the_rule_to_a_warm_up():
    """As in the QSR code: without warmup_steps the first round takes the rule at the warm-up's
    small first learning rate, here one period spanning the whole run."""
    periods, syncs, _ = _warm_up_run(QSR(period=2, alpha=0.2))
    assert periods == [(0, 120)] and syncs == 1


def test_qsr_can_hold_h_base_while_the_learning_rate_rises():
    """warmup="rising_lr": H = H_base while the learning rate rises (and for the first round),
    without warmup_steps; without that, the first round would span the whole run."""
    periods, syncs, cfg = _warm_up_run(QSR(period=2, alpha=0.2, warmup="rising_lr"))
    assert all(h == 2 for t, h in periods if t < 20)
    assert syncs > 15  # not one huge period
    assert max(h for _, h in periods) > 2  # and H grows once the lr decays
    assert periods == closed_form_periods(120, 0, 2, 0.2, 2.0, lambda t: learning_rate(cfg, t),
                                          rising_lr=True)


def test_period_one_equals_allreduce():
    ours = SimWorld(4).run(lambda comm: _train(comm, LocalSGD(period=1))[0])
    ref = SimWorld(4).run(lambda comm: _train(comm, AllReduce())[0])
    assert torch.allclose(ours[0], ref[0], atol=1e-6)
    # with momentum, once the momentum buffers are averaged too
    ours = SimWorld(4).run(lambda comm: _train(
        comm, LocalSGD(period=1, average_optimizer_state=True), momentum=0.9)[0])
    ref = SimWorld(4).run(lambda comm: _train(comm, AllReduce(), momentum=0.9)[0])
    assert torch.allclose(ours[0], ref[0], atol=1e-6)


def test_replicas_drift_between_averages_and_meet_at_the_end():
    def worker(comm):
        flat, runtime = _train(comm, LocalSGD(period=5, average_at_end=False), steps=13)
        return flat, runtime.synchronizations

    results = SimWorld(3).run(worker)
    assert not torch.allclose(results[0][0], results[1][0])  # step 12 did not average
    assert results[0][1] == 2  # after steps 4 and 9: rounds of 5 steps from the start
    ended = SimWorld(3).run(
        lambda comm: _train(comm, LocalSGD(period=5), steps=13, finish=True)[0])
    assert torch.allclose(ended[0], ended[1], atol=0)


def test_local_adamw_averages_the_moments():
    def worker(comm):
        _, runtime = _train(comm, LocalSGD(period=2, average_optimizer_state=True),
                            steps=6, optimizer="adamw")
        state = runtime.optimizer.state
        return [state[p]["exp_avg"].clone() for p in runtime.model.parameters()]

    moments = SimWorld(3).run(worker)  # step 5 averaged (steps 1, 3, 5)
    for a, b in zip(moments[0], moments[1], strict=True):
        assert torch.equal(a, b)


def gloo_against_torch(period: int, steps: int):
    import torch.distributed as dist
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    from gossamer.comm import TorchCommunicator

    comm = TorchCommunicator.from_env(timeout=60)
    try:
        ours, _ = _train(comm, LocalSGD(period=period, average_at_end=False), steps=steps,
                         momentum=0.9)
        results = [ours]
        for wrap in (False, True):
            model = _model()
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            # torch averages after step warmup_steps and every period steps from there:
            # warmup_steps = period - 1 gives local SGD's rounds of `period` steps
            averager = PeriodicModelAverager(period=period, warmup_steps=period - 1)
            if wrap:
                opt = PostLocalSGDOptimizer(optim=opt, averager=averager)
            for x, y in _batches(dist.get_rank(), steps):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
                if not wrap:
                    averager.average_parameters(model.parameters())
            results.append(_flat(model))
        return results
    finally:
        comm.close()


@pytest.mark.slow
@pytest.mark.gloo
def test_constant_period_matches_torch_model_averaging_on_gloo():
    from gossamer.testing import spawn_gloo

    results = spawn_gloo(gloo_against_torch, 3, args=(4, 18), timeout=180)
    for ours, averager, post_local in results:
        assert torch.allclose(ours, averager, atol=1e-6)
        assert torch.allclose(ours, post_local, atol=1e-6)
    # the last average was after step 15 (0-based); steps 16, 17 were local: replicas differ
    assert not torch.allclose(results[0][0], results[1][0], atol=1e-6)


@pytest.mark.parametrize("kwargs, name", [
    ({"period": 0}, "period"), ({"warmup_steps": -1}, "warmup_steps"),
    ({"alpha": -0.1}, "alpha"), ({"power": 0}, "power"), ({"power": -2.0}, "power"),
])
def test_bad_input(kwargs, name):
    with pytest.raises(ValueError, match=name):
        QSR(**kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["localsgd", "qsr"])
def test_train_on_digits(name):
    result = default_run(name)
    assert result["eval_accuracy"] >= 0.85
    # fewer bytes than AllReduce: not every step averages
    reference = default_run("allreduce")
    assert result["bytes_sent"] < reference["bytes_sent"] / 1.5


@pytest.mark.slow
def test_resume_keeps_the_h_sequence(tmp_path, monkeypatch):
    from resume_helpers import straight_and_resumed

    from gossamer.train import checkpoint as ckpt

    straight_and_resumed(
        monkeypatch, tmp_path, 30, sim=2, steps=60, eval_every=20, checkpoint_every=20,
        algorithm="qsr", options={"alpha": "0.1"}, schedule="cosine", lr=0.2, quiet=True)
    a = ckpt.safe_load(ckpt.latest_checkpoint(tmp_path / "a") / "rank-00000.pt")
    b = ckpt.safe_load(ckpt.latest_checkpoint(tmp_path / "b") / "rank-00000.pt")
    assert a["algorithm"]["periods"] == b["algorithm"]["periods"]
    assert len(a["algorithm"]["periods"]) > 3
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key])


def test_batchnorm_reestimation_after_the_final_average():
    from gossamer.algorithms.local_sgd import reestimate_batchnorm

    def batches(rank):
        g = torch.Generator().manual_seed(rank)
        return [torch.randn(16, 4, generator=g) * (rank + 1) + rank for _ in range(3)]

    def worker(comm):
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        with torch.no_grad():
            model[0].weight.copy_(torch.eye(4))
            model[0].bias.zero_()
        assert reestimate_batchnorm(comm, model, batches(comm.rank))
        assert not reestimate_batchnorm(comm, nn.Linear(2, 2), [])
        return model[1].running_mean.clone(), model[1].running_var.clone()

    results = SimWorld(3).run(worker)
    expected_mean = sum(torch.stack([b.mean(0) for b in batches(r)]).mean(0)
                        for r in range(3)) / 3
    expected_var = sum(torch.stack([b.var(0) for b in batches(r)]).mean(0)
                       for r in range(3)) / 3
    for mean, var in results:
        assert torch.allclose(mean, expected_mean, atol=1e-5)
        assert torch.allclose(var, expected_var, atol=1e-4)


def _bn_worker(comm, algorithm: LocalSGD, inputs: bool):
    """Two steps of a BatchNorm model on rank-dependent data (one round of 2), then the
    runtime's before_eval; returns the running statistics after the average and after it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), algorithm,
                              comm)
    g = torch.Generator().manual_seed(comm.rank)
    for _ in range(2):
        x = torch.randn(16, 4, generator=g) * (comm.rank + 1) + comm.rank
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    after_average = model[1].running_mean.clone()
    if inputs:
        opt.runtime.training_inputs = lambda count: (
            torch.randn(16, 4, generator=g) + comm.rank for _ in range(count))
    opt.before_eval()
    return after_average, model[1].running_mean.clone(), _flat(model)


def test_batchnorm_statistics_stay_local_and_are_reestimated_before_eval():
    results = SimWorld(3).run(_bn_worker, LocalSGD(period=2), True)
    after_average = [r[0] for r in results]
    assert not torch.allclose(after_average[0], after_average[1])  # parameters only averaged
    for r in results:
        assert torch.equal(r[2], results[0][2])  # the parameters were
        assert torch.equal(r[1], results[0][1])  # re-estimated, then averaged: the same
        assert not torch.allclose(r[1], r[0])  # (not what the worker had)
    # the old behaviour: statistics averaged with the parameters, no re-estimation
    old = SimWorld(3).run(_bn_worker, LocalSGD(period=2, average_buffers=True,
                                               reestimate_batchnorm=0), True)
    for r in old:
        assert torch.equal(r[0], old[0][0]) and torch.equal(r[1], r[0])
    # without training inputs (a loop of one's own) before_eval leaves them as they are
    alone = SimWorld(3).run(_bn_worker, LocalSGD(period=2), False)
    for r in alone:
        assert torch.equal(r[1], r[0])


def test_at_the_end_of_a_round_only_the_statistics_are_all_reduced_before_eval():
    """An evaluation right after a round's average re-estimates the statistics without
    averaging the parameters again (they are equal already): one all-reduce, of the
    statistics; inside a round (after 1 step of 2), the parameters' average comes first."""
    def worker(comm, steps):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
        opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  LocalSGD(period=2), comm)
        g = torch.Generator().manual_seed(comm.rank)
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(16, 4, generator=g) + comm.rank).pow(2).mean().backward()
            opt.step()
        opt.runtime.training_inputs = lambda count: (
            torch.randn(16, 4, generator=g) for _ in range(count))
        before = (comm.stats.operations.get("all_reduce", 0), comm.stats.total_bytes_sent)
        params = _flat(model)
        opt.before_eval()
        after = (comm.stats.operations.get("all_reduce", 0), comm.stats.total_bytes_sent)
        return after[0] - before[0], after[1] - before[1], torch.equal(_flat(model), params)

    at_the_end = SimWorld(3).run(worker, 2)
    inside = SimWorld(3).run(worker, 1)
    statistics, parameters = 2 * 4 * 4, sum(p.numel() for p in nn.Sequential(
        nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).parameters()) * 4
    ring = 2 * 2 / 3  # each of 3 workers sends 2 (n - 1) / n of a ring all-reduce's bytes
    for count, sent, unchanged in at_the_end:
        assert count == 1 and sent == pytest.approx(ring * statistics, abs=8) and unchanged
    for count, sent, unchanged in inside:
        assert count == 2 and unchanged
        assert sent == pytest.approx(ring * (statistics + parameters), abs=16)


def test_inside_a_round_the_statistics_are_the_averaged_models():
    """An evaluation inside a round (1 step of 2) re-estimates BatchNorm statistics with the
    average of the replicas, the model that is evaluated, and leaves each worker its own
    parameters."""
    def worker(comm):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
        opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  LocalSGD(period=2), comm)
        g = torch.Generator().manual_seed(comm.rank)
        opt.zero_grad()
        model(torch.randn(16, 4, generator=g) + comm.rank).pow(2).mean().backward()
        opt.step()
        inputs = [torch.randn(16, 4, generator=g) * (comm.rank + 1) for _ in range(2)]
        opt.runtime.training_inputs = lambda count: iter(inputs[:count])
        before = copy.deepcopy(model.state_dict())
        opt.before_eval()
        return before, model.state_dict(), inputs

    results = SimWorld(3).run(worker)
    params = [k for k in results[0][0] if "running" not in k and "num_batches" not in k]
    assert not torch.equal(results[0][0]["0.weight"], results[1][0]["0.weight"])  # a round
    averaged = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    averaged.load_state_dict({**results[0][0], **{
        k: sum(r[0][k] for r in results) / 3 for k in params}})
    means, variances = [], []
    for _, _, inputs in results:  # each worker's estimate with the averaged parameters
        norm = averaged[1]
        norm.reset_running_stats()
        norm.momentum = None
        averaged.train()
        for x in inputs[:2]:
            averaged(x)
        means.append(norm.running_mean.clone())
        variances.append(norm.running_var.clone())
    for before, after, _ in results:
        for k in params:
            assert torch.equal(after[k], before[k]), k  # its own parameters again
        assert torch.allclose(after["1.running_mean"], sum(means) / 3, atol=1e-6)
        assert torch.allclose(after["1.running_var"], sum(variances) / 3, atol=1e-6)


@pytest.mark.slow
def test_reestimation_runs_in_training(tmp_path):
    from test_data import write_cifar

    write_cifar(tmp_path / "cifar", n=8)

    def run(eval_every: int = 0, **options: str) -> dict:
        return run_training(TrainConfig(
            sim=2, steps=4, batch_size=4, dataset="cifar10", data_path=str(tmp_path / "cifar"),
            algorithm="localsgd", lr=0.01, quiet=True, eval_every=eval_every,
            options={"period": "2", **options}))

    # BatchNorm statistics kept local: the workers score differently ...
    local = run(reestimate_batchnorm="0")
    assert local["worker_eval_loss"][0] != local["worker_eval_loss"][1]
    # ... re-estimated and averaged before evaluation (the default): they score the same
    reestimated = run()
    assert reestimated["worker_eval_loss"][0] == reestimated["worker_eval_loss"][1]
    assert reestimated["eval_loss"] != local["eval_loss"]
    # the re-estimation before an evaluation at step 2 changes no training batch: the end is
    # the same as without it, and its all-reduce is the evaluation's traffic, not the method's
    evaluated = run(eval_every=2)
    assert evaluated["eval_loss"] == reestimated["eval_loss"]
    assert evaluated["bytes_sent"] == reestimated["bytes_sent"] > 0
    assert evaluated["synchronizations"] == reestimated["synchronizations"]


@pytest.mark.slow
def test_reestimation_keeps_a_resumed_run_equal(tmp_path, monkeypatch):
    """The re-estimation at an evaluation (step 3) and the checkpoint after it: a run stopped
    at step 4 and resumed ends as the one that never stopped, statistics and all."""
    from resume_helpers import straight_and_resumed
    from test_data import write_cifar

    from gossamer.train import checkpoint as ckpt

    write_cifar(tmp_path / "cifar", n=8)
    straight, stopped, resumed = straight_and_resumed(
        monkeypatch, tmp_path, 4, sim=2, steps=6, eval_every=3, checkpoint_every=3,
        batch_size=4, quiet=True, dataset="cifar10", data_path=str(tmp_path / "cifar"),
        lr=0.01, algorithm="localsgd", options={"period": "2"})
    for rank in range(2):
        a = ckpt.safe_load(ckpt.latest_checkpoint(straight) / f"rank-{rank:05d}.pt")
        b = ckpt.safe_load(ckpt.latest_checkpoint(stopped) / f"rank-{rank:05d}.pt")
        for key in a["buffers"]:
            assert torch.equal(a["buffers"][key], b["buffers"][key]), (rank, key)
        for key in a["model"]:
            assert torch.equal(a["model"][key], b["model"][key]), (rank, key)
    final = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()
             if json.loads(line).get("kind") == "eval"][-1]
    assert resumed["eval_loss"] == final["eval_loss"]
    assert resumed["worker_eval_loss"] == final["worker_eval_loss"]
