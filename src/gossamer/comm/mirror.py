"""One simulated worker that stands for all: the timing-only simulator of a symmetric method.

On a cluster of equal workers and equal links, a method such as AllReduce, local SGD, DiLoCo or
SGP on its exponential graph makes every worker do the same thing at the same virtual time:
the same collectives, and messages whose pattern is the same from every rank's point of view
(a rotation of the ranks, or one partner a call). Every worker's clock is then the same as
every other's, and simulating one of them gives the whole world's times. :class:`MirrorWorld`
runs the worker function of rank 0 alone, in :class:`~gossamer.comm.timing.SizeOnlyMode`, with
a :class:`MirrorComm` that completes each call as :class:`~gossamer.comm.SimWorld` would if the
other ranks made the same call at the same moment:

- a collective starts when this worker arrives (everyone arrives then) and lasts the
  alpha-beta time of :mod:`gossamer.comm.cost` over its members, as in the simulator; an
  all-gather returns this worker's tensor once per member (every member sent the same), as
  :class:`Copies`, which the methods that decompress every part (the all-gathering
  compressors, DeMo) work on once;
- a message received from peer ``q`` is the peer's copy of one this worker sent in the same
  call: the only one it sent, or, with several, the one to ``2 * rank - q`` (the peers are a
  rotation of the ranks, as on a circulant graph); it left at the same time and arrives when
  that one arrives. A receive posted in a call that sends nothing (an all-to-all that posts
  its receives first) is filled by the first later call that sends to ``2 * rank - q``.
- with ``mirror="partners"`` (WAGMA's groups, whose members send to each other) a message
  received from ``q`` is ``q``'s copy of the one this worker sends to ``q``, matched in order
  as SimWorld matches messages with receives (the ``k``-th from ``q`` fills the ``k``-th
  receive posted for ``q``). Each sender sends to its partners in its own order (rank order),
  so that the copy bound for one worker leaves earlier or later in its sender's queue than
  this worker's own message to that sender: its arrival is known only to lie between the
  first and the last arrival of the messages this worker sent since it last looked at a
  receive (a *burst*: a method mirrored by partners sends every message of a round before it
  looks at any it received). Every look at such a message (is it there yet, wait for it) must
  then come out the same anywhere in that span, for every worker: one that does not (a
  message there for some workers and not yet for others, a wait whose end differs) raises
  :class:`NotSymmetric`. So the workers keep in step, or the one-worker simulation says it
  cannot stand for them.

The cost of a prediction thus no longer grows with the number of workers, beyond what the
method's own code does per member (an all-gather's parts). The bytes are the mean over the
workers (:attr:`MirrorWorld.mean_bytes_sent`): a ring all-reduce's chunks differ by an element
between ranks, a broadcast's tree sends from some ranks only.

A call that does not fit (a receive waited for that nothing sent mirrors, several sends
none of which mirrors the peer, a membership change, a fault) raises :class:`NotSymmetric`:
the method is then not symmetric, and :func:`gossamer.plan.predict` simulates every worker.
Which methods are symmetric is declared (:meth:`gossamer.algorithms.Algorithm.symmetric`) and
tested: their predictions here equal the full timing-only simulator's at 16 workers
(tests/test_mirror.py).

Example::

    world = MirrorWorld(10_000, network=NetworkModel(bandwidth="10gbit"),
                        compute=ComputeModel(step_time=0.25))
    result = world.run(worker)        # rank 0's result; world.mean_bytes_sent: every rank's mean
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from gossamer.comm import cost
from gossamer.comm.base import (
    DEFAULT_TIMEOUT,
    CommTimeoutError,
    ReduceOp,
    check_exchange,
    check_rank,
    tensor_nbytes,
)
from gossamer.comm.network import ComputeModel, NetworkModel
from gossamer.comm.p2p_group import HEADER_BYTES
from gossamer.comm.sim import ExchangeWait, ReceiveSlot, SimComm, SimHandle, SimWorker, Wait

__all__ = ["Copies", "MirrorComm", "MirrorWorld", "NotSymmetric", "homogeneous"]


class Copies(list):
    """What an all-gather returns in a :class:`MirrorWorld`: one part per member, each a copy
    of this worker's (every member sent the same), all one tensor: read them, do not write
    them in place. A method that works on the parts one by one may work on :attr:`part` once
    instead and count it :attr:`times`: the same result for equal parts, and a prediction
    whose cost does not grow with the members."""

    def __init__(self, part: torch.Tensor, times: int) -> None:
        self.part = part.detach().clone()
        self.times = times
        super().__init__([self.part] * times)


class NotSymmetric(RuntimeError):
    """A call that one worker cannot stand for: the method is not symmetric."""


def homogeneous(world_size: int, network: NetworkModel, compute: ComputeModel) -> str:
    """Why the workers of this cluster are not interchangeable ("" when they are): every link
    and every worker's step must be alike for one worker to stand for all."""
    if compute.stragglers:
        return "stragglers"
    if compute.jitter:
        return "jitter"
    if compute.trace or compute.measured:
        return "a traced or measured compute model"
    if network.link_latency or network.link_bandwidth:
        return "per-link overrides"
    if network.node_size > 1 and network.node_size < world_size and (
            network.node_latency is not None or network.node_bandwidth is not None):
        return "nodes with their own links"
    return ""


