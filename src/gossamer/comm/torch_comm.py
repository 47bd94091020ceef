"""The Communicator over a c10d process group: one process per worker, gloo on CPU, NCCL on GPU.

:meth:`TorchCommunicator.from_env` starts torch.distributed under torchrun, SLURM or Open MPI
(or as a single process); the constructor wraps a process group that is already initialised.

Failures are made readable: every blocking operation is bounded by the timeout, and when one
fails the error names the operation ("all_reduce #12") and the peer that did not answer. To tell
a dead peer from a slow one, each worker runs a heartbeat beacon that writes a counter to the
c10d store every 0.5 s; on failure the survivors read their peers' counters twice and name the
ones that stopped.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import ipaddress
import math
import os
import re
import select
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from gossamer.comm import cost, faults
from gossamer.comm.base import (
    AsyncCollectives,
    CommError,
    CommTimeoutError,
    Communicator,
    CommunicatorBase,
    DeviceBound,
    FaultInjection,
    IdleTime,
    MembershipChange,
    ProcessGroupBacked,
    ReduceOp,
    check_exchange,
    check_rank,
    default_timeout,
    tensor_nbytes,
)
from gossamer.comm.environment import (
    BACKEND_VARIABLE,
    LaunchEnv,
    expand_nodelist,
    launch_env_from,
)
from gossamer.comm.p2p_group import P2PGroup, check_headers, divide_, numel_of, shape_header

__all__ = [
    "LaunchEnv",
    "Liveness",
    "TorchCommunicator",
    "expand_nodelist",
    "launch_env_from",
]

HEARTBEAT_INTERVAL = 0.5  # seconds between beats (at the default Liveness)
_STORE_READ_TIMEOUT = 5.0  # a diagnosis must not hang on a store that does not answer
#: the environment variable that scales every interval of :class:`Liveness`
LIVENESS_VARIABLE = "GOSSAMER_LIVENESS_SCALE"


@dataclass(frozen=True)
class Liveness:
    """How a :class:`TorchCommunicator` tells a dead peer from a slow one, in seconds.

    Attributes:
        heartbeat: between two beats of a worker's heartbeat thread (default 0.5).
        dead_after: a peer whose last beat is older is dead (default 3.0: six beats).
        diagnose_gap: between the two reads of the peers' beats that diagnose a failure
            (default 1.5: three beats; a live peer beats in between).
        store_settle: a diagnosis waits this long before its first store call, so that the
            store host's own death, if that is what happened, shows first (default 0.25).
        close_wait: the store's host waits at most this long for the others to close
            (default 3.0).

    ``Liveness.from_env()`` (what a communicator uses unless given one) multiplies every
    interval by ``GOSSAMER_LIVENESS_SCALE`` (default 1). Below 1 a dead peer is noticed and
    named sooner, and a loaded machine's live peer is more likely taken for dead: the tests
    shorten them so; a job has no reason to.
    """

    heartbeat: float = HEARTBEAT_INTERVAL
    dead_after: float = 3.0
    diagnose_gap: float = 1.5
    store_settle: float = 0.25
    close_wait: float = 3.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{f.name} must be a number of seconds > 0, got {value!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Liveness:
        """The default intervals times ``GOSSAMER_LIVENESS_SCALE`` (a number > 0)."""
        text = (os.environ if environ is None else environ).get(LIVENESS_VARIABLE, "")
        if not text:
            return cls()
        try:
            scale = float(text)
        except ValueError:
            scale = math.nan
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"{LIVENESS_VARIABLE} must be a number > 0 (it multiplies the "
                             f"heartbeat and failure-diagnosis intervals), got {text!r}")
        return cls(**{f.name: getattr(cls(), f.name) * scale for f in dataclasses.fields(cls)})

_OPEN: weakref.WeakSet[TorchCommunicator] = weakref.WeakSet()  # not closed yet
# torch's error for a tensor on a device the group's backend does not carry
_WRONG_DEVICE = re.compile(r"No backend type associated with device type (\w+)")
_EXIT_REGISTERED = False


def _release_at_exit() -> None:
    """At exit: close the communicators still open, then destroy the process groups.

    A gloo group's worker threads end only when the last reference to it goes; one left to
    the interpreter's finalisation can release a finished operation's tensors while Python
    finalises, which aborts the process ("terminate called without an active exception").
    So a program that never calls ``close()``, or whose group a framework made and left
    (Lightning destroys its group at exit for NCCL only; Accelerate not at all), has them
    released here, before the finalisation.
    """
    for comm in list(_OPEN):
        comm.close()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _release_registered() -> None:
    """Register :func:`_release_at_exit` once, when the first communicator is made (so that
    it runs before the exit hooks registered earlier, and only in a program that used one)."""
    global _EXIT_REGISTERED
    if not _EXIT_REGISTERED:
        atexit.register(_release_at_exit)
        _EXIT_REGISTERED = True

# --------------------------------------------------------------------------------------------
# Heartbeat
# --------------------------------------------------------------------------------------------


class _Heartbeat:
    """A daemon thread that writes ``{counter}:{op_seq}:{time}:{op_label}`` to the store every
    ``comm.liveness.heartbeat`` seconds (0.5 s).

    It has its own store connection, so it beats while the main thread is blocked in a
    collective; a second connection serves the main thread's reads when it diagnoses a failure.
    A third, idle socket watches the store's host: when that process is gone the socket reads
    end-of-file, which tells it without a call into the C++ store (each of which, against a
    vanished store, logs a C++ warning with its stack frames).
    """

    def __init__(self, host: str, port: int, prefix: str, comm: TorchCommunicator) -> None:
        self.host, self.port, self.prefix = host, port, prefix
        self._comm = comm
        self._interval = comm.liveness.heartbeat
        connect = timedelta(seconds=min(comm.timeout, 60.0))
        self._writer = dist.TCPStore(host, port, is_master=False, timeout=connect,
                                     wait_for_workers=False)
        self._reader = dist.TCPStore(host, port, is_master=False, timeout=connect,
                                     wait_for_workers=False)
        self._writer.set_timeout(timedelta(seconds=_STORE_READ_TIMEOUT))
        self._reader.set_timeout(timedelta(seconds=_STORE_READ_TIMEOUT))
        self._watch: socket.socket | None = None
        try:
            self._watch = socket.create_connection((host, port), timeout=connect.total_seconds())
            self._watch.setblocking(False)
        except OSError:  # the store answered the TCPStore clients: watch through them instead
            self._watch = None
        self._counter = 0
        self._global_rank = comm._global_ranks[comm.rank]
        self._key = self.key(self._global_rank)
        self._beat()  # the key exists as soon as the communicator does
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gossamer-heartbeat", daemon=True)
        self._thread.start()

    def key(self, global_rank: int) -> str:
        return f"{self.prefix}/{global_rank}"

    def _left_key(self, global_rank: int) -> str:
        return f"{self.prefix}/left/{global_rank}"

    def store_alive(self) -> bool:
        """Whether the store's host still holds this worker's idle connection (never blocks)."""
        if self._watch is None:
            return True
        try:
            readable, _, _ = select.select([self._watch], [], [], 0)
            return not readable or self._watch.recv(1, socket.MSG_PEEK) != b""
        except OSError:
            return False

    def _beat(self) -> None:
        self._counter += 1
        seq, label = self._comm._seq, self._comm._label
        self._writer.set(self._key, f"{self._counter}:{seq}:{time.time():.3f}:{label}")

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            if not self.store_alive():
                return  # the store's host is gone (the job is ending, or it died)
            try:
                self._beat()
            except Exception:  # noqa: BLE001
                # a TCPStore client does not reconnect, and each failed write logs a C++
                # warning, so stop here
                return

    def read(self, global_rank: int) -> tuple[int, int, float, str] | None:
        """A peer's last beat ``(counter, op_seq, unix_time, op_label)``, or None if it never
        beat."""
        key = self.key(global_rank)
        if not self._reader.check([key]):
            return None
        counter, seq, when, label = self._reader.get(key).decode().split(":", 3)
        return int(counter), int(seq), float(when), label

    def left(self, global_rank: int) -> str | None:
        """What a peer that closed after a failure wrote on leaving (see :meth:`stop`)."""
        key = self._left_key(global_rank)
        if not self._reader.check([key]):
            return None
        return self._reader.get(key).decode()

    def halt(self) -> None:
        """Stop beating, as a frozen process would, without counting this rank as closed."""
        self._stop.set()
        self._thread.join(timeout=2 * self._interval + _STORE_READ_TIMEOUT)

    def stop(self, world_size: int, wait_for_all: bool, failure: CommError | None = None,
             expected: int | None = None, patience: float | None = None) -> None:
        """Stop beating and count this rank as closed.

        After a ``failure`` the rank leaves its diagnosis in the store, so that a peer that
        diagnoses later learns that this one left on purpose, and whom it blamed. The store's
        host waits for ``expected`` ranks (default: all) to close, at most ``patience``
        seconds (default: the communicator's ``liveness.close_wait``): beats that hit a
        vanished store spam C++ warnings, and a peer still diagnosing a failure needs the
        store to tell a dead rank from one that left.
        """
        self._stop.set()
        self._thread.join(timeout=2 * self._interval + _STORE_READ_TIMEOUT)
        key = f"{self.prefix}/closed"
        try:
            if not self.store_alive():
                return
            if failure is not None:
                suspects = ",".join(str(p) for p in failure.peers)
                self._reader.set(self._left_key(self._global_rank), f"{failure.op}|{suspects}")
            closed = self._reader.add(key, 1)
            wanted = world_size if expected is None else expected
            if patience is None:
                patience = self._comm.liveness.close_wait
            end = time.monotonic() + patience
            while wait_for_all and closed < wanted and time.monotonic() < end:
                time.sleep(0.05)
                closed = self._reader.add(key, 0)
        except Exception:  # noqa: BLE001 - the store is gone already: nothing to wait for
            pass
        finally:
            if self._watch is not None:
                self._watch.close()


# --------------------------------------------------------------------------------------------
# The communicator
# --------------------------------------------------------------------------------------------


def _tail(buffer: torch.Tensor) -> torch.Tensor:
    """The last 8 bytes of a contiguous CPU tensor (a view)."""
    return buffer.view(-1).view(torch.uint8)[-8:]


class _Exchange:
    """The handle of :meth:`TorchCommunicator.exchange`; ``wait()`` is idempotent.

    gloo reports a point-to-point operation complete only once it has been waited for, even
    when the data is there, so ``ready()`` cannot ask it. Instead each CPU receive buffer
    ends with a random 8-byte sentinel written before the receive is posted: gloo writes a
    message into the buffer in order, so the message is complete when its last bytes
    differ from the sentinel (a message ending in exactly those 8 bytes, a chance of 2^-64,
    would be seen only at the next ``wait()``). A gloo send is never reported ready.
    """

    def __init__(self, comm: TorchCommunicator, label: str, peers: list[int], works: list,
                 sends: list[torch.Tensor], recvs: dict[int, torch.Tensor],
                 sentinels: dict[int, torch.Tensor] | None = None, counted: bool = True) -> None:
        self._comm, self._label, self._peers = comm, label, peers
        self._counted = counted
        self._works = works
        self._sends = sends  # kept alive until the sends completed
        self._recvs = recvs
        self._sentinels = sentinels or {}  # peer -> the 8 bytes its message must overwrite
        self._result: dict[int, torch.Tensor] | None = None
        self._error: CommError | None = None

    def ready(self) -> bool:
        """Whether ``wait()`` would return at once (never blocks)."""
        if self._result is not None or self._error is not None:
            return True
        if all(work.is_completed() for work in self._works):
            return True
        if self._sends or not self._sentinels:
            return False
        return all(not torch.equal(_tail(self._recvs[peer]), sentinel)
                   for peer, sentinel in self._sentinels.items())

    def _watch_arrivals(self, deadline: float) -> None:
        """On gloo, while the receives' sentinels say a message has not arrived, read the
        peers' heartbeats every ``liveness.heartbeat`` seconds: a dead peer ends the wait
        (a CommError) in seconds rather than at the timeout. A gloo receive cannot be waited
        for in slices (a timed-out wait closes its pair) nor asked whether it completed, so
        the arrivals are seen in the buffers, polled every millisecond or so."""
        comm = self._comm
        if comm.backend != "gloo" or not comm.watches_peers or not self._sentinels \
                or len(self._sentinels) < len(self._recvs):
            return
        seen: dict[int, tuple[object, float]] = {}
        started = time.perf_counter()
        checked, pause = started, 1e-4
        while not _arrived(self._recvs, self._sentinels):
            now = time.perf_counter()
            if now >= deadline:
                return  # the waits below report the timeout
            if now - checked >= comm.liveness.heartbeat:
                checked = now
                try:
                    comm.check_peers(self._peers, seen)
                except RuntimeError as exc:
                    raise self._comm._failure(self._label, self._peers, exc, deadline,
                                              collective=False) from exc
            time.sleep(pause)
            pause = min(2 * pause, 2e-3)
        self._comm._idle += time.perf_counter() - started

    def wait(self) -> dict[int, torch.Tensor]:
        if self._result is not None:
            return self._result
        if self._error is not None:
            raise self._error
        deadline = time.perf_counter() + self._comm.timeout
        try:
            self._watch_arrivals(deadline)
            for work in self._works:
                self._comm._wait(work, self._label, self._peers, deadline, collective=False)
        except CommError as exc:
            self._error = exc
            raise
        for peer, buf in self._recvs.items() if self._counted else ():
            self._comm.stats.record_receive(peer, tensor_nbytes(buf))
        self._result = dict(self._recvs)
        self._works, self._sends = [], []
        return self._result


def _arrived(recvs: dict[int, torch.Tensor], sentinels: dict[int, torch.Tensor]) -> bool:
    return all(not torch.equal(_tail(recvs[peer]), sentinel)
               for peer, sentinel in sentinels.items())


class _Collective:
    """The handle of :meth:`TorchCommunicator.all_reduce_async`; ``wait()`` is idempotent and
    waits at most the communicator's timeout."""

    def __init__(self, comm: TorchCommunicator, label: str, work, tensor: torch.Tensor,
                 mean: bool = False) -> None:
        self._comm, self._label, self._work, self._tensor = comm, label, work, tensor
        self._mean = mean  # divide the sum by the world size once it is there
        self._seq = comm._seq  # its number: another may have started since

    def ready(self) -> bool:
        return self._work is None or self._work.is_completed()

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            deadline = time.perf_counter() + self._comm.timeout
            self._comm._wait(self._work, self._label, self._comm._others(), deadline,
                             seq=self._seq)
            self._work = None
            if self._mean:
                divide_(self._tensor, self._comm.world_size)
        return self._tensor


class TorchCommunicator(CommunicatorBase, AsyncCollectives, IdleTime, DeviceBound,
                        FaultInjection, MembershipChange, ProcessGroupBacked):
    """A :class:`~gossamer.comm.base.Communicator` over a c10d process group.

    Args:
        group: the process group (default: the default group, which must be initialised).
        timeout: seconds any blocking operation may wait for a peer before it fails.
        store: the c10d store of the group; if it is a TCPStore its address is used for the
            heartbeat (see ``store_addr``).
        store_addr: ``(host, port)`` of a TCPStore that all members can reach. With it (or with
            ``store``) a heartbeat runs, and failures name the peer that stopped; without it
            they name every peer of the failed operation as a suspect.
        heartbeat_prefix: the store keys of the heartbeat (default: from the restart count and
            the group's name).
        liveness: the heartbeat's and the failure diagnosis's intervals (default:
            :meth:`Liveness.from_env`).

    Tensors go to the backend on their own device (gloo: CPU, NCCL: CUDA). After a CommError
    the process group is in an undefined state: stop, or restart the job.

    ``close()`` stops the heartbeat. Destroying the process group is the caller's business,
    unless :meth:`from_env` created it: then ``close()`` destroys it too. At exit, what is
    still open is closed and the process groups destroyed (see :meth:`close`).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        timeout: float | None = None,
        store: dist.Store | None = None,
        store_addr: tuple[str, int] | None = None,
        heartbeat_prefix: str | None = None,
        liveness: Liveness | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "torch.distributed is not initialised: call TorchCommunicator.from_env() or "
                "dist.init_process_group() first"
            )
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(
                timeout, (int, float)) or not timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self._group = group if group is not None else dist.group.WORLD
        rank = dist.get_rank(self._group)
        if rank < 0:
            raise ValueError("this process is not a member of the given group")
        super().__init__(rank, dist.get_world_size(self._group))
        self._global_ranks = list(dist.get_process_group_ranks(self._group))
        self._backend = str(dist.get_backend(self._group))
        # the sentinels of receive buffers (see _Exchange); never the global RNG
        self._sentinel_rng = torch.Generator().manual_seed(0x5E17 + self._rank)
        self._timeout = float(timeout if timeout is not None else default_timeout(self._backend))
        self._t0 = time.perf_counter()
        self._idle = 0.0  # seconds blocked in _wait
        self._seq = 0  # collectives started: every member runs the same sequence
        self._exchanges = 0
        self._label = "no operation yet"
        self._store = store  # kept alive with the communicator
        self._owns_group = False
        self._store_host: int | None = None  # global rank hosting the store, when known
        self._failed: CommError | None = None  # the failure this communicator raised, if any
        if store_addr is None and isinstance(store, dist.TCPStore):
            store_addr = (store.host, store.port)
        self._heartbeat: _Heartbeat | None = None
        #: whether waits watch the peers' heartbeats (see :attr:`watches_peers`)
        self.watch_peers = False
        #: how a dead peer is told from a slow one (default: Liveness.from_env())
        self.liveness = liveness if liveness is not None else Liveness.from_env()
        _OPEN.add(self)
        _release_registered()
        if store_addr is not None:
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            name = getattr(self._group, "group_name", "") or "default"
            prefix = heartbeat_prefix or f"gossamer/{restart}/hb/{name}"
            self._heartbeat = _Heartbeat(store_addr[0], int(store_addr[1]), prefix, self)

    @classmethod
    def from_env(
        cls,
        *,
        backend: str | None = None,
        timeout: float | None = None,
        bind_all: bool = False,
    ) -> TorchCommunicator:
        """Initialise torch.distributed from the launcher's environment and wrap it.

        See :func:`launch_env_from` for the launchers understood. The backend defaults to the
        environment variable ``GOSSAMER_BACKEND`` if set, else NCCL when CUDA is available (the
        CUDA device is set to the local rank), gloo otherwise. Rank 0 hosts the TCPStore (the
        torchelastic agent does when ``TORCHELASTIC_USE_AGENT_STORE`` is ``True``); it listens
        on MASTER_ADDR only, or on all interfaces with ``bind_all=True``. If the default group
        exists already, it is wrapped as it is. ``timeout`` (seconds each blocking operation
        and the rendezvous wait) defaults to the backend's
        (:func:`gossamer.comm.default_timeout`: 300 s on gloo, 600 s on NCCL).
        """
        if dist.is_initialized():
            return cls(timeout=timeout)
        env = launch_env_from(os.environ)
        if bind_all:
            warnings.warn(
                "bind_all=True: the rendezvous store listens on every interface, and "
                "torch.distributed has no authentication: anyone who can reach "
                f"port {env.master_port} can join or disturb the job",
                stacklevel=2,
            )
        if backend is None:
            backend = (os.environ.get(BACKEND_VARIABLE)
                       or ("nccl" if torch.cuda.is_available() else "gloo"))
        if backend == "nccl":
            torch.cuda.set_device(env.local_rank)
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        is_master = env.rank == 0 and not agent_store
        port = env.master_port
        if env.world_size == 1 and "MASTER_PORT" not in os.environ:
            port = 0  # alone: any free port, so that single runs never collide on 29500
        if timeout is None:
            timeout = default_timeout(backend)
        span = timedelta(seconds=timeout)
        listen_fd = None
        if is_master and not bind_all:
            listen_fd, port = _listen_fd(env.master_addr, port)
        store = dist.TCPStore(
            env.master_addr, port, env.world_size if is_master else None, is_master,
            timeout=span, wait_for_workers=False, master_listen_fd=listen_fd,
        )
        options = None
        if backend == "gloo" and _is_loopback(env.master_addr):
            options = _loopback_gloo_options(span)
        kwargs = {"pg_options": options} if options is not None else {}
        group_store: dist.Store = store
        if agent_store:
            # torchelastic's agent keeps its store across restarts of the worker group: each
            # attempt's keys go under a prefix of their own (as torch's env:// does), or a
            # restarted group would read the addresses the dead workers published
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            group_store = dist.PrefixStore(f"/worker/attempt_{attempt}", store)
        dist.init_process_group(
            backend, store=group_store, rank=env.rank, world_size=env.world_size,
            timeout=span, **kwargs,
        )
        try:
            comm = cls(timeout=timeout, store=store, store_addr=(env.master_addr, store.port))
        except BaseException:
            dist.destroy_process_group()
            raise
        comm._owns_group = True
        comm._store_host = None if agent_store else 0
        return comm

    # -- properties ------------------------------------------------------------------------

    @property
    def timeout(self) -> float:
        """Seconds a blocking operation waits before it fails."""
        return self._timeout

    @property
    def backend(self) -> str:
        """The process group's backend, as torch names it (``"gloo"``, ``"nccl"``...)."""
        return self._backend

    @property
    def device(self) -> torch.device:
        """Where this communicator's own small tensors live (CUDA for NCCL, else CPU)."""
        if self._backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def store(self) -> dist.Store | None:
        """The c10d store the group met through (None when not given)."""
        return self._store

    def peer_alive(self, rank: int) -> bool:
        """Whether ``rank``'s heartbeat beat within ``liveness.dead_after`` seconds (3 s; True
        without a heartbeat store: nothing says otherwise)."""
        if self._heartbeat is None or rank == self._rank:
            return True
        try:
            beat = self._heartbeat.read(self._global_ranks[rank])
        except Exception:  # noqa: BLE001 - a store that does not answer says nothing
            return True
        return beat is not None and time.time() - beat[2] < self.liveness.dead_after

    def regroup(self, rank: int, members: Sequence[int], name: str) -> TorchCommunicator:
        """Close this communicator and make one over a new default group of
        ``len(members)`` processes, this one ``rank``, met through this one's store under the
        prefix ``name``: a membership change (:mod:`gossamer.comm.membership`)."""
        store = self._store
        if not isinstance(store, dist.TCPStore) or not self._owns_group:
            raise ValueError("regroup needs a communicator made by from_env (its TCPStore)")
        self.close()
        new = TorchCommunicator.from_store(store, rank, len(members), name,
                                           backend=self._backend, timeout=self._timeout)
        new.watch_peers = self.watch_peers
        return new

    @classmethod
    def from_store(cls, store: dist.TCPStore, rank: int, world_size: int, name: str, *,
                   backend: str = "gloo", timeout: float | None = None) -> TorchCommunicator:
        """Initialise the default group of ``world_size`` processes, this one ``rank``, met
        through ``store`` under the prefix ``name``, and wrap it (``close()`` destroys it):
        how the members of a new membership meet (:mod:`gossamer.comm.membership`)."""
        timeout = float(timeout if timeout is not None else default_timeout(backend))
        span = timedelta(seconds=timeout)
        options = None
        if backend == "gloo" and _is_loopback(store.host):
            options = _loopback_gloo_options(span)
        kwargs = {"pg_options": options} if options is not None else {}
        dist.init_process_group(backend, store=dist.PrefixStore(name, store), rank=rank,
                                world_size=world_size, timeout=span, **kwargs)
        comm = cls(timeout=timeout, store=store, heartbeat_prefix=f"{name}/hb")
        comm._owns_group = True
        return comm

    @property
    def process_group(self) -> dist.ProcessGroup:
        if self._group is None:
            raise ValueError(f"{self!r} is closed")
        return self._group

    # -- collectives -------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Sum (or average) ``tensor`` over all ranks, in place; returns it.

        ``mean`` of an integer tensor rounds down.
        """
        if op not in ("sum", "mean"):
            raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
        label = self._begin("all_reduce")
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        self._run(label, lambda: dist.all_reduce(buf, group=self._group, async_op=True))
        if buf is not tensor:
            tensor.copy_(buf)
        if op == "mean":
            divide_(tensor, self._world_size)
        self._count_all_reduce(tensor)
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> _Collective:
        """Start summing (or averaging) the contiguous ``tensor`` over all ranks, in place;
        ``wait()`` on the handle (within the timeout) completes it. Collectives start in the
        same order on every rank; the bytes are counted when it starts."""
        if op not in ("sum", "mean"):
            raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
        if not tensor.is_contiguous():
            raise ValueError("all_reduce_async needs a contiguous tensor")
        label = self._begin("all_reduce")
        deadline = time.perf_counter() + self._timeout
        try:
            work = dist.all_reduce(tensor, group=self._group, async_op=True)
        except RuntimeError as exc:  # (gloo's own errors are not DistErrors: see _wait)
            raise self._failure(label, self._others(), exc, deadline) from exc
        self._count_all_reduce(tensor)
        return _Collective(self, label, work, tensor, mean=op == "mean")

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor, in rank order; sizes may differ (same dtype and ndim).

        The shapes travel first in a small int64 header; the payloads then go as bytes padded
        to the largest, and are trimmed. Only the payload bytes are counted.
        """
        n = self._world_size
        label = self._begin("all_gather")
        header = shape_header(tensor).to(tensor.device)
        headers = [torch.empty_like(header) for _ in range(n)]
        self._run(label, lambda: dist.all_gather(headers, header, group=self._group,
                                                 async_op=True))
        shapes = check_headers(headers)
        sizes = [numel_of(s) * tensor.element_size() for s in shapes]
        width = max(sizes)
        out: list[torch.Tensor]
        if width == 0:
            out = [torch.empty(s, dtype=tensor.dtype, device=tensor.device) for s in shapes]
        else:
            mine = torch.zeros(width, dtype=torch.uint8, device=tensor.device)
            if tensor.numel():
                mine[: sizes[self._rank]] = _as_bytes(tensor)
            bufs = [torch.empty_like(mine) for _ in range(n)]
            self._run(label, lambda: dist.all_gather(bufs, mine, group=self._group,
                                                     async_op=True))
            out = [
                _from_bytes(buf[:size], tensor.dtype, shape)
                for buf, size, shape in zip(bufs, sizes, shapes, strict=True)
            ]
        self._record_collective(
            "all_gather",
            cost.ring_all_gather_traffic(self._rank, n, sizes),
            cost.ring_all_gather_traffic((self._rank - 1) % n, n, sizes),
        )
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` everywhere with rank ``src``'s; returns it."""
        check_rank(src, self._world_size, "src")
        label = self._begin("broadcast")
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        root = self._global_ranks[src]
        self._run(label, lambda: dist.broadcast(buf, root, group=self._group, async_op=True))
        if buf is not tensor:
            tensor.copy_(buf)
        n, nbytes = self._world_size, tensor_nbytes(tensor)
        received = [(s, nbytes, 1) for s in cost.broadcast_sources(self._rank, n, src)]
        self._record_collective(
            "broadcast", cost.broadcast_traffic(self._rank, n, src, nbytes), received,
            mirror=False,
        )
        return tensor

    def barrier(self) -> None:
        """Return once every rank reached its barrier."""
        label = self._begin("barrier")
        # An all-reduce of one element works the same on every backend (NCCL's barrier has to
        # guess a device), and Work.wait(timeout) bounds it.
        token = torch.zeros(1, dtype=torch.uint8, device=self.device)
        self._run(label, lambda: dist.all_reduce(token, group=self._group, async_op=True))
        n = self._world_size
        received = [((self._rank - (1 << r)) % n, 0, 1) for r in range(cost.barrier_rounds(n))]
        self._record_collective(
            "barrier", cost.barrier_traffic(self._rank, n), received, mirror=False
        )

    def exchange(
        self,
        sends: Mapping[int, torch.Tensor],
        recv_from: Sequence[int],
        recv_like: torch.Tensor | None = None,
    ) -> _Exchange:
        """Post the sends and receives (isend/irecv, in one ``batch_isend_irecv``) and return
        at once; see the protocol."""
        like = check_exchange(self._rank, self._world_size, sends, recv_from, recv_like)
        if self._group is None:
            raise ValueError(f"exchange on a closed communicator ({self!r})")
        self._exchanges += 1
        label = f"exchange #{self._exchanges}"
        self._label = label
        peers = sorted(set(sends) | set(recv_from))
        ops, kept = [], []
        recvs: dict[int, torch.Tensor] = {}
        sentinels: dict[int, torch.Tensor] = {}
        deadline = time.perf_counter() + self._timeout
        try:
            # Receives first: gloo then writes an arriving message straight into the posted
            # buffer. Sends posted first make a pair that swaps messages take twice the wire
            # time on a shaped link (measured: docs/benchmarks/network.md, part a).
            for peer in recv_from:
                assert like is not None  # check_exchange guarantees it
                buf = torch.empty(like.shape, dtype=like.dtype, device=like.device)
                recvs[peer] = buf
                if buf.device.type == "cpu" and buf.numel() * buf.element_size() >= 8:
                    sentinels[peer] = torch.randint(0, 256, (8,), dtype=torch.uint8,
                                                    generator=self._sentinel_rng)
                    _tail(buf).copy_(sentinels[peer])
                ops.append(dist.P2POp(dist.irecv, buf, self._global_ranks[peer], self._group))
            for peer, t in sends.items():
                buf = t if t.is_contiguous() else t.contiguous()
                kept.append(buf)
                ops.append(dist.P2POp(dist.isend, buf, self._global_ranks[peer], self._group))
            # One batch: NCCL posts it as one group call, so that two peers that swap
            # messages cannot deadlock on the order of their sends and receives (each
            # blocks its stream until its peer's matching call); gloo posts the operations
            # one by one, in this order (receives first).
            works = dist.batch_isend_irecv(ops) if ops else []
        except RuntimeError as exc:  # a peer gone when posting: gloo's "Connection closed"
            raise self._failure(label, peers, exc, deadline, collective=False) from exc
        if self._counting:
            for peer, t in sends.items():
                self._stats.record_send(peer, tensor_nbytes(t))
            self._stats.operations["exchange"] += 1
        return _Exchange(self, label, peers, [w for w in works if w is not None], kept, recvs,
                         sentinels, counted=self._counting)

    def group(self, ranks: Sequence[int]) -> Communicator:
        """A subgroup of ``ranks`` (in this communicator's ranks), over :meth:`exchange`: its
        collectives are counted here by name, as the simulator counts a subgroup's."""
        return P2PGroup(self, ranks)

    def clock(self) -> float:
        """Real seconds since this communicator was made."""
        return time.perf_counter() - self._t0

    @property
    def idle_time(self) -> float:
        """Real seconds spent blocked waiting for collectives and exchanges to complete (the
        transfer itself included), since this communicator was made."""
        return self._idle

    def compute_step(self) -> None:
        """Nothing to do: real time passed while the step computed."""

    def fail(self, kind: str, reason: str) -> NoReturn:
        """Fault injection (:mod:`gossamer.comm.faults`): ``"crash"`` exits the process at
        once; ``"hang"`` stops the heartbeat and never returns, so that the peers see a worker
        that stopped responding."""
        if kind == "hang" and self._heartbeat is not None:
            self._heartbeat.halt()
        if kind == "crash":
            faults.crash_process(reason)
        faults.hang_process(reason)

    def close(self) -> None:
        """Stop the heartbeat; destroy the process group if :meth:`from_env` created it.

        The communicator lets go of the group in any case. A gloo group's worker threads
        end only when the last reference to it goes; one that outlives the interpreter can
        release a finished operation's tensors while Python finalises, which aborts the
        process ("terminate called without an active exception"). So when ``close()``
        returns, a group it destroyed has joined its threads. At exit, the communicators
        still open are closed and the process groups destroyed (the default group too where
        the program or a framework made it and left it), before the interpreter finalises.
        """
        if self._heartbeat is not None:
            hosting = self._store_host == self._global_ranks[self._rank]
            size, failed = len(self._global_ranks), self._failed
            if failed is None:
                self._heartbeat.stop(size, wait_for_all=hosting)
            else:
                # the peers still diagnosing the failure need the store: its host waits for
                # every rank not blamed to close, as long as one may take to notice and diagnose
                live = self.liveness
                self._heartbeat.stop(size, wait_for_all=hosting, failure=failed,
                                     expected=size - len(failed.peers),
                                     patience=self._timeout + 2 * live.diagnose_gap
                                     + live.close_wait)
            self._heartbeat = None
        _OPEN.discard(self)
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        if self._owns_group:
            self._store = None
        self._group = None
        self._owns_group = False
        gc.collect()  # a cycle holding the group would keep its threads alive

    def __enter__(self) -> TorchCommunicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"TorchCommunicator(rank={self._rank}, world_size={self._world_size}, "
                f"backend={self._backend!r})")

    # -- internals ---------------------------------------------------------------------------

    def _begin(self, op: str) -> str:
        if self._group is None:
            raise ValueError(f"{op} on a closed communicator ({self!r})")
        self._seq += 1
        self._label = f"{op} #{self._seq}"
        return self._label

    def _others(self) -> list[int]:
        return [r for r in range(self._world_size) if r != self._rank]

    def _run(self, label: str, start) -> None:
        """Start a collective and wait for it within the timeout, or raise a CommError."""
        deadline = time.perf_counter() + self._timeout
        try:
            work = start()
        except RuntimeError as exc:  # (DistError, and gloo's own errors, as in _wait)
            raise self._failure(label, self._others(), exc, deadline) from exc
        if work is not None:
            self._wait(work, label, self._others(), deadline)

    def _check_device(self, label: str, exc: BaseException) -> None:
        """A ValueError if ``exc`` is torch's for a tensor on a device that the backend does
        not carry: the caller's tensor, not a failure of the group (no peer to blame, nothing
        a restart would mend)."""
        wrong = _WRONG_DEVICE.search(str(exc))
        if wrong:
            raise ValueError(
                f"{label}: the {self._backend} backend carries no tensors on the "
                f"{wrong.group(1)} device (NCCL: CUDA tensors only). Move the tensors (the "
                "model) to a device it carries, or create the communicator with another "
                "backend, e.g. TorchCommunicator.from_env(backend='gloo') for CPU tensors"
            ) from exc

    def _wait(self, work, label: str, peers: list[int], deadline: float,
              collective: bool = True, seq: int | None = None) -> None:
        started = time.perf_counter()
        try:
            if collective and self._backend == "gloo" and self.watches_peers \
                    and peers:
                done = self._wait_watching(work, peers, deadline)
            else:
                # Work.wait(0) means "no limit" in c10d, so never pass less than a millisecond
                done = work.wait(timeout=timedelta(seconds=max(deadline - started, 1e-3)))
        except RuntimeError as exc:
            raise self._failure(label, peers, exc, deadline, collective, seq) from exc
        finally:
            self._idle += time.perf_counter() - started
        if done is False:
            raise self._failure(label, peers, None, deadline, collective, seq)

    def _wait_watching(self, work, peers: list[int], deadline: float) -> bool | None:
        """``work.wait()`` within ``deadline``, in slices of one heartbeat: after each slice
        the peers' heartbeats are read, and a peer that stopped beating (none for
        ``liveness.dead_after`` seconds, as seen from here and by its last beat's time) or
        left after a failure of its own ends the wait at once (RuntimeError); one that never
        beat is left to the connection and the timeout. Without it, a worker whose collective waits
        on a live peer that is itself stuck behind a dead one would sit there for the whole
        timeout (300 s on gloo) before the survivors could regroup. A gloo collective goes on
        after a wait that timed out; the first slices cost nothing to a collective that
        completes within them. Not for point-to-point operations: a gloo receive whose wait
        times out closes its pair ("Application timeout caused pair closure"); an exchange
        watches its receive buffers instead (``_Exchange._watch_arrivals``)."""
        live = self.liveness
        seen: dict[int, tuple[object, float]] = {}  # peer -> (its last beat, when it changed)
        while True:
            now = time.perf_counter()
            if deadline - now <= live.heartbeat:
                return work.wait(timeout=timedelta(seconds=max(deadline - now, 1e-3)))
            try:
                return work.wait(timeout=timedelta(seconds=live.heartbeat))
            except RuntimeError as exc:
                if "timed out" not in str(exc).lower():
                    raise
            self.check_peers(peers, seen)

    @property
    def watches_peers(self) -> bool:
        """Whether a wait reads the peers' heartbeats as it goes (:meth:`check_peers`): on
        when :attr:`watch_peers` is set (a run that goes on without failed workers sets it,
        see :class:`gossamer.comm.membership.Membership`) and there are heartbeats. Off
        otherwise: a peer whose heartbeat stalls for a few seconds on a loaded machine is
        not taken for dead where nothing would go on without it."""
        return self.watch_peers and self._heartbeat is not None

    def check_peers(self, peers: list[int], seen: dict[int, tuple[object, float]]) -> None:
        """RuntimeError if one of ``peers`` stopped beating (none for
        ``liveness.dead_after`` seconds, as seen over the calls that share ``seen``, and by
        its last beat's time) or left after a failure of its own, or if the heartbeat store
        failed; a peer that never beat is left to the connection and the timeout."""
        live, hb = self.liveness, self._heartbeat
        assert hb is not None
        now = time.perf_counter()
        if not hb.store_alive():
            raise RuntimeError("the heartbeat store's host closed the connection while "
                               "this rank waited")
        try:
            for p in peers:
                global_rank = self._global_ranks[p]
                if hb.left(global_rank) is not None:
                    raise RuntimeError(f"rank {p} left after a failure of its own while "
                                       "this rank waited")
                beat = hb.read(global_rank)
                if beat is None:
                    continue  # not beating yet: starting, or dead before its first beat
                if p not in seen or seen[p][0] != beat[0]:
                    seen[p] = (beat[0], now)
                elif now - seen[p][1] >= live.dead_after \
                        and time.time() - beat[2] >= live.dead_after:
                    raise RuntimeError(
                        f"rank {p} sent no heartbeat for {now - seen[p][1]:.1f} s while "
                        "this rank waited")
        except RuntimeError:
            raise
        except Exception as exc:  # noqa: BLE001 - a store that fails ends the wait
            raise RuntimeError(f"the heartbeat store failed while this rank waited: "
                               f"{_first_line(exc)}") from exc

    def _failure(self, label: str, peers: list[int], exc: BaseException | None,
                 deadline: float, collective: bool = True, seq: int | None = None
                 ) -> CommError:
        """The CommError for ``label``'s failure, the peers diagnosed; a ValueError raised
        instead where ``exc`` is about the caller's tensor (see _check_device)."""
        if exc is not None:
            self._check_device(label, exc)
        text = _first_line(exc) if exc is not None else "no completion"
        timed_out = exc is None or "timed out" in text.lower()
        if not timed_out and time.perf_counter() >= deadline:
            timed_out = True
        if collective and seq is None:
            seq = self._seq  # the collective that failed is the latest started
        diagnosis, suspects = self._diagnose(label, peers, seq if collective else None)
        what = f"timed out after {self._timeout:g} s" if timed_out else "failed"
        message = f"{label} {what}: {diagnosis}. Original error: {text}"
        cls = CommTimeoutError if timed_out else CommError
        self._failed = cls(message, op=label, peers=suspects)
        return self._failed

    def _diagnose(self, label: str, peers: list[int], seq: int | None) -> tuple[str, list[int]]:
        """Name the peers that stopped (or lag), from two reads of their heartbeats.

        ``seq`` is the collective's number (every member runs the same sequence of them); for
        an exchange it is None, and a live peer that is not itself exchanging is the suspect.
        A peer that closed after a failure of its own left its verdict in the store: it is not
        blamed, and when nothing else explains the failure its verdict is adopted.
        """
        names = ", ".join(f"rank {p}" for p in peers)
        if self._heartbeat is None:
            return f"no heartbeat store to tell which peer failed; suspects: {names}", peers
        hb = self._heartbeat
        try:
            # Each store call against a vanished host logs a C++ warning with its stack frames,
            # so its liveness is checked before each round of reads. A failure seen now may be
            # the host's own death, whose end-of-file on the idle socket can come a moment
            # after the peer's connection closed: let it arrive first.
            time.sleep(self.liveness.store_settle)
            if not hb.store_alive():
                raise ConnectionError("its host closed the connection")
            first = {p: hb.read(self._global_ranks[p]) for p in peers}
            time.sleep(self.liveness.diagnose_gap)
            if not hb.store_alive():
                raise ConnectionError("its host closed the connection")
            second = {p: hb.read(self._global_ranks[p]) for p in peers}
            gone = {p: hb.left(self._global_ranks[p]) for p in peers}
        except Exception as exc:  # noqa: BLE001 - any store failure means the same here
            return self._store_lost(hb, peers, _first_line(exc))
        now = time.time()
        parts, suspects, bystanders, named = [], [], [], []
        for p in peers:
            before, after = first[p], second[p]
            if gone[p] is not None:
                op, _, blamed = gone[p].partition("|")
                theirs = [int(b) for b in blamed.split(",") if b]
                named += [b for b in theirs if b not in named]
                whom = ", ".join(f"rank {b}" for b in theirs) or "no peer"
                parts.append(f"rank {p} left after its {op} failed (it blamed {whom})")
                continue
            if after is None:
                parts.append(f"rank {p} stopped responding (it never sent a heartbeat)")
            elif before is not None and after[0] <= before[0]:
                parts.append(f"rank {p} stopped responding (its last heartbeat, "
                             f"{max(now - after[2], 0.0):.1f} s ago, was during {after[3]})")
            elif seq is not None and after[1] < seq:
                parts.append(f"rank {p} is alive but has not reached {label} (it is in "
                             f"{after[3]})")
            elif seq is None and not after[3].startswith("exchange"):
                parts.append(f"rank {p} is alive but not exchanging (it is in {after[3]})")
            else:
                bystanders.append(p)
                continue
            suspects.append(p)
        if not suspects:
            suspects = [b for b in named if b != self._rank and b not in bystanders]
        if not suspects:
            return f"every peer ({names}) is alive and reached it", peers
        if bystanders:
            verb = "is" if len(bystanders) == 1 else "are"
            parts.append(", ".join(f"rank {p}" for p in bystanders) + f" {verb} alive and in it")
        blamed = ", ".join(f"rank {p}" for p in suspects)
        return "; ".join(parts) + f"; suspects: {blamed}", suspects

    def _store_lost(self, hb: _Heartbeat, peers: list[int], reason: str
                    ) -> tuple[str, list[int]]:
        """The diagnosis when the heartbeat store no longer answers: its host is the one
        process known to be gone; nothing can be said of the others without the store."""
        host = self._store_host_rank()
        if host is not None and host != self._rank:
            return (f"rank {host}, which hosts the heartbeat store at {hb.host}:{hb.port}, is "
                    f"gone ({reason}): it died or exited, and without its store no other peer "
                    f"can be checked; suspects: rank {host}", [host])
        names = ", ".join(f"rank {p}" for p in peers)
        return (f"the heartbeat store at {hb.host}:{hb.port} is unreachable ({reason}): its "
                f"host may be down; suspects: {names}", peers)

    def _store_host_rank(self) -> int | None:
        """This communicator's rank of the process hosting the store, if one of them does."""
        if self._store_host is None or self._store_host not in self._global_ranks:
            return None
        return self._global_ranks.index(self._store_host)

    def _count_all_reduce(self, tensor: torch.Tensor) -> None:
        """Count an all-reduce of ``tensor`` as the ring moves it."""
        n, size, numel = self._world_size, tensor.element_size(), tensor.numel()
        self._record_collective(
            "all_reduce", cost.ring_all_reduce_traffic(self._rank, n, numel, size),
            cost.ring_all_reduce_traffic((self._rank - 1) % n, n, numel, size))

    def _record_collective(self, op: str, sent: cost.Traffic, received: cost.Traffic,
                           mirror: bool = True) -> None:
        """Count a collective as cost.py moves it. ``received`` is the sender's own traffic
        (``mirror``: entries name the destination, and the sender is our predecessor)."""
        if mirror:
            pred = (self._rank - 1) % self._world_size
            received = [(pred, nbytes, messages) for _dst, nbytes, messages in received]
        self._count_collective(op, sent, received)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    """An error's first line, without the C++ source location gloo puts in front of it."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    if line.startswith("[") and "] " in line:
        line = line.split("] ", 1)[1]
    return line.split(". This is typically", 1)[0]  # gloo's advice: see the diagnosis


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _from_bytes(data: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if data.numel() == 0:
        return torch.empty(shape, dtype=dtype, device=data.device)
    return data.clone().view(dtype).reshape(shape)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _listen_fd(host: str, port: int) -> tuple[int, int]:
    """A socket listening on ``host:port`` only, for the TCPStore to serve on (it takes the fd);
    returns the fd and the port (``port`` 0 picks a free one)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ValueError(f"cannot resolve MASTER_ADDR {host!r}: {exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise ValueError(
            f"rank 0 cannot listen on MASTER_ADDR:MASTER_PORT {host}:{port} ({exc}); is the "
            "port in use, or is MASTER_ADDR not an address of this host? (bind_all=True "
            "listens on every interface)"
        ) from exc
    bound = sock.getsockname()[1]
    return sock.detach(), bound


def _loopback_gloo_options(timeout: timedelta):
    """Gloo options that keep its connections on 127.0.0.1 (every rank is on this host when
    the master is loopback), unless GLOO_SOCKET_IFNAME says otherwise."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    try:
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        options._timeout = timeout
    except (AttributeError, RuntimeError):  # private API: fall back to gloo's own choice
        return None
    return options
