"""Helpers of the resume tests: a run that stops at a given step, then resumes."""

from __future__ import annotations

from pathlib import Path

import pytest

import gossamer.train.loop as loop
from gossamer.train.config import TrainConfig
from gossamer.train.run import run_training


class Crash(RuntimeError):
    pass


def crash_at(step_to_crash: int):
    """A stand-in for the loop's learning_rate that raises at ``step_to_crash`` (0-based)."""
    real = loop.learning_rate

    def crashing(config, step):
        if step == step_to_crash:
            raise Crash(f"stopped at step {step}")
        return real(config, step)

    return crashing


def straight_and_resumed(monkeypatch, root: Path, crash_step: int, **settings) -> tuple[
        Path, Path, dict]:
    """Run ``settings`` once without stopping (in root/a) and once stopped at ``crash_step``
    and resumed (in root/b); returns both run directories and the resumed run's result."""
    straight, stopped = root / "a", root / "b"
    run_training(TrainConfig(run_dir=str(straight), **settings))
    monkeypatch.setattr(loop, "learning_rate", crash_at(crash_step))
    with pytest.raises(Exception, match=f"stopped at step {crash_step}"):
        run_training(TrainConfig(run_dir=str(stopped), **settings))
    monkeypatch.undo()
    resumed = run_training(TrainConfig(run_dir=str(stopped), resume=True, **settings))
    return straight, stopped, resumed


def state_dict_round_trip(comm, algorithm, stop, dim: int):
    """16 steps of ``nn.Linear(dim, 2)`` under ``algorithm``, stopped at step ``stop`` (None:
    never) and resumed from the runtime's and optimizers' state dicts on fresh objects; the
    final parameters, flat."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import gossamer

    torch.manual_seed(0)
    model = nn.Linear(dim, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = gossamer.distribute(model, inner, algorithm, comm, total_steps=16)
    g = torch.Generator().manual_seed(comm.rank)
    batches = [(torch.randn(5, dim, generator=g), torch.randint(0, 2, (5,), generator=g))
               for _ in range(16)]
    for k, (x, y) in enumerate(batches):
        if k == stop:
            saved = ({n: t.clone() for n, t in model.state_dict().items()},
                     opt.state_dict())
            model = nn.Linear(dim, 2)
            model.load_state_dict(saved[0])
            inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            opt = gossamer.distribute(model, inner, algorithm, comm, broadcast=False,
                                      total_steps=16)
            opt.load_state_dict(saved[1])
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    opt.finish()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def saved_mid_run(comm, algorithm, stop, dim: int, steps: int, in_flight):
    """``steps`` steps of a small MLP (SGD with momentum) under ``algorithm``, saved through
    ``torch.save`` before step ``stop`` (None: never) and loaded on every worker into fresh
    objects: (the final flat parameters, ``in_flight(runtime)`` at the save, the runtime at
    the end, the bytes this worker sent)."""
    import io

    import torch
    import torch.nn.functional as F
    from torch import nn

    import gossamer

    def build():
        model = nn.Sequential(nn.Linear(dim, 8), nn.Tanh(), nn.Linear(8, 2))
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    torch.manual_seed(0)
    model, inner = build()
    opt = gossamer.distribute(model, inner, algorithm, comm, total_steps=steps)
    g = torch.Generator().manual_seed(comm.rank)
    batches = [(torch.randn(5, dim, generator=g), torch.randint(0, 2, (5,), generator=g))
               for _ in range(steps)]
    was_in_flight = None
    for k, (x, y) in enumerate(batches):
        if k == stop:
            was_in_flight = in_flight(opt.runtime)
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=True)
            model, inner = build()
            model.load_state_dict(saved["model"])
            opt = gossamer.distribute(model, inner, algorithm, comm, broadcast=False,
                                      total_steps=steps)
            opt.load_state_dict(saved["optimizer"])
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    opt.finish()
    return (torch.cat([p.detach().flatten() for p in model.parameters()]), was_in_flight,
            opt.runtime, comm.stats.total_bytes_sent)


def assert_last_checkpoints_equal(straight: Path, stopped: Path, ranks: int,
                                  optimizer_state: bool = False) -> None:
    """The last checkpoint of each of ``ranks`` workers of the two runs holds the same model
    (and, with ``optimizer_state``, the same state of the inner optimizer), bit for bit."""
    import torch

    from gossamer.train import checkpoint as ckpt

    for rank in range(ranks):
        a, b = (ckpt.safe_load(ckpt.latest_checkpoint(run) / f"rank-{rank:05d}.pt")
                for run in (straight, stopped))
        for name in a["model"]:
            assert torch.equal(a["model"][name], b["model"][name]), (rank, name)
        if optimizer_state:
            for i, state in a["optimizer"]["state"].items():
                for key, value in state.items():
                    assert torch.equal(value, b["optimizer"]["state"][i][key]), (rank, i, key)
