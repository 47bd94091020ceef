"""What a restarted worker receives when it rejoins a run that went on without it
(``on_failure="continue"``, :mod:`gossamer.comm.membership`).

At a rejoin the members have averaged exactly among themselves; a live member (``src``)
then broadcasts to the new communicator: the model's parameters and floating-point buffers,
the optimizer's per-parameter state (momentum, Adam's moments), and, as UTF-8 JSON in a byte
tensor (nothing is pickled), the step and the algorithm runtime's state. The rejoining worker
makes its optimizer's state first (one step of zero gradients), so that the tensors match.

Example::

    step = share_state(comm, src, model, optimizer, runtime, step, joining=comm.rank == r)
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from gossamer.algorithms.base import Runtime, model_tensors
from gossamer.algorithms.buckets import apply_flat
from gossamer.algorithms.local_sgd import optimizer_state_tensors
from gossamer.comm.base import Communicator

__all__ = ["share_state"]


@torch.no_grad()
def share_state(comm: Communicator, src: int, model: nn.Module,
                optimizer: torch.optim.Optimizer, runtime: Runtime, step: int, *,
                joining: bool) -> int:
    """Collective over ``comm``: every worker ends with ``src``'s model, optimizer state,
    runtime state and step, which it returns. ``joining``: this worker is the one that
    rejoins (its own state is replaced)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # the wrapped torch optimizer
    if joining:
        _make_state(inner)
    tensors = model_tensors(model) + optimizer_state_tensors(inner)
    apply_flat(tensors, lambda buffer: comm.broadcast(buffer, src))
    text = json.dumps({"step": step, "runtime": runtime.state_dict()}) if not joining else ""
    device = getattr(comm, "device", None)  # NCCL broadcasts CUDA tensors only
    length = torch.tensor([len(text.encode())], dtype=torch.int64, device=device)
    comm.broadcast(length, src)
    data = torch.zeros(int(length), dtype=torch.uint8, device=device)
    if not joining:
        data.copy_(torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).to(device))
    comm.broadcast(data, src)
    state: dict[str, Any] = json.loads(bytes(data.cpu().tolist()).decode())
    if joining:
        runtime.load_state_dict(state["runtime"])
    return int(state["step"])


def _make_state(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer``'s per-parameter state as its first step does, with zero gradients
    (the parameters it changes are overwritten by the broadcast)."""
    params = [p for group in optimizer.param_groups for p in group["params"]
              if p.requires_grad]
    if all(p in optimizer.state and optimizer.state[p] for p in params):
        return
    saved = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p, grad in zip(params, saved, strict=True):
        p.grad = grad
