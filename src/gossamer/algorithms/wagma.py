"""WAGMA-SGD: wait-avoiding group model averaging with bounded staleness.

In round ``t`` every worker averages its model ``x_t`` inside a group of ``group_size`` workers
and then applies its own gradient, computed at ``x_t`` while the group average was under way:
``x_{t+1} = mean_{j in G_t} x_j - lr * g_i(x_t)`` (Algorithm 1 of the paper; its reference code
likewise averages the variables first and applies the gradients after). The groups change every
round (butterfly strides by default, so that information from every worker reaches every other
within log_g(n) rounds), and every ``allreduce_every`` rounds all workers average exactly (a
global barrier).

Wait-avoiding (``tau >= 1``): the group average is a collective no member waits for. A worker
publishes its model for round ``t`` to the members of round ``t``'s group as soon as it has it
(right after its previous optimizer step; it waits for these sends to leave, so on a real link
the transfer does not overlap the gradient's computation as in the paper), computes its
gradient, and then averages with the newest model each member has published: the members that
have arrived contribute their model of this round, so with equal speeds every member averages
the same models and adopts the same result, and the sum of the models moves by exactly the sum
of the updates. Only a member still computing an earlier round contributes an older model, never
older than ``tau`` rounds: a worker waits only for a member more than ``tau`` rounds behind. In
a round with a late member the members' results differ (the late member averages, later, with
its partners' newer models), which is the staleness the paper bounds (the paper by its global
synchronisation alone; ``tau``, the waiting it causes and the skip to the front below are
gossamer's, see docs/algorithms.md): the sum of the models is then not conserved (a member that
averages later mixes in models that already hold its own). With one late worker the replicas'
mean drifted by at most ``2 * (tau + 1) * lr * |update| * (g - 1) / (g * n)`` per round in every
configuration measured (n 4-16, g 2-4, tau 1-3, a 2x-4x straggler; tests/test_conservation.py
holds it to that envelope). A worker that finds, from the round numbers on the messages it
received, that others are more than ``tau`` rounds ahead (so that they would wait for it), skips
the rounds it missed and continues at the front (the others already averaged with its older
model for those rounds); before it averages it publishes its current model to the members of the
groups of the rounds it skipped, so nobody can wait for it forever. With ``tau = 0`` every group
exchanges the models of the same round: synchronous group averaging.

So a straggler that is k times slower than the rest is hidden when ``tau >= k - 1``: the fast
workers run up to ``tau`` rounds ahead of its last published model before they wait, and it
jumps forward by as much when it catches up. With smaller ``tau`` the fast workers wait part of
the time (the staleness bound is what makes them wait).

Each publication goes to the other ``group_size - 1`` members of one group: ``group_size - 1``
model copies per worker and round (a group all-reduce would send ``2 (g-1)/g``, but needs every
member at once). In the simulator the order of events follows virtual time; on gloo the same
code polls non-blocking receives, so a fast worker never waits for a slow one within the
staleness bound. A runtime whose ``events`` is set to a list records there, per round, the round
stamps of the models it averaged (for tests and the oracle in ``tests/oracles``).

Going on without a failed worker (``on_failure="continue"``, see
:meth:`WAGMA.for_members` and :meth:`WAGMAChannels.change_membership`): the groups are rebuilt
for the members, with the largest group size not above the configured one that divides their
number; what was in flight over the old communicator is dropped; the members agree on the
round (the largest any of them reached) and start from their exact average.

Reference: Li, Ben-Nun, Nadiradze, Di Girolamo, Dryden, Alistarh, Hoefler, "Breaking (Global)
Barriers in Parallel Stochastic Optimization with Wait-Avoiding Group Averaging" (IEEE TPDS
2021).

Example::

    optimizer = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    WAGMA(group_size=4, tau=1, allreduce_every=10), comm)
    # the loop is unchanged; optimizer.finish() after the last step settles and averages
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from gossamer.algorithms.base import Algorithm
from gossamer.algorithms.gossip import GossipAlgorithm
from gossamer.algorithms.wagma_channels import INITIAL, WAGMAChannels
from gossamer.checks import check_int
from gossamer.comm.base import Communicator
from gossamer.options import option
from gossamer.topology import Topology


@dataclass(frozen=True, kw_only=True)
class WAGMA(GossipAlgorithm):
    """Wait-avoiding group model averaging (WAGMA-SGD).

    Args:
        group_size: g, workers per group (default 4); must divide the number of workers.
            After a membership change the members go on with the largest divisor of their
            number not above g (see :meth:`for_members`).
        tau: the staleness bound in rounds (default 1): a member's contribution is at most
            this many rounds old. 0: synchronous group averaging (every member waits for the
            others' parameters of the same round).
        allreduce_every: K, an exact average of all every K rounds (default 10; 0: never).
        topology: the groups of each round, as the connected components of a topology
            (default ``"butterfly_groups"`` with ``group_size``).
        average_before_eval: exact average before each evaluation (default False).
        average_at_end: exact average after the last step (default True).
    """

    name: ClassVar[str] = "wagma"
    default_topology: ClassVar[str] = "butterfly_groups"
    continues_after_failure: ClassVar[bool] = True
    mirror: ClassVar[str] = "partners"  # a group's members send to each other
    flat_parameters: ClassVar[bool] = True  # models published and averaged as flat copies

    group_size: int = option(4, "the paper's group size: workers per averaging group; higher: "
                             "groups average more workers, more bytes per round")
    tau: int = option(1, "the staleness bound in rounds (gossamer's, see docs/algorithms.md); "
                      "higher: hides slower stragglers, staler contributions")
    allreduce_every: int = option(10, "lower: closer replicas, more global barriers")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("group_size", self.group_size, 1)
        check_int("tau", self.tau, 0)

    def topology_options(self) -> dict[str, object]:
        return {"group_size": self.group_size}

    def sharding_refusal(self) -> str | None:
        return ("it is asynchronous: each shard's ranks would decide alone which published "
                "models to average, so the shards of one replica could mix models of different "
                "ages; not proven on local shards yet")

    def symmetric(self) -> bool:
        # Asynchronous (tau >= 1) on groups of one size: each member sends its model to the
        # others of its group, and finds theirs there when it averages, so on alike workers
        # and links every worker keeps in step; the one-worker simulation checks that as it
        # goes (its "partners" mirror). A synchronous group average (tau = 0) waits for the
        # members' models, which each sends in rank order: the members' waits differ by
        # their places in the senders' queues.
        if not self.tau or not isinstance(self.topology, Topology):
            return False
        topology = self.topology
        return all(len({len(g) for g in topology.groups(p)}) == 1
                   for p in range(topology.period))

    def check_world_size(self, world_size: int) -> None:
        if isinstance(self.topology, str) and world_size % self.group_size:
            raise ValueError(f"group_size={self.group_size} does not divide the number of "
                             f"workers {world_size}")

    def for_members(self, world_size: int) -> WAGMA:
        """This configuration for ``world_size`` members after a membership change: the
        same settings with the group size :func:`member_group_size` gives (``group_size``
        itself where it divides ``world_size``; else the largest divisor of ``world_size``
        not above it, 2 at least, so that the bytes per round and the members waited for
        stay within what was configured; a prime number of members larger than
        ``group_size`` has no such divisor and forms one group of all). Depends on the
        configured options and ``world_size`` only, so every member gets the same; a later
        change starts again from the configured ``group_size`` (a worker that rejoins brings
        the groups back). A topology given as an object was built for one number of
        workers and cannot be adapted: a ValueError naming it unless it suits
        ``world_size``."""
        if isinstance(self.topology, Topology):
            if self.topology.world_size != world_size:
                raise ValueError(
                    f"topology: the Topology object {self.topology.name!r} was built for "
                    f"{self.topology.world_size} workers and cannot be adapted to the "
                    f"{world_size} members that go on (on_failure='continue'); give the "
                    "topology by name (e.g. 'butterfly_groups') so that its groups are "
                    "rebuilt for the members")
            return self.resolve(world_size)
        size = member_group_size(self.group_size, world_size)
        adapted = self if size == self.group_size else dataclasses.replace(self, group_size=size)
        return adapted.resolve(world_size)

    def bind(self, comm: Communicator, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> WAGMARuntime:
        self.validate(comm.world_size)
        return WAGMARuntime(self, comm, model, optimizer)


def member_group_size(group_size: int, world_size: int) -> int:
    """The group size ``world_size`` members go on with when ``group_size`` was configured:
    ``group_size`` where it divides ``world_size``; else the largest divisor of
    ``world_size`` from 2 to ``group_size``; else (no divisor that small: ``world_size`` is a
    prime above ``group_size``) its smallest divisor above ``group_size``, which for a prime
    is ``world_size`` itself: one group of all; 1 for a single worker. Group size 1 (no
    averaging between the exact ones) is never chosen for more than one worker: the groups
    of every round would then never connect the workers. Examples with ``group_size=4``:
    3 members -> 3, 6 -> 3, 7 -> 7, 15 -> 3."""
    if world_size % group_size == 0:
        return group_size
    below = [d for d in range(2, min(group_size, world_size) + 1) if world_size % d == 0]
    if below:
        return max(below)
    return min((d for d in range(group_size + 1, world_size + 1) if world_size % d == 0),
               default=1)


class WAGMARuntime(WAGMAChannels):
    """One worker of WAGMA: each round's group average with bounded staleness (its rounds,
    the models published to it and its channels are those of :class:`WAGMAChannels`)."""

    def __init__(self, config: WAGMA, comm: Communicator, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        super().__init__(config, comm, model, optimizer)
        self.config: WAGMA = config
        # statistics
        self.group_averages = 0  # rounds averaged in a group
        self.rounds_skipped = 0  # rounds this worker jumped over to catch up
        self.waits = 0  # times a member was more than tau rounds behind
        self.ages: Counter[int] = Counter()  # contribution age (rounds) -> count
        #: (step, round, "group" or "global", {member: stamp of the model averaged},
        #: {member: its age in rounds}) per round; kept only when recording (set
        #: ``events = []``)
        self.events: list[tuple[int, int, str, dict[int, int], dict[int, int]]] | None = None

    # ---- a step
    @torch.no_grad()
    def after_backward(self) -> None:
        x = self.read_parameters()  # x_t: published when the last step made it
        q = self.round
        if self.asynchronous:
            self._drain()
            q = self._target_round()
            if q > self.round:  # catch up; members of the skipped rounds may wait for us
                self.rounds_skipped += q - self.round
                # x, published for this worker's round, is its model for every round skipped
                last = q if self.is_global(q) else q + 1
                self._publish(x, self.round, range(self.round + 1, last), until=last - 1)
        if self.is_global(q):
            x = self._global_average(x, q, done=False)[0]
            self._record(q, "global", {})
        elif not self.asynchronous:
            x = self._synchronous_average(x, q)
            self._record(q, "group", {m: q for m in self._group_of(q) if m != self.comm.rank})
        else:
            x = self._average(x, q)
        self.write_parameters(x)  # the optimizer applies g(x_t) to the group's average
        self.round = q + 1
        self.published.forget(self.round - self.config.tau)  # what no later round can use

    @torch.no_grad()
    def after_step(self) -> None:
        x = self.checked_parameters()  # x_{t+1}, checked before it is sent
        if self.asynchronous and not self.is_global(self.round):
            self._publish(x, self.round, [self.round])

    def _record(self, q: int, kind: str, stamps: dict[int, int],
                ages: dict[int, int] | None = None) -> None:
        if self.events is not None:
            self.events.append((self.step, q, kind, stamps, ages or dict.fromkeys(stamps, 0)))

    def _target_round(self) -> int:
        """The round to execute: this worker's next one; or, when the newest round a partner
        has published a model for is more than tau rounds ahead of it (so that the partner
        waits for this worker) and this worker did not itself wait in its last round, that
        round: it skips to the front. A partner one round ahead is the normal case (it finished
        its step first), not a reason to skip. Never past a global round."""
        newest = max((self.published.newest(m)[0] for m in self.partners if m not in self.held),
                     default=INITIAL)
        if newest - self.round > self.config.tau and not self._waited:
            q = newest  # others wait for us: skip to the front
        else:
            q = self.round
        if self.config.allreduce_every:
            q = min(q, self._next_global())
        return q

    def _average(self, x: torch.Tensor, q: int) -> torch.Tensor:
        """x averaged with the models the other members of round ``q``'s group published for
        it, waiting for a member only while its newest is more than tau rounds old."""
        members = [m for m in self._group_of(q) if m != self.comm.rank]
        total = x.clone()
        self._waited = False
        stamps, ages = {}, {}
        for m in members:
            found = self.published.model_for(m, q)
            if not _within(found, self.config.tau) and m not in self.held:
                self.waits += 1
                self._waited = True
                while not _within(found, self.config.tau) and m not in self.held:
                    self._take(m)
                    found = self.published.model_for(m, q)
            if m in self.held and not _within(found, 0):
                # paused before round q: its current parameters
                age, (stamp, contribution) = 0, self.held[m]
            else:
                age, stamp, contribution = found
            stamps[m], ages[m] = stamp, age
            self.ages[age] += 1
            total += contribution
        self.group_averages += 1
        self._record(q, "group", stamps, ages)
        return total / (len(members) + 1)

    def _synchronous_average(self, x: torch.Tensor, q: int) -> torch.Tensor:
        members = [m for m in self._group_of(q) if m != self.comm.rank]
        if not members:
            return x
        received = self.comm.exchange({m: x for m in members}, members).wait()
        total = x.clone()
        for m in members:
            total += received[m]
        self.ages[0] += len(members)
        self.group_averages += 1
        return total / (len(members) + 1)

    @torch.no_grad()
    def change_membership(self, comm: Communicator, algorithm: Algorithm) -> None:
        assert isinstance(algorithm, WAGMA)
        super().change_membership(comm, algorithm)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),  # settled first: nothing in flight
                "group_averages": self.group_averages, "rounds_skipped": self.rounds_skipped,
                "waits": self.waits, "ages": dict(self.ages)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.group_averages = int(state["group_averages"])
        self.rounds_skipped = int(state["rounds_skipped"])
        self.waits = int(state["waits"])
        self.ages = Counter({int(k): int(v) for k, v in state["ages"].items()})


def _within(found: tuple[int, int, torch.Tensor] | None, age: int) -> bool:
    """Whether a model was found for the round and is at most ``age`` rounds old."""
    return found is not None and found[0] <= age
