"""The outer step of DiLoCo and its family: an optimizer over global parameters that steps
on the averaged pseudo-gradient, the state it keeps between rounds, and the communicators of
replicas made of several workers. An object a method's configuration holds
(:attr:`~gossamer.algorithms.DiLoCo.outer_step`), not a base class.

Douillard et al., "DiLoCo" (2023, arXiv 2311.08105), Algorithm 1: ``theta^(t) =
OuterOpt(theta^(t-1), Delta^(t))``, the paper's OuterOpt SGD with Nesterov momentum 0.9 and
learning rate 0.7.

Example::

    outer = OuterStep(outer="sgd", outer_lr=0.7, outer_momentum=0.9)
    state = OuterState(outer, model.parameters())  # the global parameters, the optimizer
    deltas = state.pseudo_gradients(range(len(state.params)))
    ...                                            # average deltas over the workers
    state.step(range(len(state.params)), deltas)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gossamer.checks import check_int
from gossamer.comm.base import Communicator
from gossamer.comm.buckets import apply_flat
from gossamer.options import option

__all__ = ["OUTER_OPTIONS", "OuterFactory", "OuterState", "OuterStep", "check_replicas",
           "check_replicas_divide", "group_communicators", "outer_optimizer_class"]

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
class OuterStep:
    """The outer optimizer: a ``torch.optim`` class by name with its learning rate (and SGD's
    momentum and Nesterov), or a Python factory over the global parameters.

    Args:
        outer: a ``torch.optim`` class name, any case (default ``"sgd"``).
        outer_lr: its learning rate (default 0.7, the paper's).
        outer_momentum: SGD's momentum (default 0.9, the paper's); only for ``outer="sgd"``.
        outer_nesterov: SGD's Nesterov momentum (default True, the paper's).
        outer_optimizer: a factory ``params -> torch.optim.Optimizer`` instead of the others
            (default None).
    """

    outer: str = option("sgd", "the outer optimizer: a torch.optim class name (sgd, adam, "
                        "adamw, ...)")
    outer_lr: float = option(0.7, "the outer learning rate")
    outer_momentum: float = option(0.9, "the outer SGD's momentum")
    outer_nesterov: bool = option(True, "the outer SGD's Nesterov momentum")
    outer_optimizer: OuterFactory | None = option(
        None, "Python: a factory params -> torch optimizer, instead of outer and outer_*")

    def __post_init__(self) -> None:
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

    @classmethod
    def of(cls, config: Any) -> OuterStep:
        """The outer step that ``config`` (a method's configuration with the options
        :data:`OUTER_OPTIONS`) names."""
        return cls(**{name: getattr(config, name) for name in OUTER_OPTIONS})

    def make(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
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


#: the options of a method's configuration that make its :class:`OuterStep`
OUTER_OPTIONS = ("outer", "outer_lr", "outer_momentum", "outer_nesterov", "outer_optimizer")


def check_replicas(replica_size: object, bucket_mb: object) -> None:
    """The options of replicas of several workers: ``replica_size`` an int >= 1,
    ``bucket_mb`` (MiB per gradient all-reduce inside a replica) a number > 0."""
    check_int("replica_size", replica_size, 1)
    if not (isinstance(bucket_mb, (int, float)) and math.isfinite(bucket_mb)
            and bucket_mb > 0):
        raise ValueError(f"bucket_mb must be a number > 0, got {bucket_mb!r}")


def check_replicas_divide(replica_size: int, world_size: int) -> None:
    """``replica_size`` must divide the ``world_size`` workers."""
    if world_size % replica_size:
        raise ValueError(f"replica_size={replica_size} does not divide the "
                         f"{world_size} workers")


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

    def __init__(self, outer: OuterStep, params: Sequence[nn.Parameter]) -> None:
        self.params = list(params)
        self.global_params = [nn.Parameter(p.detach().clone()) for p in self.params]
        self.optimizer = outer.make(self.global_params)

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
