"""The Communicator protocol that every algorithm speaks, and what its implementations share.

Two implementations exist: :class:`gossamer.comm.TorchCommunicator` (a c10d process group, one
process per worker) and the workers of :class:`gossamer.comm.SimWorld` (many workers in one
process, in virtual time). Algorithms are written only against :class:`Communicator`, so the
same code runs in both.

Accounting is part of the protocol: every byte an algorithm sends is counted per peer, and the
collectives are counted as the ring algorithm moves them (``2 (n - 1) / n`` of the tensor per
worker for an all-reduce), the same way in both communicators.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

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

    Fault injection (:mod:`gossamer.comm.faults`) uses two optional methods when a
    communicator has them: ``fail(kind, reason)`` (``"crash"`` or ``"hang"`` this worker the
    way this communicator's workers fail) and ``slow_down(factor)`` (a communicator with
    virtual time makes this worker's compute take longer).
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


@contextmanager
def counting_paused(comm: object) -> Iterator[None]:
    """A context in which ``comm`` (a communicator with a ``_counting`` flag: Torch, Sim,
    P2PGroup) counts none of the exchanges posted inside, its ``_uncounted`` (see
    :func:`gossamer.comm.p2p_group.uncounted`)."""
    saved, comm._counting = comm._counting, False  # type: ignore[attr-defined]
    try:
        yield
    finally:
        comm._counting = saved  # type: ignore[attr-defined]
