"""The resident processes of spawn_gloo's pool wait for calls blocked on a pipe: idle, they take
no CPU, and they end when the process that made the pool dies without closing it."""

import os
import subprocess
import sys
import time

import pytest

_PROGRAM = """
import os, sys
from gossamer.testing import _pools, spawn_gloo
assert spawn_gloo(os.getpid, 2) != [None, None]
print(*(child.pid for child in _pools[2].children), flush=True)
os._exit(0)  # no atexit: the pool is never closed
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1].startswith("Z")  # a zombie: it has exited
    except FileNotFoundError:
        return True


@pytest.mark.slow
@pytest.mark.gloo
def test_the_resident_processes_idle_without_cpu_and_end_with_their_parent():
    done = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 30
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids), "a resident process outlived its parent"


@pytest.mark.slow
@pytest.mark.gloo
def test_an_idle_resident_process_takes_no_cpu():
    from gossamer.testing import _pools, spawn_gloo

    spawn_gloo(os.getpid, 1)
    child = _pools[1].children[0]

    def cpu_ticks() -> int:
        with open(f"/proc/{child.pid}/stat") as stat:
            fields = stat.read().split(") ")[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks

    before = cpu_ticks()
    time.sleep(2.0)
    # a child polling for calls every 10 ms took several ticks (of 10 ms) in 2 s
    assert cpu_ticks() - before <= 1
