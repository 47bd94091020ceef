"""GossamerStrategy in real PyTorch Lightning fits, on 2 gloo processes.

AllReduce through the strategy is the oracle's arithmetic exactly: from rank 0's initial
weights, SGD on the average of the two workers' gradients of the batches each one saw. The
local and gossip methods end with equal replicas after the fit (finish() at on_train_end), the
communicator counted bytes, and a Lightning checkpoint saved mid-way resumes to the same
weights as an uninterrupted fit.
"""

from __future__ import annotations

import os
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from torch.nn import functional as F

import gossamer
from gossamer.integrations.lightning import GossamerStrategy

WORKERS = 2
LR = 0.1


class Tiny(pl.LightningModule):
    """A linear regression that records the batches it trains on."""

    def __init__(self, momentum: float = 0.0) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                       torch.nn.Linear(8, 1))
        self.momentum = momentum
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append((x.clone(), y.clone()))
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=self.momentum)


def _loader(samples: int = 80) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(samples, 4, generator=g),
                                          torch.randn(samples, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)


def _trainer(strategy: GossamerStrategy, root: str, **limits) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=WORKERS, strategy=strategy,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=root, **limits)


def _params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _fit(algorithm, root: str, steps: int, accumulate: int = 1) -> dict:
    rank = int(os.environ["RANK"])
    torch.manual_seed(rank)  # different initial weights: the strategy broadcasts rank 0's
    module = Tiny()
    initial = _params(module)
    strategy = GossamerStrategy(algorithm)
    trainer = _trainer(strategy, root, max_steps=steps, accumulate_grad_batches=accumulate)
    trainer.fit(module, _loader())
    optimizer = strategy.distributed_optimizers[0]
    return {"synchronizations": optimizer.runtime.synchronizations,
            "initial": initial, "final": _params(module), "seen": module.seen,
            "bytes": optimizer.comm.stats.total_bytes_sent, "steps": optimizer.runtime.step,
            "global_step": trainer.global_step, "ddp": type(strategy.model).__name__}


def _oracle(initial: list[torch.Tensor], seen: list[list]) -> list[torch.Tensor]:
    """SGD on the average of the workers' gradients, step by step, in one process."""
    torch.manual_seed(0)
    model = Tiny().net
    with torch.no_grad():
        for p, value in zip(model.parameters(), initial, strict=True):
            p.copy_(value)
    for batches in zip(*seen, strict=True):
        grads = []
        for x, y in batches:
            model.zero_grad()
            F.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for p, *worker_grads in zip(model.parameters(), *grads, strict=True):
                p -= LR * torch.stack(worker_grads).mean(0)
    return _params(model)