#: how the peers' messages mirror this worker's (see the module docs)
MIRRORS = ("rotation", "partners")


class MirrorWorld:
    """Rank 0 of ``world_size`` workers, simulated alone for a symmetric method (see the
    module docs); timing-only. Takes SimWorld's arguments, on a homogeneous cluster
    (:func:`homogeneous`: ValueError otherwise), and ``mirror``: how a message received
    mirrors one sent, ``"rotation"`` (default) or ``"partners"`` (module docs)."""

    def __init__(self, world_size: int, *, network: NetworkModel | None = None,
                 compute: ComputeModel | None = None, seed: int = 0,
                 timeout: float = DEFAULT_TIMEOUT, mirror: str = "rotation") -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if mirror not in MIRRORS:
            raise ValueError(f"mirror must be one of {', '.join(MIRRORS)}, got {mirror!r}")
        self.mirror = mirror
        self.world_size = world_size
        self.network = network if network is not None else NetworkModel()
        self.compute = compute if compute is not None else ComputeModel()
        why = homogeneous(world_size, self.network, self.compute)
        if why:
            raise ValueError(f"MirrorWorld needs interchangeable workers; this cluster has {why}")
        self.seed = seed
        self.timeout = float(timeout)
        self.mean_bytes_sent = 0.0  # per worker, mean over the world's workers
        self.mean_messages_sent = 0.0

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(comm, *args, **kwargs)`` for rank 0, standing for every rank; its result."""
        from gossamer.comm.timing import SizeOnlyMode

        saved_rng, saved_grad = torch.get_rng_state(), torch.is_grad_enabled()
        self.groups: dict[Hashable, int] = {}
        self.member_index: dict[int, dict[int, int]] = {}
        self.everyone = tuple(range(self.world_size))
        self._durations: dict[Hashable, float] = {}
        self.shared: dict[str, Any] = {}
        self.burst: _Burst | None = None  # partners: the messages sent since the last look
        self.worker = SimWorker(0, self.seed)
        torch.default_generator.set_state(self.worker.torch_rng)  # as SimWorld's rank 0
        try:
            with SizeOnlyMode():
                return fn(MirrorComm(self, self.worker, self.everyone),
                          *args, **kwargs)
        finally:
            torch.set_rng_state(saved_rng)
            torch.set_grad_enabled(saved_grad)

    # -- what SimComm and SimHandle ask of their world: SimWorld's public methods -------------
    def collective_duration(self, key: Hashable, compute: Callable[[], float]) -> float:
        """A collective's virtual duration, ``compute()``, kept by ``key`` (as SimWorld's)."""
        duration = self._durations.get(key)
        if duration is None:
            duration = self._durations[key] = compute()
        return duration

    def wake(self, w: SimWorker, at: float, error: BaseException | None = None) -> None:
        """``w`` goes on at virtual time ``at`` (the time it waited counts as idle), to raise
        ``error`` (if any) at its next :meth:`yield_turn`."""
        w.idle_time += max(0.0, at - w.clock)
        w.clock = max(w.clock, at)
        w.wait = None
        w.wake_error = error

    def sync(self, w: SimWorker) -> None:
        """Nothing earlier can happen: every other worker is where this one is."""

    def yield_turn(self, w: SimWorker) -> None:
        """No other worker takes a turn; raises what :meth:`wake` left for ``w`` (a timeout)."""
        if w.wake_error is not None:
            error, w.wake_error = w.wake_error, None
            raise error

    def block(self, w: SimWorker, wait: Wait) -> NoReturn:
        """A receive that no message fills: the method is not symmetric."""
        raise NotSymmetric(f"{wait.op}: waits for a message that no call of this worker "
                           "mirrors")

    def wake_if_complete(self, w: SimWorker) -> None:
        """Wake ``w``, whose exchange has every message, when the last arrives (or at its
        deadline, with a timeout)."""
        wait = w.wait
        assert isinstance(wait, ExchangeWait) and wait.handle is not None
        deadline = wait.started + self.timeout
        completion = wait.handle.completion()
        if isinstance(wait.handle, _PartnerHandle):
            # every worker must go on at one time: its wait ends, or none waits at all
            if completion > max(w.clock, wait.handle.earliest()):
                raise NotSymmetric(f"{wait.op}: waits for a message from a partner that "
                                   "arrives at different times on different workers")
        if completion > deadline:
            self.wake(w, deadline, CommTimeoutError(
                f"{wait.op} on rank {w.rank} timed out after {self.timeout:g} s (virtual)",
                op=wait.op, peers=()))
        else:
            self.wake(w, completion)


class MirrorComm(SimComm):
    """Rank 0's communicator in a :class:`MirrorWorld` (over the world or a group of it)."""

    _world: MirrorWorld  # type: ignore[assignment]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: receives posted with nothing sent in their call, by source: see _fill_posted
        self._posted: list[tuple[int, ReceiveSlot]] = []
        #: partners: the receives posted and not filled yet, by source, oldest first; and the
        #: partners' copies of messages that no receive was posted for yet
        self._waiting: defaultdict[int, deque[_PartnerSlot]] = defaultdict(deque)
        self._arrived: defaultdict[int, deque[tuple[torch.Tensor, float, _Burst]]] = \
            defaultdict(deque)

    def _collective_done(self, key: Hashable, duration: Callable[[], float]) -> None:
        """This worker and every other member arrive now; the collective ends ``duration()``
        later (kept by ``key``), as SimWorld's does when its last member arrives."""
        world, w = self._world, self._worker
        end = max(w.clock, w.nic_free) + world.collective_duration((self._group, *key), duration)
        w.nic_free = end
        world.wake(w, end)

    def _mean(self, nbytes: float, messages: float) -> None:
        """Add one call's bytes and messages per worker, the mean over its members (every
        worker is in a group alike), to the world's."""
        self._world.mean_bytes_sent += nbytes
        self._world.mean_messages_sent += messages

    @property
    def mean_sent(self) -> tuple[float, float]:
        """Bytes and messages sent so far per worker, the mean over the world's workers (this
        worker's own counters are in :attr:`stats`)."""
        return self._world.mean_bytes_sent, self._world.mean_messages_sent

    # ---- collectives
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        self._start_all_reduce(tensor, op)
        n = self.world_size
        numel, esize = tensor.numel(), tensor.element_size()
        if n == 1:
            return tensor
        # every chunk leaves every rank twice but its own two: 2 (n - 1) / n of it on average
        self._mean(2 * numel * (n - 1) * esize / n, 2 * (n - 1))
        network, members = self._world.network, self._members
        self._collective_done(("all_reduce", numel, esize), lambda: cost.ring_all_reduce_time(
            n, numel, esize, network, members))
        # The values: every member holds the same; SimWorld's sum follows the values a program
        # wrote into a tensor (the control values of the timing-only mode), so here too
        if op == "sum":
            tensor.mul_(n)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        n = self.world_size
        if self._worker.parts:
            self._local_work()
        self._count("all_gather")
        if n == 1:
            return [tensor.detach().clone()]
        nbytes = tensor_nbytes(tensor)
        network, members = self._world.network, self._members

        def duration() -> float:
            total = cost.ring_all_gather_time([HEADER_BYTES] * n, network, members)
            if nbytes:
                total += cost.ring_all_gather_time([nbytes] * n, network, members)
            return total

        self._collective_done(("all_gather", nbytes), duration)
        self._all_gather_traffic([nbytes] * n)
        self._mean((n - 1) * nbytes, n - 1)
        # each member's part is this worker's (they sent the same); copies, as SimWorld's
        return Copies(tensor, n)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        n = self.world_size
        check_rank(src, n, "src")
        if self._worker.parts:
            self._local_work()
        self._count("broadcast")
        nbytes = tensor_nbytes(tensor)
        self._broadcast_traffic(src, nbytes)
        if n == 1:
            return tensor
        self._mean((n - 1) * nbytes / n, (n - 1) / n)  # n - 1 messages in the tree
        network, members = self._world.network, self._members
        self._collective_done(("broadcast", src, nbytes), lambda: cost.broadcast_time(
            n, src, nbytes, network, members))
        return tensor  # the source's values are this worker's

    def barrier(self) -> None:
        if self._worker.parts:
            self._local_work()
        self._count("barrier")
        self._barrier_traffic_counted()
        n = self.world_size
        if n == 1:
            return
        self._mean(0, cost.barrier_rounds(n))
        network, members = self._world.network, self._members
        self._collective_done(("barrier",), lambda: cost.barrier_time(n, network, members))

    # ---- point to point
    def exchange(self, sends: Mapping[int, torch.Tensor], recv_from: Sequence[int],
                 recv_like: torch.Tensor | None = None) -> SimHandle:
        like = check_exchange(self._rank, self.world_size, sends, recv_from, recv_like)
        if self._worker.parts:
            self._local_work()
        self._exchanges += 1
        name = f"exchange #{self._exchanges}"
        counted = self._counting
        if counted:
            self._count("exchange")
        if self._world.mirror == "partners":
            return self._exchange_partners(sends, recv_from, like, name, counted)
        w, network = self._worker, self._world.network
        sends_done = w.clock
        sent: dict[int, tuple[torch.Tensor, float]] = {}
        for peer, tensor in sends.items():
            nbytes = tensor_nbytes(tensor)
            dst = self._members[peer]
            start = max(w.clock, w.nic_free)
            w.nic_free = start + network.transfer_time(w.rank, dst, nbytes)
            sent[peer] = (tensor, w.nic_free + network.message_time(w.rank, dst, 0))
            sends_done = w.nic_free
            if counted:
                self._record(peer, nbytes, sent=True)
                self._mean(nbytes, 1)
        slots = []
        n, me = self.world_size, self._rank
        for src in recv_from:
            slot = ReceiveSlot(self._members[src])
            slots.append(slot)
            if not sent:  # posted first (an all-to-all): filled by the sends that follow
                self._posted.append((src, slot))
                continue
            if len(sent) == 1:  # the peer's copy of this worker's one message
                tensor, arrival = next(iter(sent.values()))
            elif (2 * me - src) % n in sent:  # a rotation: src sent to me as I sent to 2me-src
                tensor, arrival = sent[(2 * me - src) % n]
            else:
                raise NotSymmetric(
                    f"{name}: rank {me} receives from {src} but sent nothing that mirrors it")
            slot.tensor, slot.arrival = tensor.detach().clone(), arrival
        if sent and self._posted:
            self._fill_posted(sent)
        return SimHandle(self, slots, sends_done, like, name, counted)

    def _fill_posted(self, sent: Mapping[int, tuple[torch.Tensor, float]]) -> None:
        """Complete the receives posted before these sends whose message they mirror: the one
        from ``src`` is the peer's copy of what this worker sent to ``2 * rank - src`` (the
        others stay posted; one waited for unfilled raises :class:`NotSymmetric`)."""
        n, me = self.world_size, self._rank
        waiting = []
        for src, slot in self._posted:
            mirror = sent.get((2 * me - src) % n)
            if mirror is None:
                waiting.append((src, slot))
            else:
                slot.tensor, slot.arrival = mirror[0].detach().clone(), mirror[1]
        self._posted = waiting

    def _exchange_partners(self, sends: Mapping[int, torch.Tensor], recv_from: Sequence[int],
                           like: torch.Tensor | None, name: str, counted: bool) -> SimHandle:
        """:meth:`exchange` where partners mirror each other: each message this worker
        sends to ``q`` stands for ``q``'s to it, which fills the oldest receive posted for
        ``q`` (or waits for the next one posted), as SimWorld matches them; its arrival is
        the span of the burst it was sent in (module docs)."""
        w, world = self._worker, self._world
        network = world.network
        sends_done = w.clock
        if sends and world.burst is None:
            world.burst = _Burst()
        for peer, tensor in sends.items():
            nbytes = tensor_nbytes(tensor)
            dst = self._members[peer]
            start = max(w.clock, w.nic_free)
            w.nic_free = start + network.transfer_time(w.rank, dst, nbytes)
            arrival = w.nic_free + network.message_time(w.rank, dst, 0)
            sends_done = w.nic_free
            world.burst.add(start, arrival)
            if counted:
                self._record(peer, nbytes, sent=True)
                self._mean(nbytes, 1)
            message = (tensor.detach().clone(), arrival, world.burst)
            if self._waiting[peer]:
                self._waiting[peer].popleft().fill(*message)
            else:
                self._arrived[peer].append(message)
        slots = []
        for src in recv_from:
            slot = _PartnerSlot(self._members[src])
            slots.append(slot)
            if self._arrived[src]:
                slot.fill(*self._arrived[src].popleft())
            else:
                self._waiting[src].append(slot)
        return _PartnerHandle(self, slots, sends_done, like, name, counted)

    # ---- what one worker cannot stand for
    def regroup(self, rank: int, members: Sequence[int], name: str) -> NoReturn:
        raise NotSymmetric("a membership change")

    def peer_alive(self, rank: int) -> bool:
        return True

    def fail(self, kind: str, reason: str) -> NoReturn:
        raise NotSymmetric(f"an injected fault ({reason})")

    def sleep(self, seconds: float) -> None:
        w = self._worker
        w.idle_time += seconds
        w.clock += seconds


