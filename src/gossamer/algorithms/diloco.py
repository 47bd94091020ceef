"""DiLoCo: H local steps of any inner optimizer, then one step of an outer optimizer on the
averaged pseudo-gradient.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models" (2023,
arXiv 2311.08105), Algorithm 1. Every worker starts a round from the global parameters
``theta^(t-1)``, takes H steps of its inner optimizer (AdamW in the paper; any ``torch.optim``
optimizer here, the one given to :func:`gossamer.distribute`) on its own data, and then

    Delta^(t) = (1/k) sum_i (theta^(t-1) - theta_i^(t))      the averaged pseudo-gradient
    theta^(t) = OuterOpt(theta^(t-1), Delta^(t))              (SGD, Nesterov, lr 0.7, mom. 0.9)

and every worker continues from ``theta^(t)``. The inner optimizer's state stays local. With
an outer SGD of learning rate 1 and no momentum, ``theta^(t)`` is the average of the workers'
parameters: local SGD.

What this library adds to the paper:

- **The period** H is constant (``period``) or follows the Quadratic Synchronization Rule from
  the inner learning rate (``alpha > 0``: ``H = max(period, floor((alpha / lr) ** power))``,
  see :class:`~gossamer.algorithms.QSR`), with the same warm-up options; the last round is cut
  to end at the last step when the number of steps is known.
- **Compression**: the pseudo-gradients can go through any compressor of the library
  (``compression="topk:ratio=0.01"``, ...) with its error feedback: what a worker did not
  send is added to its next pseudo-gradient.
- **Replicas of several workers** (``replica_size`` R > 1): consecutive ranks form a replica
  whose members all-reduce their gradients after every backward pass, so that it trains as one
  data-parallel replica (torchft's replica groups); DiLoCo runs between the replicas. The
  members of a replica hold the same parameters, so each worker all-reduces the
  pseudo-gradient only with the workers of the same position in the other replicas.
  (``group_size``, this option's old name, is read with a note for one more release.)

The global parameters and the outer optimizer's state are part of the runtime's state, so
checkpoints hold them.

Example::

    inner = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1)
    optimizer = gossamer.distribute(model, inner, DiLoCo(period=500))
    # any outer optimizer (Python): a factory over the global parameters
    DiLoCo(period=50, outer_optimizer=lambda params: torch.optim.Adam(params, lr=1e-3))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import nn

from gossamer.algorithms.allreduce import AllReduce, AllReduceRuntime, compression_argument
from gossamer.algorithms.base import average_tensors
from gossamer.algorithms.local_sgd import QSR, LocalSGD, LocalSGDRuntime, optimizer_state_tensors
from gossamer.checks import check_int
from gossamer.comm.base import Communicator
from gossamer.comm.buckets import apply_flat
from gossamer.comm.state import broadcast_object
from gossamer.compress.reducer import CompressedReducer
from gossamer.compress.registry import Compression, DGCCompression
from gossamer.options import option
from gossamer.patterns.nonfinite import all_finite

OuterFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def outer_optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` optimizer class called ``name`` (any case); ValueError naming the
    ``outer`` option otherwise."""
    classes = {cls.__name__.lower(): cls for cls in vars(torch.optim).values()
               if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
               and cls is not torch.optim.Optimizer}
    if not isinstance(name, str) or name.lower() not in classes:
        raise ValueError(f"outer: {name!r} is not a torch.optim optimizer; known: "
                         f"{', '.join(sorted(classes))}")
    return classes[name.lower()]


