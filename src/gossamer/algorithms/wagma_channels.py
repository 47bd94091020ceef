"""A WAGMA worker's rounds and channels (:mod:`gossamer.algorithms.wagma` is the method):
the groups of each round, the models its partners published to it, its channels to them (a
:class:`~gossamer.patterns.mailbox.StampedMailbox`), the exact average of all, and what keeps
them consistent around the method's rounds: pausing before an evaluation or a checkpoint,
settling (nothing in flight), a change of membership, and checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn

from gossamer.algorithms.base import Algorithm
from gossamer.algorithms.gossip import GossipAlgorithm, GossipRuntime
from gossamer.comm.base import Communicator
from gossamer.patterns.mailbox import Message, StampedMailbox
from gossamer.patterns.staleness import PublishedModels

# message kinds; each message carries two fields, the round stamp and the last round it is
# the sender's model for (see gossamer.patterns.mailbox for the rest of its trailer)
DATA = 0  # a model published for a round
HOLD = 1  # the sender pauses (evaluation, checkpoint, end): use these until it publishes
# (a hold, and a closing message, is not a model published for a round: they are kept apart
# from the published models, so that a pause leaves the rounds after it as they would have
# been)
INITIAL = 0  # the stamp of the initial parameters: round 0's model, equal on every worker


class WAGMAOptions(Protocol):
    """The options of WAGMA's configuration that its rounds and channels use."""

    name: str
    tau: int
    allreduce_every: int


class WAGMAChannels(GossipRuntime):
    """A WAGMA worker's round, the models published to it by each partner, the channels it
    has open to them, and pausing, settling, a membership change and checkpoints."""

    def __init__(self, config: GossipAlgorithm, comm: Communicator, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        super().__init__(config, comm, model, optimizer)
        self.config: WAGMAOptions = config  # type: ignore[assignment]
        #: every worker this one is grouped with in some round
        self.partners = self._partners()
        self._dtype = self.flat.buffers[0].dtype
        self.round = 0  # the next round this worker executes
        self._waited = False  # whether the last group average waited for a member
        self._paused_at: int | None = None  # the step after which this worker last paused
        initial = self.read_parameters()  # equal on every worker (distribute broadcasts)
        #: the models partners published that may still be averaged
        self.published = PublishedModels(self.partners, initial, INITIAL)
        #: partners paused (see pause()): their round and current parameters
        self.held: dict[int, tuple[int, torch.Tensor]] = {}
        # the channels to the partners, with tau + 1 receives posted for each, so that a
        # worker busy computing can receive as many rounds as others may run ahead
        self.window = config.tau + 1
        self.mailbox: StampedMailbox | None = None
        self.open = False  # whether the channels are open (settle() closes them)
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
        return self.topology.group_of(self.comm.rank, round_)

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

    # ---- messages: the flat parameters, a kind, the round stamp and the last round it is
    # the sender's model for, over channels kept open to the partners
    def _post_receives(self) -> None:
        self.mailbox = StampedMailbox(self.comm, self.partners, self.flat.buffers[0],
                                      fields=2, window=self.window)
        self.open = True

    @property
    def sent(self) -> dict[int, int]:
        """Messages sent to each partner over the current channels."""
        return self.mailbox.sent if self.mailbox is not None else {}

    @property
    def taken(self) -> dict[int, int]:
        """Messages taken from each partner over the current channels."""
        return self.mailbox.taken if self.mailbox is not None else {}

    def _take(self, peer: int) -> None:
        """Take the oldest message from ``peer`` and keep what it says."""
        assert self.mailbox is not None
        self._keep((peer, *self.mailbox.take(peer)))

    @property
    def models(self) -> dict[int, dict[int, tuple[int, torch.Tensor]]]:
        """Per partner, the models it published that may still be averaged: first round ->
        (last round it is the partner's model for, the model)."""
        return self.published.by_peer

    def _keep(self, message: Message) -> None:
        peer, kind, (stamp, until), x = message
        if kind == HOLD:  # paused: these are its current parameters until it resumes
            self.held[peer] = (stamp, x)
        elif kind == DATA:
            self.published.keep(peer, stamp, until, x)

    def _drain(self) -> None:
        """Take every message that has arrived (never blocks)."""
        assert self.mailbox is not None
        for message in self.mailbox.drain():
            self._keep(message)

    def _send(self, x: torch.Tensor, stamp: int, kind: int, peers: Iterable[int],
              until: int | None = None) -> None:
        assert self.mailbox is not None
        self.mailbox.send(x, kind, (stamp, stamp if until is None else until), peers)

    def _publish(self, x: torch.Tensor, stamp: int, rounds: Iterable[int],
                 until: int | None = None) -> None:
        """Send ``x``, this worker's model for rounds ``stamp`` to ``until`` (default: for
        ``stamp`` only), to the other members of the groups of ``rounds``."""
        self._send(x, stamp, DATA, {m for r in rounds for m in self._group_of(r)}, until)

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
            self.published.reset(self.partners, q, x)  # every partner now holds exactly x
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
        self._send(x, self.round, HOLD, self.partners)
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
        assert self.mailbox is not None
        for message in self.mailbox.close(self.read_parameters(), (self.round, self.round)):
            self._keep(message)
        self.open = False
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
        assert isinstance(algorithm, GossipAlgorithm)
        rebound = comm is self.comm and self.open  # receives posted over comm already
        if not rebound:  # dropped: never waited for (the old communicator is dead)
            if self.mailbox is not None:
                self.mailbox.drop()
            self.mailbox, self.open = None, False
        super().change_membership(comm, algorithm)  # topology, then the exact average
        self.config = algorithm
        device = self.flat.buffers[0].device
        rounds = comm.all_gather(torch.tensor([self.round], dtype=torch.int64, device=device))
        self.round = max(int(r.reshape(-1)[0]) for r in rounds)
        self.partners = self._partners()
        self.window = algorithm.tau + 1
        x = self.read_parameters()
        self.published.reset(self.partners, self.round, x)
        self.held.clear()
        self._waited = False
        self._paused_at = None
        if self.asynchronous and not rebound:
            self._post_receives()
        elif rebound and self.mailbox is not None and self.mailbox.partners != self.partners:
            raise ValueError(f"{algorithm.name}: the receives posted over the members' "
                             "communicator are for other partners than its groups give")

    def state_dict(self) -> dict[str, Any]:
        self.settle(restart=True)  # nothing in flight: the state is what this worker holds
        return {**super().state_dict(), "round": self.round,
                "models": self.published.state_dict(), "waited": self._waited}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.round = int(state["round"])
        self.published.load_state_dict(state["models"], self._dtype)
        # whether its last round waited decides whether its next may skip (a checkpoint
        # from before it was saved: False)
        self._waited = bool(state.get("waited", False))
        self._paused_at = None  # (rounds may have run since a pause at the loaded step)
