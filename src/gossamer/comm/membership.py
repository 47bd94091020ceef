"""Membership of a run that goes on when workers fail (``on_failure="continue"``).

When an operation fails (a :class:`~gossamer.comm.CommError`: a peer died, hung or stopped
answering), each survivor calls :meth:`Membership.regroup`. Over a key-value store that
outlives the workers (the launcher's TCPStore; a dict of the simulated world in SimWorld) the
survivors of epoch ``e`` agree on epoch ``e + 1``:

1. each writes ``{e+1}/join/{id}`` with the step it was in (``id``: its rank at the start of
   the run, which it keeps);
2. the first to join writes the epoch's opening time (first writer wins, ``compare_set``);
3. each waits until every member of epoch ``e`` has joined or is dead (its heartbeat
   stopped; in the simulator: it crashed, hung or finished), at most ``window`` seconds
   after the opening;
4. the first to get there writes the decision, ``STEP|ID,ID,...``: the ids that joined, and
   the largest step among them (first writer wins, so every member reads the same one);
5. each member makes a communicator over the new members, ranks renumbered in the order of
   their ids; a worker that joined too late to be in the decision leaves with a CommError.

The members then go on from the agreed step (see :func:`gossamer.train.loop.train_worker`):
the algorithm's runtime rebuilds and re-validates its topology for the new world size and the
members start from their exact average (:meth:`~gossamer.algorithms.Runtime.change_membership`).
:attr:`Membership.history` records each change as ``{"step": S, "members": [ids]}``; the same
fault injected in the simulator and on gloo gives the same history.

A worker restarted by ``gossamer launch --max-restarts N`` rejoins (:meth:`Membership.rejoin`):
it writes ``rejoin/{id}`` = ``waiting``; every :data:`REJOIN_EVERY` steps the members agree
with one small all-reduce on who waits (:meth:`Membership.waiting`; a worker the launcher has
announced as restarting is waited for there), and make the next epoch with them
(:meth:`Membership.admit`); the training loop then has a live member send its state
(:func:`gossamer.train.elastic.share_state`).

Every wait is bounded: the agreement and the wait for a restarting worker by ``window``
(virtual seconds in the simulator), a rejoining worker's wait by the caller's ``wait``.

Example::

    membership = Membership(comm, window=2 * comm.timeout + 10)
    try:
        optimizer.step()
    except CommError as error:
        step = membership.regroup(error, step)   # membership.comm: the new communicator
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch

from gossamer.comm.base import (
    DEFAULT_TIMEOUT,
    CommError,
    CommTimeoutError,
    Communicator,
    DeviceBound,
    MembershipChange,
    ProcessGroupBacked,
    SharedState,
)

__all__ = ["POLL", "REJOIN_EVERY", "REJOIN_VARIABLE", "STORE_VARIABLE", "Membership",
           "announce_restart", "last_members", "membership_window"]

POLL = 0.1  # seconds between two looks at who has joined (virtual in the simulator)
REJOIN_EVERY = 10  # steps between two looks for restarted workers waiting to rejoin
#: Set to "1" by ``gossamer launch`` in the environment of a worker it restarted: it rejoins.
REJOIN_VARIABLE = "GOSSAMER_REJOIN"
#: Set to "1" by ``gossamer launch --on-failure continue`` in every worker's environment: the
#: launcher hosts the store and lets the others go on when one fails.
STORE_VARIABLE = "GOSSAMER_LAUNCHER_STORE"
_PREFIX = "gossamer/membership"


def membership_window(timeout: float) -> float:
    """How long the survivors wait for each other at most: a survivor blocked in an operation
    with a peer that left notices within its timeout, then diagnoses for a few seconds."""
    return 2 * timeout + 10.0


class _TorchStore:
    """The membership keys in the launcher's TCPStore, in real time."""

    def __init__(self, store: Any) -> None:
        if store is None:
            raise ValueError("on_failure='continue' needs the communicator's TCPStore")
        self._store = store

    def get(self, key: str) -> str | None:
        key = f"{_PREFIX}/{key}"
        return self._store.get(key).decode() if self._store.check([key]) else None

    def set(self, key: str, value: str) -> None:
        self._store.set(f"{_PREFIX}/{key}", value)

    def first(self, key: str, value: str) -> str:
        """Write ``value`` unless the key is set; what it holds now (the first writer's)."""
        return self.first_replace(key, "", value)

    def first_replace(self, key: str, old: str, value: str) -> str:
        """Write ``value`` if the key holds ``old`` ("": is not set); what it holds now."""
        return self._store.compare_set(f"{_PREFIX}/{key}", old, value).decode()

    @staticmethod
    def now(comm: Any) -> float:
        return time.time()  # the same clock on every process of one host

    @staticmethod
    def pause(comm: Any, seconds: float) -> None:
        time.sleep(seconds)


