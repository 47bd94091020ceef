"""The Communicator protocol that every algorithm speaks, and what its implementations share.

Two implementations exist: :class:`gossamer.comm.TorchCommunicator` (a c10d process group, one
process per worker) and the workers of :class:`gossamer.comm.SimWorld` (many workers in one
process, in virtual time). Algorithms are written only against :class:`Communicator`, so the
same code runs in both.

Accounting is part of the protocol: every byte an algorithm sends is counted per peer, and the
collectives are counted as the ring algorithm moves them (``2 (n - 1) / n`` of the tensor per
worker for an all-reduce), the same way in both communicators. :class:`CommunicatorBase` holds
what gossamer's communicators share: the rank, the world size and that accounting.

What only some communicators can do is a capability that a communicator declares by deriving
from it, and that a caller checks once with ``isinstance``: :class:`AsyncCollectives`,
:class:`IdleTime`, :class:`VirtualClock`, :class:`DeviceBound`, :class:`FaultInjection`,
:class:`MembershipChange`, :class:`SharedState` and :class:`ProcessGroupBacked`. They are
abstract base classes rather than structural protocols: a communicator says what it supports
(a method that raises, such as the mirrored simulator's ``regroup``, is still declared), and
the check neither evaluates a property nor costs more than a cached type test.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NoReturn, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    import torch.distributed as dist

    from gossamer.comm import cost

ReduceOp = Literal["sum", "mean"]

#: Seconds a blocking operation waits for a peer before it fails, unless configured otherwise.
DEFAULT_TIMEOUT = 300.0

#: The default timeout of each backend. gloo and the simulator (virtual seconds, so that a
#: simulated run fails when the real one would): 300 s, far above any step of a CPU job, short
#: enough that a dead peer is reported within minutes. NCCL: 600 s (torch's own NCCL default),
#: because NCCL builds its communicators during the first collective, which takes longer the
#: more nodes there are, and GPU jobs checkpoint larger models while the others wait.
DEFAULT_TIMEOUTS = {"sim": 300.0, "gloo": 300.0, "nccl": 600.0}


def default_timeout(backend: str) -> float:
    """Seconds a blocking operation of ``backend`` waits by default (:data:`DEFAULT_TIMEOUTS`;
    :data:`DEFAULT_TIMEOUT` for a backend not listed there)."""
    return DEFAULT_TIMEOUTS.get(str(backend).lower(), DEFAULT_TIMEOUT)


class CommError(RuntimeError):
    """A communication operation failed; the message names the operation and the peer(s)."""

    def __init__(self, message: str, *, op: str, peers: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.op = op
        self.peers = tuple(peers)


class CommTimeoutError(CommError):
    """A blocking operation waited longer than its timeout for the named peer(s)."""



def control_device(device: torch.device) -> torch.device:
    """Where a method keeps the small tensors of its protocol (stamps, counts) that travel
    with its payloads: the payloads' device (a collective takes one device only, on NCCL),
    but the CPU where the payloads are shapes only (the timing-only simulator's ``meta``
    tensors, whose values the protocol still needs)."""
    return torch.device("cpu") if device.type == "meta" else device


def without_grad(fn: Callable[..., object], *args: object) -> object:
    """``fn(*args)`` with autograd off (on this thread: the mode is per thread), then the
    mode as it was. What ``torch.no_grad()`` does, through torch's own switch: the context
    manager costs a few us a call, which a small model's step in the simulator notices."""
    enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        return fn(*args)
    finally:
        torch._C._set_grad_enabled(enabled)

