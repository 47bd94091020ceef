"""Run ``python ARGS...`` as a fresh interpreter would, in a process forked from a warm one, for
tests: a fresh interpreter spends seconds importing torch before the program's first line, and
the tests run many short programs (the documentation's examples, the command line).

A resident process (started on first use, one per test process) imports torch and gossamer
and then only forks: each run is a child of it, with the run's working directory, environment
and arguments, standard input from ``/dev/null`` and its output in files; it runs the program
as ``python`` would (a script with its directory first on ``sys.path``, ``-m module``,
``-c code``), runs the ``atexit`` handlers, and exits with the program's exit status. Forking
after torch is imported is what torch's own DataLoader workers do. Arguments with other
interpreter options run in a fresh interpreter. :func:`run_python` runs one program to its
end; :func:`start_python` starts one and returns at once, so that several run together (the
workers of a job of several processes), each answering as a ``subprocess.Popen`` does.
Example::

    done = run_python(["-m", "gossamer", "--version"], cwd=tmp_path, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("gossamer")
    workers = [start_python(["-m", "gossamer", "train", ...], cwd=tmp_path, env=env_of(rank),
                            stderr=tmp_path / f"rank{rank}.err") for rank in range(4)]
    workers[1].kill(); codes = [w.wait(timeout=60) for w in workers]

``GOSSAMER_WARM=0`` runs every program in a fresh interpreter instead.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["WARM_VARIABLE", "WarmProcess", "run_python", "start_python"]

#: set to 0: every program runs in a fresh interpreter
WARM_VARIABLE = "GOSSAMER_WARM"
_SERVER = "from gossamer.warm import _serve; _serve()"
_PRELOAD = ("torch", "numpy", "gossamer", "gossamer.cli", "gossamer.train.run",
            "gossamer.testing")


def run_python(args: Sequence[str], *, cwd: str | Path, timeout: float,
               env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python *args`` in ``cwd`` with ``env`` (default: this process's), its output
    captured as text: what ``subprocess.run([sys.executable, *args], cwd=cwd, env=env,
    capture_output=True, text=True, timeout=timeout)`` returns, and the same
    ``subprocess.TimeoutExpired`` (the program killed) after ``timeout`` seconds."""
    with tempfile.TemporaryDirectory(prefix="gossamer-warm-") as folder:
        out, err = Path(folder) / "out", Path(folder) / "err"
        process = start_python(args, cwd=cwd, env=env, stdout=out, stderr=err)
        try:
            code: int | None = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=60)
            code = None
        stdout = out.read_text(errors="replace")
        stderr = err.read_text(errors="replace")
    command = [sys.executable, *map(str, args)]
    if code is None:
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(command, code, stdout, stderr)


def start_python(args: Sequence[str], *, cwd: str | Path,
                 env: Mapping[str, str] | None = None, stdout: str | Path | None = None,
                 stderr: str | Path | None = None) -> WarmProcess | subprocess.Popen[bytes]:
    """Start ``python *args`` in ``cwd`` with ``env`` (default: this process's), standard
    input from ``/dev/null``, its output written to the files ``stdout`` and ``stderr`` (None:
    discarded; the same file for both: one stream, as ``stderr=subprocess.STDOUT``); return
    at once. The process answers what a ``subprocess.Popen`` answers:
    ``pid``, ``poll()``, ``wait(timeout)`` (``subprocess.TimeoutExpired`` after ``timeout``
    seconds), ``send_signal``, ``terminate``, ``kill``, ``returncode`` (a signal's: minus its
    number). Several run at once, each forked from the warm process; with
    ``GOSSAMER_WARM=0`` (or interpreter options in ``args``) it is a ``subprocess.Popen``
    of a fresh interpreter."""
    args = [str(a) for a in args]
    environ = dict(os.environ if env is None else env)
    out, err = (os.devnull if path is None else str(path) for path in (stdout, stderr))
    if (os.environ.get(WARM_VARIABLE) == "0" or not args
            or (args[0].startswith("-") and args[0] not in ("-m", "-c"))):
        with open(out, "wb") as out_file, open(err, "wb") as err_file:
            return subprocess.Popen([sys.executable, *args], cwd=cwd, env=environ,
                                    stdin=subprocess.DEVNULL, stdout=out_file,
                                    stderr=subprocess.STDOUT if err == out else err_file)
    return _warm_server().start(args, str(cwd), environ, out, err)


