"""gossamer.launch.supervisor: start workers, prefix their lines, stop them all when one fails.

The workers are tiny Python programs. Where two of them must be at a known point together,
they meet at a FIFO (opening one end blocks until the other end is opened): nothing sleeps.
"""

from __future__ import annotations

import contextlib
import io
import os
import select
import signal
import sys
import time
from pathlib import Path

import pytest

from gossamer.launch.supervisor import (
    TIMED_OUT,
    Output,
    Supervisor,
    describe_exit,
    shell_code,
)

FOREVER = "import threading; threading.Event().wait()"  # a worker that never ends by itself


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _output() -> Output:
    return Output(io.StringIO(), io.StringIO())


def test_lines_are_prefixed_per_rank_and_stream() -> None:
    output = _output()
    with Supervisor(output=output) as workers:
        for rank in range(2):
            code = (f"import sys; print('hello from {rank}'); "
                    f"print('step 1\\rstep 2 of {rank}'); "
                    f"print('warning {rank}', file=sys.stderr)")
            workers.start(rank, _python(code), os.environ, echo=f"[rank {rank}] ")
        outcome = workers.wait(timeout=60)
    assert outcome.exit_code == 0
    assert outcome.codes == {0: 0, 1: 0}
    assert (outcome.failed, outcome.timed_out, outcome.stopped) == (None, False, ())
    out, err = output.out.getvalue().splitlines(), output.err.getvalue().splitlines()
    for rank in range(2):
        # a progress bar's \r: the line's latest state only
        assert out.index(f"[rank {rank}] hello from {rank}") < \
            out.index(f"[rank {rank}] step 2 of {rank}")
        assert f"[rank {rank}] warning {rank}" in err
    assert len(out) == 4 and len(err) == 2
    assert sorted(workers.tail(1)) == sorted(["hello from 1", "step 2 of 1", "warning 1"])


def test_unechoed_lines_are_kept_in_the_tail() -> None:
    output = _output()
    with Supervisor(output=output, tail=2) as workers:
        workers.start(0, _python("print(1); print(2); print(3)"), os.environ, echo=None)
        assert workers.wait(timeout=60).exit_code == 0
    assert output.out.getvalue() == ""
    assert workers.tail(0) == ["2", "3"]


def test_a_failed_worker_stops_the_others_and_its_code_is_forwarded() -> None:
    output = _output()
    calls = []
    with Supervisor(output=output, on_failure=lambda *a: calls.append(a)) as workers:
        workers.start(0, _python(FOREVER), os.environ, echo="[rank 0] ")
        workers.start(1, _python("print('giving up'); raise SystemExit(3)"), os.environ,
                      echo="[rank 1] ")
        start = time.monotonic()
        outcome = workers.wait(timeout=120)
    assert time.monotonic() - start < 60  # stopped, not waited for
    assert outcome.failed == 1
    assert outcome.exit_code == 3
    assert outcome.codes == {0: -signal.SIGTERM, 1: 3}
    assert outcome.stopped == (0,)
    assert not outcome.timed_out
    # told once, after the failed worker's last lines, with the ranks still running
    assert calls == [(1, 3, [0])]
    assert workers.tail(1) == ["giving up"]


