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
:meth:`WAGMA.for_members` and :meth:`WAGMARuntime.change_membership`): the groups are rebuilt
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
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from gossamer.algorithms.base import Algorithm
from gossamer.algorithms.gossip import GossipAlgorithm, GossipRuntime
from gossamer.checks import check_int
from gossamer.comm.base import Communicator, Handle
from gossamer.options import option
from gossamer.topology import Topology

# message kinds (the second of the three int64 values after the parameters)
_DATA = 0  # a model published for a round
_HOLD = 1  # the sender pauses (evaluation, checkpoint, end): use these until it publishes
_CLOSE = 2  # the sender closes the channel (settle); the parameters are its current ones
# (neither is a model published for a round: they are kept apart from ``models``, so that a
# pause leaves the rounds after it as they would have been)
_TRAILER = 32  # bytes after the parameters: stamp, kind, acknowledgement, until (int64 each)
_INITIAL = 0  # the stamp of the initial parameters: round 0's model, equal on every worker


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

    group_size: int = option(4, "higher: groups average more workers, more bytes per round")
    tau: int = option(1, "higher: hides slower stragglers, staler contributions")
    allreduce_every: int = option(10, "lower: closer replicas, more global barriers")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("group_size", self.group_size, 1)
        check_int("tau", self.tau, 0)

    def topology_options(self) -> dict[str, object]:
        return {"group_size": self.group_size}

    def symmetric(self) -> bool:
        return False  # receives posted ahead of the sends, from partners that differ by round

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


