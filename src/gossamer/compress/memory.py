"""Error feedback: what a compressor did not send is added to the next step's gradient.

Seide et al., "1-Bit Stochastic Gradient Descent and its Application to Data-Parallel
Distributed Training of Speech DNNs" (2014); Karimireddy et al., "Error Feedback Fixes SignSGD
and other Gradient Compression Schemes" (2019). With ``e`` the residual of a tensor:

    compensated = grad + e
    sent = decompress(compress(compensated))
    e = compensated - sent

so that ``compensated == sent + e`` holds after every step, up to one rounding of ``e`` (kept in
float32, or float64 for a float64 model).

With a ``decay`` beta below 1, ``compensated = grad + beta e``: what was not sent fades by beta
a step, as in the accumulators of SparseLoCo and MuLoCo (Sarfi et al. 2025, Algorithm 1;
Therien et al. 2025, the authors' ``error_decay``), where it also takes the place of the outer
momentum's memory of past rounds.

**Units.** The residual is in gradient units: it is added to the gradient before the learning
rate, and the optimizer applies ``lr`` to the average later, as in Vogels et al., "PowerSGD"
(NeurIPS 2019), Algorithm 2, in their code (epfml/powersgd) and in torch's ``powerSGD_hook``.
Stich et al., "Sparsified SGD with Memory" (2018), Algorithm 1, and Karimireddy et al. (2019),
Algorithm 2, keep it in parameter units instead (``p_t = lr_t g_t + e_t``, the step is what is
sent). The two are the same at a constant learning rate (for a compressor that commutes with
scaling: top-k, random-k, PowerSGD; the papers' residual is ``lr`` times this one). Under a
schedule they differ: here a residual built while the rate was ``lr_old`` is applied at the
rate of the step that finally sends it, so after a decay the delayed part of the gradient moves
the parameters less than it would have when it was computed (while a warm-up raises the rate,
more); in parameter units it keeps its own rate. Gradient units are kept because the memory
sits between the backward pass and any ``torch.optim`` optimizer (momentum, Adam, weight decay,
any scheduler) and does not need to know the learning rate: the compressed average replaces
the gradient, and the optimizer does what it does with an uncompressed one. Nothing rescales
the residual when the rate changes: with a step decay, whatever the residual holds at the drop
is applied at the new rate.

Example::

    AllReduce(compressor=TopK(ratio=0.01), memory=ErrorFeedback())
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from gossamer.compress.base import Compressor, Memory, value_dtype
from gossamer.compress.payloads import Payload, SharedIndexPayload, SparsePayload


def check_decay(name: str, value: object) -> None:
    """An error-feedback decay ``name``: a number in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{name}: must be a number in [0, 1], got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ErrorFeedback(Memory):
    """Keep the residual ``compensated - sent`` of each tensor and add it to the next gradient.

    The residual buffer doubles as the compensated gradient (no allocation after the first
    step), so the tensor :meth:`compensate` returns belongs to the memory until :meth:`update`.

    Args:
        decay: beta, the residual's factor before the next gradient is added (default 1:
            nothing fades); in [0, 1]. Lower: older residuals count less.
    """

    decay: float = 1.0

    # internal state: the residual of each tensor, by name
    _residuals: dict[str, torch.Tensor] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False)

    def compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        residual = self._residuals.get(key)
        if residual is None or residual.shape != grad.shape:
            residual = grad.detach().to(value_dtype(grad.dtype), copy=True)
            self._residuals[key] = residual
            return residual
        if self.decay != 1:
            residual.mul_(self.decay)
        return residual.add_(grad.detach())

    def update(self, key: str, compensated: torch.Tensor, payload: Payload,
               compressor: Compressor) -> None:
        residual = self._residuals[key]
        if residual is not compensated:
            residual.copy_(compensated)
        if isinstance(payload, (SparsePayload, SharedIndexPayload)):
            # only the sent elements change: no dense temporary
            residual.view(-1).index_add_(0, payload.indices,
                                         payload.values.to(residual.dtype), alpha=-1)
        else:
            residual.sub_(compressor.decompress(payload, key).view_as(residual))

    def __post_init__(self) -> None:
        check_decay("decay", self.decay)

    def residual(self, key: str) -> torch.Tensor | None:
        """The residual of tensor ``key`` (None before its first step)."""
        return self._residuals.get(key)

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {k: v.clone() for k, v in self._residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._residuals.clear()
        self._residuals.update({k: v.clone() for k, v in state["residuals"].items()})
