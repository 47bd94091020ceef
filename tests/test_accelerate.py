"""The Hugging Face Accelerate recipe of docs/integrations.md, run as written on 2 gloo processes.

The test reads the recipe's code block from the page, so the tested code and the documented
code are one. With "allreduce" it must be SGD (with momentum) on the average of the two
workers' gradients of the batches each one saw, from rank 0's initial weights; local SGD must
end with equal replicas after finish().
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import accelerate  # noqa: F401  (the dev extra installs it: a missing one fails here)
import pytest
import torch

import gossamer

DOCS = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"


def _recipe() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    found = [code for code in blocks if "from accelerate import Accelerator" in code]
    assert len(found) == 1, "docs/integrations.md: one Accelerate recipe"
    return found[0]


def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))


def _run_recipe(code: str, algorithm) -> dict:
    namespace: dict = {"__name__": "recipe"}  # the recipe's own __main__ part stays out
    exec(compile(code, str(DOCS), "exec"), namespace)
    rank = int(os.environ["RANK"])
    torch.manual_seed(rank)  # different initial weights: distribute() broadcasts rank 0's
    model = torch.nn.Linear(8, 1)
    initial = [p.detach().clone() for p in model.parameters()]
    seen: list[tuple[torch.Tensor, ...]] = []
    model.register_forward_hook(lambda module, inputs, output: seen.append(
        (inputs[0].detach().clone(),)))
    loader = torch.utils.data.DataLoader(_dataset(), batch_size=4, shuffle=False)
    model, optimizer = namespace["train"](model, loader, algorithm, epochs=2)
    return {"initial": initial, "final": [p.detach().clone() for p in model.parameters()],
            "seen": seen, "bytes": optimizer.comm.stats.total_bytes_sent,
            "world": optimizer.comm.world_size, "wrapped": type(model).__name__}


def _oracle(initial: list[torch.Tensor], seen: list[list], lr: float = 0.05) -> list:
    """SGD with momentum 0.9 on the average of the workers' gradients, in one process."""
    model = torch.nn.Linear(8, 1)
    with torch.no_grad():
        for p, value in zip(model.parameters(), initial, strict=True):
            p.copy_(value)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for batches in zip(*seen, strict=True):
        grads = []
        for (x,) in batches:
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *worker_grads in zip(model.parameters(), *grads, strict=True):
            p.grad = torch.stack(worker_grads).mean(0)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.gloo
def test_accelerate_recipe_is_averaged_gradient_sgd():
    from gossamer.testing import spawn_gloo

    results = spawn_gloo(_run_recipe, 2, args=(_recipe(), "allreduce"), timeout=120)
    for r in results:
        assert r["world"] == 2 and r["bytes"] > 0
        assert r["wrapped"] == "Linear"  # no DistributedDataParallel around it
        assert len(r["seen"]) == 16  # 64 samples, 2 workers, batches of 4, 2 epochs
    assert not torch.equal(results[0]["seen"][0][0], results[1]["seen"][0][0])  # sharded
    for a, b in zip(results[0]["final"], results[1]["final"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    expected = _oracle(results[0]["initial"], [r["seen"] for r in results])
    for got, want in zip(results[0]["final"], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.gloo
def test_accelerate_recipe_with_local_sgd_ends_with_equal_replicas():
    from gossamer.testing import spawn_gloo

    results = spawn_gloo(_run_recipe, 2, args=(_recipe(), gossamer.LocalSGD(period=3)),
                         timeout=120)
    assert all(r["bytes"] > 0 for r in results)
    for a, b in zip(results[0]["final"], results[1]["final"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(results[0]["final"][0], results[0]["initial"][0])
