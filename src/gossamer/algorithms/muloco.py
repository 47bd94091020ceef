"""MuLoCo: DiLoCo with Muon as the inner optimizer and its pseudo-gradients quantised to 2 bits
with error feedback.

Therien, Huang, Rish, Belilovsky, "MuLoCo: Muon is a practical inner optimizer for DiLoCo"
(2025, arXiv 2505.23725), Algorithm 1 (DiLoCo, Douillard et al. 2023) with the compression of
its Section 3: every worker r starts a round from the global parameters ``theta^(t-1)``, takes
H steps of Muon (AdamW for the parameters Muon cannot take), and then

    Delta_r = theta^(t-1) - theta_r^(t)          its pseudo-gradient
    e_r     = beta e_r + Delta_r                 the error-feedback accumulator
    D_r     = Q(e_r)                             each tensor quantised to ``bits`` bits
    e_r     = e_r - D_r                          what was not sent stays
    Delta   = (1/R) sum_r D_r                    every worker's D_r, all-gathered
    theta^(t) = OuterOpt(theta^(t-1), Delta)     SGD, Nesterov momentum 0.9

Q is the statistical quantiser (:class:`~gossamer.compress.statistical.StatisticalQuantiser`,
SparseLoCo's): the tensor's mean, ``2^bits`` bins over ``range_in_sigmas`` standard
deviations, each bin decoded to the mean of its values.

This is DiLoCo (:class:`~gossamer.algorithms.DiLoCo`: its rounds, replicas, checkpoints,
continuing after a failure) whose ``compression`` is that quantiser with the decaying error
feedback (:class:`~gossamer.compress.statistical.StatisticalCompression`), a configuration
and not a runtime of its own. ``bits=32`` sends the exact float32 average: DiLoCo itself.

**The inner optimizer** is the one given to :func:`gossamer.distribute`, as for DiLoCo: pass
:func:`gossamer.muon` (Muon for the hidden matrices, AdamW for the rest). With any other,
binding warns that the run is DiLoCo with quantised pseudo-gradients, not MuLoCo.

**Defaults** from the authors' configuration (github.com/facebookresearch/MuLoCo at 15ee278b,
``torchtitan/config/diloco/2x_4gpu_muloco_quantized_outer.py``): ``quantization_bins`` 4
(2 bits), ``quantization_range`` 6, ``error_decay`` 0.9, outer SGD with Nesterov momentum
0.9 and learning rate 0.8. One difference from that code: it adds ``outer_lr * Delta_r`` to the
accumulator and then steps the outer SGD with ``outer_lr`` again (its
``QuantizedOuterSGD._save_grads`` and ``step``), so its pseudo-gradient moves the parameters
by ``outer_lr^2``; here the accumulator holds ``Delta_r`` and ``outer_lr`` applies once, so
``outer_lr=0.64`` is its 0.8 (tests/oracles/muloco.py checks both).

**Sharded models** are refused: Muon orthogonalises whole matrices, and on an FSDP2 shard it
would orthogonalise a block of rows, another optimizer (the quantiser's statistics would be
per shard too).

Example::

    inner = gossamer.muon(model, lr=3e-3, weight_decay=0.01)
    optimizer = gossamer.distribute(model, inner, MuLoCo(period=30, bits=2))
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

import torch
from torch import nn

from gossamer.algorithms.base import Algorithm
from gossamer.algorithms.diloco import DiLoCo, DiLoCoRuntime, check_rounds
from gossamer.algorithms.outer import OuterStep, check_replicas_divide
from gossamer.algorithms.rounds import RoundSchedule
from gossamer.comm.base import Communicator
from gossamer.compress.memory import check_decay
from gossamer.compress.statistical import QUANTISER_BITS, StatisticalCompression, check_range
from gossamer.optim import MuonWithAdamW
from gossamer.options import option, option_of

__all__ = ["BITS", "MuLoCo"]

#: the pseudo-gradients' widths ``bits`` takes; 32: the exact float32 average
BITS = (*QUANTISER_BITS, 32)


@dataclass(frozen=True, kw_only=True)
class MuLoCo(Algorithm):
    """MuLoCo (Therien et al. 2025): DiLoCo with Muon inside, its pseudo-gradients quantised
    to ``bits`` bits with error feedback, all-gathered.

    Args:
        bits: the pseudo-gradients' width: 2 (default), 4 or 8 with the statistical
            quantiser; 32: the exact float32 average (DiLoCo).
        range_in_sigmas: the quantiser's range in standard deviations (default 6).
        error_decay: beta, each worker's accumulator's factor before the round's
            pseudo-gradient is added (default 0.9); in [0, 1].
        outer_lr, outer_momentum, outer_nesterov: the outer SGD (defaults 0.8, 0.9, True).
        period, alpha, power, warmup, warmup_steps, warmup_period, replica_size, bucket_mb,
            average_optimizer_state, average_buffers, reestimate_batchnorm, average_at_end:
            as :class:`DiLoCo`'s.
    """

    name: ClassVar[str] = "muloco"
    needs: ClassVar[str] = (
        "Muon as its inner optimizer (--optimizer muon, gossamer.muon(model, lr=...)): with "
        "another one it warns, and the run is DiLoCo with 2-bit pseudo-gradients")
    continues_after_failure: ClassVar[bool] = True
    renamed_options: ClassVar[Mapping[str, str]] = MappingProxyType(
        {"group_size": "replica_size"})

    period: int = option_of(DiLoCo, "period")
    warmup_steps: int = option_of(DiLoCo, "warmup_steps")
    warmup_period: int = option_of(DiLoCo, "warmup_period")
    average_optimizer_state: bool = option_of(DiLoCo, "average_optimizer_state")
    average_buffers: bool = option_of(DiLoCo, "average_buffers")
    reestimate_batchnorm: int = option_of(DiLoCo, "reestimate_batchnorm")
    average_at_end: bool = option_of(DiLoCo, "average_at_end")
    alpha: float = option_of(DiLoCo, "alpha")
    power: float = option_of(DiLoCo, "power")
    warmup: str = option_of(DiLoCo, "warmup")
    replica_size: int = option_of(DiLoCo, "replica_size")
    bucket_mb: float = option_of(DiLoCo, "bucket_mb")
    outer_lr: float = option(0.8, "the outer SGD's learning rate (the authors' 0.8)")
    outer_momentum: float = option_of(DiLoCo, "outer_momentum")
    outer_nesterov: bool = option_of(DiLoCo, "outer_nesterov")
    bits: int = option(2, "the pseudo-gradients' bits: 2, 4, 8 (statistical quantiser), 32 "
                       "(the exact float32 average: DiLoCo)")
    range_in_sigmas: float = option_of(StatisticalCompression, "range_in_sigmas")
    error_decay: float = option(0.9, "beta: each worker's error-feedback accumulator decays "
                                "by it before the round's pseudo-gradient is added")

    def __post_init__(self) -> None:
        check_rounds(self)
        if self.bits not in BITS:
            raise ValueError(f"bits: must be one of {', '.join(map(str, BITS))}, "
                             f"got {self.bits!r}")
        check_range(self.range_in_sigmas)
        check_decay("error_decay", self.error_decay)

    @property
    def schedule(self) -> RoundSchedule:
        """How long each round lasts: DiLoCo's rule."""
        return DiLoCo.schedule.fget(self)  # type: ignore[attr-defined]

    @property
    def outer_step(self) -> OuterStep:
        """The outer SGD."""
        return OuterStep(outer="sgd", outer_lr=self.outer_lr,
                         outer_momentum=self.outer_momentum,
                         outer_nesterov=self.outer_nesterov)

    @property
    def compression(self) -> StatisticalCompression | None:
        """What DiLoCo's runtime sends the pseudo-gradients through (None: 32 bits, the
        exact average)."""
        if self.bits == 32:
            return None
        return StatisticalCompression(bits=self.bits, range_in_sigmas=self.range_in_sigmas,
                                      error_decay=self.error_decay)

    def symmetric(self) -> bool:
        return True  # the same all-gathers on every worker (and on every replica)

    def validate(self, world_size: int) -> None:
        check_replicas_divide(self.replica_size, world_size)

    def sharding_refusal(self) -> str | None:
        return ("MuLoCo's inner Muon orthogonalises whole matrices: on an FSDP2 shard it "
                "would orthogonalise a block of rows, another optimizer; it does not run on "
                "sharded models")

    def bind(self, comm: Communicator, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> DiLoCoRuntime:
        self.validate(comm.world_size)
        if not isinstance(optimizer, (MuonWithAdamW, torch.optim.Muon)):
            warnings.warn(f"muloco: the inner optimizer is {type(optimizer).__name__}, not "
                          "Muon (gossamer.muon(model, lr=...), --optimizer muon): this runs "
                          "DiLoCo with quantised pseudo-gradients", stacklevel=3)
        return DiLoCoRuntime(self, comm, model, optimizer)  # type: ignore[arg-type]