class WAGMARuntime(GossipRuntime):
    """One worker of WAGMA: its round, the recent models published to it by each
    partner, and the receives and sends it has in flight."""

    def __init__(self, config: WAGMA, comm: Communicator, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        super().__init__(config, comm, model, optimizer)
        self.config: WAGMA = config
        #: every worker this one is grouped with in some round
        self.partners = self._partners()
        flat = self.flat.buffers[0]
        self._dtype, self._numel = flat.dtype, flat.numel()
        # the receive template on the model's device: a message lands there (a CPU template
        # put every received model of a GPU run, or of a timing-only one, in host memory)
        self._like = torch.empty(self._numel * flat.element_size() + _TRAILER,
                                 dtype=torch.uint8, device=flat.device)
        # internal state
        self.round = 0  # the next round this worker executes
        self._waited = False  # whether the last group average waited for a member
        self._paused_at: int | None = None  # the step after which this worker last paused
        initial = self.read_parameters()  # equal on every worker (distribute broadcasts)
        #: per partner, the models it published that may still be averaged: first round
        #: -> (last round it is the partner's model for, the model). A model is published
        #: for one round, or, when its owner skips rounds, for each round it skipped
        self.models: dict[int, dict[int, tuple[int, torch.Tensor]]] = {
            m: {_INITIAL: (_INITIAL, initial)} for m in self.partners}
        #: partners paused (see pause()): their round and current parameters
        self.held: dict[int, tuple[int, torch.Tensor]] = {}
        # receives posted for each open partner, oldest first: tau + 1 of them, so that a
        # worker busy computing can receive as many rounds as others may run ahead
        self.window = config.tau + 1
        self.posted: dict[int, deque[Handle]] = {}
        self.outbox: dict[int, deque[tuple[int, Handle]]] = {}  # sends kept, per partner
        self.sent: dict[int, int] = {}  # messages sent to each partner
        self.taken: dict[int, int] = {}  # messages taken from each partner
        self.acked: dict[int, int] = {}  # of ours, the most each partner said it has taken
        self.open = False  # whether receives are posted (settle() closes them)
        # statistics
        self.group_averages = 0  # rounds averaged in a group
        self.rounds_skipped = 0  # rounds this worker jumped over to catch up
        self.waits = 0  # times a member was more than tau rounds behind
        self.ages: Counter[int] = Counter()  # contribution age (rounds) -> count
        #: (step, round, "group" or "global", {member: stamp of the model averaged},
        #: {member: its age in rounds}) per round; kept only when recording (set
        #: ``events = []``)
        self.events: list[tuple[int, int, str, dict[int, int], dict[int, int]]] | None = None
        if self.asynchronous:
            self._post_receives()

    @property
    def asynchronous(self) -> bool:
        """Whether rounds may differ between workers (tau >= 1 and more than one worker)."""
        return self.config.tau > 0 and self.comm.world_size > 1

    # ---- the schedule
    def _partners(self) -> list[int]:
        """Every worker this one is grouped with in some round of the topology."""
        period = self.topology.period
        return sorted({j for p in range(period) for j in self._group_of(p)} - {self.comm.rank})

    def _group_of(self, round_: int) -> list[int]:
        rank = self.comm.rank
        return next(g for g in self.topology.groups(round_) if rank in g)

    def groups(self, round_: int) -> list[list[int]]:
        """Every group of ``round_`` (they partition the ranks)."""
        return self.topology.groups(round_)

    def is_global(self, round_: int) -> bool:
        """Whether ``round_`` is an exact average of all."""
        every = self.config.allreduce_every
        return bool(every) and (round_ + 1) % every == 0

    def _next_global(self) -> int:
        every = self.config.allreduce_every
        return self.round + (every - 1 - self.round % every)

    # ---- messages: the flat parameters, then three int64: the round stamp, the kind, and
    # how many messages the sender has taken from the receiver (an acknowledgement)
    def _post_receives(self) -> None:
        self.posted = {m: deque(self.comm.exchange({}, [m], recv_like=self._like)
                                for _ in range(self.window)) for m in self.partners}
        self.outbox = {m: deque() for m in self.partners}
        self.sent = dict.fromkeys(self.partners, 0)
        self.taken = dict.fromkeys(self.partners, 0)
        self.acked = dict.fromkeys(self.partners, 0)
        self.open = True

    def _take(self, peer: int) -> None:
        """Complete the oldest receive from ``peer`` and keep what it says."""
        message = self.posted[peer].popleft().wait()[peer]
        stamp, kind, acked, until = (int(v) for v in message[-_TRAILER:].view(torch.int64))
        x = message[:-_TRAILER].view(self._dtype).clone()
        self.taken[peer] += 1
        self.acked[peer] = max(self.acked[peer], acked)
        if kind == _CLOSE:  # the sender closes every receive posted for it
            for handle in self.posted.pop(peer):
                handle.wait()
        else:
            self.posted[peer].append(self.comm.exchange({}, [peer], recv_like=self._like))
        if kind == _HOLD:  # paused: these are its current parameters until it resumes
            self.held[peer] = (stamp, x)
        elif kind == _DATA:
            known = self.models[peer]
            if stamp not in known or until >= known[stamp][0]:  # not older than what we hold
                known[stamp] = (until, x)
        self._release(peer)

    def _newest(self, peer: int) -> tuple[int, torch.Tensor]:
        """The last round ``peer`` has published a model for, and that model."""
        stamp = max(self.models[peer])
        return self.models[peer][stamp]

    def _model_for(self, peer: int, q: int) -> tuple[int, int, torch.Tensor] | None:
        """``peer``'s model for round ``q``: its age in rounds (0: its model of that round),
        its stamp and the model; None while it has published nothing for round ``q`` or
        earlier. A model published for later rounds only is never used for ``q``: it
        already holds this worker's contribution to them."""
        known = self.models[peer]
        current = [stamp for stamp, (until, _) in known.items() if stamp <= q <= until]
        if current:
            stamp = max(current)
            return 0, stamp, known[stamp][1]
        older = [stamp for stamp, (until, _) in known.items() if until < q]
        if not older:
            return None
        stamp = max(older, key=lambda k: known[k][0])
        return q - known[stamp][0], stamp, known[stamp][1]

    def _forget(self) -> None:
        """Drop the models no later round can use: published for rounds before the oldest
        this worker may still average with (the newest of each partner is kept)."""
        oldest = self.round - self.config.tau
        for known in self.models.values():
            newest = max(known)
            for stamp in [k for k, (until, _) in known.items() if until < oldest and k != newest]:
                del known[stamp]

    def _release(self, peer: int) -> None:
        """Forget the sends to ``peer`` known to be complete. gloo reports a send complete
        only once waited for, and waiting for one the peer has no receive posted for could
        wait for ever; but the peer keeps ``window`` receives posted beyond the messages it
        has acknowledged, so those sends are matched and their wait returns."""
        box = self.outbox[peer]
        while box and (box[0][0] <= self.acked[peer] + self.window or box[0][1].ready()):
            box.popleft()[1].wait()

    def _drain(self) -> None:
        """Take every message that has arrived (never blocks)."""
        for peer in list(self.posted):
            while peer in self.posted and self.posted[peer][0].ready():
                self._take(peer)

    def _send(self, x: torch.Tensor, stamp: int, kind: int, peers: Iterable[int],
              until: int | None = None) -> None:
        payload = x.view(torch.uint8)
        until = stamp if until is None else until
        for m in sorted(set(peers) - {self.comm.rank}):
            trailer = torch.tensor([stamp, kind, self.taken[m], until]).view(torch.uint8)
            self.sent[m] += 1
            handle = self.comm.exchange({m: torch.cat([payload, trailer])}, [])
            self.outbox[m].append((self.sent[m], handle))
            self._release(m)

    def _publish(self, x: torch.Tensor, stamp: int, rounds: Iterable[int],
                 until: int | None = None) -> None:
        """Send ``x``, this worker's model for rounds ``stamp`` to ``until`` (default: for
        ``stamp`` only), to the other members of the groups of ``rounds``."""
        self._send(x, stamp, _DATA, {m for r in rounds for m in self._group_of(r)}, until)

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
        self._forget()

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
        newest = max((self._newest(m)[0] for m in self.partners if m not in self.held),
                     default=_INITIAL)
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
            found = self._model_for(m, q)
            if not _within(found, self.config.tau) and m not in self.held:
                self.waits += 1
                self._waited = True
                while not _within(found, self.config.tau) and m not in self.held:
                    self._take(m)
                    found = self._model_for(m, q)
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

    def _global_average(self, x: torch.Tensor, q: int, done: bool) -> tuple[torch.Tensor, bool]:
        """Round ``q``'s exact average of all; ``done`` says this worker is paused. Returns
        the average and whether every worker was paused: then no worker executes round
        ``q`` (the all-reduce was only the pause's agreement) and ``x`` comes back as it was,
        the round not taken."""
        if self.asynchronous:  # one more element: the fraction of paused workers
            buffer = torch.cat([x, x.new_tensor([1.0 if done else 0.0])])
            self.comm.all_reduce(buffer, op="mean")
            if bool(buffer[-1] == 1.0):
                return x, True
            x, all_done = buffer[:-1], False
            for m in self.partners:  # every partner now holds exactly x
                self.models[m] = {q: (q, x)}
        else:
            self.comm.all_reduce(x, op="mean")
            all_done = done
        self.synchronizations += 1
        self.round = q + 1
        return x, all_done

    # ---- pausing, settling, checkpoints
    @torch.no_grad()
    def pause(self) -> None:
        """Bring every worker to a halt before a collective indexed by steps (evaluation,
        checkpoint, end), which would otherwise interleave with the rounds of workers that
        are rounds behind or ahead. Collective: every worker calls it after the same step;
        a second call after the same step does nothing.

        The partners are told to use this worker's current parameters meanwhile (a hold
        message), so that nobody waits for a paused worker. With global rounds the paused
        workers agree in an all-reduce shaped as a global round's (a worker may be blocked
        in one, waiting for the others): while some worker is still in a global round, the
        paused ones take part in it with their current parameters and adopt its average
        (that round comes early for them); once all have paused, the last all-reduce is
        only the agreement and changes nothing. So a pause averages nothing unless a worker
        was in a global round. At the end every hold message has been taken and every
        worker resumes as an ordinary member, its round and the models it keeps as they were
        (but for a global round it joined).
        """
        if not self.open or self._paused_at == self.step:  # synchronous, settled, or paused
            return
        x = self.read_parameters()
        self._send(x, self.round, _HOLD, self.partners)
        if self.config.allreduce_every:
            joined, all_done = False, False
            while not all_done:
                y, all_done = self._global_average(x, self._next_global(), done=True)
                joined, x = joined or not all_done, y
            if joined:
                self.write_parameters(x)
        else:
            self.comm.barrier()
        for peer in self.partners:
            while peer not in self.held:  # everything it sent before pausing
                self._take(peer)
        self.held.clear()
        self._paused_at = self.step

    @torch.no_grad()
    def settle(self, restart: bool = False) -> None:
        """Pause, then take in every message in flight and close the channels. With
        ``restart`` the receives are posted again."""
        if not self.open:
            return
        self.pause()
        for _ in range(self.window):  # one for each receive posted
            self._send(self.read_parameters(), self.round, _CLOSE, self.partners)
        for peer in self.partners:
            while peer in self.posted:  # until its closing message
                self._take(peer)
        self.open = False
        for box in self.outbox.values():  # every partner took everything
            for _, handle in box:
                handle.wait()
        if restart:
            self._post_receives()

    def before_eval(self) -> None:
        self.pause()
        super().before_eval()

    # ---- a membership change (on_failure="continue")
    @torch.no_grad()
    def change_membership(self, comm: Communicator, algorithm: Algorithm) -> None:
        """Go on over ``comm`` with ``algorithm`` (``WAGMA.for_members``: the groups for the
        new number of members). Collective over ``comm``.

        1. What was in flight over the old communicator is dropped, never waited for: the
           receives posted there, the sends not known complete, the models partners
           published (their ranks were the old ones), the pauses. A failure may have come in
           the middle of a round: nothing of it is settled, since settling would wait for
           the dead worker; the dead worker's models, and those of live partners not taken
           yet, are lost (the exact average below makes up for them).
        2. The topology is rebuilt for the new ranks, and the members average exactly
           (parameters and floating-point buffers).
        3. The members agree on the round: the largest any of them reached (an all-gather
           of one integer), so that the group of each round and the exact average every
           ``allreduce_every`` rounds stay the same on every member, and no member's round
           goes back (a member behind skips to it, as it would to catch up).
        4. Each member knows every partner's model for that round: the average it holds
           itself. So the next round's group average needs no message (it gives the average
           back), and the rounds after it go on as usual; receives are posted anew over
           ``comm``.

        A worker that rejoins binds its runtime over ``comm`` itself, which posts its
        receives there: they are kept (nothing has been sent to it yet), not posted twice.
        Statistics (rounds, waits, ages) are kept."""
        assert isinstance(algorithm, WAGMA)
        rebound = comm is self.comm and self.open  # receives posted over comm already
        if not rebound:  # dropped: never waited for (the old communicator is dead)
            self.posted, self.outbox = {}, {}
            self.sent, self.taken, self.acked = {}, {}, {}
            self.open = False
        super().change_membership(comm, algorithm)  # topology, then the exact average
        self.config = algorithm
        device = self.flat.buffers[0].device
        rounds = comm.all_gather(torch.tensor([self.round], dtype=torch.int64, device=device))
        self.round = max(int(r.reshape(-1)[0]) for r in rounds)
        self.partners = self._partners()
        self.window = algorithm.tau + 1
        x = self.read_parameters()
        self.models = {m: {self.round: (self.round, x)} for m in self.partners}
        self.held.clear()
        self._waited = False
        self._paused_at = None
        if self.asynchronous and not rebound:
            self._post_receives()
        elif rebound and sorted(self.posted) != self.partners:
            raise ValueError(f"{algorithm.name}: the receives posted over the members' "
                             "communicator are for other partners than its groups give")

    def state_dict(self) -> dict[str, Any]:
        self.settle(restart=True)  # nothing in flight: the state is what this worker holds
        return {**super().state_dict(), "round": self.round,
                "models": {str(m): {str(k): v for k, v in known.items()}
                           for m, known in self.models.items()},
                "waited": self._waited,
                "group_averages": self.group_averages, "rounds_skipped": self.rounds_skipped,
                "waits": self.waits, "ages": dict(self.ages)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.round = int(state["round"])
        self.models = {int(m): {int(k): (int(until), x.to(self._dtype))
                                 for k, (until, x) in known.items()}
                       for m, known in state["models"].items()}
        # whether its last round waited decides whether its next may skip (a checkpoint
        # from before it was saved: False)
        self._waited = bool(state.get("waited", False))
        self._paused_at = None  # (rounds may have run since a pause at the loaded step)
        self.group_averages = int(state["group_averages"])
        self.rounds_skipped = int(state["rounds_skipped"])
        self.waits = int(state["waits"])
        self.ages = Counter({int(k): int(v) for k, v in state["ages"].items()})


def _within(found: tuple[int, int, torch.Tensor] | None, age: int) -> bool:
    """Whether a model was found for the round and is at most ``age`` rounds old."""
    return found is not None and found[0] <= age