@dataclass
class CommStats:
    """Bytes and messages sent and received by one worker, per peer (global ranks).

    Collectives are counted as the ring algorithm moves them; see :mod:`gossamer.comm.cost`.
    """

    bytes_sent: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    bytes_received: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    messages_sent: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    messages_received: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    operations: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def record_send(self, peer: int, nbytes: int, messages: int = 1) -> None:
        self.bytes_sent[peer] += int(nbytes)
        self.messages_sent[peer] += messages

    def record_receive(self, peer: int, nbytes: int, messages: int = 1) -> None:
        self.bytes_received[peer] += int(nbytes)
        self.messages_received[peer] += messages

    @property
    def total_bytes_sent(self) -> int:
        return sum(self.bytes_sent.values())

    @property
    def total_bytes_received(self) -> int:
        return sum(self.bytes_received.values())

    @property
    def total_messages_sent(self) -> int:
        return sum(self.messages_sent.values())

    def reset(self) -> None:
        for counter in (self.bytes_sent, self.bytes_received, self.messages_sent,
                        self.messages_received, self.operations):
            counter.clear()

    def as_dict(self) -> dict[str, object]:
        """A JSON-friendly summary (peers as string keys)."""
        return {
            "bytes_sent": self.total_bytes_sent,
            "bytes_received": self.total_bytes_received,
            "messages_sent": self.total_messages_sent,
            "bytes_sent_per_peer": {str(k): v for k, v in sorted(self.bytes_sent.items())},
            "operations": dict(sorted(self.operations.items())),
        }


@runtime_checkable
class Handle(Protocol):
    """An operation in flight; ``wait()`` blocks (bounded by the communicator's timeout)."""

    def ready(self) -> bool:
        """Whether ``wait()`` would return at once; never blocks. In the simulator: whether
        everything has arrived by this worker's virtual time."""
        ...

    def wait(self) -> dict[int, torch.Tensor]:
        """Complete the operation and return what was received, keyed by the sender's rank."""
        ...


@runtime_checkable
class Communicator(Protocol):
    """What an algorithm may do with the other workers.

    Ranks are those of this communicator: ``0 .. world_size - 1`` (a subgroup renumbers its
    members in the order given to :meth:`group`). Tensors are reduced in place.

    What only some communicators can do (start a collective without blocking, crash on
    purpose, run in virtual time...) is not part of the protocol: a communicator declares it
    by deriving from the capability (:class:`AsyncCollectives`, :class:`FaultInjection`,
    :class:`VirtualClock` ...), and a caller checks it with ``isinstance``.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def stats(self) -> CommStats: ...

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over all workers, in place; returns it."""
        ...

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Gather every worker's 1-D or n-D tensor; sizes may differ per rank (same dtype)."""
        ...

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every worker with the one of rank ``src``; returns it."""
        ...

    def exchange(
        self,
        sends: Mapping[int, torch.Tensor],
        recv_from: Sequence[int],
        recv_like: torch.Tensor | None = None,
    ) -> Handle:
        """Send ``sends[peer]`` to each peer and receive one tensor from each of ``recv_from``.

        Returns at once; ``handle.wait()`` returns ``{peer: tensor}``. Received tensors have
        the shape and dtype of ``recv_like`` (default: the first tensor sent). Sent tensors
        must not be modified before ``wait()``. Messages between a pair are received in the
        order they were sent.
        """
        ...

    def group(self, ranks: Sequence[int]) -> Communicator:
        """A communicator over a subset of this one's ranks (called by the members only)."""
        ...

    def barrier(self) -> None: ...

    def clock(self) -> float:
        """Seconds since this communicator started: virtual in the simulator, real otherwise."""
        ...

    def compute_step(self) -> None:
        """Mark that one training step's computation happened on this worker.

        The simulator advances the worker's virtual clock by its compute model; real
        communicators do nothing, since real time passed.
        """
        ...