class _Burst:
    """The messages a worker sent since it last looked at a receive (partners): when they
    left its NIC and arrived, earliest and latest. A partner's copy bound for any worker
    left in the same burst of the partner's, in another place in its queue."""

    __slots__ = ("first", "last", "started")

    def __init__(self) -> None:
        self.first = float("inf")  # the earliest arrival
        self.last = -float("inf")  # the latest arrival
        self.started = -float("inf")  # when the last send started

    def add(self, start: float, arrival: float) -> None:
        self.first = min(self.first, arrival)
        self.last = max(self.last, arrival)
        self.started = max(self.started, start)


@dataclass
class _PartnerSlot(ReceiveSlot):
    """A receive filled by a partner's copy of a message this worker sent in ``burst``."""

    burst: _Burst | None = None

    def fill(self, tensor: torch.Tensor, arrival: float, burst: _Burst) -> None:
        self.tensor, self.arrival, self.burst = tensor, arrival, burst


class _PartnerHandle(SimHandle):
    """An exchange where partners mirror each other: what its receives say must be the same
    for every worker, wherever in its burst each partner's copy left (module docs)."""

    _slots: list[_PartnerSlot]

    def completion(self) -> float:
        """The latest time, over the workers, at which every send left and every receive
        arrived (a receive not filled: its burst's last arrival once it is)."""
        return max([self._sends_done] + [s.burst.last for s in self._slots
                                         if s.burst is not None])

    def earliest(self) -> float:
        """The earliest such time over the workers."""
        return max([self._sends_done] + [s.burst.first for s in self._slots
                                         if s.burst is not None])

    def ready(self) -> bool:
        if self._result is not None:
            return True
        w = self._view.sim_worker
        if not self._slots:  # sends only: this worker's own NIC, the same on every worker
            return self._sends_done <= w.clock
        self._view.sim_world.burst = None  # a look at the receives ends the burst
        if any(s.tensor is None for s in self._slots):
            # a message not sent yet: its copies are not sent yet on any worker either (every
            # message of a round leaves before a receive is looked at)
            return False
        if self.completion() <= w.clock and all(s.burst.started < w.clock
                                                for s in self._slots):
            return True  # there on every worker (sent before this time, arrived by it)
        if self.earliest() > w.clock:
            return False  # on none
        raise NotSymmetric(f"{self._name}: a message from a partner has arrived on some "
                           "workers and not on others when they look for it")

    def wait(self) -> dict[int, torch.Tensor]:
        if self._slots and self._result is None:
            self._view.sim_world.burst = None
        return super().wait()