def test_a_worker_killed_by_a_signal_exits_with_128_plus_the_signal() -> None:
    kill_self = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    with Supervisor() as workers:
        workers.start(0, _python(kill_self), os.environ)
        outcome = workers.wait(timeout=60)
    assert outcome.codes == {0: -signal.SIGKILL}
    assert outcome.exit_code == 128 + signal.SIGKILL
    assert describe_exit(outcome.codes[0]) == "was killed by SIGKILL"


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    fifo = tmp_path / "ready"
    os.mkfifo(fifo)
    # rank 0 ignores SIGTERM, then opens the FIFO, which blocks until rank 1 opens it too:
    # rank 1 fails only once rank 0 ignores SIGTERM
    stubborn = (f"import signal, threading; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                f"f = open({str(fifo)!r}, 'w'); threading.Event().wait()")
    fails = f"open({str(fifo)!r}).close(); raise SystemExit(5)"
    with Supervisor(grace=0.5) as workers:
        workers.start(0, _python(stubborn), os.environ)
        workers.start(1, _python(fails), os.environ)
        outcome = workers.wait(timeout=120)
    assert outcome.exit_code == 5
    assert outcome.codes[0] == -signal.SIGKILL


def test_linger_lets_the_others_end_by_themselves(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    # rank 0 reads until rank 1, the writer, is gone; then it ends by itself, with code 0
    reader = f"open({str(fifo)!r}).read()"
    writer = f"f = open({str(fifo)!r}, 'w'); raise SystemExit(7)"
    with Supervisor(linger=60) as workers:
        workers.start(0, _python(reader), os.environ)
        workers.start(1, _python(writer), os.environ)
        outcome = workers.wait(timeout=120)
    assert outcome.codes == {0: 0, 1: 7}
    assert (outcome.failed, outcome.stopped, outcome.exit_code) == (1, (), 7)


def test_is_failure_decides_what_stops_the_others(tmp_path: Path) -> None:
    """An exit that is expected (a worker killed on purpose) stops nobody."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = f"open({str(fifo)!r}).read(); print('survived')"
    writer = f"f = open({str(fifo)!r}, 'w'); raise SystemExit(1)"
    output = _output()
    with Supervisor(output=output, is_failure=lambda rank, code: code != 0 and rank != 1) \
            as workers:
        workers.start(0, _python(reader), os.environ)
        workers.start(1, _python(writer), os.environ)
        outcome = workers.wait(timeout=120)
    assert outcome.codes == {0: 0, 1: 1}
    assert outcome.failed is None and outcome.exit_code == 0
    assert output.out.getvalue() == "survived\n"


@pytest.mark.slow
def test_a_timeout_fires_and_stops_every_worker() -> None:
    with Supervisor(grace=5) as workers:
        workers.start(0, _python(FOREVER), os.environ)
        workers.start(1, _python(FOREVER), os.environ)
        start = time.monotonic()
        outcome = workers.wait(timeout=1.0)
        elapsed = time.monotonic() - start
    assert outcome.timed_out
    assert outcome.exit_code == TIMED_OUT
    assert outcome.failed is None
    assert outcome.stopped == (0, 1)
    assert outcome.codes == {0: -signal.SIGTERM, 1: -signal.SIGTERM}
    assert 1.0 <= elapsed < 30


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs Linux's pidfd_open")
def test_the_whole_process_group_is_stopped(tmp_path: Path) -> None:
    """A worker's own children (torchrun's workers, say) go with it."""
    fifo = tmp_path / "ready"
    os.mkfifo(fifo)
    grandchild = f"f = open({str(fifo)!r}, 'w'); import threading; threading.Event().wait()"
    parent = (f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
              f"{grandchild!r}]); print(p.pid, flush=True); p.wait()")
    output = _output()
    with Supervisor(output=output) as workers:
        workers.start(0, _python(parent), os.environ, echo="")
        open(fifo).close()  # the grandchild runs
        outcome = workers.wait(timeout=0.5)
    assert outcome.timed_out
    pid = int(output.out.getvalue().split()[0])
    try:
        assert _ends_within(pid, 10.0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # not left behind when the test fails


def _ends_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` is gone, or ends within ``seconds`` (its pidfd turns readable
    when it exits; reaping it is its new parent's business)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], seconds)[0])
    finally:
        os.close(fd)


def test_environment_and_directory_are_the_ones_given(tmp_path: Path) -> None:
    output = _output()
    env = {"PATH": os.environ.get("PATH", ""), "GOSSAMER_ONLY": "this"}
    code = "import os; print(sorted(k for k in os.environ if k.startswith('GOSSAMER'))); " \
           "print(os.getcwd())"
    with Supervisor(output=output) as workers:
        workers.start(0, _python(code), env, cwd=tmp_path)
        assert workers.wait(timeout=60).exit_code == 0
    assert output.out.getvalue().splitlines() == ["['GOSSAMER_ONLY']", str(tmp_path)]


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="grace"):
        Supervisor(grace=-1)
    with pytest.raises(ValueError, match="linger"):
        Supervisor(linger=float("nan"))
    with Supervisor() as workers:
        workers.start(0, _python("pass"), os.environ)
        with pytest.raises(ValueError, match="rank 0"):
            workers.start(0, _python("pass"), os.environ)
        assert workers.wait(timeout=60).exit_code == 0


def test_exit_texts() -> None:
    assert describe_exit(0) == "exited with code 0"
    assert describe_exit(-signal.SIGTERM) == "was killed by SIGTERM"
    assert describe_exit(None) == "is still running"
    assert shell_code(3) == 3
    assert shell_code(-signal.SIGINT) == 130
