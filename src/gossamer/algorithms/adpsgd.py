"""AD-PSGD: asynchronous decentralized parallel SGD with bilateral averaging.

Workers of even rank are active, of odd rank passive; every edge of the (bipartite) topology
joins an active and a passive worker, so two workers never wait for each other in a cycle.
After each local step an active worker with no request out sends its parameters to its next
passive neighbour (round robin) and goes on computing. A passive worker, after each of its own
steps, answers every request that has arrived: it averages its current parameters with the
requester's, ``x_p <- (x_p + x_a) / 2``, and replies with that average. When the reply arrives
at the active worker, at a later step, it takes the same average:
``x_a <- x_a + (reply - x_a_sent)``.

This is the atomic pairwise average of the paper (Algorithm 1: ``x_i, x_j <- (x_i + x_j) / 2``,
then the local model is updated with a gradient computed at stale parameters): the average is
taken at the moment the passive worker answers, on the parameters the active worker sent, and
the steps the active worker took meanwhile (gradients computed before the average) are applied
on top of it. The sum of the models is conserved at every exchange, so no worker's progress is
halved or lost. Nothing waits for a slow worker: a request to a busy passive worker is answered
when it gets to it, and meanwhile the active worker goes on with its own steps (it keeps one
request out at a time, as above: it asks its next neighbour once the reply is taken). There is
no global barrier, unless ``allreduce_every`` asks for one.

An exact average (every ``allreduce_every`` steps, before an evaluation with
``average_before_eval``, at the end) first settles the exchanges in flight
(:meth:`ADPSGDRuntime.settle`): every request sent is answered and its reply taken, so the
average is that of a consistent state (the sum of the models conserved) and no reply from
before it moves a replica after it. Then the exchanges start again.

In the simulator "has it arrived" is decided in virtual time, so the order of events is that of
a real network with the same speeds, and runs are deterministic; on gloo the same code polls
real non-blocking receives (a reply is awaited on a receive of its own, which gloo can report
complete without waiting; the request's send is known complete once the reply is there).
With ``record=True`` the runtime keeps the order of its exchanges in ``events`` (for tests and
the oracle in ``tests/oracles``).

Under ``on_failure="continue"`` the survivors of a failure (and the members at a rejoin) drop
the exchanges of the old communicator, pair again by their new ranks and start from their
exact average (:meth:`ADPSGDRuntime.change_membership`). Nothing in a step waits for the dead
worker: the survivors notice a failure at the latest at the training loop's next collective
(the look for restarted workers, every 10 steps), and go on from the largest step among them.

Reference: Lian, Zhang, Zhang, Liu, "Asynchronous Decentralized Parallel Stochastic Gradient
Descent" (ICML 2018), Algorithm 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from gossamer.algorithms.base import Algorithm
from gossamer.algorithms.gossip import GossipAlgorithm, GossipRuntime
from gossamer.comm.base import Communicator, Handle, control_device
from gossamer.patterns.mailbox import Inbox, Outbox
from gossamer.topology import Topology


@dataclass(frozen=True, kw_only=True)
class ADPSGD(GossipAlgorithm):
    """Asynchronous decentralized SGD: active (even) and passive (odd) workers average in pairs.

    Args:
        topology: bipartite between even and odd ranks, connected (default
            ``"bipartite_exponential"``).
        allreduce_every: an exact average every K steps (default 0: never). It is a global
            barrier: it makes the method synchronous at those steps, where every exchange in
            flight is completed first.
        average_before_eval: exact average before each evaluation, the exchanges in flight
            completed first (default False).
        average_at_end: exact average after the last step (default True).
    """

    name: ClassVar[str] = "adpsgd"
    default_topology: ClassVar[str] = "bipartite_exponential"
    continues_after_failure: ClassVar[bool] = True
    flat_parameters: ClassVar[bool] = True  # requests and replies carry flat copies
    # requests are answered as they come: nothing waits for a peer's end (whose settling
    # all-reduces a count per pair of workers, 800 MB at 10,000 workers)
    peers_wait_for_finish: ClassVar[bool] = False

    def check_topology(self, topology: Topology) -> None:
        topology.require_strongly_connected(arg="topology")
        for phase in range(topology.period):
            for i in range(topology.world_size):
                for j in topology.out_peers(i, phase):
                    if (i - j) % 2 == 0:
                        raise ValueError(
                            f"topology: AD-PSGD pairs active (even) with passive (odd) ranks, "
                            f"but {topology.name!r} joins ranks {i} and {j}"
                        )

    def sharding_refusal(self) -> str | None:
        return ("it is asynchronous: each shard's ranks would pick their partners alone, so the "
                "shards of one replica could average with different replicas; not proven on "
                "local shards yet")

    def symmetric(self) -> bool:
        return False  # random partners, receives posted ahead of the sends

    def bind(self, comm: Communicator, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> ADPSGDRuntime:
        return ADPSGDRuntime(self, comm, model, optimizer)


class ADPSGDRuntime(GossipRuntime):
    """One worker of AD-PSGD and the exchanges it has in flight."""

    def __init__(self, config: ADPSGD, comm: Communicator, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        super().__init__(config, comm, model, optimizer)
        # internal state
        self.neighbors: list[int] = []  # the ranks this worker ever pairs with
        self.active = True  # even rank: asks; odd rank: answers
        self.next_peer = 0  # active: round-robin position in neighbors
        self.requests: dict[int, int] = {}  # by peer: sent (active) / answered (passive)
        # active: the request out (at most one), by peer: the parameters it carried and the
        # reply's receive
        self.outstanding: dict[int, tuple[torch.Tensor, Handle]] = {}
        self.inbox: Inbox | None = None  # passive: a receive posted for each peer
        self.outbox = Outbox()  # sends not known to be complete yet
        self._pair()
        # statistics
        self.averagings = 0  # pairwise averages this worker took part in
        #: (step, kind, peer, request number) per exchange, kind "request", "answer" or
        #: "take"; kept only when recording (set ``events = []``)
        self.events: list[tuple[int, str, int, int]] | None = None
        self._post_receives()

    def _pair(self) -> None:
        """This worker's role and neighbours in ``self.topology``; no request counted yet."""
        topo, rank = self.topology, self.comm.rank
        self.neighbors = sorted({j for k in range(topo.period) for j in topo.out_peers(rank, k)})
        self.active = rank % 2 == 0
        self.next_peer = 0
        self.requests = {p: 0 for p in self.neighbors}

    def _like(self) -> torch.Tensor:
        return self.flat.buffers[0]

    def _record(self, kind: str, peer: int, number: int) -> None:
        if self.events is not None:
            self.events.append((self.step, kind, peer, number))

    def _post_receives(self) -> None:
        self.open = True  # requests may be in flight; settle() closes
        if not self.active:
            self.inbox = Inbox(self.comm, self.neighbors, self._like())

    @torch.no_grad()
    def after_step(self) -> None:
        x = self.checked_parameters()
        x = self._take_replies(x, block=False) if self.active else self._answer(x, block=False)
        if self.active:
            self._request(x)
        self.write_parameters(x)
        # all but the newest sends, one per neighbour, have their receives posted (a passive
        # worker keeps one posted per active neighbour; a reply's is posted with its request)
        self.outbox.keep_at_most(len(self.neighbors))
        self.periodic_average()

    def _take_replies(self, x: torch.Tensor, block: bool) -> torch.Tensor:
        """Active: apply every reply that has arrived (all of them with ``block``)."""
        for peer in sorted(self.outstanding):
            sent, reply = self.outstanding[peer]
            if block or reply.ready():
                del self.outstanding[peer]
                x += reply.wait()[peer] - sent  # the pair's average, plus our steps since
                self.averagings += 1
                self._record("take", peer, self.requests[peer])
        return x

    def _request(self, x: torch.Tensor) -> None:
        """Active: ask the next neighbour (round robin) to average, unless a request is still
        out. One at a time, as the paper's atomic averages are: a second request would carry
        parameters that lack the first average, and the two replies together would move this
        worker twice as far towards its neighbours as the averages allow (it oscillates)."""
        if self.outstanding or not self.neighbors:  # one out already, or alone
            return
        peer = self.neighbors[self.next_peer]
        self.next_peer = (self.next_peer + 1) % len(self.neighbors)
        sent = x.clone()  # the reply's receive first: the reply never waits for it
        self.outstanding[peer] = (sent, self.comm.exchange({}, [peer], recv_like=sent))
        self.outbox.add(self.comm.exchange({peer: sent}, []))
        self.requests[peer] += 1
        self._record("request", peer, self.requests[peer])

    def _answer(self, x: torch.Tensor, block: bool, until: dict[int, int] | None = None
                ) -> torch.Tensor:
        """Passive: answer the requests that have arrived (or, with ``block``, the first
        ``until[peer]`` requests of each peer): average, and reply with the average."""
        assert self.inbox is not None
        for peer in self.neighbors:
            while (self.requests[peer] < until[peer]) if block else self.inbox.ready(peer):
                x = (x + self.inbox.take(peer)) / 2  # the next receive posted
                self.outbox.add(self.comm.exchange({peer: x}, []))  # x is not modified
                self.averagings += 1
                self.requests[peer] += 1
                self._record("answer", peer, self.requests[peer])
        return x

    @torch.no_grad()
    def settle(self, restart: bool = False) -> None:
        """Collective: answer and take every request in flight, then close the channels.

        Every worker learns how many requests each active worker sent (one small all-reduce);
        passive workers answer exactly those, active workers take every reply, then each
        active worker sends one closing message that consumes the receive each passive
        neighbour has posted. With ``restart`` the passive workers post new receives.
        """
        n = self.comm.world_size
        if n == 1 or not self.open:  # alone, or settled for good already (every worker alike)
            return
        self.open = False
        # on the parameters' device: the communicator's collectives take no other (NCCL)
        counts = torch.zeros(n * n, dtype=torch.float64,
                             device=control_device(self.flat.buffers[0].device))
        if self.active:
            for peer, sent in self.requests.items():
                counts[self.comm.rank * n + peer] = sent
        self.comm.all_reduce(counts)
        x = self.read_parameters()
        if self.active:
            x = self._take_replies(x, block=True)
            closing = torch.zeros_like(x)
            for p in self.neighbors:
                self.outbox.add(self.comm.exchange({p: closing}, []))
        else:
            until = {a: int(counts[a * n + self.comm.rank]) for a in self.neighbors}
            x = self._answer(x, block=True, until=until)
            assert self.inbox is not None
            for peer in self.neighbors:
                self.inbox.close(peer)  # the closing message
        self.write_parameters(x)
        self.outbox.wait_all()
        self.requests = {p: 0 for p in self.neighbors}
        if restart:
            self._post_receives()

    @torch.no_grad()
    def average_parameters(self) -> None:
        """The exact average of a settled state: every request in flight answered and its
        reply taken first (collective), then the exchanges go on; after ``finish()`` (the
        channels closed) nothing is open to settle or restart. Without the settling, a reply
        taken after the average would pull the replicas apart again, and the average would
        miss the half of each pair's average not taken yet."""
        self.settle(restart=True)
        super().average_parameters()

    @torch.no_grad()
    def change_membership(self, comm: Communicator, algorithm: Algorithm) -> None:
        """Go on over ``comm``: the exchanges of the old communicator are dropped, the pairs
        are made again for the new ranks, and the members start from their exact average.

        Nothing of the old communicator is waited on or applied later: a request still out
        (its reply, if it comes, would answer parameters from before the failure), the
        receives a passive worker posted, the sends not known complete. A pair's average
        half done when the failure came (the passive worker averaged and replied, the active
        worker never took the reply; or a request the dead worker never answered) is not
        repaired: the exact average that follows (settling nothing) makes every member equal
        anyway, but what was in flight is lost: the dead worker's share, and, where two
        survivors were half-way through an exchange (the passive worker averaged and replied,
        the active worker never took the reply), the active worker's ``(x_p - s) / 2`` (the
        passive model before the answer, less the parameters sent), which the sum of the
        members does not get back. Then the roles and neighbours follow the new
        ranks (even: active, odd: passive; ``bipartite_exponential`` pairs them for any
        number of workers), every pair's request count starts at zero on both sides and the
        round robin at the first neighbour, and the passive workers post their receives over
        ``comm``: a request on the new communicator is always answered by a peer that counts
        it as the first one. At a rejoin the members settled over the old communicator
        before, and the rejoining worker's runtime was made over ``comm``: its receives,
        posted on ``comm`` and still empty, are kept (a second one per peer would swallow a
        request).
        """
        rebound = comm is self.comm and self.open  # a rejoining worker's receives, on comm
        if comm is not self.comm:  # the old communicator is dead: nothing on it is waited on
            self.outstanding.clear()
            if self.inbox is not None:
                self.inbox.drop()
            self.outbox.drop()
        # closed, so that the average below settles nothing: the old communicator is dead,
        # the members settled before a rejoin, and a rejoining worker has nothing in flight
        self.open = False
        super().change_membership(comm, algorithm)  # the topology for the new size; average
        self._pair()
        if rebound:
            self.open = True
        else:
            self._post_receives()

    def state_dict(self) -> dict[str, Any]:
        self.settle(restart=True)  # nothing in flight: the state is just these numbers
        return {**super().state_dict(), "next_peer": self.next_peer,
                "averagings": self.averagings}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.next_peer = int(state["next_peer"])
        self.averagings = int(state["averagings"])
