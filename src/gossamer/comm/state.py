"""Objects sent between workers without pickling: the structure of a state (dicts, lists,
tuples, numbers, strings, and each tensor's shape and dtype) as UTF-8 JSON in a byte tensor,
then the tensors, one flat message per dtype.

Example::

    state = broadcast_object(comm, 0, runtime.outer.state_dict() if comm.rank == 0 else None)
"""

from __future__ import annotations

import json
from typing import Any

import torch

from gossamer.comm.base import Communicator, DeviceBound
from gossamer.comm.buckets import apply_flat

__all__ = ["broadcast_object", "decode", "encode"]


@torch.no_grad()
def broadcast_object(comm: Communicator, src: int, obj: Any) -> Any:
    """Collective over ``comm``: ``src``'s ``obj`` (only tensors, numbers, strings and
    containers of them; ignored elsewhere) on every worker, its tensors received into tensors
    of their own (on the communicator's device). ``src`` gets back its own ``obj``."""
    device = comm.device if isinstance(comm, DeviceBound) else None  # NCCL: CUDA tensors only
    sending = comm.rank == src
    tensors: list[torch.Tensor] = []
    text = json.dumps(encode(obj, tensors)).encode() if sending else b""
    length = torch.tensor([len(text)], dtype=torch.int64, device=device)
    comm.broadcast(length, src)
    data = torch.zeros(int(length), dtype=torch.uint8, device=device)
    if sending:
        data.copy_(torch.frombuffer(bytearray(text), dtype=torch.uint8).to(data.device))
    comm.broadcast(data, src)
    skeleton = json.loads(bytes(data.cpu().tolist()).decode())
    if not sending:  # received into tensors of their own, the same shapes and dtypes
        tensors = [torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                   for shape, dtype in skeleton["tensors"]]
    apply_flat(tensors, lambda buffer: comm.broadcast(buffer, src))
    return obj if sending else decode(skeleton["state"], tensors)


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