@pytest.mark.slow
@pytest.mark.gloo
def test_allreduce_strategy_is_averaged_gradient_sgd(tmp_path):
    from gossamer.testing import spawn_gloo

    steps = 10
    results = spawn_gloo(_fit, WORKERS, args=("allreduce", str(tmp_path), steps), timeout=120)
    for r in results:
        assert r["ddp"] == "Tiny"  # never wrapped in DistributedDataParallel
        assert r["global_step"] == r["steps"] == steps
        assert len(r["seen"]) == steps
        assert r["bytes"] > 0
    # each worker trained on its own share of the data (Lightning's distributed sampler)
    assert not torch.equal(results[0]["seen"][0][0], results[1]["seen"][0][0])
    for a, b in zip(results[0]["final"], results[1]["final"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    expected = _oracle(results[0]["initial"], [r["seen"] for r in results])
    for got, want in zip(results[0]["final"], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # rank 1 started from different weights: the broadcast made rank 0's the start
    assert not torch.equal(results[0]["initial"][0], results[1]["initial"][0])


@pytest.mark.slow
@pytest.mark.gloo
def test_gradient_accumulation_reduces_once_a_step(tmp_path):
    """accumulate_grad_batches=2 with a compressed AllReduce, which reduces during backward
    and refuses a second backward before the step: the strategy's block_backward_sync makes
    the first micro-batch accumulate only, so each step reduces once."""
    from gossamer.testing import spawn_gloo

    steps = 4
    results = spawn_gloo(_fit, WORKERS, args=(gossamer.algorithms.TopKAllReduce(ratio=0.5),
                                              str(tmp_path), steps, 2), timeout=120)
    for r in results:
        assert r["steps"] == r["synchronizations"] == steps
        assert len(r["seen"]) == 2 * steps
    for a, b in zip(results[0]["final"], results[1]["final"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("algorithm", [gossamer.LocalSGD(period=3), "sgp"],
                         ids=["localsgd", "sgp"])
def test_local_and_gossip_methods_end_with_equal_replicas(algorithm, tmp_path):
    from gossamer.testing import spawn_gloo

    steps = 7  # local SGD: the last round is capped to end on the last step
    results = spawn_gloo(_fit, WORKERS, args=(algorithm, str(tmp_path), steps), timeout=120)
    for r in results:
        assert r["steps"] == steps and r["bytes"] > 0
    for a, b in zip(results[0]["final"], results[1]["final"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # and the replicas moved: they are not just rank 0's initial weights
    assert not torch.allclose(results[0]["final"][0], results[0]["initial"][0])


def _fit_with_checkpoint(algorithm, root: str, resume: bool) -> dict:
    rank = int(os.environ["RANK"])
    path = os.path.join(root, "half.ckpt")
    torch.manual_seed(rank)
    module = Tiny(momentum=0.9)
    loader = _loader(samples=32)  # 4 steps an epoch on each of the 2 workers
    if resume:
        first = _trainer(GossamerStrategy(algorithm, total_steps=8), root, max_epochs=1)
        first.fit(module, loader)
        first.save_checkpoint(path)  # on every worker, as Lightning requires
        torch.manual_seed(100 + rank)
        module = Tiny(momentum=0.9)  # fresh weights: the checkpoint must bring them back
    strategy = GossamerStrategy(algorithm, total_steps=8)
    trainer = _trainer(strategy, root, max_epochs=2)
    trainer.fit(module, loader, ckpt_path=path if resume else None)
    optimizer = strategy.distributed_optimizers[0]
    saved = torch.load(path, weights_only=False)["optimizer_states"][0] if resume else None
    workers = torch.load(path, weights_only=False).get("gossamer_workers") if resume else None
    return {"final": _params(module), "steps": optimizer.runtime.step,
            "global_step": trainer.global_step,
            "saved_keys": sorted(saved) if saved is not None else None,
            "workers": workers is not None}


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("algorithm", [
    "allreduce",
    # saved at step 4, in the middle of a round (rounds end at 3, 6, 8): the replicas and
    # momentum buffers differ there, and each worker must get its own back
    gossamer.LocalSGD(period=3, average_at_end=False),
], ids=["allreduce", "localsgd"])
def test_lightning_checkpoint_resumes_the_fit(algorithm, tmp_path):
    from gossamer.testing import spawn_gloo

    straight = spawn_gloo(_fit_with_checkpoint, WORKERS,
                          args=(algorithm, str(tmp_path / "straight"), False), timeout=120)
    resumed = spawn_gloo(_fit_with_checkpoint, WORKERS,
                         args=(algorithm, str(tmp_path / "resumed"), True), timeout=120)
    for r in resumed:
        assert r["global_step"] == r["steps"] == 8  # the algorithm's step came back too
        assert {"algorithm", "param_groups", "state"} <= set(r["saved_keys"])
        per_worker = isinstance(algorithm, gossamer.LocalSGD)
        assert r["workers"] == per_worker
        assert ("algorithm_by_rank" in r["saved_keys"]) != per_worker
    for s, r in zip(straight, resumed, strict=True):
        for a, b in zip(s["final"], r["final"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_strategy_checks_its_arguments():
    with pytest.raises(ValueError, match="algorithm"):
        GossamerStrategy(3)
    with pytest.raises(ValueError, match="nonfinite"):
        GossamerStrategy("allreduce", nonfinite="ignore")
    with pytest.raises(ValueError, match="total_steps"):
        GossamerStrategy("allreduce", total_steps=0)
    with pytest.raises(ValueError):
        GossamerStrategy("no-such-method")
    assert isinstance(GossamerStrategy("sgp").algorithm, gossamer.SGP)


@pytest.mark.slow
def test_importing_gossamer_does_not_import_lightning():
    code = ("import sys, gossamer, gossamer.integrations; "
            "assert 'lightning' not in sys.modules, 'lightning imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_a_missing_lightning_names_the_extra():
    code = ("import sys; sys.modules['lightning'] = None\n"
            "try:\n    import gossamer.integrations.lightning\n"
            "except ImportError as e:\n    assert 'gossamer[lightning]' in str(e), e\n"
            "else:\n    raise SystemExit('imported')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
