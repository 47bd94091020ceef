"""Start N worker processes, pump their output, and stop them all when one fails.

The one process supervisor of ``gossamer launch`` (:mod:`gossamer.launch.launcher`), of the
test helper :func:`gossamer.testing.spawn_gloo` and of the benchmarks' emulated runs:

- each worker is a process of its own session, started with the environment it is given (see
  :mod:`gossamer.comm.environment` for the launcher's variables), so that its whole process
  group can be signalled;
- its stdout and stderr are read line by line into a tail of its last lines and, if asked,
  written with a prefix (``[rank 3] ``) to an :class:`Output`, one whole line at a time; or
  they go straight to this process's own (``output=None``);
- :meth:`Supervisor.wait` returns when every worker has exited, or when one failed (after
  ``linger`` seconds for the others to end by themselves), or when its timeout passed; in the
  last two cases the others are stopped: SIGTERM to their process groups, SIGKILL after
  ``grace`` seconds;
- :attr:`Outcome.exit_code` is what a launcher exits with: 0, the first failed worker's exit
  code (128 + the signal's number when a signal killed it), or 124 when the time ran out.

Every wait is bounded, and nothing sleeps to synchronise: each worker has a thread blocked in
``waitpid`` that reports its exit on a queue, and :meth:`Supervisor.wait` blocks on that queue.

Example::

    with Supervisor(output=Output(sys.stdout, sys.stderr)) as workers:
        for rank in range(2):
            env = {**without_launcher(), **torchrun_variables(rank, 2, "127.0.0.1", port)}
            workers.start(rank, [sys.executable, "train.py"], env, echo=f"[rank {rank}] ")
        outcome = workers.wait(timeout=600)
    sys.exit(outcome.exit_code)
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

__all__ = ["GRACE", "TIMED_OUT", "Outcome", "Output", "Supervisor", "describe_exit",
           "shell_code"]

GRACE = 5.0  # seconds the workers get to exit after SIGTERM before they are killed
TIMED_OUT = 124  # the exit code of a run whose time ran out, as timeout(1) gives
_REAP_WAIT = 10.0  # seconds a SIGKILLed process may take to be reaped (the kernel's work)
_PUMP_WAIT = 5.0  # seconds a pump may take to pass on the last lines of an ended worker
_SLICE = 1.0  # the longest single wait of wait(), so that it never blocks unbounded


def shell_code(returncode: int) -> int:
    """A process's exit code as a shell reports it: 128 + the signal's number for a signal."""
    return returncode if returncode >= 0 else 128 - returncode


def describe_exit(returncode: int | None) -> str:
    """``exited with code 1``, ``was killed by SIGKILL``, or ``is still running``."""
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


@dataclass
class Output:
    """Where the workers' lines go, one whole line at a time: every writer (the pumps, and the
    supervisor's owner through :meth:`write`) holds one lock per line."""

    out: IO[str]
    err: IO[str]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def write(self, sink: IO[str], line: str) -> None:
        with self.lock:
            sink.write(line + "\n")
            sink.flush()


@dataclass(frozen=True)
class Outcome:
    """How the workers ended.

    Args:
        codes: rank -> exit code as :class:`subprocess.Popen` gives it (negative: killed by
            that signal; None: not even SIGKILL ended it in time).
        failed: the first rank that failed, or None.
        timed_out: whether the time ran out before the workers ended.
        stopped: the ranks that were still running when one failed or the time ran out, and
            that the supervisor stopped.
    """

    codes: Mapping[int, int | None]
    failed: int | None = None
    timed_out: bool = False
    stopped: tuple[int, ...] = ()

    @property
    def exit_code(self) -> int:
        """0; the first failed worker's exit code (128 + signal); :data:`TIMED_OUT`."""
        if self.failed is not None:
            code = self.codes[self.failed]
            return TIMED_OUT if code is None else shell_code(code)
        return TIMED_OUT if self.timed_out else 0