class _SimStore:
    """The membership keys in a dict shared by the simulated workers, in virtual time."""

    def __init__(self, comm: Any) -> None:
        self._data: dict[str, str] = comm.shared.setdefault("membership", {})

    def get(self, key: str) -> str | None:
        return self._data.get(key)

    def set(self, key: str, value: str) -> None:
        self._data[key] = value

    def first(self, key: str, value: str) -> str:
        return self._data.setdefault(key, value)

    def first_replace(self, key: str, old: str, value: str) -> str:
        if self._data.get(key, "") == old:
            self._data[key] = value
        return self._data[key]

    @staticmethod
    def now(comm: Any) -> float:
        return comm.clock()

    @staticmethod
    def pause(comm: Any, seconds: float) -> None:
        comm.sleep(seconds)


class Membership:
    """Who trains, epoch by epoch; :meth:`regroup` after a failure (see the module).

    Args:
        comm: the communicator of the whole run at its start, one that declares
            :class:`~gossamer.comm.base.MembershipChange` (a TorchCommunicator over a store
            that outlives the workers, or a simulated worker's communicator).
        window: seconds the survivors wait for each other at most (default: from the
            communicator's timeout, :func:`membership_window`; the simulator's workers:
            from the default timeout, in virtual seconds).
    """

    def __init__(self, comm: Communicator, *, window: float | None = None) -> None:
        if not isinstance(comm, MembershipChange):
            raise ValueError(f"comm: a membership needs a communicator that can change its "
                             f"members (MembershipChange); {type(comm).__name__} cannot")
        self.comm = comm
        if isinstance(comm, ProcessGroupBacked):
            # the survivors go on: a wait behind a dead peer ends once its heartbeat stops
            comm.watch_peers = True  # type: ignore[attr-defined]
        self.members: tuple[int, ...] = tuple(range(comm.world_size))  # ids, in rank order
        self.me = comm.rank
        self.epoch = 0
        timeout = comm.timeout if isinstance(comm, ProcessGroupBacked) else DEFAULT_TIMEOUT
        self.window = float(window if window is not None else membership_window(timeout))
        self.history: list[dict[str, Any]] = []
        self.size = comm.world_size  # the ids are 0 .. size - 1
        self.joined_at: int | None = None  # a rejoined worker: the step it joined after
        self._kv = (_SimStore(comm) if isinstance(comm, SharedState) else
                    _TorchStore(comm.store if isinstance(comm, ProcessGroupBacked) else None))

    def regroup(self, error: CommError, step: int) -> int:
        """Agree with the survivors on the new members and the step to go on from; make
        :attr:`comm` a communicator over them. ``step``: the step this worker was in. Returns
        the agreed step (the largest any member was in). Raises a CommError if this worker
        joined after the others had agreed without it."""
        kv, comm, epoch = self._kv, self.comm, self.epoch + 1
        kv.set(f"{epoch}/join/{self.me}", str(step))
        deadline = float(kv.first(f"{epoch}/opened", repr(kv.now(comm)))) + self.window
        while True:
            joined = {m: int(v) for m in self.members
                      if (v := kv.get(f"{epoch}/join/{m}")) is not None}
            if all(m in joined or not self._alive(m) for m in self.members) or (
                    kv.now(comm) >= deadline):
                break
            kv.pause(comm, POLL)
        ids = ",".join(str(m) for m in sorted(joined))
        decided = kv.first(f"{epoch}/decided", f"{max(joined.values())}|{ids}")
        agreed, members = _decision(decided)
        names = ",".join(map(str, members))
        if self.me not in members:
            raise CommError(
                f"{error.op} failed and the survivors went on without this worker (rank "
                f"{self.me} at the start): it joined after they had agreed on ranks {names} "
                f"(on_failure='continue'). The failure: {error}", op=error.op,
                peers=error.peers) from error
        self._change(epoch, agreed, members)
        return agreed

    def _change(self, epoch: int, step: int, members: tuple[int, ...]) -> None:
        self.comm = self.comm.regroup(members.index(self.me), members, f"{_PREFIX}/{epoch}")
        self.members, self.epoch = members, epoch
        self.history.append({"step": step, "members": list(members)})

    # -- rejoining ---------------------------------------------------------------------------

    def waiting(self, step: int) -> list[int]:
        """Collective over :attr:`comm`, at ``step``: the ids of restarted workers waiting to
        rejoin, as any member saw them in the store, so that every member gets the same list.
        A worker the launcher restarted that has not asked yet is waited for, at most
        :attr:`window` seconds; one that does not come in time is let in at a later look."""
        kv, size = self._kv, self.size
        device = self.comm.device if isinstance(self.comm, DeviceBound) else None
        flags = torch.zeros(2 * size, dtype=torch.int32, device=device)
        for m in range(size):
            state = kv.get(f"rejoin/{m}") if m not in self.members else None
            if state in ("waiting", "restarting"):
                flags[m if state == "waiting" else size + m] = 1
        self.comm.all_reduce(flags)
        ready = [m for m in range(size) if int(flags[m])]
        coming = [m for m in range(size) if int(flags[size + m]) and m not in ready]
        if not coming:
            return ready
        deadline = kv.now(self.comm) + self.window
        arrived = [m for m in coming if kv.get(f"rejoin/{m}") == "waiting"]
        while len(arrived) < len(coming) and kv.now(self.comm) < deadline:
            kv.pause(self.comm, POLL)
            arrived = [m for m in coming if kv.get(f"rejoin/{m}") == "waiting"]
        decided = kv.first(f"admit/{self.epoch}/{step}", ",".join(map(str, ready + arrived)))
        ids = sorted(int(m) for m in decided.split(",") if m)
        for m in coming:
            if m not in ids:  # too late: not waited for again, let in when it asks
                kv.first_replace(f"rejoin/{m}", "restarting", "late")
        return ids

    def admit(self, ids: list[int], step: int) -> None:
        """Make :attr:`comm` a communicator over the members and the workers ``ids`` (from
        :meth:`waiting`) that rejoin after ``step``."""
        epoch = self.epoch + 1
        members = tuple(sorted({*self.members, *ids}))
        decided = self._kv.first(f"{epoch}/decided",
                                 f"{step}|{','.join(map(str, members))}")
        for m in ids:
            self._kv.set(f"rejoin/{m}", f"epoch:{epoch}")
        self._change(epoch, *_decision(decided))

    def source(self) -> int:
        """The rank, in :attr:`comm`, of the member that gives its state at a rejoin: the
        lowest id of the epoch before (a live member, the same for every member)."""
        return self.members.index(min(self.history[-2]["members"]))

    def close(self) -> None:
        """The run is over: a worker still waiting to rejoin stops waiting."""
        self._kv.set("finished", "1")

    @classmethod
    def rejoin(cls, me: int, size: int, host: str, port: int, *, timeout: float,
               wait: float, backend: str = "gloo") -> Membership | None:
        """A restarted worker (id ``me`` of ``size``) asks to rejoin through the store at
        ``host:port``, waits at most ``wait`` seconds for the members to admit it, and meets
        them; None when the run finished first."""
        import torch.distributed as dist

        from gossamer.comm.torch_comm import TorchCommunicator

        store = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=timeout),
                              wait_for_workers=False)
        kv = _TorchStore(store)
        kv.set(f"rejoin/{me}", "waiting")
        deadline = time.monotonic() + wait
        while not (state := kv.get(f"rejoin/{me}") or "").startswith("epoch:"):
            if state != "waiting":  # the members gave up waiting just before it asked
                kv.set(f"rejoin/{me}", "waiting")
            if kv.get("finished") is not None:
                return None
            if time.monotonic() > deadline:
                raise CommTimeoutError(f"rejoin: the members did not admit rank {me} within "
                                       f"{wait:g} s", op="rejoin", peers=[])
            time.sleep(POLL)
        epoch = int(str(state).partition(":")[2])
        step, members = _decision(kv.get(f"{epoch}/decided") or "")
        comm = TorchCommunicator.from_store(store, members.index(me), len(members),
                                            f"{_PREFIX}/{epoch}", backend=backend,
                                            timeout=timeout)
        self = cls(comm)
        self.me, self.size, self.members, self.epoch, self.joined_at = (
            me, size, members, epoch, step)
        for e in range(1, epoch + 1):  # the history the others made meanwhile
            done, ids = _decision(kv.get(f"{e}/decided") or "")
            self.history.append({"step": done, "members": list(ids)})
        return self

    def _alive(self, member: int) -> bool:
        """Whether a member that has not joined may still do so: its heartbeat beats (in the
        simulator: it has neither crashed, nor hung, nor finished)."""
        if member == self.me:
            return True
        return bool(self.comm.peer_alive(self.members.index(member)))



def announce_restart(store: Any, member: int) -> None:
    """The launcher restarted worker ``member``: the members wait for it at their next look
    (:meth:`Membership.waiting`)."""
    _TorchStore(store).set(f"rejoin/{member}", "restarting")


def last_members(store: Any) -> tuple[int, ...] | None:
    """The members of the newest epoch agreed in ``store`` (a TCPStore), or None if the
    membership never changed: what the launcher reads to stop a worker the others left."""
    kv, epoch, members = _TorchStore(store), 1, None
    while (decided := kv.get(f"{epoch}/decided")) is not None:
        members, epoch = _decision(decided)[1], epoch + 1
    return members


def _decision(text: str) -> tuple[int, tuple[int, ...]]:
    """``"STEP|ID,ID,..."`` -> (step, ids)."""
    step, _, ids = text.partition("|")
    return int(step), tuple(int(m) for m in ids.split(","))
