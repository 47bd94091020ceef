"""What every algorithm is: a frozen configuration that binds to one worker's model and optimizer.

An :class:`Algorithm` is a keyword-only frozen dataclass, validated when it is built, that
holds hyperparameters only. :meth:`Algorithm.bind` makes the per-worker :class:`Runtime`, the
one object that holds all the mutable state (step counter, residuals, push-sum weights...)
and acts at explicit points of a training step:

1. ``before_forward`` — e.g. SGP's de-biasing of the parameters;
2. ``after_backward`` — gradient-level methods (AllReduce, DGC, GossipGraD);
3. the wrapped ``torch.optim`` optimizer steps (algorithms never re-implement SGD or Adam);
4. ``after_step`` — parameter-level methods (SGP, D-PSGD, local SGD, WAGMA).

Runtimes talk to other workers only through a :class:`~gossamer.comm.Communicator`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn

from gossamer.algorithms.buckets import apply_flat
from gossamer.comm.base import Communicator


class Algorithm(ABC):
    """A distributed training method's configuration (subclasses are frozen dataclasses)."""

    #: The registry name, used by the command line and recipes.
    name: ClassVar[str]

    def validate(self, world_size: int) -> None:
        """Check this configuration against a world size (ValueError naming the argument).

        Called before any worker starts where the world size is known, and again by bind.
        """
        return None  # nothing depends on the world size unless a method says so

    @abstractmethod
    def bind(
        self, comm: Communicator, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> Runtime:
        """Make this worker's runtime state for ``model`` and ``optimizer``."""


class Runtime:
    """One worker's side of an algorithm: its hooks into the training step and its state."""

    #: True when every worker holds the same parameters after each step (synchronous
    #: gradient averaging), so evaluating any replica evaluates the average.
    replicas_identical: ClassVar[bool] = False

    def __init__(self, comm: Communicator, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.comm = comm
        self.model = model
        self.optimizer = optimizer
        # internal state
        self.step = 0  # optimizer steps taken
        self.total_steps: int | None = None  # set by a training loop that knows it
        # statistics
        self.synchronizations = 0  # exact averages of the whole world (collectives)

    def before_forward(self) -> None:
        """Called before each forward pass (and once when bound)."""

    def after_backward(self) -> None:
        """Called when gradients are ready, before the optimizer steps."""

    def after_step(self) -> None:
        """Called after the optimizer stepped."""

    def before_eval(self) -> None:
        """Called (on every worker) before the training loop evaluates."""

    def finish(self) -> None:
        """Called (on every worker) after the last step: settle what is in flight."""

    @torch.no_grad()
    def average_parameters(self) -> None:
        """Make every replica equal to the exact average of all (parameters and buffers).

        Used before evaluation and at the end of training. Collective: every worker calls it.
        """
        average_tensors(self.comm, model_tensors(self.model))
        self.synchronizations += 1

    def state_dict(self) -> dict[str, Any]:
        """This runtime's mutable state (never process groups or communicators)."""
        return {"step": self.step, "synchronizations": self.synchronizations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.synchronizations = int(state["synchronizations"])


class ExactAverages:
    """The exact averages of all that decentralized methods offer, from the options
    ``allreduce_every``, ``average_before_eval`` and ``average_at_end`` of ``self.config``
    (mixed into a :class:`Runtime`)."""

    def periodic_average(self) -> None:
        """The exact all-reduce average every ``allreduce_every`` steps."""
        every = self.config.allreduce_every
        if every and (self.step + 1) % every == 0:
            self.average_parameters()

    def before_eval(self) -> None:
        if self.config.average_before_eval:
            self.average_parameters()

    def finish(self) -> None:
        self.settle()
        if self.config.average_at_end:
            self.average_parameters()

    def settle(self) -> None:
        """Take in every message still in flight (nothing is lost at the end)."""


def model_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Parameters then floating-point buffers (BatchNorm statistics), in registration order."""
    tensors = [p.data for p in model.parameters()]
    tensors += [b for b in model.buffers() if torch.is_floating_point(b)]
    return tensors


@torch.no_grad()
def average_tensors(comm: Communicator, tensors: list[torch.Tensor]) -> None:
    """Replace each tensor by its exact mean over all workers, with one all-reduce per dtype."""
    apply_flat(tensors, lambda buffer: comm.all_reduce(buffer, op="mean"))
