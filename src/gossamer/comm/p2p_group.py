"""A subgroup communicator built only on its parent's point-to-point ``exchange``.

Collectives over a subset of ranks need no new process group (creating one in c10d is itself a
collective over the whole world): :class:`P2PGroup` runs the ring, tree and dissemination
algorithms of :mod:`gossamer.comm.cost` as sequences of ``parent.exchange`` calls, so it works
over any :class:`~gossamer.comm.base.Communicator`, real or simulated, and moves exactly the
bytes that cost.py counts. A parent that keeps gossamer's accounting
(:class:`~gossamer.comm.base.CommunicatorBase`) counts a group's collective under its name,
with cost.py's bytes and messages, as the simulator counts a subgroup's, not the exchanges that
carry it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from gossamer.comm import cost
from gossamer.comm.base import (
    CommError,
    Communicator,
    CommunicatorBase,
    DeviceBound,
    Handle,
    ReduceOp,
    check_exchange,
    check_group_ranks,
    check_rank,
    tensor_nbytes,
)

__all__ = ["P2PGroup"]

# all_gather sends each rank's shape ahead of the payload in a fixed-size int64 header.
_MAX_DIMS = 16
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
)


class _GroupExchange:
    """The handle of :meth:`P2PGroup.exchange`: the parent's, with ranks translated back."""

    def __init__(self, group: P2PGroup, handle: Handle, label: str, counted: bool = True
                 ) -> None:
        self._group, self._handle, self._label = group, handle, label
        self._counted = counted
        self._result: dict[int, torch.Tensor] | None = None

    def ready(self) -> bool:
        return self._result is not None or self._handle.ready()

    def wait(self) -> dict[int, torch.Tensor]:
        if self._result is None:
            with self._group._errors(self._label):
                got = self._handle.wait()
            index = self._group._index
            self._result = {index[q]: t for q, t in got.items()}
            for peer, t in self._result.items() if self._counted else ():
                self._group.stats.record_receive(peer, tensor_nbytes(t))
        return self._result


