"""What Streaming DiLoCo's runtime keeps beyond the paper's schedule: its fragments, the
exchange in flight with the quantisation errors it feeds back (:class:`~gossamer.patterns.
scattered.MeanInFlight`), each fragment's last synchronisation, the exact final average that
leaves every replica the same, going on without a failed worker, and its checkpoints.
:class:`~gossamer.algorithms.streaming_diloco.StreamingDiLoCoRuntime` adds the schedule.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from gossamer.algorithms.base import average_tensors
from gossamer.algorithms.diloco import DiLoCoRuntime
from gossamer.algorithms.local_sgd import RoundsConfig, optimizer_state_tensors
from gossamer.comm.base import Communicator
from gossamer.comm.buckets import apply_flat
from gossamer.comm.state import broadcast_object
from gossamer.compress.lowbit import LowBit
from gossamer.patterns.fragments import split_fragments
from gossamer.patterns.nonfinite import all_finite
from gossamer.patterns.parts import part_of
from gossamer.patterns.scattered import Exchange, MeanInFlight


class FragmentsConfig(RoundsConfig, Protocol):
    """What :class:`FragmentRuntime` reads of its configuration (Streaming DiLoCo's), beyond
    what DiLoCo's runtime reads."""

    @property
    def fragments(self) -> int: ...
    @property
    def pattern(self) -> str: ...
    @property
    def precision(self) -> str: ...
    @property
    def warmup_steps(self) -> int: ...

__all__ = ["FragmentRuntime", "FragmentsConfig"]


class FragmentRuntime(DiLoCoRuntime):
    """DiLoCo's runtime over fragments of the model, each synchronised on its own: the
    fragments, the exchange in flight, the errors, and what every synchronisation shares."""

    def __init__(self, config: FragmentsConfig, comm: Communicator, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        super().__init__(config, comm, model, optimizer)  # type: ignore[arg-type]
        self.config: FragmentsConfig = config
        sizes = [p.numel() for p in self.trained]
        # cut by the whole tensors' sizes: every shard of a sharded model (each sees its part
        # of each tensor) cuts the model where the unsharded run does
        self.fragment_indices = split_fragments(
            self.names, [part_of(p).numel for p in self.trained], config.fragments,
            config.pattern)
        #: elements of each fragment: the largest is the peak of an exchange
        self.fragment_sizes = [sum(sizes[i] for i in f) for f in self.fragment_indices]
        #: the fragment's exchange in flight, and this worker's encoding errors
        self.means = MeanInFlight(LowBit(config.precision))
        # each fragment's last synchronisation: the steps done then, and whether each worker
        # kept a local share of it (mixing > 0), so that the replicas differ
        self.synced_after = [0] * config.fragments
        self.kept_local = [False] * config.fragments
        self.fragment_syncs = [0] * config.fragments  # statistics: outer steps per fragment

    def _compression(self) -> None:
        return None  # its pseudo-gradients travel in its precision (self.means)

    @property
    def in_flight(self) -> Exchange | None:
        """The fragment's exchange in flight, if any."""
        return self.means.in_flight

    @property
    def residuals(self) -> dict[Any, torch.Tensor]:
        """This worker's encoding errors, by (fragment, "sent" or "mean")."""
        return self.means.residuals

    def _outer_step(self, indices: Sequence[int], averaged: Sequence[torch.Tensor],
                    mixing: float) -> None:
        """The outer step of the parameters ``indices`` with their averaged pseudo-gradients,
        then each local value becomes ``mixing * local + (1 - mixing) * global``."""
        self.outer.step(indices, averaged)
        for i in indices:
            local, global_ = self.trained[i], self.outer.global_params[i]
            local.copy_(global_.detach().lerp(local, mixing))

    def _average_options(self, indices: Sequence[int]) -> None:
        """What the options average exactly at a synchronisation of the parameters
        ``indices``: every floating-point buffer (``average_buffers``) and the inner
        optimizer's state of those parameters (``average_optimizer_state``). Collective."""
        tensors = []
        if self.config.average_buffers:
            tensors += [b for b in self.model.buffers() if torch.is_floating_point(b)]
        if self.config.average_optimizer_state:
            tensors += optimizer_state_tensors(self.optimizer,
                                              [self.trained[i] for i in indices])
        if tensors:
            average_tensors(self.comm, tensors)

    def _synced(self, fragments: Iterable[int], done: int, kept_local: bool) -> None:
        for fragment in fragments:
            self.synced_after[fragment] = done
            self.kept_local[fragment] = kept_local

    def _replicas_equal(self) -> bool:
        """Not known from the last synchronisation: a fragment's leaves the others as they
        are (an evaluation's re-estimation averages the parameters first)."""
        return False

    @torch.no_grad()
    def average_parameters(self) -> None:
        """Every replica the same, as the fragments' schedule would have it: after the last
        step, and before restarted workers join. Collective.

        The exchange in flight is taken in first. Then each fragment with inner steps since
        its last synchronisation takes one outer step, exact (unquantised, mixing 0: every
        worker holds its global value), and a fragment synchronised since the last inner step
        takes none (an outer step on a pseudo-gradient of zero would still move it by the outer
        momentum); where each worker kept a local share of it (``mixing`` > 0), the replicas
        become their exact average. One all-reduce for both; nothing where nothing differs."""
        self.settle()
        done, fragments = self.step, range(self.config.fragments)
        due = [p for p in fragments if self.synced_after[p] < done]
        mixed = [p for p in fragments if p not in due and self.kept_local[p]]
        stepped = [i for p in due for i in self.fragment_indices[p]]
        merged = [i for p in mixed for i in self.fragment_indices[p]]
        if stepped or merged:
            self._exact(stepped, merged)
            self.synchronizations += 1
            self.last_averaged = self.step
        self._synced(due + mixed, done, kept_local=False)

    def _exact(self, stepped: Sequence[int], merged: Sequence[int]) -> None:
        """An outer step of the parameters ``stepped`` with their exact mean pseudo-gradient
        (mixing 0), the replicas of ``merged`` set to their exact mean, in one all-reduce;
        then what the options average for ``stepped``. Collective."""
        if not all_finite([self.trained[i] for i in [*stepped, *merged]]):
            raise self.nonfinite_error("parameters")
        deltas = self.outer.pseudo_gradients(stepped)
        apply_flat(deltas + [self.trained[i].data for i in merged],
                   lambda buffer: self.across.all_reduce(buffer, op="mean"))
        if deltas:
            self._outer_step(stepped, deltas, 0.0)
        self._average_options(stepped)

    @torch.no_grad()
    def change_membership(self, comm: Communicator, algorithm: Any) -> None:
        """Go on over the members of ``comm`` (``on_failure="continue"``; ``replica_size``
        must divide their number).

        1. The fragment's exchange in flight is dropped, never waited on: its messages
           travel over the old communicator, whose members are no longer those that must
           answer. Each member's quantisation errors of that fragment go back to what they
           were before the exchange (what it sent will never be applied), and the errors of
           the means each member kept for its chunk (chunks of the old ranks) are dropped;
           the errors of its own pseudo-gradients are kept, without the old size's padding.
        2. The groups are rebuilt for the new members, and the global parameters and the
           outer optimizer's state of the member of rank 0 are sent to every member (a
           failure in the middle of an exchange may have let some members take in a
           fragment's outer step that the others did not).
        3. An outer step of every fragment at once over the members, exact (unquantised,
           ``mixing`` 0): each fragment's pseudo-gradient since its last synchronisation
           reaches the global parameters as it would have at its own synchronisation, and
           every member continues from the same global parameters. During the warm-up
           (``warmup_steps``): a plain exact average.

        The fragments' schedule goes on from the step: a fragment whose exchange was dropped
        is not synchronised at its scheduled end (the outer step above took it in); the next
        starts at its usual step. The dead worker's share of the dropped exchange is lost.
        """
        self.means.drop()
        self.means.keep_own_errors(self.fragment_sizes)
        self._reconnect(comm, algorithm)
        self._share_outer(comm)
        if self.step < self.config.warmup_steps:
            if not all_finite(self.trained):
                raise self.nonfinite_error("parameters")
            self.outer.warm_up(self.across)
            self._average_options(range(len(self.trained)))
        else:
            self._exact(range(len(self.trained)), [])
        self._synced(range(self.config.fragments), self.step, kept_local=False)
        self.synchronizations += 1
        self.last_averaged = self.step - 1

    @torch.no_grad()
    def rejoin(self, comm: Communicator, algorithm: Any) -> None:
        """Go on over ``comm`` once restarted workers joined the members: as
        :meth:`change_membership` without its outer step and without sharing the outer state.

        Every worker holds one state already: the members took in the exchange in flight and
        made every replica the same (:meth:`settle`, :meth:`average_parameters`), then one of
        them gave its state to every worker. A second outer step, on a pseudo-gradient of
        zero, would still move the parameters by the outer momentum. So only what depends on
        the ranks is rebuilt: the groups, and each member's errors (those of its own
        pseudo-gradients kept, those of the means of old chunks dropped). A worker that
        rejoins received a member's state without its errors (:meth:`load_state_dict`): it
        starts with none."""
        self.means.drop()  # (none: the members settled before sharing their state)
        self.means.keep_own_errors(self.fragment_sizes)
        self._reconnect(comm, algorithm)
        self.last_averaged = self.step - 1

    def _share_outer(self, comm: Communicator) -> None:
        """The global parameters and the outer optimizer's state of the member of rank 0,
        on every member (a fragment never synchronised has no outer state yet).
        Collective."""
        state = broadcast_object(comm, 0, self.outer.state_dict() if comm.rank == 0 else None)
        if comm.rank != 0:
            self.outer.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        """Also the exchange in flight, if any: its fragment, the vector this worker sent and
        its errors of the fragment as they were before (see :meth:`load_state_dict`)."""
        return {**super().state_dict(), "fragment_syncs": list(self.fragment_syncs),
                "synced_after": list(self.synced_after), "kept_local": list(self.kept_local),
                **self.means.state_dict(),
                # whose errors these are: a worker's rank and the number of workers, and
                # the fragments they are of
                "residuals_of": [self.comm.rank, self.comm.world_size],
                "fragment_sizes": list(self.fragment_sizes)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Also each worker's quantisation errors and its exchange in flight, when the state
        is its own (saved at the same rank of as many workers, with the same fragments): a
        worker that rejoins receives a member's state, and starts with no errors of its own
        instead of that member's. An exchange in flight starts again at once, before the next
        step's compute, with the same payloads, uncounted (they were counted before the
        checkpoint): every worker must load its own state (a resumed run, collective), and
        the run goes on as the one that saved it."""
        super().load_state_dict(state)
        count = self.config.fragments
        self.fragment_syncs = [int(x) for x in state["fragment_syncs"]]
        # (a state of an earlier version: every fragment takes an outer step at the end)
        self.synced_after = [int(x) for x in state.get("synced_after", [-1] * count)]
        self.kept_local = [bool(x) for x in state.get("kept_local", [False] * count)]
        owner = state.get("residuals_of")
        own = (owner is None or [int(x) for x in owner] == [self.comm.rank,
                                                            self.comm.world_size]) \
            and [int(x) for x in state.get("fragment_sizes", [])] == self.fragment_sizes
        self.means.load_state_dict(state, self.across, own)
