"""What a restarted worker receives when it rejoins a run that went on without it
(``on_failure="continue"``, :mod:`gossamer.comm.membership`).

At a rejoin the members have averaged exactly among themselves; a live member (``src``)
then broadcasts to the new communicator its step, its model's ``state_dict()``, its torch
optimizer's and its algorithm runtime's. Nothing is pickled: the structure of these states
(dicts, lists, numbers, strings, and each tensor's shape and dtype) travels as UTF-8 JSON in a
byte tensor, then the tensors, one flat message per dtype
(:func:`gossamer.comm.state.broadcast_object`). The rejoining worker rebuilds the
states from them and loads them.

Example::

    step = share_state(comm, src, model, optimizer, runtime, step, joining=comm.rank == r)
"""

from __future__ import annotations

import torch
from torch import nn

from gossamer.algorithms.base import Runtime
from gossamer.comm.base import Communicator
from gossamer.comm.state import broadcast_object, decode, encode

__all__ = ["decode", "encode", "share_state"]


@torch.no_grad()
def share_state(comm: Communicator, src: int, model: nn.Module,
                optimizer: torch.optim.Optimizer, runtime: Runtime, step: int,
                joining: bool, counters: dict[str, float] | None = None) -> int:
    """Collective over ``comm``: ``src``'s model, optimizer state, runtime state and step
    reach every worker; a ``joining`` one (that rejoins) loads them, the others keep theirs.
    Returns ``src``'s step.

    ``counters``: numbers that go with the state (the training loop's bytes, messages and
    seconds so far, and the examples trained on): ``src``'s reach every worker, and a
    ``joining`` worker's dict is updated with them, so that it goes on counting from where
    a member is (its clock from the run's, not from its restart).

    The optimizer state that goes is the torch optimizer's that ``runtime`` was bound with:
    the one ``optimizer`` wraps where it is what ``distribute()`` returned."""
    inner = runtime.optimizer  # the wrapped torch optimizer
    state = None
    if comm.rank == src:
        state = {"step": step, "model": model.state_dict(), "optimizer": inner.state_dict(),
                 "runtime": runtime.state_dict(), "counters": dict(counters or {})}
    state = broadcast_object(comm, src, state)
    if joining:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optimizer"])
        runtime.load_state_dict(state["runtime"])
        if counters is not None:
            counters.update({k: float(v) for k, v in state["counters"].items()})
    return int(state["step"])