class P2PGroup(CommunicatorBase, DeviceBound):
    """The members ``ranks`` of ``parent`` as a communicator of their own.

    Member ``ranks[i]`` of the parent is rank ``i`` here. Construct it on the members only
    (others get a ValueError), all with the same ``ranks``. Its ``stats`` count in group ranks,
    as cost.py counts the collectives; the parent's stats (and theirs up to the world's) also
    see the traffic, in their ranks: a collective under its name with cost.py's bytes and
    messages (barrier signals included, the all-gather's shape headers not), as the simulator
    counts a subgroup's (the parent's
    :meth:`~gossamer.comm.base.CommunicatorBase.record_group_collective`); an :meth:`exchange`
    as the parent's own. A parent without gossamer's accounting keeps what it counted of the
    exchanges that carried a collective. Each step of a collective is bounded by the parent's
    timeout, and a parent's CommError comes back naming the group operation.
    """

    def __init__(self, parent: Communicator, ranks: Sequence[int]) -> None:
        members = check_group_ranks(ranks, parent.world_size)
        if parent.rank not in members:
            raise ValueError(
                f"ranks={list(members)} does not contain this worker (rank {parent.rank} of "
                "the parent): a group is constructed on its members only"
            )
        self._parent = parent
        self._ranks = members
        self._index = {q: i for i, q in enumerate(members)}
        super().__init__(self._index[parent.rank], len(members))
        # what the parent declares, checked once: its accounting and its device
        self._accounting = parent if isinstance(parent, CommunicatorBase) else None
        self._bound = parent if isinstance(parent, DeviceBound) else None
        self._seq = 0

    @property
    def ranks(self) -> tuple[int, ...]:
        """The members, in the parent's ranks."""
        return self._ranks

    @property
    def parent(self) -> Communicator:
        return self._parent

    @property
    def device(self) -> torch.device:
        """Where the group's own small tensors (barrier tokens) live: the parent's device
        (the CPU where the parent is bound to none)."""
        return self._bound.device if self._bound is not None else torch.device("cpu")

    # -- collectives -------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Ring all-reduce in place: reduce-scatter, then all-gather, of ``n`` flat chunks.

        ``mean`` divides at the end (rounding down for integer tensors).
        """
        if op not in ("sum", "mean"):
            raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
        label = self._begin("all_reduce")
        n, r = self.world_size, self._rank
        if n > 1:
            copied = not tensor.is_contiguous()
            flat = tensor.contiguous().view(-1)  # a view of tensor unless it had to copy
            sizes = cost.chunk_sizes(flat.numel(), n)
            starts = [sum(sizes[:i]) for i in range(n)]

            def chunk(i: int) -> torch.Tensor:
                return flat[starts[i]: starts[i] + sizes[i]]

            nxt, prv = (r + 1) % n, (r - 1) % n
            with self._errors(label), self._parent_uncounted():  # counted below, by name
                # Reduce-scatter: after step s, chunk r - s - 1 holds s + 2 contributions.
                for s in range(n - 1):
                    send, recv = (r - s) % n, (r - s - 1) % n
                    got = self._exchange({nxt: chunk(send)}, [prv], chunk(recv))
                    chunk(recv).add_(got[prv])
                # All-gather: rank r starts with the fully reduced chunk r + 1.
                for s in range(n - 1):
                    send, recv = (r + 1 - s) % n, (r - s) % n
                    got = self._exchange({nxt: chunk(send)}, [prv], chunk(recv))
                    chunk(recv).copy_(got[prv])
            if copied:
                tensor.copy_(flat.view(tensor.shape))
        if op == "mean":
            divide_(tensor, n)
        numel, size = tensor.numel(), tensor.element_size()
        self._count_collective(
            "all_reduce",
            cost.ring_all_reduce_traffic(r, n, numel, size),
            [((r - 1) % n, b, m) for _, b, m in
             cost.ring_all_reduce_traffic((r - 1) % n, n, numel, size)],
        )
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every member's tensor in group-rank order, over a ring; sizes may differ per rank.

        The shapes go around the ring first (small int64 headers), then the payloads.
        """
        label = self._begin("all_gather")
        n, r = self.world_size, self._rank
        # Counted below: the payloads only, as TorchCommunicator.all_gather counts them.
        with self._errors(label), self._parent_uncounted():
            header = shape_header(tensor).to(tensor.device)
            headers = self._ring_gather(header, lambda i: header)
            shapes = check_headers(headers)
            numels = [numel_of(s) for s in shapes]
            mine = tensor.detach().reshape(-1).clone()
            blocks = self._ring_gather(
                mine,
                lambda i: torch.empty(numels[i], dtype=tensor.dtype, device=tensor.device),
            )
        out = [b.reshape(s) for b, s in zip(blocks, shapes, strict=True)]
        nbytes = [k * tensor.element_size() for k in numels]
        self._count_collective(
            "all_gather",
            cost.ring_all_gather_traffic(r, n, nbytes),
            [((r - 1) % n, b, m) for _, b, m in
             cost.ring_all_gather_traffic((r - 1) % n, n, nbytes)],
        )
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Binomial-tree broadcast from ``src`` (the edges of cost.py), in place."""
        n, r = self.world_size, self._rank
        check_rank(src, n, "src")
        label = self._begin("broadcast")
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        with self._errors(label), self._parent_uncounted():  # counted below, by name
            for edges in cost.broadcast_edges(n, src):
                sends = {dst: buf for s, dst in edges if s == r}
                recv_from = [s for s, dst in edges if dst == r]
                if sends or recv_from:
                    got = self._exchange(sends, recv_from, buf)
                    for s in recv_from:
                        buf.copy_(got[s])
        if buf is not tensor:
            tensor.copy_(buf)
        nbytes = tensor_nbytes(tensor)
        self._count_collective(
            "broadcast",
            cost.broadcast_traffic(r, n, src, nbytes),
            [(s, nbytes, 1) for s in cost.broadcast_sources(r, n, src)],
        )
        return tensor

    def barrier(self) -> None:
        """Dissemination barrier: in round k, signal rank + 2^k and wait for rank - 2^k."""
        label = self._begin("barrier")
        n, r = self.world_size, self._rank
        token = torch.zeros(1, dtype=torch.uint8, device=self.device)
        with self._errors(label), self._parent_uncounted():  # counted below: 0 bytes
            for k in range(cost.barrier_rounds(n)):
                self._exchange({(r + (1 << k)) % n: token}, [(r - (1 << k)) % n], token)
        self._count_collective(
            "barrier",
            cost.barrier_traffic(r, n),
            [((r - (1 << k)) % n, 0, 1) for k in range(cost.barrier_rounds(n))],
        )

    def exchange(
        self,
        sends: Mapping[int, torch.Tensor],
        recv_from: Sequence[int],
        recv_like: torch.Tensor | None = None,
    ) -> Handle:
        """The parent's exchange, in group ranks."""
        like = check_exchange(self._rank, self.world_size, sends, recv_from, recv_like)
        label = self._begin("exchange")
        with self._errors(label):
            handle = self._parent.exchange(
                {self._ranks[p]: t for p, t in sends.items()},
                [self._ranks[p] for p in recv_from],
                like,
            )
        if self._counting:
            for peer, t in sends.items():
                self._stats.record_send(peer, tensor_nbytes(t))
            self._stats.operations["exchange"] += 1
        return _GroupExchange(self, handle, label, counted=self._counting)

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Exchanges posted inside are counted neither here nor in the parent (see
        :meth:`~gossamer.comm.base.CommunicatorBase.uncounted`)."""
        with super().uncounted(), self._parent_uncounted():
            yield

    def group(self, ranks: Sequence[int]) -> Communicator:
        """A nested subgroup, ``ranks`` in this group's ranks."""
        return P2PGroup(self, ranks)

    def clock(self) -> float:
        return self._parent.clock()

    def compute_step(self) -> None:
        self._parent.compute_step()

    def __repr__(self) -> str:
        return f"P2PGroup(rank={self._rank}, ranks={list(self._ranks)})"

    # -- internals ---------------------------------------------------------------------------

    def _begin(self, op: str) -> str:
        self._seq += 1
        return f"{op} #{self._seq}"

    def _exchange(
        self, sends: Mapping[int, torch.Tensor], recv_from: Sequence[int], like: torch.Tensor
    ) -> dict[int, torch.Tensor]:
        """One step of a collective: exchange in group ranks and wait; not counted here."""
        handle = self._parent.exchange(
            {self._ranks[p]: t for p, t in sends.items()}, [self._ranks[p] for p in recv_from],
            like,
        )
        return {self._index[q]: t for q, t in handle.wait().items()}

    def _ring_gather(self, mine: torch.Tensor, like) -> list[torch.Tensor]:
        """Ring all-gather: at step s, forward block r - s and receive block r - s - 1."""
        n, r = self.world_size, self._rank
        blocks: list[torch.Tensor | None] = [None] * n
        blocks[r] = mine
        nxt, prv = (r + 1) % n, (r - 1) % n
        for s in range(n - 1):
            send, recv = (r - s) % n, (r - s - 1) % n
            block = blocks[send]
            assert block is not None  # received in the previous step
            blocks[recv] = self._exchange({nxt: block}, [prv], like(recv))[prv]
        return blocks  # type: ignore[return-value]

    @contextmanager
    def _errors(self, label: str) -> Iterator[None]:
        """Name the group operation in the parent's errors, and the suspects in group ranks."""
        try:
            yield
        except CommError as exc:
            peers = [self._index[p] for p in exc.peers if p in self._index]
            message = (f"{label} of group {list(self._ranks)} failed (the ranks below are the "
                       f"parent's): {exc}")
            raise type(exc)(message, op=label, peers=peers) from exc

    def _count_collective(self, op: str, sent: cost.Traffic, received: cost.Traffic) -> None:
        """Count a collective (``received`` naming the senders) here and, in its ranks, in
        the parent (a nested group's too: :meth:`record_group_collective`)."""
        super()._count_collective(op, sent, received)
        if self._accounting is not None:
            ranks = self._ranks
            self._accounting.record_group_collective(
                op, [(ranks[p], b, m) for p, b, m in sent],
                [(ranks[p], b, m) for p, b, m in received],
            )

    def _parent_uncounted(self) -> AbstractContextManager:
        """The parent's :meth:`uncounted` (nothing where it keeps no such accounting)."""
        return self._accounting.uncounted() if self._accounting is not None else nullcontext()


