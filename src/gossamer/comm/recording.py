"""A record of what gossamer's communicators ask of ``torch.distributed``, to check NCCL's rules
on gloo.

NCCL requires every rank to issue the collectives of a communicator in the same order, two
threads issuing on one communicator at once can deadlock it, and its point-to-point sends and
receives must be matched, per pair and in order, by the peer (gloo forgives much of this). A
:class:`Recorder` logs, on one rank, every call that a
:class:`~gossamer.comm.torch_comm.TorchCommunicator` makes of ``torch.distributed`` (the
collectives, ``isend``/``irecv`` and ``batch_isend_irecv``) under its process group, and every
operation of a :class:`~gossamer.comm.p2p_group.P2PGroup` under that subgroup: the operation,
its sizes and dtype, the issuing thread, its order in the group and the thread's vector clock
(what the thread is known to have waited for). The checks (:func:`check_collectives`,
:func:`check_threads`, :func:`check_point_to_point`) take every rank's record.

Nothing is recorded, and nothing costs, unless a recorder is installed
(:meth:`Recorder.installed`): it swaps the ``torch.distributed`` module that
``gossamer.comm.torch_comm`` calls for a recording stand-in, and wraps ``P2PGroup``'s
operations, and puts both back when it leaves. Threads that hand work to each other tell the
recorder so with :meth:`Recorder.release` (before) and :meth:`Recorder.acquire` (after):
:func:`gossamer.testing.recording` does it for the communication thread of
:mod:`gossamer.patterns.overlap`.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gossamer.comm import p2p_group, torch_comm
from gossamer.comm.base import check_exchange

__all__ = ["Call", "Recorder", "check_collectives", "check_point_to_point", "check_threads"]

#: one point-to-point part of a call: ("send" or "recv", the peer's rank in the group, numel,
#: dtype)
Part = tuple[str, int, int, str]


@dataclass(frozen=True)
class Call:
    """One call on one rank.

    Attributes:
        group: the group's key, the same on every member (``pg:NAME`` for a process group,
            ``p2p:PARENT:RANKS`` for a P2PGroup).
        members: the members' ranks in the world.
        rank: this rank in the group.
        index: the call's place in this rank's sequence of the group.
        kind: ``"collective"``, ``"p2p"`` (a lone ``isend``/``irecv``) or ``"batch"`` (a
            ``batch_isend_irecv``, or a P2PGroup exchange: sends and receives posted together).
        op: the operation (``all_reduce``, ``isend``, ``batch_isend_irecv``...).
        sizes: what must agree between ranks (element counts; a broadcast's root).
        dtype: the tensors' dtype.
        parts: a point-to-point call's sends and receives (see :data:`Part`).
        thread: the issuing thread's name.
        thread_id: its identity in the vector clocks.
        clock: the issuing thread's vector clock at the call, ``{thread_id: count}``.
    """

    group: str
    members: tuple[int, ...]
    rank: int
    index: int
    kind: str
    op: str
    sizes: tuple[int, ...]
    dtype: str
    parts: tuple[Part, ...]
    thread: str
    thread_id: int
    clock: dict[int, int]

    def describe(self) -> str:
        what = self.op + (f"{list(self.sizes)} {self.dtype}" if self.kind == "collective"
                          else "")
        if self.parts:
            what += " " + ", ".join(f"{k} {'to' if k == 'send' else 'from'} {p} [{n}] {d}"
                                    for k, p, n, d in self.parts)
        return f"#{self.index} {what} on {self.thread}"


class Recorder:
    """The calls of one rank (``calls``, in the order they were issued)."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        self._clocks: dict[int, dict[int, int]] = {}  # thread id -> its vector clock
        self._counts: dict[str, int] = defaultdict(int)  # group -> calls so far

    # -- happens-before ----------------------------------------------------------------------

    def _tick(self) -> dict[int, int]:
        me = threading.get_ident()
        clock = self._clocks.setdefault(me, {})
        clock[me] = clock.get(me, 0) + 1
        return dict(clock)

    def release(self) -> dict[int, int]:
        """A token of everything this thread did so far, for :meth:`acquire` on another."""
        with self._lock:
            return self._tick()

    def acquire(self, token: dict[int, int]) -> None:
        """This thread has waited for what :meth:`release` gave ``token`` for."""
        with self._lock:
            clock = self._clocks.setdefault(threading.get_ident(), {})
            for thread, count in token.items():
                clock[thread] = max(clock.get(thread, 0), count)

    # -- recording ---------------------------------------------------------------------------

    def record(self, group: str, members: Sequence[int], rank: int, kind: str, op: str,
               sizes: Sequence[int], dtype: torch.dtype | str | None,
               parts: Sequence[Part] = ()) -> None:
        thread = threading.current_thread()
        with self._lock:
            index = self._counts[group]
            self._counts[group] += 1
            self.calls.append(Call(group, tuple(members), rank, index, kind, op,
                                   tuple(int(s) for s in sizes), _dtype(dtype), tuple(parts),
                                   thread.name, threading.get_ident(), self._tick()))

    @contextmanager
    def installed(self) -> Iterator[Recorder]:
        """Record while inside (one recorder at a time in a process)."""
        if isinstance(torch_comm.dist, _RecordingDist):
            raise RuntimeError("a recorder is installed already")
        saved = {name: p2p_group.P2PGroup.__dict__[name] for name in _GROUP_OPS}
        torch_comm.dist = _RecordingDist(self)  # type: ignore[assignment]
        for name in _GROUP_OPS:
            setattr(p2p_group.P2PGroup, name, _recorded_group_op(self, name, saved[name]))
        try:
            yield self
        finally:
            torch_comm.dist = dist
            for name, method in saved.items():
                setattr(p2p_group.P2PGroup, name, method)


def _dtype(dtype: torch.dtype | str | None) -> str:
    return "" if dtype is None else str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------- process groups


def _group_of(group: dist.ProcessGroup | None) -> tuple[str, tuple[int, ...], int]:
    group = group if group is not None else dist.group.WORLD
    members = tuple(dist.get_process_group_ranks(group))
    return f"pg:{group.group_name}", members, dist.get_rank(group)


class _RecordingDist:
    """``torch.distributed`` as ``gossamer.comm.torch_comm`` sees it while a recorder is
    installed: the communication calls are recorded, then made; everything else is the
    module's."""

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder
        self.isend = self._point_to_point("isend", dist.isend)
        self.irecv = self._point_to_point("irecv", dist.irecv)
        self._real_ops = {self.isend: dist.isend, self.irecv: dist.irecv}

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def _collective(self, op: str, group: dist.ProcessGroup | None, sizes: Sequence[int],
                    dtype: torch.dtype) -> None:
        key, members, rank = _group_of(group)
        self._recorder.record(key, members, rank, "collective", op, sizes, dtype)

    def all_reduce(self, tensor: torch.Tensor, *args: Any, group=None, **kwargs: Any) -> Any:
        self._collective("all_reduce", group, [tensor.numel()], tensor.dtype)
        return dist.all_reduce(tensor, *args, group=group, **kwargs)

    def all_gather(self, tensors: list[torch.Tensor], tensor: torch.Tensor, *args: Any,
                   group=None, **kwargs: Any) -> Any:
        self._collective("all_gather", group, [tensor.numel(), *(t.numel() for t in tensors)],
                         tensor.dtype)
        return dist.all_gather(tensors, tensor, *args, group=group, **kwargs)

    def broadcast(self, tensor: torch.Tensor, src: int, *args: Any, group=None,
                  **kwargs: Any) -> Any:
        self._collective("broadcast", group, [tensor.numel(), src], tensor.dtype)
        return dist.broadcast(tensor, src, *args, group=group, **kwargs)

    def _point_to_point(self, op: str, real: Callable[..., Any]) -> Callable[..., Any]:
        kind = "send" if op == "isend" else "recv"

        def call(tensor: torch.Tensor, peer: int | None = None, group=None,
                 **kwargs: Any) -> Any:
            key, members, rank = _group_of(group)
            part = (kind, members.index(peer), tensor.numel(), _dtype(tensor.dtype))
            self._recorder.record(key, members, rank, "p2p", op, [], tensor.dtype, [part])
            return real(tensor, peer, group=group, **kwargs)

        call.__name__ = op
        return call

    def P2POp(self, op: Callable[..., Any], tensor: torch.Tensor, peer: int | None = None,  # noqa: N802
              group=None, **kwargs: Any) -> dist.P2POp:
        """torch's P2POp of the real ``isend``/``irecv`` (it accepts no other)."""
        return dist.P2POp(self._real_ops.get(op, op), tensor, peer, group, **kwargs)

    def batch_isend_irecv(self, ops: list[dist.P2POp]) -> Any:
        if ops:
            key, members, rank = _group_of(ops[0].group)
            parts = [("send" if o.op is dist.isend else "recv", members.index(o.peer),
                      o.tensor.numel(), _dtype(o.tensor.dtype)) for o in ops]
            self._recorder.record(key, members, rank, "batch", "batch_isend_irecv", [], None,
                                  parts)
        return dist.batch_isend_irecv(ops)


# ---------------------------------------------------------------------------- P2PGroup

_GROUP_OPS = ("all_reduce", "all_gather", "broadcast", "barrier", "exchange")


def _group_key(group: Any) -> tuple[str, tuple[int, ...]]:
    """A P2PGroup's key and its members in the world, from its parents."""
    parent = group.parent
    if isinstance(parent, p2p_group.P2PGroup):
        key, world = _group_key(parent)
    elif isinstance(parent, torch_comm.TorchCommunicator):
        name, world, _ = _group_of(parent.process_group)
        key = name
    else:
        key, world = type(parent).__name__, tuple(range(parent.world_size))
    members = tuple(world[r] for r in group.ranks)
    return f"p2p:{key}:{list(members)}", members


def _recorded_group_op(recorder: Recorder, name: str, method: Callable[..., Any]
                       ) -> Callable[..., Any]:
    signature = inspect.signature(method)

    @functools.wraps(method)
    def call(group: Any, *args: Any, **kwargs: Any) -> Any:
        key, members = _group_key(group)
        given = signature.bind(group, *args, **kwargs).arguments
        if name == "exchange":
            sends, recv_from = given["sends"], given["recv_from"]
            like = check_exchange(group.rank, group.world_size, sends, recv_from,
                                  given.get("recv_like"))
            parts = [("recv", p, like.numel(), _dtype(like.dtype)) for p in recv_from
                     if like is not None]
            parts += [("send", p, t.numel(), _dtype(t.dtype)) for p, t in sends.items()]
            recorder.record(key, members, group.rank, "batch", name, [], None, parts)
        elif name == "barrier":
            recorder.record(key, members, group.rank, "collective", name, [], None)
        else:
            tensor = given["tensor"]
            # an all-gather's sizes may differ between ranks: its shapes travel first
            sizes = [] if name == "all_gather" else [tensor.numel()]
            if name == "broadcast":
                sizes.append(given.get("src", 0))
            recorder.record(key, members, group.rank, "collective", name, sizes,
                            tensor.dtype)
        return method(group, *args, **kwargs)

    return call


# ---------------------------------------------------------------------------- the checks


def _by_group(logs: Sequence[Sequence[Call]]) -> dict[str, dict[int, list[Call]]]:
    """``{group: {rank in the group: its calls}}``, every member present."""
    groups: dict[str, dict[int, list[Call]]] = {}
    for calls in logs:
        for call in calls:
            per_rank = groups.setdefault(call.group, {r: [] for r in range(len(call.members))})
            per_rank[call.rank].append(call)
    return groups


def check_collectives(logs: Sequence[Sequence[Call]]) -> list[str]:
    """NCCL's first rule: every member of a group issues the same collectives (operation,
    sizes, dtype) in the same order. ``logs``: every rank's calls. The problems (none: [])."""
    problems = []
    for group, per_rank in _by_group(logs).items():
        sequences = {r: [c for c in calls if c.kind == "collective"]
                     for r, calls in per_rank.items()}
        first = sequences[0]
        for r, seq in sequences.items():
            if r == 0:
                continue
            for i in range(max(len(first), len(seq))):
                a = first[i] if i < len(first) else None
                b = seq[i] if i < len(seq) else None
                if (a is None or b is None
                        or (a.op, a.sizes, a.dtype) != (b.op, b.sizes, b.dtype)):
                    problems.append(
                        f"{group}: collective {i} is {a.describe() if a else 'missing'} on rank "
                        f"0 but {b.describe() if b else 'missing'} on rank {r}")
                    break
    return problems


def _ordered(before: Call, after: Call) -> bool:
    """Whether ``before`` happened before ``after`` (its thread's clock says so)."""
    return before.clock[before.thread_id] <= after.clock.get(before.thread_id, 0)


def check_threads(logs: Sequence[Sequence[Call]]) -> list[str]:
    """NCCL's second rule: on each rank, the calls of a group are issued one after the other:
    two calls from different threads are ordered by a wait of one thread for the other (so
    that every rank issues them in the same order), never concurrent."""
    problems = []
    for group, per_rank in _by_group(logs).items():
        for r, calls in per_rank.items():
            for a, b in zip(calls, calls[1:], strict=False):
                if a.thread_id != b.thread_id and not _ordered(a, b):
                    problems.append(
                        f"{group}, rank {r}: {b.describe()} was issued while "
                        f"{a.describe()} may still be issuing (no wait orders the threads)")
                    break
    return problems


def check_point_to_point(logs: Sequence[Sequence[Call]]) -> list[str]:
    """NCCL's third rule: point-to-point sends and receives are posted in batches (a lone
    ``isend``/``irecv`` is a problem), and every send has its receive at the peer, per pair
    and in order, with the same size and dtype."""
    problems = []
    for group, per_rank in _by_group(logs).items():
        sends: dict[tuple[int, int], list[tuple[int, str]]] = defaultdict(list)
        recvs: dict[tuple[int, int], list[tuple[int, str]]] = defaultdict(list)
        for r, calls in per_rank.items():
            lone = [c for c in calls if c.kind == "p2p"]
            if lone:
                problems.append(f"{group}, rank {r}: {len(lone)} point-to-point calls outside "
                                f"a batch, the first {lone[0].describe()}")
            for call in calls:
                for kind, peer, numel, dtype in call.parts:
                    if kind == "send":
                        sends[(r, peer)].append((numel, dtype))
                    else:
                        recvs[(peer, r)].append((numel, dtype))
        for pair in sorted(set(sends) | set(recvs)):
            sent, received = sends.get(pair, []), recvs.get(pair, [])
            if sent != received:
                i = next((i for i, (a, b) in enumerate(zip(sent, received, strict=False))
                          if a != b), min(len(sent), len(received)))
                problems.append(
                    f"{group}: {pair[0]} -> {pair[1]}: {len(sent)} sends, {len(received)} "
                    f"receives, first differing at {i}: "
                    f"{sent[i] if i < len(sent) else 'no send'} sent, "
                    f"{received[i] if i < len(received) else 'no receive'} received")
    return problems
