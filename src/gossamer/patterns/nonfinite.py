"""Non-finite values (NaN, +-inf) never leave a worker.

Before a worker sends a gradient or its parameters, it checks them with one cheap reduction
(a sum, whose result is finite only if every element is), and, where the algorithm holds the
values in a flat buffer anyway, on that buffer. The policy ``nonfinite`` says what happens then:

- ``"raise"`` (default): stop with a :class:`NonFiniteError` (a ``FloatingPointError``) that
  names the rank, the step and what was non-finite;
- ``"skip"``: skip the update: the wrapped optimizer does not step (its momentum and moments
  stay clean), and nothing non-finite is sent.

Who decides depends on how the algorithm communicates:

- **agreement** (``allreduce`` and the compressed all-reduces ``dgc``, ``topk``, ``randomk``,
  ``qsgd``, ``powersgd``, ``fp16``): they make a global collective every step anyway, so every
  worker learns which ranks had a non-finite gradient from one bit per rank, summed (or
  averaged: AllReduce's buckets) at the end of that collective's buffer (one float32 more per
  22 ranks, no message of its own; fp16's
  half-precision wires make it a separate small all-reduce). A worker with a non-finite
  gradient sends zeros in its place (the compressed ones compress zeros, so that no
  error-feedback residual or DGC momentum ever sees the value). With ``raise`` every worker
  raises, naming the offending rank(s); with ``skip`` every worker drops that step's average
  and skips the update, so the replicas stay identical (with error feedback, what the others
  sent that step is dropped with it; what they did not send stays in their residuals).
- **local decision** (``sgp``, ``osgp``, ``dpsgd``, ``adpsgd``, ``wagma``, ``localsgd``,
  ``qsr``, ``gossipgrad``): a global all-reduce every step would be a barrier that takes away
  their asynchrony and straggler tolerance, so the offending worker decides alone. With
  ``skip`` it skips its own update (its gradient is checked before the optimizer steps) but
  takes part in the communication with its finite parameters, so no neighbour waits or receives
  a NaN; GossipGraD, which gossips gradients, sends zeros in place of the gradient and applies
  the combination of its partners'. With ``raise`` it raises; its peers then time out waiting
  for it, naming it. Parameter-level methods check the parameters before they are sent: with
  ``raise`` a non-finite gradient is found there (it makes the parameters non-finite), which
  costs one sum over the flat parameters they copy anyway; parameters that became non-finite
  although the gradient was finite (a diverging optimizer) raise under either policy, since
  skipping cannot repair the optimizer's state. Local SGD sends its parameters only when it
  averages, so it checks them there: under ``raise`` the error names that step.

**Mixed precision** (a ``torch.amp.GradScaler`` given to ``distribute(..., scaler=)``): a
non-finite scaled gradient is an overflow, which the scaler handles by skipping the step and
lowering its scale; it is never raised, whatever the policy. Every worker must skip the same
step, or the others would wait in the next collective, and every scaler must back off alike.
So the workers always agree, on one bit per rank: the all-reduce methods on the step's own
collective, as above (nothing more is sent); the others (gossip, asynchronous, local SGD,
GossipGraD) with one small all-reduce of their own per step (:func:`agree`), made only under a
scaler. If any worker overflowed, every worker skips the step as a whole (no optimizer step,
no gossip, the step counter and the schedules stay where they were) and tells its scaler, so
that every scale is updated identically. The DDP hooks agree the same way and make every
worker's reduced bucket NaN, so that every scaler finds the overflow (see
:mod:`gossamer.hooks`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gossamer.comm.base import Communicator

__all__ = ["POLICIES", "NonFiniteError", "agree", "all_finite", "check_policy",
           "describe_nonfinite", "flag_words", "ranks_from_flags", "set_flag"]

POLICIES = ("raise", "skip")
# ranks per float32 flag word: sums of distinct powers of two below 2^22 are exact, and their
# mean over any number of ranks, rounded to float32, is within 2^22 * 2^-24 = 1/4 of the sum
# divided by that number: the sum comes back exactly (see ranks_from_flags)
_BITS = 22


class NonFiniteError(FloatingPointError):
    """A gradient or parameter was NaN or infinite.

    Attributes: ``rank`` (the worker raising), ``step`` (1-based), ``ranks`` (the workers that
    had non-finite values, when known).
    """

    def __init__(self, message: str, *, rank: int, step: int, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.rank, self.step, self.ranks = rank, step, tuple(ranks)


def check_policy(value: str) -> str:
    if value not in POLICIES:
        raise ValueError(f"nonfinite {value!r} is unknown; known: {', '.join(POLICIES)}")
    return value


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite: one sum per tensor (NaN and inf
    survive a sum), and one device synchronisation.

    (A tensor of finite values whose float32 sum overflows, above 3e38, counts as
    non-finite.) About 2.5 us for the 9,610 parameters of the digits MLP on one CPU core.
    """
    if not tensors:
        return True
    if tensors[0].is_cpu:  # no synchronisation to save: plain Python floats
        if len(tensors) == 1:  # a flat buffer: one call, no generator
            return math.isfinite(tensors[0].sum(dtype=torch.float32).item())
        return math.isfinite(sum(t.sum(dtype=torch.float32).item() for t in tensors))
    sums = torch.stack([t.sum(dtype=torch.float32) for t in tensors])
    return math.isfinite(sums.sum().item())


