"""Local SGD, the Quadratic Synchronization Rule, Local AdamW."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gossamer
from gossamer.algorithms import QSR, AllReduce, LocalSGD
from gossamer.comm import SimWorld
from gossamer.train.config import TrainConfig, learning_rate
from gossamer.train.loop import run_training


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
                        lr) -> list[tuple[int, int]]:
    """The QSR periods computed directly from the rule, independently of the runtime."""
    periods, t = [], warmup
    previous = lr(warmup - 1) if warmup else None  # the learning rate at the last average
    while t < total:
        rising = previous is None or lr(t) > previous
        h = h_base if rising else max(h_base, math.floor((alpha / lr(t)) ** power))
        previous = lr(t)
        left = total - 1 - t
        if left == 0:
            break
        h = min(h, left)
        periods.append((t, h))
        t += h
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
    assert len({h for _, h in expected}) > 2  # the rule did vary H
    assert runtime.synchronizations == 5 + len(expected) + 1  # and the last step averages


def test_qsr_holds_h_base_during_a_learning_rate_warm_up():
    """A rising learning rate (warm-up) keeps H at H_base; without that, the first average's
    small learning rate would give one period spanning the whole run."""
    total = 120
    cfg = TrainConfig(lr=0.2, steps=total, schedule="cosine", warmup_steps=20, min_lr=0.001)
    qsr = QSR(period=2, alpha=0.2)
    _, runtime = SimWorld(2).run(
        lambda comm: _train(comm, qsr, steps=total, schedule=lambda t: learning_rate(cfg, t))
    )[0]
    assert all(h == 2 for t, h in runtime.periods if t < 20)
    assert runtime.synchronizations > 15  # not one huge period
    assert max(h for _, h in runtime.periods) > 2  # and H grows once the lr decays
    expected = closed_form_periods(total, 0, 2, 0.2, 2.0, lambda t: learning_rate(cfg, t))
    assert runtime.periods == expected


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
    assert results[0][1] == 3  # after steps 0, 5, 10
    ended = SimWorld(3).run(
        lambda comm: _train(comm, LocalSGD(period=5), steps=13, finish=True)[0])
    assert torch.allclose(ended[0], ended[1], atol=0)


def test_local_adamw_averages_the_moments():
    def worker(comm):
        _, runtime = _train(comm, LocalSGD(period=2, average_optimizer_state=True),
                            steps=5, optimizer="adamw")
        state = runtime.optimizer.state
        return [state[p]["exp_avg"].clone() for p in runtime.model.parameters()]

    moments = SimWorld(3).run(worker)  # step 4 averaged (steps 0, 2, 4)
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
            averager = PeriodicModelAverager(period=period, warmup_steps=0)
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


@pytest.mark.gloo
def test_constant_period_matches_torch_model_averaging_on_gloo():
    from gossamer.testing import spawn_gloo

    results = spawn_gloo(gloo_against_torch, 3, args=(4, 18), timeout=180)
    for ours, averager, post_local in results:
        assert torch.allclose(ours, averager, atol=1e-6)
        assert torch.allclose(ours, post_local, atol=1e-6)
    # the last average was after step 16 (0-based); step 17 was local, so replicas differ
    assert not torch.allclose(results[0][0], results[1][0], atol=1e-6)


@pytest.mark.parametrize("kwargs, name", [
    ({"period": 0}, "period"), ({"warmup_steps": -1}, "warmup_steps"),
    ({"alpha": -0.1}, "alpha"), ({"power": 0}, "power"), ({"power": -2.0}, "power"),
])
def test_bad_input(kwargs, name):
    with pytest.raises(ValueError, match=name):
        QSR(**kwargs)


@pytest.mark.parametrize("name", ["localsgd", "qsr"])
def test_train_on_digits(name):
    result = run_training(TrainConfig(sim=4, algorithm=name, quiet=True))
    assert result["eval_accuracy"] >= 0.85
    # fewer bytes than AllReduce: not every step averages
    reference = run_training(TrainConfig(sim=4, algorithm="allreduce", quiet=True))
    assert result["bytes_sent"] < reference["bytes_sent"] / 1.5


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


def test_reestimation_runs_in_training(tmp_path):
    from test_data import write_cifar

    write_cifar(tmp_path / "cifar", n=8)

    def run(batches: int) -> dict:
        return run_training(TrainConfig(
            sim=2, steps=4, batch_size=4, dataset="cifar10", data_path=str(tmp_path / "cifar"),
            algorithm="localsgd", lr=0.01, quiet=True, eval_every=0,
            options={"period": "2", "average_buffers": "false",
                     "reestimate_batchnorm": str(batches)}))

    # BatchNorm statistics kept local: the workers score differently ...
    local = run(0)
    assert local["worker_eval_loss"][0] != local["worker_eval_loss"][1]
    # ... re-estimated and averaged after the final average: they score the same
    reestimated = run(2)
    assert reestimated["worker_eval_loss"][0] == reestimated["worker_eval_loss"][1]