def check_rank(value: int, world_size: int, name: str) -> int:
    """Validate a rank argument, raising a ValueError that names it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int rank, got {value!r}")
    if not 0 <= value < world_size:
        raise ValueError(f"{name}={value} is not a rank of a world of size {world_size}")
    return value


def check_group_ranks(ranks: Sequence[int], world_size: int) -> tuple[int, ...]:
    """Validate the ``ranks`` of a subgroup: distinct ranks of the parent, at least one."""
    ranks = tuple(ranks)
    if not ranks:
        raise ValueError("ranks must name at least one rank")
    for r in ranks:
        check_rank(r, world_size, "ranks")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks must be distinct, got {list(ranks)}")
    return ranks


def check_exchange(
    rank: int,
    world_size: int,
    sends: Mapping[int, torch.Tensor],
    recv_from: Sequence[int],
    recv_like: torch.Tensor | None,
) -> torch.Tensor | None:
    """Validate the arguments of :meth:`Communicator.exchange`; return the receive template."""
    for peer in sends:
        check_rank(peer, world_size, "sends")
        if peer == rank:
            raise ValueError(f"sends names this worker's own rank {rank}")
    for peer in recv_from:
        check_rank(peer, world_size, "recv_from")
        if peer == rank:
            raise ValueError(f"recv_from names this worker's own rank {rank}")
    if len(set(recv_from)) != len(recv_from):
        raise ValueError(f"recv_from must not repeat a peer, got {list(recv_from)}")
    if recv_like is None and sends:
        recv_like = next(iter(sends.values()))
    if recv_from and recv_like is None:
        raise ValueError("recv_like is needed to receive when nothing is sent")
    return recv_like


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# --------------------------------------------------------------------------------------------
# What gossamer's communicators share
# --------------------------------------------------------------------------------------------


class CommunicatorBase(ABC):
    """What every communicator of gossamer holds: its rank, its world size and its accounting.

    A subclass implements the operations of :class:`Communicator` and counts what they move
    in :attr:`stats`. Two things let a subgroup that is built on this communicator's
    point-to-point exchanges (:class:`~gossamer.comm.p2p_group.P2PGroup`) count its
    collectives as this communicator counts its own: :meth:`uncounted` (the exchanges that
    carry them are not counted) and :meth:`record_group_collective` (the collective is,
    under its name, with the traffic that :mod:`gossamer.comm.cost` gives).

    Args:
        rank: this worker's rank in the communicator.
        world_size: the number of workers of the communicator.
        stats: where the traffic is counted (default: counters of its own).
    """

    def __init__(self, rank: int, world_size: int, stats: CommStats | None = None) -> None:
        self._rank = rank
        self._world_size = world_size
        self._stats = stats if stats is not None else CommStats()
        self._counting = True  # whether exchanges count in the stats (see uncounted)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def stats(self) -> CommStats:
        return self._stats

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """A context in which the exchanges posted here are not counted in :attr:`stats`: the
        exchanges that carry a subgroup's collective, which :meth:`record_group_collective`
        counts instead, and its control messages (the shape headers of its all-gather), which
        a communicator's own all-gather does not count either (the stats count payloads, as
        :mod:`gossamer.comm.cost` does)."""
        saved, self._counting = self._counting, False
        try:
            yield
        finally:
            self._counting = saved

    def record_group_collective(self, op: str, sent: cost.Traffic,
                                received: cost.Traffic) -> None:
        """Count a collective ``op`` that a subgroup of this communicator ran, with the traffic
        :mod:`gossamer.comm.cost` gives (in this communicator's ranks; ``received`` names the
        senders), as this communicator counts its own: the same bytes, messages and operation
        name on every backend. Nothing is counted inside :meth:`uncounted`."""
        if self._counting:
            self._count_collective(op, sent, received)

    def _count_collective(self, op: str, sent: cost.Traffic, received: cost.Traffic) -> None:
        """Count a collective ``op`` in :attr:`stats`: ``sent`` names the destinations,
        ``received`` the senders."""
        for peer, nbytes, messages in sent:
            self._stats.record_send(peer, nbytes, messages)
        for peer, nbytes, messages in received:
            self._stats.record_receive(peer, nbytes, messages)
        self._stats.operations[op] += 1

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor: ...

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor: ...

    @abstractmethod
    def exchange(self, sends: Mapping[int, torch.Tensor], recv_from: Sequence[int],
                 recv_like: torch.Tensor | None = None) -> Handle: ...

    @abstractmethod
    def group(self, ranks: Sequence[int]) -> Communicator: ...

    @abstractmethod
    def barrier(self) -> None: ...

    @abstractmethod
    def clock(self) -> float: ...

    @abstractmethod
    def compute_step(self) -> None: ...


# --------------------------------------------------------------------------------------------
# Capabilities: what only some communicators can do, declared by deriving from it
# --------------------------------------------------------------------------------------------


class CollectiveHandle(Protocol):
    """A collective in flight (:meth:`AsyncCollectives.all_reduce_async`)."""

    def ready(self) -> bool:
        """Whether ``wait()`` would return at once; never blocks."""
        ...

    def wait(self) -> torch.Tensor:
        """Complete the collective (within the communicator's timeout); the tensor."""
        ...


class AsyncCollectives(ABC):
    """Collectives that start without blocking, between processes that run on while they
    travel (:class:`~gossamer.comm.TorchCommunicator`): communication can then overlap
    backward (:mod:`gossamer.patterns.overlap`). The simulator's workers take turns on one
    scheduler, where nothing may run on another thread: they do not declare it."""

    @abstractmethod
    def all_reduce_async(self, tensor: torch.Tensor, op: ReduceOp = "sum"
                         ) -> CollectiveHandle:
        """Start reducing the contiguous ``tensor`` over all workers, in place; the handle's
        ``wait()`` completes it. Collectives start in the same order on every worker."""


class IdleTime(ABC):
    """A communicator that measures how long its worker waited for communication."""

    @property
    @abstractmethod
    def idle_time(self) -> float:
        """Seconds spent blocked waiting for other workers or the network (virtual seconds in
        the simulator, real ones on processes)."""


class VirtualClock(ABC):
    """A communicator in virtual time, whose worker's compute is a model
    (:class:`~gossamer.comm.ComputeModel`): the simulator's workers."""

    @abstractmethod
    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of virtual time."""

    @abstractmethod
    def slow_down(self, factor: float) -> None:
        """From now on this worker's compute takes ``factor`` times as long."""

    @abstractmethod
    def simulation_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of this worker beyond the training's own state (the compute
        model's draws), so that a resumed run goes on as one never interrupted."""

    @abstractmethod
    def load_simulation_state(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`simulation_state`'s ``state``."""


class DeviceBound(ABC):
    """A communicator that carries tensors of one device only, where its own small tensors
    (flags, tokens, headers) must live too (CUDA under NCCL)."""

    @property
    @abstractmethod
    def device(self) -> torch.device: ...


class FaultInjection(ABC):
    """A communicator whose workers fail on purpose the way its workers fail for real
    (:mod:`gossamer.comm.faults`)."""

    @abstractmethod
    def fail(self, kind: str, reason: str) -> NoReturn:
        """``"crash"`` or ``"hang"`` this worker, with ``reason`` in what the others see."""


class MembershipChange(ABC):
    """A communicator whose workers can go on without a failed one, or with a restarted one,
    over a communicator of the new members (:mod:`gossamer.comm.membership`)."""

    @abstractmethod
    def peer_alive(self, rank: int) -> bool:
        """Whether ``rank`` may still answer (False once it is known to be dead or gone)."""

    @abstractmethod
    def regroup(self, rank: int, members: Sequence[int], name: str) -> Communicator:
        """A communicator over ``members`` (global ranks; this worker is the ``rank``-th),
        the epoch ``name``; this one is left behind."""


class SharedState(ABC):
    """Workers in one process that share a key-value store (the simulator's): the members of
    a membership agree through it, in virtual time."""

    @property
    @abstractmethod
    def shared(self) -> dict[str, Any]:
        """A dict every worker of the run sees."""


class ProcessGroupBacked(ABC):
    """A communicator over a torch.distributed process group."""

    @property
    @abstractmethod
    def process_group(self) -> dist.ProcessGroup:
        """The c10d process group (a ValueError once the communicator is closed)."""

    @property
    @abstractmethod
    def backend(self) -> str:
        """The group's backend, as torch names it (``"gloo"``, ``"nccl"``...)."""

    @property
    @abstractmethod
    def store(self) -> dist.Store | None:
        """The c10d store the group met through (None when not known)."""

    @property
    @abstractmethod
    def timeout(self) -> float:
        """Seconds a blocking operation waits for a peer before it fails."""