class WarmProcess:
    """A program forked from the warm process (see :func:`start_python`)."""

    def __init__(self, server: _Server, request: int, pid: int, args: list[str]) -> None:
        self._server, self._request = server, request
        self.pid, self.args = pid, [sys.executable, *args]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.answer(self._request, "exit", timeout)
        if self.returncode is None and not self._server.alive():
            # the warm process is gone without a word of this program (killed from outside):
            # it cannot reap the program any more; kill it, as the warm process would have
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.returncode = -signal.SIGKILL
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reaped yet: the pid is still this program's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server:
    """The warm process, and a thread that reads its answers: ``[request, "pid", pid]`` once
    a program is forked, ``[request, "exit", status]`` once it is reaped."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=dict(os.environ))
        self._changed = threading.Condition()
        self._answers: dict[tuple[int, str], int] = {}
        self._requests = 0
        self._gone = False
        threading.Thread(target=self._read, name="gossamer-warm", daemon=True).start()

    def alive(self) -> bool:
        return not self._gone and self.process.poll() is None

    def _read(self) -> None:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        while True:
            answer = _receive(fd, None)
            with self._changed:
                if answer is None:
                    self._gone = True
                else:
                    request, kind, value = answer
                    self._answers[(request, kind)] = value
                self._changed.notify_all()
            if answer is None:
                return

    def answer(self, request: int, kind: str, timeout: float | None) -> int | None:
        """The answer ``kind`` to ``request``; None if it has not come within ``timeout``
        seconds (or the warm process is gone)."""
        with self._changed:
            self._changed.wait_for(lambda: (request, kind) in self._answers or self._gone,
                                   timeout)
            return self._answers.get((request, kind))

    def start(self, args: list[str], cwd: str, env: dict[str, str], out: str, err: str
              ) -> WarmProcess:
        assert self.process.stdin is not None
        with self._changed:
            self._requests += 1
            request = self._requests
            _send(self.process.stdin.fileno(), [request, args, cwd, env, out, err])
        pid = self.answer(request, "pid", 60.0)
        if pid is None:
            _close_server()
            raise RuntimeError("the warm process did not fork within 60 s")
        return WarmProcess(self, request, pid, args)

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()  # end of file: it kills what still runs, and exits
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_server: _Server | None = None


def _warm_server() -> _Server:
    global _server
    if _server is None or not _server.alive():
        _server = _Server()
    return _server


def _close_server() -> None:
    global _server
    if _server is not None:
        _server.close()
        _server = None


atexit.register(_close_server)


def _send(fd: int, obj: Any) -> None:
    data = json.dumps(obj).encode()
    data = struct.pack("!I", len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def _read_exactly(fd: int, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _receive(fd: int, timeout: float | None) -> Any:
    """The next object from ``fd``; None after ``timeout`` seconds (or at end of file)."""
    if timeout is not None and not select.select([fd], [], [], timeout)[0]:
        return None
    header = _read_exactly(fd, 4)
    if header is None:
        return None
    data = _read_exactly(fd, struct.unpack("!I", header)[0])
    return None if data is None else json.loads(data)


# ---- the warm process

REAP_INTERVAL = 0.02  # seconds between two looks for finished programs while some run


def _serve() -> None:
    """Import what the programs import, then fork one child per request read from stdin,
    answering with its pid at once and with its exit status once it is reaped; at end of
    file, kill what still runs and exit."""
    import importlib

    answers = os.dup(1)  # the answers' pipe; what anything prints goes to stderr instead
    os.dup2(2, 1)
    for name in _PRELOAD:
        importlib.import_module(name)
    running: dict[int, int] = {}  # pid -> request
    while True:
        readable = select.select([0], [], [], REAP_INTERVAL if running else None)[0]
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in running:
                _send(answers, [running.pop(pid), "exit", os.waitstatus_to_exitcode(status)])
        if not readable:
            continue
        message = _receive(0, None)
        if message is None:
            for pid in running:
                os.kill(pid, signal.SIGKILL)
            for pid, request in running.items():
                _, status = os.waitpid(pid, 0)
                _send(answers, [request, "exit", os.waitstatus_to_exitcode(status)])
            return
        request, *program = message
        pid = os.fork()
        if pid == 0:
            os.close(answers)
            _child(*program)  # never returns
        running[pid] = request
        _send(answers, [request, "pid", pid])


def _child(args: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """Run the program as ``python *args`` would, then exit with its status."""
    import runpy
    import traceback

    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
    if err == out:  # both into one file, as stderr=subprocess.STDOUT
        os.dup2(1, 2)
    else:
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    code: Any = 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path[0] = ""
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            sys.path[0] = ""
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = list(args)
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:  # noqa: BLE001 - as the interpreter reports it
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
            tb = tb.tb_next  # from the program's first frame, as a fresh interpreter shows
        traceback.print_exception(type(exc), exc, tb)
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - nothing left to report it to
                pass
        os._exit(code & 0xFF)
