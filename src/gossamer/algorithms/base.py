"""What every algorithm is: a frozen configuration that binds to one worker's model and optimizer.

An :class:`Algorithm` is a keyword-only frozen dataclass, validated when it is built, that
holds hyperparameters only. :meth:`Algorithm.bind` makes the per-worker :class:`Runtime`, the
one object that holds all the mutable state (step counter, residuals, push-sum weights...)
and acts at explicit points of a training step:

1. ``before_forward`` — e.g. SGP's de-biasing of the parameters;
2. ``check_gradients`` and ``after_backward`` — gradient-level methods (AllReduce, DGC,
   GossipGraD); either may set ``skip_update`` for non-finite gradients
   (:mod:`gossamer.patterns.nonfinite`);
3. the wrapped ``torch.optim`` optimizer steps (algorithms never re-implement SGD or Adam),
   unless ``skip_update``;
4. ``after_step`` — parameter-level methods (SGP, D-PSGD, local SGD, WAGMA).

Runtimes talk to other workers only through a :class:`~gossamer.comm.Communicator`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from gossamer.checks import check_int
from gossamer.comm.base import Communicator
from gossamer.comm.buckets import apply_flat
from gossamer.patterns.nonfinite import (
    NonFiniteError,
    all_finite,
    check_policy,
    describe_nonfinite,
)


class Algorithm(ABC):
    """A distributed training method's configuration (subclasses are frozen dataclasses)."""

    #: The registry name, used by the command line and recipes.
    name: ClassVar[str]
    #: What the method needs beyond its defaults to learn the default task and the MNIST CNN
    #: within 2 points of AllReduce, where its defaults do not ("" when they do): shown by
    #: `gossamer algorithms`; `gossamer compare` leaves such methods out of its default set.
    needs: ClassVar[str] = ""
    #: Options renamed, old name -> new: the old name is read (with a note) for one release.
    renamed_options: ClassVar[Mapping[str, str]] = MappingProxyType({})
    #: Whether the workers can go on without a failed one (``on_failure="continue"``): the
    #: method needs no step in which every worker takes part, and its runtime implements
    #: :meth:`Runtime.change_membership`.
    continues_after_failure: ClassVar[bool] = False
    #: Options it no longer has, name -> (the one value it could take, or
    #: :data:`gossamer.options.ANY_VALUE` where it had no effect; why): files written before
    #: still load (see :func:`gossamer.options.converted`).
    retired_options: ClassVar[Mapping[str, tuple[Any, str]]] = MappingProxyType({})

    @property
    def label(self) -> str:
        """What results, summaries and tables call this method: its registry name, or the
        preset's it was built as (``dgc`` for AllReduce with DGC's compressor)."""
        return self.name

    #: How a symmetric method's peers mirror one worker's messages in the one-worker
    #: simulation (:mod:`gossamer.comm.mirror`): ``"rotation"``, the peers a rotation of the
    #: ranks (a circulant graph, or one partner a call); ``"partners"``, the message received
    #: from a peer its copy of the one sent to it (groups whose members send to each other),
    #: which the simulation checks as it goes.
    mirror: ClassVar[str] = "rotation"
    #: Whether what the method sends depends only on how many elements of each dtype the
    #: model's parameters (and its floating-point buffers) have, not on how they split into
    #: tensors (its runtime moves flat copies of them): the timing-only predictor then
    #: simulates it on a model of one tensor of each (:func:`gossamer.plan.predict`).
    flat_parameters: ClassVar[bool] = False
    #: Whether a worker may wait, in a step, for what another sends only when it finishes
    #: training (:meth:`Runtime.finish`: on unlike workers, a WAGMA worker behind may wait for
    #: a model that a partner done with its steps never publishes, until the partner's pause
    #: tells it to go on without): a prediction that simulates every worker then finishes each
    #: after its measured steps, or some would wait for ever. False where nothing waits for a
    #: peer's end, which is then left out (it comes after every measured step).
    peers_wait_for_finish: ClassVar[bool] = True

    def symmetric(self) -> bool:
        """Whether, on a cluster of equal workers and links, every worker makes the same calls
        at the same virtual times, its peers mirroring it (the same collectives; messages
        whose pattern is a rotation of the ranks, or one partner a call, or partners that
        send to each other: :attr:`mirror`): the timing-only predictor then simulates one
        worker for all (:mod:`gossamer.comm.mirror`). False unless a method declares it;
        tests/test_mirror.py checks every declaration against the simulation of every
        worker."""
        return False

    def validate(self, world_size: int) -> None:
        """Check this configuration against a world size (ValueError naming the argument).

        Called before any worker starts where the world size is known, and again by bind.
        """
        return None  # nothing depends on the world size unless a method says so

    def resolve(self, world_size: int) -> Algorithm:
        """This configuration for ``world_size`` workers, validated once, with what depends on
        the world size built once (a gossip method's topology): bind the result on every
        worker instead of this object. ValueError naming the argument otherwise."""
        self.validate(world_size)
        return self

    def for_members(self, world_size: int) -> Algorithm:
        """This configuration as the members go on with after a membership change
        (``on_failure="continue"``), resolved for their number: by default the same settings,
        which must suit ``world_size`` (ValueError naming the argument otherwise). A method
        whose settings are tied to the number of workers (WAGMA's groups) adapts them here,
        alike on every member."""
        return self.resolve(world_size)

    def sharding_refusal(self) -> str | None:
        """Why this configuration does not run on a model sharded with FSDP2 (see
        :mod:`gossamer.sharding`), or None where it does: on each rank's local shards, with
        the ranks that hold the same shard in the other replicas. :func:`gossamer.distribute`
        refuses a sharded model with this reason. A method runs there once it is proven to
        give what the unsharded run gives (``tests/test_sharding.py``); until then it says
        so."""
        return "not proven on local shards yet (tests/test_sharding.py does not run it)"

    def optimizer_refusal(self, optimizer: str, momentum: float) -> str | None:
        """Why this method cannot run with the command line's inner optimizer (``optimizer``:
        ``sgd``, ``adamw`` or ``muon``; ``momentum``: SGD's), or None where it can: the
        training configuration refuses the run before it starts (a method bound to a
        Python optimizer checks it at run time)."""
        return None

    def failure_refusal(self) -> str | None:
        """Why this configuration, of a method that goes on without a failed worker
        (:attr:`continues_after_failure`), does not (an option that forbids it, named), or
        None where it does: ``on_failure="continue"`` is refused with this reason."""
        return None

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
    #: True when the workers agree on non-finite gradients on a collective the step makes
    #: anyway (the all-reduce methods); under a GradScaler the others agree with a small
    #: all-reduce of their own (see gossamer.patterns.nonfinite).
    agrees_on_gradients: ClassVar[bool] = False
    #: The configuration this runtime was bound from (set by the method's runtime; None where
    #: a runtime does not keep it).
    config: Any = None

    def __init__(self, comm: Communicator, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.comm = comm
        self.model = model
        self.optimizer = optimizer
        # internal state
        self.step = 0  # optimizer steps taken
        # what the training loop tells the runtime through start() (distribute() calls it)
        self.total_steps: int | None = None  # the run's length, where the loop knows it
        #: ``training_inputs(k)``: k minibatches of this worker's training inputs, drawn apart
        #: from the batches training uses, where the loop has the data (``gossamer train``
        #: does); local SGD re-estimates BatchNorm statistics with them
        self.training_inputs: Callable[[int], Iterable[torch.Tensor]] | None = None
        # non-finite values (see gossamer.patterns.nonfinite)
        self.nonfinite = "raise"  # the policy, "raise" or "skip"
        self.skip_update = False  # this step: the wrapped optimizer must not step
        # this step under a GradScaler: whether it found the scaled gradients here non-finite
        # (an overflow, which every worker skips and none raises); None: no scaler
        self.overflow: bool | None = None
        self.named_parameters = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # statistics
        self.synchronizations = 0  # exact averages of the whole world (collectives)
        self.skipped_steps = 0  # updates skipped (or gradients dropped) for non-finite values

    def start(self, *, total_steps: int | None = None,
              training_inputs: Callable[[int], Iterable[torch.Tensor]] | None = None,
              nonfinite: str = "raise") -> None:
        """What the training loop tells the runtime before the first step: the number of
        steps (QSR's schedule and local SGD's last round need it), a source of training inputs
        (local SGD re-estimates BatchNorm statistics with them) and the non-finite policy.
        :func:`gossamer.distribute` calls it."""
        if total_steps is not None:
            check_int("total_steps", total_steps, 1)
        if training_inputs is not None and not callable(training_inputs):
            raise ValueError(f"training_inputs must be callable, got {training_inputs!r}")
        check_policy(nonfinite)
        self.total_steps = total_steps
        self.training_inputs = training_inputs
        self.nonfinite = nonfinite

    def check_gradients(self) -> None:
        """Called before ``after_backward``: under the ``"skip"`` policy, skip this worker's
        update if one of its gradients is non-finite (each worker for itself). Algorithms
        whose workers agree on it (AllReduce), or that check a flat copy anyway, override it.
        """
        self.skip_update = False
        if self.nonfinite == "skip":
            grads = [p.grad for _, p in self.named_parameters if p.grad is not None]
            self.skip_update = not all_finite(grads)

    def nonfinite_error(self, what: str, ranks: Sequence[int] = (),
                        found: str | None = None) -> NonFiniteError:
        """The error for non-finite values found on this worker (``what``: "gradient" or
        "parameters"; ``found``: where, if known already), or reported by ``ranks`` through
        an agreement."""
        step, rank = self.step + 1, self.comm.rank
        ranks = list(ranks) or [rank]
        named = [(n, p.grad if what == "gradient" else p.detach())
                 for n, p in self.named_parameters]
        if rank in ranks:
            found = found or describe_nonfinite(named, what) or f"the {what}"
            if what == "parameters":
                cause = describe_nonfinite([(n, p.grad) for n, p in self.named_parameters],
                                           "gradient")
                found += (f" (after the optimizer step on {cause})" if cause else
                          " although the gradients were finite (the optimizer diverged: "
                          "skipping cannot repair its state; lower the learning rate)")
            message = f"rank {rank}: non-finite values at step {step} in {found}"
            others = [r for r in ranks if r != rank]
            if others:
                message += f" ({_ranks(others)} had some too)"
        else:
            message = (f"rank {rank}: {_ranks(ranks)} had non-finite values at step {step} in "
                       f"the {what}")
        return NonFiniteError(f"{message}; nothing non-finite was sent. nonfinite='raise' "
                              "stops here ('skip' would skip such updates)",
                              rank=rank, step=step, ranks=ranks)

    def before_forward(self) -> None:
        """Called before each forward pass (and once when bound)."""

    def after_backward(self) -> None:
        """Called when gradients are ready, before the optimizer steps."""

    def use_scaler(self, scaled: bool) -> None:
        """Whether a GradScaler steps the optimizer (``distribute(..., scaler=)``): the
        gradients of backward are then scaled until the step unscales them."""

    def pause_gradient_sync(self, paused: bool) -> None:
        """Whether the backward passes from now on accumulate only (``no_sync``): a method
        that communicates during backward waits for the last micro-batch's (default: nothing
        to pause)."""

    def after_step(self) -> None:
        """Called after the optimizer stepped."""

    def before_eval(self) -> None:
        """Called (on every worker) before the training loop evaluates: what the method does
        to its training there (an exact average under ``average_before_eval``), counted as
        the method's traffic. Then :meth:`prepare_eval`."""

    def prepare_eval(self) -> None:
        """Called (on every worker) after :meth:`before_eval`: what only the evaluation needs
        and training never sees (local SGD's BatchNorm statistics re-estimated); the training
        loop counts its traffic as the evaluation's, not the method's."""

    def pause(self) -> None:
        """Bring this worker's exchanges to a halt before a collective that the training loop
        makes after the same step on every worker (an evaluation's, a checkpoint's, the look
        for restarted workers under ``on_failure="continue"``), where a worker that is rounds
        ahead or behind could otherwise wait for a partner inside that collective. The
        training loop calls it before each evaluation and checkpoint, counting its traffic as
        theirs. Collective where the method needs it (WAGMA); nothing for the others."""

    def settle(self) -> None:
        """Take in every message in flight, so that nothing is lost and step-indexed
        collectives may follow (an asynchronous method's rounds stop). Collective where the
        method needs it; idempotent. ``finish()`` calls it first."""

    def finish(self) -> None:
        """Called (on every worker) after the last step: settle what is in flight."""
        self.settle()

    @torch.no_grad()
    def average_parameters(self) -> None:
        """Make every replica equal to the exact average of all (parameters and buffers).

        Used before evaluation and at the end of training. Collective: every worker calls it.
        """
        average_tensors(self.comm, model_tensors(self.model))
        self.synchronizations += 1

    def change_membership(self, comm: Communicator, algorithm: Algorithm) -> None:
        """Go on over ``comm``, the communicator of the new members after a failure or a
        rejoin (``on_failure="continue"``), with ``algorithm.for_members(comm.world_size)``:
        rebuild what depends on the ranks and start from the members' exact average.
        Collective over ``comm``. A method that continues after a failure
        (:attr:`Algorithm.continues_after_failure`) implements it; the others cannot."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot change its membership: its method does not go on "
            "without a failed worker (on_failure='continue')")

    def rejoin(self, comm: Communicator, algorithm: Algorithm) -> None:
        """Go on over ``comm`` once restarted workers have joined the members
        (``on_failure="continue"``), with ``algorithm.for_members(comm.world_size)``.
        Collective over ``comm``: called on every worker, old and new.

        The workers hold one identical state already: the members averaged exactly
        (:meth:`average_parameters`) over the old communicator, then one of them gave its
        state to every worker. So only what depends on the ranks is rebuilt here; no
        synchronisation of its own is due. By default :meth:`change_membership` (which a
        method that goes on after a failure has), whose exact average of identical replicas
        leaves them identical to each other; it is not counted in ``synchronizations`` (the
        members' average was the rejoin's). A method whose membership change makes an update
        that is not an exact average (DiLoCo's outer step) overrides this to leave that
        update out."""
        synchronizations = self.synchronizations
        self.change_membership(comm, algorithm)
        self.synchronizations = synchronizations

    def state_dict(self) -> dict[str, Any]:
        """This runtime's mutable state (never process groups or communicators)."""
        return {"step": self.step, "synchronizations": self.synchronizations,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.synchronizations = int(state["synchronizations"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


@runtime_checkable
class RuntimeHolder(Protocol):
    """What holds a worker's runtime: the optimizer that :func:`gossamer.distribute` returns.
    The metrics take it (or a communicator, or a model) and read the runtime from it."""

    runtime: Runtime


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


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