def describe_nonfinite(named: Sequence[tuple[str, torch.Tensor | None]], what: str
                       ) -> str | None:
    """Which of ``named`` hold non-finite values, e.g. ``"the gradient of net.0.weight (1 NaN
    of 8192)"``, or None if none does; for error messages only (it is slow)."""
    parts = []
    for name, tensor in named:
        if tensor is None or bool(torch.isfinite(tensor).all()):
            continue
        nans = int(torch.isnan(tensor).sum())
        infs = int(torch.isinf(tensor).sum())
        counts = ", ".join(c for c in (f"{nans} NaN" if nans else "",
                                       f"{infs} inf" if infs else "") if c)
        parts.append(f"{name} ({counts} of {tensor.numel()})")
    if not parts:
        return None
    more = f" and {len(parts) - 3} more" if len(parts) > 3 else ""
    return f"the {what} of " + ", ".join(parts[:3]) + more


# -- agreement: one bit per rank, summed by an all-reduce -------------------------------------


def flag_words(world_size: int) -> int:
    """float32 elements that hold one bit per rank."""
    return -(-world_size // _BITS)


def set_flag(flags: torch.Tensor, rank: int) -> None:
    """Set ``rank``'s bit in ``flags`` (zeros elsewhere): the sum over ranks is their OR."""
    flags[rank // _BITS] = float(1 << (rank % _BITS))


def ranks_from_flags(flags: torch.Tensor, mean_of: int = 1) -> list[int]:
    """The ranks whose bits are set in the all-reduced ``flags``: their sum, or their mean
    over ``mean_of`` ranks."""
    values = flags.tolist()
    if not any(values):  # the usual case, at once
        return []
    ranks = []
    for word, value in enumerate(values):
        bits = round(value * mean_of)
        ranks += [word * _BITS + b for b in range(_BITS) if bits >> b & 1]
    return ranks


def agree(comm: Communicator, found: bool, device: torch.device | str = "cpu") -> list[int]:
    """The ranks whose ``found`` is True (non-finite values), from one all-reduce of one bit
    per rank (a float32 per 22 ranks) on ``device``. Collective: for callers that make no
    collective of their own at that point, under a GradScaler only (a barrier otherwise
    absent from gossip and asynchronous methods)."""
    flags = torch.zeros(flag_words(comm.world_size), dtype=torch.float32, device=device)
    if found:
        set_flag(flags, comm.rank)
    comm.all_reduce(flags, op="sum")
    return ranks_from_flags(flags)