@dataclass(frozen=True, kw_only=True)
class DiLoCo(QSR):
    """DiLoCo (Douillard et al. 2023): rounds of H inner steps, then an outer optimizer step
    on the pseudo-gradient averaged over the workers (or groups).

    Args:
        period: H, inner steps per round (default 16); H_base when ``alpha > 0``.
        alpha: 0 (default): a constant period; > 0: the period follows the Quadratic
            Synchronization Rule from the inner learning rate (see :class:`QSR`, ``power``).
        outer: the outer optimizer, a ``torch.optim`` class name (default ``"sgd"``).
        outer_lr: its learning rate (default 0.7, the paper's).
        outer_momentum: SGD's momentum (default 0.9, the paper's); only for ``outer="sgd"``.
        outer_nesterov: SGD's Nesterov momentum (default True, the paper's).
        outer_optimizer: Python: a factory ``params -> torch.optim.Optimizer`` over the global
            parameters, instead of ``outer``, ``outer_lr``, ``outer_momentum`` and
            ``outer_nesterov`` (default None).
        compression: a compressor spec for the pseudo-gradients, ``"topk:ratio=0.01"`` (see
            :mod:`gossamer.compress.registry`), with its error feedback (default None: the
            exact float32 average). DGC's memory is a gradient method's and is refused.
        replica_size: workers per replica (default 1: every worker is a replica of its own);
            the members of a replica all-reduce gradients every step (``bucket_mb`` per
            collective).
        bucket_mb: MiB per gradient all-reduce inside a replica (default 25).
        warmup_steps: rounds that start before this step last ``warmup_period`` steps (1)
            and end with a plain exact average, no outer step: synchronous training while the
            learning rate warms up, as the paper's DiLoCo starts from a model trained
            synchronously (default 0: none). The parameters are averaged after each worker's
            own step: exactly synchronous training for SGD, close to it for AdamW, whose
            moments stay each worker's own.
        (and the options of :class:`QSR` and :class:`LocalSGD`: ``power``, ``warmup``,
        ``warmup_period``, ``average_optimizer_state`` (the inner state,
        averaged at each outer step), ``average_buffers``, ``reestimate_batchnorm``,
        ``average_at_end``: an outer step after the last step if it did not end a round.)
    """

    name: ClassVar[str] = "diloco"
    continues_after_failure: ClassVar[bool] = True
    renamed_options: ClassVar[Mapping[str, str]] = MappingProxyType(
        {"group_size": "replica_size"})
    #: the number of outer steps is what a worker counts as synchronisations
    cap_to_end: ClassVar[bool] = True

    period: int = option(16, "H: inner steps per outer step; H_base when alpha > 0")
    alpha: float = option(0.0, "0: constant period; > 0: the QSR rule from the inner lr, "
                          "H = max(period, floor((alpha / lr) ** power))")
    outer: str = option("sgd", "the outer optimizer: a torch.optim class name (sgd, adam, "
                        "adamw, ...)")
    outer_lr: float = option(0.7, "the outer learning rate")
    outer_momentum: float = option(0.9, "the outer SGD's momentum")
    outer_nesterov: bool = option(True, "the outer SGD's Nesterov momentum")
    outer_optimizer: OuterFactory | None = option(
        None, "Python: a factory params -> torch optimizer, instead of outer and outer_*")
    compression: Compression | str | None = option(
        None, "pseudo-gradients through a compressor spec NAME[:KEY=VALUE...], with its error "
        "feedback (topk, randomk, qsgd, powersgd, fp16); none: the exact float32 average")
    replica_size: int = option(1, "workers per replica: they all-reduce gradients every step, "
                               "and DiLoCo runs between the replicas")
    bucket_mb: float = option(25.0, "MiB per gradient all-reduce inside a replica")
    warmup_steps: int = option(0, "rounds starting before this step last warmup_period steps "
                               "and end with a plain average (synchronous warm-up), no outer "
                               "step")

    def __post_init__(self) -> None:
        super().__post_init__()
        outer_optimizer_class(self.outer)
        for name in ("outer_lr", "outer_momentum"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                    and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.outer.lower() != "sgd" and (self.outer_momentum != 0.9
                                            or self.outer_nesterov is not True):
            raise ValueError(f"outer_momentum and outer_nesterov are SGD's; outer={self.outer!r} "
                             "takes only outer_lr (or give outer_optimizer)")
        if self.outer.lower() == "sgd" and self.outer_nesterov and self.outer_momentum == 0:
            raise ValueError("outer_nesterov needs outer_momentum > 0")
        if self.outer_optimizer is not None and not callable(self.outer_optimizer):
            raise ValueError(f"outer_optimizer must be a callable params -> optimizer, got "
                             f"{self.outer_optimizer!r}")
        if self.compression is not None:
            compression = compression_argument(self.compression)
            if isinstance(compression, DGCCompression):
                raise ValueError("compression: dgc's memory takes over a gradient optimizer's "
                                 "momentum; use topk, randomk, qsgd, powersgd or fp16 for "
                                 "pseudo-gradients")
            object.__setattr__(self, "compression", compression)
        check_int("replica_size", self.replica_size, 1)
        if not (isinstance(self.bucket_mb, (int, float)) and math.isfinite(self.bucket_mb)
                and self.bucket_mb > 0):
            raise ValueError(f"bucket_mb must be a number > 0, got {self.bucket_mb!r}")

    def round_period(self, step: int, lr: float, previous_lr: float | None) -> int:
        if self.alpha == 0:  # a constant period (and the warm-up's)
            return LocalSGD.round_period(self, step, lr, previous_lr)
        return super().round_period(step, lr, previous_lr)

    def validate(self, world_size: int) -> None:
        if world_size % self.replica_size:
            raise ValueError(f"replica_size={self.replica_size} does not divide the "
                             f"{world_size} workers")

    def make_outer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        """The outer optimizer over the global parameters."""
        if self.outer_optimizer is not None:
            outer = self.outer_optimizer(params)
            if not isinstance(outer, torch.optim.Optimizer):
                raise ValueError(f"outer_optimizer returned {type(outer).__name__}, not a "
                                 "torch.optim.Optimizer")
            return outer
        cls = outer_optimizer_class(self.outer)
        if cls is torch.optim.SGD:
            return cls(params, lr=self.outer_lr, momentum=self.outer_momentum,
                       nesterov=self.outer_nesterov)
        return cls(params, lr=self.outer_lr)

    def bind(self, comm: Communicator, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> DiLoCoRuntime:
        self.validate(comm.world_size)
        return DiLoCoRuntime(self, comm, model, optimizer)


def group_communicators(comm: Communicator, replica_size: int
                        ) -> tuple[Communicator | None, Communicator]:
    """(this worker's replica, or None for replicas of one; the workers of the same position
    in every replica), for replicas of ``replica_size`` consecutive ranks."""
    if replica_size == 1:
        return None, comm
    replica, position = divmod(comm.rank, replica_size)
    members = list(range(replica * replica_size, (replica + 1) * replica_size))
    across = [position + j * replica_size for j in range(comm.world_size // replica_size)]
    return comm.group(members), comm.group(across)


class OuterState:
    """The global parameters and the outer optimizer: what DiLoCo's methods keep between
    rounds, on every worker alike."""

    def __init__(self, config: DiLoCo, params: Sequence[nn.Parameter]) -> None:
        self.params = list(params)
        self.global_params = [nn.Parameter(p.detach().clone()) for p in self.params]
        self.optimizer = config.make_outer(self.global_params)

    @torch.no_grad()
    def pseudo_gradients(self, indices: Sequence[int]) -> list[torch.Tensor]:
        """``global - local`` of the parameters ``indices``."""
        return [self.global_params[i] - self.params[i] for i in indices]

    @torch.no_grad()
    def step(self, indices: Sequence[int], averaged: Sequence[torch.Tensor]) -> None:
        """One outer step of the parameters ``indices`` with their averaged pseudo-gradients;
        the others keep their global value and their outer state."""
        for i, delta in zip(indices, averaged, strict=True):
            self.global_params[i].grad = delta.view_as(self.global_params[i]).to(
                self.global_params[i].dtype)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def warm_up(self, comm: Communicator) -> None:
        """A warm-up round's end: the replicas averaged exactly, the global parameters set to
        the average; the outer optimizer does not step."""
        apply_flat(self.params, lambda buffer: comm.all_reduce(buffer, op="mean"))
        for p, g in zip(self.params, self.global_params, strict=True):
            g.copy_(p)

    def state_dict(self) -> dict[str, Any]:
        return {"global": [p.detach().clone() for p in self.global_params],
                "outer": self.optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        for p, saved in zip(self.global_params, state["global"], strict=True):
            p.copy_(saved)
        self.optimizer.load_state_dict(state["outer"])


class DiLoCoRuntime(LocalSGDRuntime):
    """One worker of DiLoCo: the rounds of local SGD, an outer step where they average."""

    def __init__(self, config: DiLoCo, comm: Communicator, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        super().__init__(config, comm, model, optimizer)
        self.config: DiLoCo = config
        self.trained = [p for p in model.parameters() if p.requires_grad]
        self.names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.outer = OuterState(config, self.trained)
        self._connect(comm)

    def _connect(self, comm: Communicator) -> None:
        """The group, the communicator across the groups and the compressor over it, for
        the workers of ``comm``."""
        config = self.config
        self.group, self.across = group_communicators(comm, config.replica_size)
        # the group's gradient all-reduce: a group trains as one data-parallel replica
        self.inner: AllReduceRuntime | None = None
        if self.group is not None:
            self.inner = AllReduce(bucket_mb=config.bucket_mb).bind(self.group, self.model,
                                                                    self.optimizer)
        self.reducer: CompressedReducer | None = None
        if isinstance(config.compression, Compression):
            compressor, memory = config.compression.build(self.across.world_size)
            self.reducer = CompressedReducer(self.across, compressor, memory,
                                             bucket_bytes=int(config.bucket_mb * 2**20))

    def start(self, **kwargs: Any) -> None:
        super().start(**kwargs)
        if self.inner is not None:
            self.inner.start(nonfinite=self.nonfinite)

    @torch.no_grad()
    def change_membership(self, comm: Communicator, algorithm: Any) -> None:
        """The groups (``replica_size`` must divide the new world size) and the compression
        (its memory emptied) rebuilt for the new members; the members agree on the global
        parameters and the outer optimizer (:meth:`_agree_on_outer`); then an outer step over
        them. Collective over ``comm``."""
        self._reconnect(comm, algorithm)
        self._agree_on_outer(comm)
        super().change_membership(comm, algorithm)

    @torch.no_grad()
    def _agree_on_outer(self, comm: Communicator) -> None:
        """The global parameters and the outer optimizer of the member that took in the most
        outer steps (the lowest rank among them) on every member. A failure during an outer
        step's all-reduce may have let some members take it in and not others, and the global
        parameters would then differ for good; a member that missed it had sent its
        pseudo-gradient into it, so it goes on from the step's global parameters, as the
        others did. Collective over ``comm``."""
        device = self.trained[0].device if self.trained else None
        counts = [int(c.reshape(-1)[0]) for c in comm.all_gather(
            torch.tensor([self.synchronizations], dtype=torch.int64, device=device))]
        if min(counts) == max(counts):  # every member took in the same outer steps
            return
        source = counts.index(max(counts))
        state = broadcast_object(comm, source,
                                 self.outer.state_dict() if comm.rank == source else None)
        if self.synchronizations < counts[source]:
            self.outer.load_state_dict(state)
            for p, g in zip(self.trained, self.outer.global_params, strict=True):
                p.copy_(g)
            self.synchronizations = counts[source]

    @torch.no_grad()
    def rejoin(self, comm: Communicator, algorithm: Any) -> None:
        """The groups and the compression rebuilt as at :meth:`change_membership`, without its
        outer step: the members made one over themselves before their state was shared (one
        outer step per round, as in the paper; a second, on a pseudo-gradient of zero, would
        still move the parameters by the outer momentum)."""
        self._reconnect(comm, algorithm)
        super().rejoin(comm, algorithm)

    def _reconnect(self, comm: Communicator, algorithm: Any) -> None:
        """Over the workers of ``comm``: the communicator, the groups (``replica_size`` must
        divide the new world size) and the compression (its memory emptied)."""
        algorithm.validate(comm.world_size)
        self.comm = comm
        self._connect(comm)
        if self.inner is not None:
            self.inner.start(nonfinite=self.nonfinite)

    def check_gradients(self) -> None:
        if self.inner is None:
            super().check_gradients()
            return
        self.inner.overflow = self.overflow
        self.inner.check_gradients()
        self.skip_update = self.inner.skip_update

    def after_backward(self) -> None:
        if self.inner is not None:
            self.inner.step = self.step
            self.inner.after_backward()
            self.skip_update = self.inner.skip_update

    @torch.no_grad()
    def average_parameters(self) -> None:
        """An outer step over the round so far (collective), unless the replicas were
        synchronised after the step before this one (a round's end, a membership change):
        every worker holds the global parameters then, and an outer step on that zero
        pseudo-gradient would still move them by the outer momentum."""
        if not self._replicas_equal():
            self._average()

    @torch.no_grad()
    def _average(self) -> None:
        """The outer step: average the pseudo-gradients, step the global parameters, and
        continue every worker from them."""
        if not all_finite(self.trained):
            raise self.nonfinite_error("parameters")
        if self.periods and self.periods[-1][0] < self.config.warmup_steps:
            self.outer.warm_up(self.across)  # a plain average: synchronous training
        else:
            indices = list(range(len(self.trained)))
            deltas = self.outer.pseudo_gradients(indices)
            self.reduce(deltas)
            self.outer.step(indices, deltas)
            for p, g in zip(self.trained, self.outer.global_params, strict=True):
                p.copy_(g)
        extra = []
        if self.config.average_buffers:
            extra += [b for b in self.model.buffers() if torch.is_floating_point(b)]
        if self.config.average_optimizer_state:
            extra += optimizer_state_tensors(self.optimizer)
        if extra:
            average_tensors(self.comm, extra)
        self.synchronizations += 1
        self.last_averaged = self.step

    def reduce(self, deltas: list[torch.Tensor]) -> None:
        """Replace each pseudo-gradient by its average over the groups, in place."""
        if self.reducer is not None:
            self.reducer.reduce(list(zip(self.names, deltas, strict=True)),
                                self.synchronizations)
        else:
            apply_flat(deltas, lambda buffer: self.across.all_reduce(buffer, op="mean"))

    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), **self.outer.state_dict()}
        if self.reducer is not None:
            state["compression"] = self.reducer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.outer.load_state_dict(state)
        if self.reducer is not None:
            self.reducer.load_state_dict(state["compression"])
