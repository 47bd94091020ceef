"""Run ``python ARGS...`` as a fresh interpreter would, in a process forked from a warm one, for
tests: a fresh interpreter spends seconds importing torch before the program's first line, and
the tests run many short programs (the documentation's examples, the command line).

A resident process (started on first use, one per test process) imports torch and gossamer
and then only forks: each run is a child of it, with the run's working directory, environment
and arguments, standard input from ``/dev/null`` and its output in files; it runs the program
as ``python`` would (a script with its directory first on ``sys.path``, ``-m module``,
``-c code``), runs the ``atexit`` handlers, and exits with the program's exit status. Forking
after torch is imported is what torch's own DataLoader workers do. Arguments with other
interpreter options run in a fresh interpreter. Example::

    done = run_python(["-m", "gossamer", "--version"], cwd=tmp_path, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("gossamer")

``GOSSAMER_WARM=0`` runs every program in a fresh interpreter instead.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["WARM_VARIABLE", "run_python"]

#: set to 0: every program runs in a fresh interpreter
WARM_VARIABLE = "GOSSAMER_WARM"
_SERVER = "from gossamer.warm import _serve; _serve()"
_PRELOAD = ("torch", "numpy", "gossamer", "gossamer.cli", "gossamer.train.run",
            "gossamer.testing")
_server: subprocess.Popen[bytes] | None = None


def run_python(args: Sequence[str], *, cwd: str | Path, timeout: float,
               env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python *args`` in ``cwd`` with ``env`` (default: this process's), its output
    captured as text: what ``subprocess.run([sys.executable, *args], cwd=cwd, env=env,
    capture_output=True, text=True, timeout=timeout)`` returns, and the same
    ``subprocess.TimeoutExpired`` (the program killed) after ``timeout`` seconds."""
    args = [str(a) for a in args]
    environ = dict(os.environ if env is None else env)
    if (os.environ.get(WARM_VARIABLE) == "0" or not args
            or (args[0].startswith("-") and args[0] not in ("-m", "-c"))):
        return subprocess.run([sys.executable, *args], cwd=cwd, env=environ,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="gossamer-warm-") as folder:
        out, err = Path(folder) / "out", Path(folder) / "err"
        code = _run_forked(args, str(cwd), environ, str(out), str(err), timeout)
        stdout = out.read_text(errors="replace")
        stderr = err.read_text(errors="replace")
    command = [sys.executable, *args]
    if code is None:
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(command, code, stdout, stderr)


def _run_forked(args: list[str], cwd: str, env: dict[str, str], out: str, err: str,
                timeout: float) -> int | None:
    """The exit status of the forked run (a signal's: minus its number), None if it was
    killed after ``timeout`` seconds."""
    server = _warm_server()
    assert server.stdin is not None and server.stdout is not None
    requests, answers = server.stdin.fileno(), server.stdout.fileno()
    _send(requests, (args, cwd, env, out, err))
    pid = _receive(answers, 60.0)
    if pid is None:
        _close_server()
        raise RuntimeError("the warm process did not fork within 60 s")
    status = _receive(answers, timeout)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        _receive(answers, 60.0)  # its status, once reaped
        return None
    return status


def _warm_server() -> subprocess.Popen[bytes]:
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, env=dict(os.environ))
    return _server


def _close_server() -> None:
    global _server
    if _server is not None:
        if _server.stdin is not None:
            _server.stdin.close()  # end of file: it exits
        try:
            _server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _server.kill()
            _server.wait()
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


def _serve() -> None:
    """Import what the programs import, then fork one child per request read from stdin,
    answering with its pid and then its exit status; exit at end of file."""
    import importlib

    answers = os.dup(1)  # the answers' pipe; what anything prints goes to stderr instead
    os.dup2(2, 1)
    for name in _PRELOAD:
        importlib.import_module(name)
    while True:
        request = _receive(0, None)
        if request is None:
            return
        pid = os.fork()
        if pid == 0:
            os.close(answers)
            _child(*request)  # never returns
        _send(answers, pid)
        _, status = os.waitpid(pid, 0)
        _send(answers, os.waitstatus_to_exitcode(status))


def _child(args: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """Run the program as ``python *args`` would, then exit with its status."""
    import runpy
    import traceback

    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
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