@dataclass
class _Worker:
    rank: int
    process: subprocess.Popen
    tail: collections.deque[str]
    done: threading.Event = field(default_factory=threading.Event)  # reaped
    muted: threading.Event = field(default_factory=threading.Event)  # being stopped: no echo
    threads: list[threading.Thread] = field(default_factory=list)  # the pumps


class Supervisor:
    """N worker processes, watched together; see the module docstring.

    Args:
        output: where the workers' prefixed lines go; None: the workers write straight to this
            process's stdout and stderr, and no tail is kept (default None).
        grace: seconds the workers get to exit after SIGTERM when they are stopped, before
            SIGKILL (default 5.0).
        linger: seconds the others get to end by themselves after one failed, before they are
            stopped (default 0.0: at once).
        is_failure: whether ``(rank, exit code)`` is a failure (default: a code other than 0).
        on_failure: called with ``(rank, exit code, ranks still running)`` at the first
            failure, once the failed worker's last lines are out, before anything is stopped.
        shield: a context manager factory that :meth:`stop` runs inside, e.g. a
            :class:`~gossamer.launch.netem.SignalGuard`'s ``shielded``, so that a second
            Ctrl-C does not cut the stopping short (default: none).
        tail: how many of each worker's last lines :meth:`tail` keeps (default 40).
    """

    def __init__(
        self,
        *,
        output: Output | None = None,
        grace: float = GRACE,
        linger: float = 0.0,
        is_failure: Callable[[int, int], bool] | None = None,
        on_failure: Callable[[int, int, list[int]], None] | None = None,
        shield: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
        tail: int = 40,
    ) -> None:
        if not grace >= 0:
            raise ValueError(f"grace must be >= 0 seconds, got {grace!r}")
        if not linger >= 0:
            raise ValueError(f"linger must be >= 0 seconds, got {linger!r}")
        self.output = output
        self.grace = float(grace)
        self.linger = float(linger)
        self._is_failure = is_failure or (lambda rank, code: code != 0)
        self._on_failure = on_failure
        self._shield = shield or contextlib.nullcontext
        self._tail = tail
        self._workers: dict[int, _Worker] = {}
        self._exits: queue.Queue[int] = queue.Queue()
        self._stopped = False

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def ranks(self) -> list[int]:
        return list(self._workers)

    def start(
        self,
        rank: int,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        cwd: str | Path | None = None,
        echo: str | None = "",
    ) -> None:
        """Start worker ``rank``: ``argv`` with exactly the environment ``env``.

        ``echo`` is the prefix its lines are written to :attr:`output` with (stdout to
        ``output.out``, stderr to ``output.err``); None: they are only kept for :meth:`tail`.
        Ignored without an output. Raises OSError when the process cannot start.
        """
        if rank in self._workers:
            raise ValueError(f"rank {rank} is started already")
        pipe = subprocess.PIPE if self.output is not None else None
        # Its own session: a Ctrl-C in the terminal reaches this process only, which stops the
        # workers in order, and the worker's whole process group can be signalled.
        process = subprocess.Popen(list(argv), env=dict(env), cwd=cwd,
                                   stdin=subprocess.DEVNULL, stdout=pipe, stderr=pipe,
                                   start_new_session=True)
        worker = _Worker(rank, process, collections.deque(maxlen=self._tail))
        self._workers[rank] = worker
        self._stopped = False
        if self.output is not None:
            assert process.stdout is not None and process.stderr is not None
            for source, sink in ((process.stdout, self.output.out),
                                 (process.stderr, self.output.err)):
                self._thread(worker, f"pump-{rank}", self._pump, worker, source, sink, echo)
        self._thread(worker, f"reaper-{rank}", self._reap, worker)

    def _thread(self, worker: _Worker, name: str, target: Callable[..., None],
                *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=f"gossamer-{name}",
                                  daemon=True)
        thread.start()
        if target is not self._reap:
            worker.threads.append(thread)

    def _reap(self, worker: _Worker) -> None:
        # Bounded by stop(): every worker is SIGKILLed in the end.
        worker.process.wait()
        worker.done.set()
        self._exits.put(worker.rank)

    def _pump(self, worker: _Worker, source: IO[bytes], sink: IO[str],
              prefix: str | None) -> None:
        """Copy ``source`` line by line into the tail, and to ``sink`` unless muted."""
        assert self.output is not None
        with source:
            for raw in iter(source.readline, b""):
                # a progress bar redraws with \r: keep the latest state of the line
                line = raw.decode(errors="replace").rstrip("\r\n").rsplit("\r", 1)[-1]
                worker.tail.append(line)
                if prefix is not None and not worker.muted.is_set():
                    self.output.write(sink, prefix + line)
                # muted: keep draining, so that the worker never blocks on a full pipe

    def tail(self, rank: int) -> list[str]:
        """The last lines worker ``rank`` wrote (stdout and stderr, as they came)."""
        return list(self._workers[rank].tail)

    def wait(self, timeout: float | None = None) -> Outcome:
        """Wait until every worker has ended, one failed, or ``timeout`` seconds passed.

        At the first failure :attr:`on_failure` is called, the others get ``linger`` seconds
        to end, and then they are stopped; so are they when the time runs out. ``timeout``
        None waits as long as the workers run (each single wait is still bounded). A signal
        that raises in the main thread (Ctrl-C) leaves the workers running: leave the
        ``with`` block, or call :meth:`stop`.
        """
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        failed: int | None = None
        linger_end = None
        timed_out = False
        seen: set[int] = set()
        arrived: list[int] = []  # exits reported and not yet looked at, in the order they came
        while True:
            for rank in arrived:
                seen.add(rank)
                code = self._workers[rank].process.returncode
                if failed is None and self._is_failure(rank, code):
                    failed = rank
                    self._failed(rank, code)
                    linger_end = time.monotonic() + self.linger
            arrived.clear()
            if len(seen) == len(self._workers):
                break
            now = time.monotonic()
            if linger_end is not None and now >= linger_end:
                break
            if deadline is not None and now >= deadline:
                timed_out = True
                break
            ends = [t - now for t in (deadline, linger_end) if t is not None]
            try:
                arrived.append(self._exits.get(timeout=min([_SLICE, *ends])))
                while True:
                    arrived.append(self._exits.get_nowait())
            except queue.Empty:
                pass
        running = tuple(r for r, w in self._workers.items() if not w.done.is_set())
        if running:
            self.stop()
        return Outcome(codes={r: w.process.returncode for r, w in self._workers.items()},
                       failed=failed, timed_out=timed_out, stopped=running)

    def _failed(self, rank: int, code: int) -> None:
        worker = self._workers[rank]
        end = time.monotonic() + _PUMP_WAIT
        for thread in worker.threads:  # its last lines first (a child may hold the pipe)
            thread.join(timeout=max(0.0, end - time.monotonic()))
        if self._on_failure is not None:
            running = [r for r, w in self._workers.items() if not w.done.is_set()]
            self._on_failure(rank, code, running)

    def stop(self) -> None:
        """SIGTERM every running worker's process group, SIGKILL every group after ``grace``
        seconds, reap them and let the pumps finish; what they print meanwhile is not echoed.
        Safe to call twice."""
        if self._stopped:
            return
        with self._shield():
            workers = list(self._workers.values())
            running = [w for w in workers if not w.done.is_set()]
            for w in running:
                w.muted.set()
                _signal_group(w.process, signal.SIGTERM)
            end = time.monotonic() + self.grace
            for w in running:
                w.done.wait(timeout=max(0.0, end - time.monotonic()))
            for w in workers:
                # also the groups of workers that exited: their children may live on
                _signal_group(w.process, signal.SIGKILL)
            end = time.monotonic() + _REAP_WAIT
            for w in workers:
                w.done.wait(timeout=max(0.0, end - time.monotonic()))
            end = time.monotonic() + _PUMP_WAIT
            for w in workers:
                for thread in w.threads:
                    thread.join(timeout=max(0.0, end - time.monotonic()))
            self._stopped = True


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass
