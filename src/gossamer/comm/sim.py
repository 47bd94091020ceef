"""SimWorld: many workers in one process, in deterministic virtual time.

Each simulated worker runs the same per-worker function it would run under torchrun, as a
greenlet (a coroutine with a stack of its own) in the calling thread, and talks to the others
through a :class:`~gossamer.comm.Communicator`. Only one worker runs at any moment; when it
must wait (a collective, a message), the scheduler resumes the ready worker with the smallest
virtual clock (ties: the smallest rank). Everything that is exchanged carries virtual
timestamps, and timeouts are decided by comparing them, so the result is bit-identical from
run to run and no operating-system scheduling is involved. Switching greenlets costs about a
microsecond, where switching threads cost a hundred: 256 workers of a small model simulate at
close to the speed of running their steps one after the other.

Virtual clocks advance by the :class:`~gossamer.comm.ComputeModel` at every
``compute_step()`` and by the :class:`~gossamer.comm.NetworkModel` for every message: a
send leaves when the sender's NIC is free, occupies it for ``bytes / bandwidth`` and arrives
``latency`` later. Collectives start when their last member arrives and take the alpha-beta
time of the ring (or tree) algorithm in :mod:`gossamer.comm.cost`. Each worker also has its own
torch CPU random state and grad mode, swapped in when it runs, as if it were a process of its
own (other thread-local torch state, such as autocast, is shared: keep it inside a step).

Example::

    from gossamer.comm import SimWorld, NetworkModel

    def worker(comm):
        t = torch.full((4,), float(comm.rank))
        comm.all_reduce(t)
        return t

    world = SimWorld(8, network=NetworkModel(latency=1e-5, bandwidth=1.25e9), seed=0)
    results = world.run(worker)          # one result per rank
    print(world.report.wall_clock)       # simulated seconds
"""

from __future__ import annotations

import _thread
import functools
import gc
import heapq
import math
import signal
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np
import torch
from greenlet import greenlet

from gossamer.comm import cost
from gossamer.comm.base import (
    DEFAULT_TIMEOUT,
    CommError,
    CommStats,
    CommTimeoutError,
    CommunicatorBase,
    FaultInjection,
    IdleTime,
    MembershipChange,
    ReduceOp,
    SharedState,
    VirtualClock,
    check_exchange,
    check_group_ranks,
    check_rank,
    tensor_nbytes,
    without_grad,
)
from gossamer.comm.faults import InjectedFault
from gossamer.comm.network import ComputeModel, NetworkModel
from gossamer.comm.p2p_group import HEADER_BYTES, divide_

_READY, _RUNNING, _BLOCKED, _DONE = "ready", "running", "blocked", "done"
#: allocations between the cyclic collector's young passes during a run (see SimWorld.run)
GC_THRESHOLD = 100_000


def _ranks_text(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"ranks 0-2, 5"`` (``"rank 3"`` for one)."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def _failure_lines(failures: dict[int, BaseException]) -> list[str]:
    """One line per distinct error, naming the ranks that raised it: a method that fails
    alike on every worker (a bad option) is said once, not once per worker."""
    by_text: dict[str, list[int]] = {}
    for rank, error in sorted(failures.items()):
        by_text.setdefault(f"{type(error).__name__}: {error}", []).append(rank)
    return [f"{_ranks_text(ranks)}: {text}" for text, ranks in by_text.items()]


class SimulationError(RuntimeError):
    """One or more simulated workers failed; ``failures`` maps rank to its exception."""

    def __init__(self, message: str, failures: dict[int, BaseException]) -> None:
        super().__init__(message)
        self.failures = failures


@dataclass
class SimReport:
    """What a :meth:`SimWorld.run` measured, all times in virtual seconds."""

    wall_clock: float  # the latest worker's clock at the end
    clocks: list[float]  # each worker's clock at the end
    compute_time: list[float]  # time each worker spent computing
    idle_time: list[float]  # time each worker spent waiting for others or the network
    steps: list[int]  # compute_step() calls per worker
    bytes_sent: list[int]  # per worker, all peers
    bytes_per_link: dict[tuple[int, int], int]  # (sender, receiver) -> bytes
    messages_sent: list[int]

    def as_dict(self) -> dict[str, Any]:
        return {
            "wall_clock": self.wall_clock,
            "clocks": self.clocks,
            "compute_time": self.compute_time,
            "idle_time": self.idle_time,
            "steps": self.steps,
            "bytes_sent": self.bytes_sent,
            "messages_sent": self.messages_sent,
        }


class SimWorker:
    """Scheduler-side state of one simulated worker (what SimWorld's scheduling methods, and
    MirrorWorld's, take)."""

    def __init__(self, rank: int, seed: int) -> None:
        self.rank = rank
        self.clock = 0.0
        self.nic_free = 0.0  # when this worker's NIC finishes its queued sends
        self.state = _READY
        self.glet: greenlet | None = None
        self.grad_enabled = True
        self.stats = CommStats()
        self.compute_time = 0.0
        self.idle_time = 0.0
        self.steps = 0
        self.steps_before = 0  # a resumed run's steps before its checkpoint (a trace's place)
        self.slowdown = 1.0  # compute takes this many times as long (fault injection)
        # a traced step's parts not charged yet: one at each communicator call (ComputeModel;
        # a 0 for the step's first call, whose part the step's start charged)
        self.parts: deque[float] = deque()
        self.active_time = 0.0  # real seconds run since the last compute_step (measured mode)
        self.resumed_at = 0.0
        self.deadline_token = 0
        self.wait: Wait | None = None
        self.wake_error: BaseException | None = None
        self.error: BaseException | None = None
        self.result: Any = None
        self.collective_seq: dict[int, int] = defaultdict(int)  # by group (SimWorld.groups)
        seeds = np.random.SeedSequence([seed, rank]).generate_state(2)
        self.rng = np.random.default_rng(seeds[0])
        self.torch_rng = torch.Generator().manual_seed(int(seeds[1])).get_state()


@dataclass
class Wait:
    """What a blocked worker waits for, to say so when it times out."""

    op: str
    peers: tuple[int, ...]  # global ranks that have not answered yet
    started: float


@dataclass
class _Pending:
    """A collective whose members are arriving."""

    kind: str
    members: tuple[int, ...]
    name: str
    group: int  # the members' id (SimWorld.groups)
    signature: Any = None  # what every member must call alike (the first arrival's)
    arrivals: dict[int, float] = field(default_factory=dict)  # global rank -> start time
    first: float = math.inf  # earliest and latest arrival
    last: float = -math.inf
    data: dict[int, Any] = field(default_factory=dict)  # global rank -> its data
    results: dict[int, Any] = field(default_factory=dict)  # global rank -> what it gets back
    abandoned_at: float | None = None  # virtual time a member gave up; it never completes


@dataclass
class ReceiveSlot:
    """A posted receive, filled by the matching message."""

    src: int
    tensor: torch.Tensor | None = None
    arrival: float = 0.0


class SimWorld:
    """n simulated workers in one process, deterministic, with virtual clocks.

    What a :class:`SimComm` asks of the world it runs in is public, as a
    :class:`~gossamer.comm.mirror.MirrorWorld` (one worker that stands for all) answers it
    too: :attr:`groups` (an id for each set of members), :attr:`member_index` (each group's
    local rank of every member), :attr:`everyone` (the world's ranks) and :attr:`shared` (the
    run's key-value store), all set up by each run, and :meth:`sync`, :meth:`yield_turn`,
    :meth:`block`, :meth:`wake`, :meth:`wake_if_complete` and :meth:`collective_duration`.
    The rest (matching collectives and messages) serves the calls that MirrorComm replaces.

    Args:
        world_size: number of workers (>= 1).
        network: message costs (default :class:`NetworkModel`: 1 Gbit/s, 50 us).
        compute: step costs (default :class:`ComputeModel`: 10 ms per step).
        seed: seeds each worker's torch CPU generator and compute jitter (default 0).
        timeout: virtual seconds a blocking operation waits for a peer before it fails with
            an error naming the peer (default 300).
        real_timeout: real seconds one worker may run without communicating before the run
            is declared hung (default 600).
        timing_only: run the workers under :class:`~gossamer.comm.timing.SizeOnlyMode`, for
            models built on the ``meta`` device: the same runtimes, calls, virtual times and
            bytes, no values (default False). See :mod:`gossamer.comm.timing`.
    """

    def __init__(
        self,
        world_size: int,
        *,
        network: NetworkModel | None = None,
        compute: ComputeModel | None = None,
        seed: int = 0,
        timeout: float = DEFAULT_TIMEOUT,
        real_timeout: float = 600.0,
        timing_only: bool = False,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if not real_timeout > 0:
            raise ValueError(f"real_timeout must be > 0 seconds, got {real_timeout!r}")
        self.world_size = world_size
        self.network = network if network is not None else NetworkModel()
        self.compute = compute if compute is not None else ComputeModel()
        for rank in self.compute.stragglers:
            check_rank(rank, world_size, "compute.stragglers")
        for rank in self.compute.trace:
            check_rank(rank, world_size, "compute.trace")
        self.seed = seed
        self.timeout = float(timeout)
        self.real_timeout = float(real_timeout)
        if timing_only and self.compute.measured:
            raise ValueError("timing_only: a measured compute model needs the real computation")
        self.timing_only = bool(timing_only)
        self.report: SimReport | None = None
        self._in_run = False

    # ------------------------------------------------------------------ running
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(comm, *args, **kwargs)`` on every worker; return the results by rank.

        Raises :class:`SimulationError` if any worker raised, naming each failed rank.
        After the run, :attr:`report` holds the virtual wall-clock, bytes and idle times.
        """
        if self._in_run:
            raise RuntimeError("SimWorld.run is not re-entrant")
        self._in_run = True
        saved_rng, saved_grad = torch.get_rng_state(), torch.is_grad_enabled()
        # The workers' objects live as long as the run (millions of them at 10,000 workers),
        # and the cyclic collector's passes over them, every 700 allocations by default,
        # cost a quarter of a run that finds almost no cycles: every 100,000 they cost little
        thresholds = gc.get_threshold()
        gc.set_threshold(max(thresholds[0], GC_THRESHOLD), *thresholds[1:])
        try:
            if not self.timing_only:
                return self._run(fn, args, kwargs)
            from gossamer.comm.timing import SizeOnlyMode

            with SizeOnlyMode():
                return self._run(fn, args, kwargs)
        finally:
            gc.set_threshold(*thresholds)
            torch.set_rng_state(saved_rng)
            torch.set_grad_enabled(saved_grad)
            self._in_run = False

    def _run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[Any]:
        n = self.world_size
        self._workers = [SimWorker(r, self.seed) for r in range(n)]
        self._ready: list[tuple[float, int]] = [(0.0, r) for r in range(n)]
        self._deadlines: list[tuple[float, int, int]] = []
        self._pending: dict[tuple[int, int], _Pending] = {}
        # members -> a small id: collectives are keyed by it, not by the members' tuple, whose
        # hash costs as much as its length (10,000 workers: 50 us per collective per worker)
        self.groups: dict[Hashable, int] = {}  # by members (and epoch)
        self.member_index: dict[int, dict[int, int]] = {}  # group id -> global -> local rank
        self.everyone = tuple(range(n))  # the world's members, one tuple for every worker
        self._durations: dict[Hashable, float] = {}  # see collective_duration
        self._inbox: dict[tuple[int, int], deque[tuple[torch.Tensor, float]]] = defaultdict(deque)
        self._posted: dict[tuple[int, int], deque[ReceiveSlot]] = defaultdict(deque)
        self._hub = greenlet.getcurrent()
        self._running: SimWorker | None = None
        self._handoff: SimWorker | None = None  # picked by a worker, to be started by the hub
        self._switched_at = time.perf_counter()
        self._hung: int | None = None
        self.shared: dict[str, Any] = {}  # SimComm.shared
        for w in self._workers:
            w.glet = greenlet(functools.partial(self._worker_main, w, fn, args, kwargs),
                              parent=self._hub)
        watchdog = _Watchdog(self) if threading.current_thread() is threading.main_thread() \
            else None
        # The watchdog interrupts the main thread as SIGINT does; a process started with SIGINT
        # ignored (a background job of a non-interactive shell, nohup) would never see it
        restore = None
        if watchdog is not None and signal.getsignal(signal.SIGINT) in (
                signal.SIG_IGN, signal.SIG_DFL, None):
            restore = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            while (nxt := self._next()) is not None:
                self._running = nxt
                self._switched_at = time.perf_counter()
                nxt.state = _RUNNING
                nxt.glet.switch()
            self._running = None
        finally:
            if watchdog is not None:
                watchdog.stop()
            if restore is not None:
                signal.signal(signal.SIGINT, restore)
        self.report = self._make_report()
        failures = {w.rank: w.error for w in self._workers if w.error is not None}
        if failures:
            lines = _failure_lines(failures)
            first = min(failures, key=lambda r: (self._workers[r].clock, r))
            raise SimulationError(
                f"{len(failures)} of {n} simulated workers failed, first (in virtual time) "
                f"rank {first}:\n" + "\n".join(lines),
                failures,
            ) from failures[first]
        return [w.result for w in self._workers]

    def _next(self) -> SimWorker | None:
        """The hub's next worker: the one a worker handed over (to be started), or the
        scheduler's choice."""
        if self._handoff is not None:
            nxt, self._handoff = self._handoff, None
            return nxt
        return self._pick()

    def _worker_main(self, w: SimWorker, fn: Callable, args: tuple, kwargs: dict) -> None:
        """The body of ``w``'s greenlet: its first turn starts here."""
        self._resume(w)
        try:
            w.result = fn(SimComm(self, w, self.everyone), *args, **kwargs)
        except KeyboardInterrupt:
            if self._hung != w.rank:
                raise  # a real Ctrl-C: stop the whole simulation
            w.error = CommTimeoutError(
                f"rank {w.rank} ran for more than {self.real_timeout:g} s of real time without "
                "communicating (real_timeout): it looks hung", op="run", peers=[w.rank],
            )
        except BaseException as exc:  # noqa: BLE001 - reported by run()
            w.error = exc
        w.state = _DONE

    def _make_report(self) -> SimReport:
        links: dict[tuple[int, int], int] = {}
        for w in self._workers:
            for peer, nbytes in w.stats.bytes_sent.items():
                if nbytes:
                    links[(w.rank, peer)] = nbytes
        return SimReport(
            wall_clock=max(w.clock for w in self._workers),
            clocks=[w.clock for w in self._workers],
            compute_time=[w.compute_time for w in self._workers],
            idle_time=[w.idle_time for w in self._workers],
            steps=[w.steps for w in self._workers],
            bytes_sent=[w.stats.total_bytes_sent for w in self._workers],
            bytes_per_link=links,
            messages_sent=[w.stats.total_messages_sent for w in self._workers],
        )

    # ------------------------------------------------------------------ scheduling
    # (sync, yield_turn, block, wake, wake_if_complete: SimComm's, and MirrorWorld's too)
    def _pick(self) -> SimWorker | None:
        """The next worker to run: the smallest (clock, rank) among the ready, after firing
        every timeout that falls before it. None when every worker is done."""
        while True:
            while self._deadlines:
                deadline, rank, token = self._deadlines[0]
                w = self._workers[rank]
                if w.state == _BLOCKED and w.deadline_token == token:
                    break
                heapq.heappop(self._deadlines)
            if self._deadlines and (not self._ready or self._deadlines[0][0] < self._ready[0][0]):
                deadline, rank, _ = heapq.heappop(self._deadlines)
                self._fire_timeout(self._workers[rank], deadline)
                continue
            if self._ready:
                _, rank = heapq.heappop(self._ready)
                return self._workers[rank]
            blocked = [w for w in self._workers if w.state == _BLOCKED]
            if not blocked:
                return None
            for w in blocked:  # hung on purpose, or else only with an infinite timeout
                if isinstance(w.wait, _HangWait):
                    self.wake(w, w.clock, InjectedFault(
                        f"{w.wait.reason}; the simulation ended it once no other worker was "
                        "left to run"))
                    continue
                self.wake(w, w.clock, CommError(
                    f"deadlock: every live worker is blocked; rank {w.rank} waits in "
                    f"{w.wait.op if w.wait else '?'}", op=w.wait.op if w.wait else "?",
                ))

    def _resume(self, w: SimWorker) -> None:
        """Runs in ``w``'s greenlet when it gets the turn: its own random and grad state."""
        # (the generator's and autograd's own calls: torch's wrappers cost a few us a switch)
        torch.default_generator.set_state(w.torch_rng)
        torch._C._set_grad_enabled(w.grad_enabled)
        w.resumed_at = time.perf_counter()

    def yield_turn(self, w: SimWorker) -> None:
        """Give up the turn and come back when the scheduler picks ``w`` again.

        The caller has either queued ``w`` as ready or marked it blocked. Raises what the
        scheduler left for ``w`` (a timeout).
        """
        if torch.is_inference_mode_enabled():
            raise RuntimeError(
                "SimWorld cannot switch workers inside torch.inference_mode(), whose state it "
                "cannot save: communicate under torch.no_grad() instead"
            )
        w.torch_rng = torch.default_generator.get_state()
        w.grad_enabled = torch.is_grad_enabled()
        w.active_time += time.perf_counter() - w.resumed_at
        # the scheduler's choice, made here: one switch, straight to the next worker (through
        # the hub, two switches a turn cost a fifth of a small model's simulated step)
        nxt = self._pick()
        if nxt is None or not nxt.glet:  # none (impossible while w waits), or not started:
            self._handoff = nxt  # the hub starts it, on its own stack (a greenlet starts on
            self._hub.switch()  # the stack of the one that switches to it first)
        elif nxt is not w:
            self._running = nxt
            self._switched_at = time.perf_counter()
            nxt.state = _RUNNING
            nxt.glet.switch()
        else:
            w.state = _RUNNING
            self._switched_at = time.perf_counter()
        self._resume(w)
        if w.wake_error is not None:
            error, w.wake_error = w.wake_error, None
            raise error

    def sync(self, w: SimWorker) -> None:
        """Let every worker that is earlier in virtual time act first: afterwards nothing
        can happen any more at a virtual time before ``w``'s clock."""
        ready, deadlines = self._ready, self._deadlines
        if (not ready or (w.clock, w.rank) < ready[0]) and not (
                deadlines and deadlines[0][0] < w.clock) and w.wake_error is None \
                and not torch.is_inference_mode_enabled():
            # the scheduler would pick ``w`` again: go on without giving up the turn (an
            # asynchronous method looks for each peer's message this way, 10,000 workers
            # times a step)
            self._switched_at = time.perf_counter()
            return
        heapq.heappush(ready, (w.clock, w.rank))
        w.state = _READY
        self.yield_turn(w)

    def block(self, w: SimWorker, wait: Wait) -> None:
        """Block ``w`` until woken or until its timeout."""
        w.state = _BLOCKED
        w.wait = wait
        w.deadline_token += 1
        heapq.heappush(self._deadlines, (wait.started + self.timeout, w.rank, w.deadline_token))
        self.yield_turn(w)

    def wake(self, w: SimWorker, at: float, error: BaseException | None = None) -> None:
        """Make ``w`` ready to run at virtual time ``at`` (the time it waited counts as idle),
        to raise ``error`` (if any) when it resumes."""
        w.idle_time += max(0.0, at - w.clock)
        w.clock = max(w.clock, at)
        w.state = _READY
        w.wait = None
        w.wake_error = error
        heapq.heappush(self._ready, (w.clock, w.rank))

    def _describe(self, rank: int, seen: frozenset[int] = frozenset()) -> str:
        """What ``rank`` is doing; for a blocked worker, also whom it waits for (and so on),
        so that a worker waiting for a waiting worker names the one that failed."""
        w = self._workers[rank]
        if w.error is not None:
            text = str(w.error)
            if seen and len(text) > 160:  # a worker further down the chain: its gist
                text = text[:157] + "..."
            return f"rank {rank} (failed: {type(w.error).__name__}: {text})"
        if w.state == _DONE:
            return f"rank {rank} (finished)"
        if w.state == _BLOCKED and isinstance(w.wait, _HangWait):
            return f"rank {rank} (hung at t={w.clock:.6g} s: {w.wait.reason})"
        if w.state == _BLOCKED and w.wait is not None:
            others = [p for p in self._waiting_for(w) if p not in seen and p != rank]
            via = ""
            if others and len(seen) < 3:
                via = ", waiting for " + ", ".join(
                    self._describe(p, seen | {rank}) for p in others[:2])
            return f"rank {rank} (blocked in {w.wait.op} at t={w.clock:.6g} s{via})"
        return f"rank {rank} (at t={w.clock:.6g} s, not there yet)"

    def _waiting_for(self, w: SimWorker) -> tuple[int, ...]:
        """The ranks whose arrival or message blocked ``w`` is still missing."""
        wait = w.wait
        if isinstance(wait, _CollectiveWait) and wait.pending is not None:
            return tuple(m for m in wait.pending.members if m not in wait.pending.arrivals)
        if isinstance(wait, ExchangeWait) and wait.handle is not None:
            return tuple(s.src for s in wait.handle._slots if s.tensor is None)
        return ()

    def _hang(self, w: SimWorker, reason: str) -> NoReturn:
        """``w`` blocks for ever (fault injection): no deadline, nothing wakes it, except the
        end of the simulation (see _pick)."""
        w.state = _BLOCKED
        w.wait = _HangWait(f"a hang ({reason})", (), w.clock, reason=reason)
        self.yield_turn(w)
        raise AssertionError("a hung worker was resumed")  # _pick wakes it with an error

    def _fire_timeout(self, w: SimWorker, deadline: float) -> None:
        """``w`` gave up waiting at virtual time ``deadline`` ."""
        wait = w.wait
        assert wait is not None
        if isinstance(wait, _CollectiveWait):
            pending = wait.pending
            assert pending is not None
            wait.peers = tuple(
                m for m in pending.members if pending.arrivals.get(m, math.inf) > deadline
            )
        elif isinstance(wait, ExchangeWait):
            assert wait.handle is not None
            wait.peers = tuple(
                s.src for s in wait.handle._slots if s.tensor is None or s.arrival > deadline
            )
        peers = ", ".join(self._describe(p) for p in wait.peers) or "nobody"
        error = CommTimeoutError(
            f"{wait.op} on rank {w.rank} timed out after {self.timeout:g} s (virtual) "
            f"waiting for {peers}",
            op=wait.op, peers=wait.peers,
        )
        self.wake(w, deadline, error)
        if isinstance(wait, _CollectiveWait) and wait.pending.abandoned_at is None:
            pending = wait.pending
            pending.abandoned_at = deadline
            # Members that arrive after the give-up (in virtual time) find it abandoned.
            for m, arrival in pending.arrivals.items():
                member = self._workers[m]
                if arrival > deadline and member.state == _BLOCKED and isinstance(
                    member.wait, _CollectiveWait
                ) and member.wait.pending is pending:
                    self.wake(member, arrival, self._abandoned(pending, w.rank, deadline))

    def _abandoned(self, pending: _Pending, by: int, at: float) -> CommError:
        return CommError(
            f"{pending.name}: rank {by} gave up on it at t={at:.6g} s (timeout), before this "
            "worker arrived", op=pending.name, peers=[by],
        )

    # ------------------------------------------------------------------ collectives
    def _collective(
        self, view: SimComm, kind: str, data: Any, signature: Any,
        finish: Callable[[_Pending], tuple[float, dict[int, Any]]],
    ) -> Any:
        """Arrive at a collective of ``view``'s members; the last to arrive completes it."""
        w = view._worker
        members = view._members
        # No need to wait for earlier workers first: the outcome depends only on the members'
        # virtual arrival times, and a timeout is decided by comparing them (see _fire_timeout).
        w.collective_seq[view._group] += 1
        seq = w.collective_seq[view._group]
        key = (view._group, seq)
        pending = self._pending.get(key)
        if pending is None:  # the first to arrive (not setdefault: one record per collective)
            pending = self._pending[key] = _Pending(kind, members, f"{kind} #{seq}",
                                                    view._group, signature)
        name = pending.name
        arrival = max(w.clock, w.nic_free)
        if pending.kind != kind or pending.signature != signature:
            pending.abandoned_at = -math.inf
            name = f"{kind} #{seq}"
            raise CommError(
                f"{name}: members called different collectives or shapes "
                f"({pending.signature if pending.data else pending.kind} vs {signature})",
                op=name,
            )
        if pending.abandoned_at is not None and arrival > pending.abandoned_at:
            by = min(pending.arrivals, key=lambda m: pending.arrivals[m])
            raise self._abandoned(pending, by, pending.abandoned_at)
        pending.arrivals[w.rank] = arrival
        pending.first, pending.last = min(pending.first, arrival), max(pending.last, arrival)
        pending.data[w.rank] = data
        if (
            len(pending.arrivals) < len(members)
            or pending.abandoned_at is not None
            or pending.last > pending.first + self.timeout  # someone gave up first
        ):
            # who is missing is worked out only if it times out (_fire_timeout)
            self.block(w, _CollectiveWait(name, (), arrival, pending=pending))
            return pending.results.pop(w.rank, None)
        del self._pending[key]
        end, results = finish(pending)
        pending.results.update(results)
        for m in members:
            member = self._workers[m]
            member.nic_free = end
            if member is not w:
                self.wake(member, end)
        self.wake(w, end)
        self.yield_turn(w)
        return pending.results.pop(w.rank, None)

    def collective_duration(self, key: Hashable, compute: Callable[[], float]) -> float:
        """A collective's virtual duration, ``compute()``, kept by ``key`` (the group's id,
        the collective and its sizes): the network model is frozen, and its members' links
        are the same at every call (the ring's slowest link costs a call per member)."""
        duration = self._durations.get(key)
        if duration is None:
            duration = self._durations[key] = compute()
        return duration

    def _finish_all_reduce(self, p: _Pending) -> tuple[float, dict[int, Any]]:
        """Sum (or average) the members' tensors into every one of them."""
        parts = [p.data[m] for m in p.members]
        n = len(parts)
        total = parts[0].detach().clone()
        for part in parts[1:]:
            total.add_(part)
        if p.signature[1] == "mean":
            divide_(total, n)  # integers round down, as on real processes
        torch._foreach_copy_(parts, [total] * n)  # one call for every member
        numel, esize = total.numel(), total.element_size()
        return p.last + self.collective_duration(
            (p.group, "all_reduce", numel, esize),
            lambda: cost.ring_all_reduce_time(n, numel, esize, self.network, p.members)), {}

    def _finish_barrier(self, p: _Pending) -> tuple[float, dict[int, Any]]:
        n = len(p.members)
        return p.last + self.collective_duration(
            (p.group, "barrier"), lambda: cost.barrier_time(n, self.network, p.members)), {}

    # ------------------------------------------------------------------ point to point
    def _send(self, w: SimWorker, dst: int, tensor: torch.Tensor) -> float:
        """Queue a message on ``w``'s NIC; returns when the NIC is done with it."""
        nbytes = tensor_nbytes(tensor)
        start = max(w.clock, w.nic_free)
        w.nic_free = start + self.network.transfer_time(w.rank, dst, nbytes)
        arrival = w.nic_free + self.network.message_time(w.rank, dst, 0)
        payload = tensor.detach().clone()
        posted = self._posted[(w.rank, dst)]
        if posted:
            slot = posted.popleft()
            slot.tensor, slot.arrival = payload, arrival
            receiver = self._workers[dst]
            if receiver.state == _BLOCKED and isinstance(receiver.wait, ExchangeWait):
                self.wake_if_complete(receiver)
        else:
            self._inbox[(w.rank, dst)].append((payload, arrival))
        return w.nic_free

    def _post(self, w: SimWorker, src: int) -> ReceiveSlot:
        slot = ReceiveSlot(src)
        inbox = self._inbox[(src, w.rank)]
        if inbox:
            slot.tensor, slot.arrival = inbox.popleft()
        else:
            self._posted[(src, w.rank)].append(slot)
        return slot

    def wake_if_complete(self, w: SimWorker) -> None:
        """Wake ``w`` if its exchange has everything it waits for ."""
        wait = w.wait
        assert isinstance(wait, ExchangeWait) and wait.handle is not None
        missing = tuple(s.src for s in wait.handle._slots if s.tensor is None)
        if missing:
            wait.peers = missing
            return
        deadline = wait.started + self.timeout
        completion = wait.handle.completion()
        if completion > deadline:  # a message arrives, in virtual time, too late
            self._fire_timeout(w, deadline)
        else:
            self.wake(w, completion)


@dataclass
class _CollectiveWait(Wait):
    pending: _Pending | None = None


@dataclass
class ExchangeWait(Wait):
    """A worker waits for the receives of an exchange (``handle``)."""

    handle: SimHandle | None = None


@dataclass
class _HangWait(Wait):
    reason: str = ""


class SimHandle:
    """An exchange in flight in the simulator."""

    def __init__(
        self, view: SimComm, slots: list[ReceiveSlot], sends_done: float,
        like: torch.Tensor | None, name: str, counted: bool = True,
    ) -> None:
        self._view = view
        self._slots = slots
        self._sends_done = sends_done
        self._like = like
        self._name = name
        self._counted = counted  # whether the receives count in the stats (see uncounted)
        self._result: dict[int, torch.Tensor] | None = None

    def completion(self) -> float:
        """The virtual time at which every send left and every receive arrived."""
        return max([self._sends_done] + [s.arrival for s in self._slots])

    def ready(self) -> bool:
        """Whether everything has arrived by this worker's virtual time (never blocks)."""
        if self._result is not None:
            return True
        world, w = self._view._world, self._view._worker
        world.sync(w)
        return all(s.tensor is not None for s in self._slots) and self.completion() <= w.clock

    def wait(self) -> dict[int, torch.Tensor]:
        view = self._view
        if view._worker.parts:
            view._local_work()
        if self._result is not None:
            return self._result
        world, w = view._world, view._worker
        wait = ExchangeWait(self._name, (), w.clock, handle=self)
        if any(s.tensor is None for s in self._slots):
            world.block(w, wait)
        else:
            w.wait = wait
            world.wake_if_complete(w)
            world.yield_turn(w)
        result = {}
        for slot in self._slots:
            tensor = slot.tensor
            assert tensor is not None and self._like is not None
            if tensor.numel() != self._like.numel() or tensor.dtype != self._like.dtype:
                raise CommError(
                    f"{self._name}: rank {view._to_local(slot.src)} sent {tensor.numel()} "
                    f"{tensor.dtype} elements, expected {self._like.numel()} {self._like.dtype}",
                    op=self._name, peers=[view._to_local(slot.src)],
                )
            peer = view._to_local(slot.src)
            if self._counted:
                view._record(peer, tensor_nbytes(tensor), sent=False)
            result[peer] = tensor.view(self._like.shape).to(self._like.device)
        self._result = result
        return result


#: counters and what to add to them: (bytes by peer, messages by peer, peer, bytes, messages)
_Plan = list[tuple[dict[int, int], dict[int, int], int, int, int]]


class SimComm(CommunicatorBase, IdleTime, VirtualClock, FaultInjection, MembershipChange,
              SharedState):
    """One simulated worker's communicator (over the whole world or a subgroup of it)."""

    def __init__(self, world: SimWorld, worker: SimWorker, members: tuple[int, ...],
                 epoch: str | None = None, parent: SimComm | None = None) -> None:
        self._world = world
        self._worker = worker
        self._members = members
        # ``epoch``: the membership this communicator belongs to (None: the run's first). Its
        # collectives are matched apart from those of the same members in another epoch, as
        # a new process group's are on real processes: a member that missed a collective of
        # an earlier epoch is not matched against it.
        self._epoch = epoch
        key = members if epoch is None else (members, epoch)
        self._group = world.groups.setdefault(key, len(world.groups))
        # the members' local ranks, one mapping per group for all its members (10,000 workers
        # each with a map of the world's ranks would hold 10^8 entries)
        index = world.member_index.get(self._group)
        if index is None:
            index = world.member_index[self._group] = {g: i for i, g in enumerate(members)}
        self._index = index
        everyone = world.everyone
        super().__init__(index[worker.rank], len(members),
                         worker.stats if members is everyone or (
                             len(members) == world.world_size and members == everyone)
                         else CommStats())
        # Where traffic is counted: here (in this view's ranks), in every enclosing group (in
        # its ranks: a subgroup's traffic is its parent's too, as a P2PGroup's goes through
        # its parent) and in the worker's stats (global ranks), each stats object once.
        sinks: list[tuple[CommStats, dict[int, int] | None]] = [(self._stats, self._index)]
        if parent is not None:
            sinks += parent._sinks
        sinks.append((worker.stats, None))
        self._sinks: list[tuple[CommStats, dict[int, int] | None]] = []
        for stats, index in sinks:
            if all(stats is not seen for seen, _ in self._sinks):
                self._sinks.append((stats, index))
        self._exchanges = 0
        #: (numel, element size) -> the ring all-reduce's traffic of this rank, as a _plan
        self._ring_traffic: dict[tuple[int, int], _Plan] = {}
        self._barrier_traffic: _Plan | None = None  # the same at every barrier: see barrier()
        #: the counters of operations of this view and the enclosing ones (see _count)
        self._operations = [stats.operations for stats, _ in self._sinks]

    @property
    def global_rank(self) -> int:
        return self._worker.rank

    @property
    def sim_worker(self) -> Any:
        """The simulated worker this view belongs to (its virtual clock, its rank)."""
        return self._worker

    @property
    def sim_world(self) -> Any:
        """The simulated world this view runs in."""
        return self._world

    def _to_local(self, global_rank: int) -> int:
        return self._index[global_rank]

    def _record(self, peer: int, nbytes: int, *, sent: bool, messages: int = 1) -> None:
        """Count traffic with ``peer`` (a rank of this view) here, in the enclosing groups
        and in the world stats, each in its own ranks."""
        traffic = [(peer, nbytes, messages)]
        if sent:
            self._record_traffic(traffic, [])
        else:
            self._record_traffic([], traffic)

    def _record_traffic(self, sent: cost.Traffic, received: cost.Traffic) -> None:
        self._replay(self._plan(sent, received))

    def _plan(self, sent: cost.Traffic, received: cost.Traffic) -> _Plan:
        """What :meth:`_record_traffic` of ``sent`` and ``received`` adds, and to which
        counters: for a collective whose traffic is the same at every call, recorded by
        :meth:`_replay` without working out the peers again (a call of a small model's
        simulated step is a few microseconds)."""
        plan = []
        for traffic, is_sent in ((sent, True), (received, False)):
            for peer, nbytes, messages in traffic:
                member = self._members[peer]
                for stats, index in self._sinks:
                    p = member if index is None else index[member]
                    if is_sent:
                        plan.append((stats.bytes_sent, stats.messages_sent, p, nbytes, messages))
                    else:
                        plan.append((stats.bytes_received, stats.messages_received, p, nbytes,
                                     messages))
        return plan

    @staticmethod
    def _replay(plan: _Plan) -> None:
        """Record a :meth:`_plan`'s traffic (what _record_traffic would have)."""
        for nbytes_by_peer, messages_by_peer, peer, nbytes, messages in plan:
            nbytes_by_peer[peer] += nbytes
            messages_by_peer[peer] += messages

    def _count(self, op: str) -> None:
        for operations in self._operations:
            operations[op] += 1

    def _count_collective(self, op: str, sent: cost.Traffic, received: cost.Traffic) -> None:
        """Count a collective ``op`` (traffic in this view's ranks, ``received`` naming the
        senders) here, in the enclosing groups and in the world stats: what
        :meth:`record_group_collective` counts of a
        :class:`~gossamer.comm.p2p_group.P2PGroup` over this communicator, as :meth:`group`'s
        collectives are counted."""
        self._record_traffic(sent, received)
        self._count(op)

    # ---- the traffic of each collective, counted alike by SimComm and MirrorComm
    def _all_reduce_traffic(self, tensor: torch.Tensor) -> None:
        size = (tensor.numel(), tensor.element_size())
        plan = self._ring_traffic.get(size)
        if plan is None:  # the same every step: worked out once
            n, me = self.world_size, self._rank
            pred = (me - 1) % n
            plan = self._ring_traffic[size] = self._plan(
                cost.ring_all_reduce_traffic(me, n, *size),
                [(pred, b, m) for _, b, m in cost.ring_all_reduce_traffic(pred, n, *size)],
            )
        self._replay(plan)

    def _all_gather_traffic(self, sizes: list[int]) -> None:
        n, me = self.world_size, self._rank
        pred = (me - 1) % n
        self._record_traffic(
            cost.ring_all_gather_traffic(me, n, sizes),
            [(pred, b, m) for _, b, m in cost.ring_all_gather_traffic(pred, n, sizes)],
        )

    def _broadcast_traffic(self, src: int, nbytes: int) -> None:
        n, me = self.world_size, self._rank
        self._record_traffic(
            cost.broadcast_traffic(me, n, src, nbytes),
            [(s, nbytes, 1) for s in cost.broadcast_sources(me, n, src)],
        )

    def _barrier_traffic_counted(self) -> None:
        plan = self._barrier_traffic
        if plan is None:  # the same at every barrier: worked out once
            n, me = self.world_size, self._rank
            plan = self._barrier_traffic = self._plan(
                cost.barrier_traffic(me, n),
                [((me - (1 << r)) % n, 0, 1) for r in range(cost.barrier_rounds(n))],
            )
        self._replay(plan)

    # ---- collectives
    def _start_all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        """What every all-reduce does first: check ``op``, finish the local work, count the
        call and its traffic (shared with MirrorComm)."""
        if op not in ("sum", "mean"):
            raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
        if self._worker.parts:
            self._local_work()
        self._count("all_reduce")
        self._all_reduce_traffic(tensor)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        self._start_all_reduce(tensor, op)
        if len(self._members) == 1:
            return tensor
        signature = ("all_reduce", op, tuple(tensor.shape), tensor.dtype)
        without_grad(self._world._collective, self, "all_reduce", tensor, signature,
                     self._world._finish_all_reduce)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        n = self.world_size
        if self._worker.parts:
            self._local_work()
        self._count("all_gather")
        world = self._world

        def finish(p: _Pending) -> tuple[float, dict[int, Any]]:
            parts = [p.data[m] for m in p.members]
            sizes = [tensor_nbytes(t) for t in parts]
            # Each member gets copies of its own: it may modify them in place.
            results = {m: (sizes, [t.detach().clone() for t in parts]) for m in p.members}
            # as the real communicators do it: the shapes first, in a small header gathered
            # alike, then the payloads (none when every one is empty)
            duration = cost.ring_all_gather_time([HEADER_BYTES] * len(p.members),
                                                 world.network, p.members)
            if max(sizes):
                duration += cost.ring_all_gather_time(sizes, world.network, p.members)
            return p.last + duration, results

        signature = ("all_gather", tensor.dtype, tensor.dim())
        if n == 1:
            return [tensor.detach().clone()]
        sizes, parts = self._world._collective(self, "all_gather", tensor, signature, finish)
        self._all_gather_traffic(sizes)
        return parts

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
        world = self._world

        def finish(p: _Pending) -> tuple[float, dict[int, Any]]:
            source = p.data[p.members[src]]
            for m in p.members:
                if m != p.members[src]:
                    p.data[m].copy_(source)
            start = p.last
            return start + cost.broadcast_time(n, src, nbytes, world.network, p.members), {}

        signature = ("broadcast", src, tuple(tensor.shape), tensor.dtype)
        with torch.no_grad():
            self._world._collective(self, "broadcast", tensor, signature, finish)
        return tensor

    def barrier(self) -> None:
        if self._worker.parts:
            self._local_work()
        self._count("barrier")
        self._barrier_traffic_counted()
        if len(self._members) == 1:
            return
        self._world._collective(self, "barrier", None, ("barrier",),
                                self._world._finish_barrier)

    # ---- point to point
    def exchange(
        self,
        sends: Mapping[int, torch.Tensor],
        recv_from: Sequence[int],
        recv_like: torch.Tensor | None = None,
    ) -> SimHandle:
        like = check_exchange(self._rank, self.world_size, sends, recv_from, recv_like)
        if self._worker.parts:
            self._local_work()
        self._exchanges += 1
        name = f"exchange #{self._exchanges}"
        counted = self._counting
        if counted:
            self._count("exchange")
        world, w = self._world, self._worker
        sends_done = w.clock
        for peer, tensor in sends.items():
            sends_done = world._send(w, self._members[peer], tensor)
            if counted:
                self._record(peer, tensor_nbytes(tensor), sent=True)
        slots = [world._post(w, self._members[src]) for src in recv_from]
        return SimHandle(self, slots, sends_done, like, name, counted)

    def group(self, ranks: Sequence[int]) -> SimComm:
        ranks = check_group_ranks(ranks, self.world_size)
        if self._rank not in ranks:
            raise ValueError(f"ranks {list(ranks)} do not include this worker's rank {self._rank}")
        # of this view's class: a MirrorComm's groups are MirrorComms
        return type(self)(self._world, self._worker, tuple(self._members[r] for r in ranks),
                          self._epoch, parent=self)

    # ---- membership changes (gossamer.comm.membership)
    @property
    def shared(self) -> dict[str, Any]:
        """A dict every worker of this run sees: the simulator's key-value store."""
        return self._world.shared

    def peer_alive(self, rank: int) -> bool:
        """Whether ``rank`` has neither crashed, nor hung, nor finished."""
        peer = self._world._workers[self._members[rank]]
        return peer.state != _DONE and not isinstance(peer.wait, _HangWait)

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of virtual time, letting every earlier worker act first."""
        w = self._worker
        w.idle_time += seconds
        w.clock += seconds
        self._world.sync(w)

    def regroup(self, rank: int, members: Sequence[int], name: str) -> SimComm:
        """A communicator over ``members`` (global ranks; this worker's is ``rank``-th). The
        messages sent to this worker and the receives it posted before are dropped: they
        belong to the old membership."""
        world, me = self._world, self._worker.rank
        if tuple(members)[rank] != me:
            raise ValueError(f"regroup: member {rank} is {members[rank]}, not this worker ({me})")
        for key in [k for k in world._inbox if k[1] == me]:
            del world._inbox[key]
        for key in [k for k in world._posted if k[1] == me]:
            del world._posted[key]
        return SimComm(world, self._worker, tuple(members), name)

    # ---- time
    def clock(self) -> float:
        return self._worker.clock

    @property
    def idle_time(self) -> float:
        """Virtual seconds this worker spent blocked, waiting for other workers or the network."""
        return self._worker.idle_time

    # ---- fault injection (gossamer.comm.faults)
    def fail(self, kind: str, reason: str) -> NoReturn:
        """``"crash"``: this worker stops here, as a dead process would (whoever waits for it
        times out); ``"hang"``: it blocks for ever without finishing."""
        if kind == "hang":
            self._world._hang(self._worker, reason)
        raise InjectedFault(reason)

    def _local_work(self) -> None:
        """Charge the next part of a traced step (:class:`ComputeModel`), on entering a
        communicator call."""
        w = self._worker
        duration = w.parts.popleft() * w.slowdown
        w.clock += duration
        w.compute_time += duration

    def slow_down(self, factor: float) -> None:
        """From now on this worker's compute takes ``factor`` times as long (virtual time)."""
        self._worker.slowdown = float(factor)

    def simulation_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of this simulated worker beyond the training's own state:
        the generator of its compute model's draws (``jitter``) and its count of steps (the
        place in a ``trace``), so that a resumed run takes the step times that a run never
        interrupted would have taken."""
        return {"compute_rng": self._worker.rng.bit_generator.state,
                "compute_steps": self._worker.steps + self._worker.steps_before,
                "compute_parts": list(self._worker.parts)}

    def load_simulation_state(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`simulation_state`'s ``state``."""
        self._worker.rng.bit_generator.state = dict(state["compute_rng"])
        w = self._worker
        w.steps_before = int(state.get("compute_steps", w.steps + w.steps_before)) - w.steps
        w.parts = deque(float(t) for t in state.get("compute_parts", w.parts))

    def compute_step(self) -> None:
        w = self._worker
        model = self._world.compute
        left = 0.0
        if w.parts:  # the previous step's parts after its last call
            left = sum(w.parts)
            w.parts.clear()
        if model.measured:
            now = time.perf_counter()
            duration = w.active_time + (now - w.resumed_at)
            w.active_time, w.resumed_at = 0.0, now
        else:
            step = w.steps_before + w.steps
            parts = model.step_parts(w.rank, step)
            if parts is None:
                duration = model.step_duration(w.rank, w.rng, step)
            else:  # the first part now, the next at the second call, and so on
                duration = parts[0]
                if len(parts) > 1:
                    w.parts.append(0.0)  # the step's first call: its work is charged here
                    w.parts.extend(parts[1:])
        duration = (left + duration) * w.slowdown
        w.clock += duration
        w.compute_time += duration
        w.steps += 1


class _Watchdog:
    """Interrupts the main thread when one simulated worker runs too long without yielding.

    Workers are greenlets of one thread, so a worker stuck in its own computation would stop
    the whole simulation; this thread turns that into an error naming the worker.
    """

    def __init__(self, world: SimWorld) -> None:
        self._world = world
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True,
                                        name="gossamer-sim-watchdog")
        self._thread.start()

    def _watch(self) -> None:
        world = self._world
        period = min(1.0, world.real_timeout / 4)
        while not self._stop.wait(period):
            running = world._running
            overrun = time.perf_counter() - world._switched_at
            if running is not None and overrun > world.real_timeout:
                world._hung = running.rank
                _thread.interrupt_main()
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
