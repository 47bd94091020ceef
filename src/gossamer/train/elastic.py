"""What a restarted worker receives when it rejoins a run that went on without it
(``on_failure="continue"``, :mod:`gossamer.comm.membership`).

At a rejoin the members have averaged exactly among themselves; a live member (``src``)
then broadcasts to the new communicator its step, its model's ``state_dict()``, its torch
optimizer's and its algorithm runtime's. Nothing is pickled: the structure of these states
(dicts, lists, numbers, strings, and each tensor's shape and dtype) travels as UTF-8 JSON in a
byte tensor, then the tensors, one flat message per dtype. The rejoining worker rebuilds the
states from them and loads them.

Example::

    step = share_state(comm, src, model, optimizer, runtime, step, joining=comm.rank == r)
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from gossamer.algorithms.base import Runtime
from gossamer.algorithms.buckets import apply_flat
from gossamer.comm.base import Communicator

__all__ = ["decode", "encode", "share_state"]


@torch.no_grad()
def share_state(comm: Communicator, src: int, model: nn.Module,
                optimizer: torch.optim.Optimizer, runtime: Runtime, step: int,
                joining: bool) -> int:
    """Collective over ``comm``: ``src``'s model, optimizer state, runtime state and step
    reach every worker; a ``joining`` one (that rejoins) loads them, the others keep theirs.
    Returns ``src``'s step."""
    inner = getattr(optimizer, "optimizer", optimizer)  # the wrapped torch optimizer
    device = getattr(comm, "device", None)  # NCCL broadcasts CUDA tensors only
    sending = comm.rank == src
    tensors: list[torch.Tensor] = []
    text = ""
    if sending:
        state = {"step": step, "model": model.state_dict(), "optimizer": inner.state_dict(),
                 "runtime": runtime.state_dict()}
        text = json.dumps(encode(state, tensors))
    length = torch.tensor([len(text.encode())], dtype=torch.int64, device=device)
    comm.broadcast(length, src)
    data = torch.zeros(int(length), dtype=torch.uint8, device=device)
    if sending:
        data.copy_(torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).to(device))
    comm.broadcast(data, src)
    skeleton = json.loads(bytes(data.cpu().tolist()).decode())
    if not sending:  # received into tensors of their own, the same shapes and dtypes
        tensors = [torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                   for shape, dtype in skeleton["tensors"]]
    apply_flat(tensors, lambda buffer: comm.broadcast(buffer, src))
    state = decode(skeleton["state"], tensors)
    if joining:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optimizer"])
        runtime.load_state_dict(state["runtime"])
    return int(state["step"])


def encode(obj: Any, tensors: list[torch.Tensor]) -> dict[str, Any]:
    """``{"state": ..., "tensors": [[shape, dtype], ...]}``: ``obj`` as plain JSON data with
    each tensor replaced by its index in ``tensors`` (appended to), and keys kept with their
    types (an optimizer's state is keyed by integers)."""
    return {"state": _encode(obj, tensors),
            "tensors": [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in tensors]}


def decode(data: Any, tensors: list[torch.Tensor]) -> Any:
    """The object :func:`encode` encoded, with ``tensors`` in their places."""
    (kind, value), = data.items()
    if kind == "t":
        return tensors[value]
    if kind == "d":
        return {decode(k, tensors): decode(v, tensors) for k, v in value}
    if kind in ("l", "u"):
        items = [decode(v, tensors) for v in value]
        return items if kind == "l" else tuple(items)
    return value


def _encode(obj: Any, tensors: list[torch.Tensor]) -> dict[str, Any]:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return {"t": len(tensors) - 1}
    if isinstance(obj, dict):
        return {"d": [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"l" if isinstance(obj, list) else "u": [_encode(v, tensors) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"v": obj}
    raise TypeError(f"a rejoining worker cannot be sent a {type(obj).__name__} ({obj!r}): "
                    "only tensors, numbers, strings and containers of them")