# Shared with TorchCommunicator.


def divide_(tensor: torch.Tensor, n: int) -> None:
    """Divide in place for a mean; integer tensors round down (they cannot hold fractions)."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.div_(n)
    else:
        tensor.floor_divide_(n)


def numel_of(shape: Sequence[int]) -> int:
    total = 1
    for d in shape:
        total *= d
    return total


#: bytes of :func:`shape_header`: what an all-gather sends before its payloads
HEADER_BYTES = (2 + _MAX_DIMS) * torch.int64.itemsize


def shape_header(tensor: torch.Tensor) -> torch.Tensor:
    """``[ndim, dtype code, *shape, 0...]`` as int64 on the CPU, the same length on every rank."""
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"all_gather supports at most {_MAX_DIMS} dims, got {tensor.dim()}")
    code = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else len(_DTYPES)
    header = torch.zeros(HEADER_BYTES // torch.int64.itemsize, dtype=torch.int64)
    header[0], header[1] = tensor.dim(), code
    header[2: 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header


def check_headers(headers: Sequence[torch.Tensor]) -> list[tuple[int, ...]]:
    """Every rank's shape; a ValueError, raised alike on every rank, if dtype or ndim differ."""
    rows = [h.cpu().tolist() for h in headers]
    ndims = [row[0] for row in rows]
    if len(set(ndims)) > 1:
        raise ValueError(f"all_gather needs the same number of dims on every rank, got {ndims}")
    if len({row[1] for row in rows}) > 1:
        raise ValueError("all_gather needs the same dtype on every rank")
    return [tuple(row[2: 2 + ndims[0]]) for row in rows]
