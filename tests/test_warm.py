"""gossamer.warm.run_python runs a program as a fresh interpreter would: the same output, exit
status, arguments, working directory, environment, path and error report as
``subprocess.run([sys.executable, ...])``, and a timeout that kills the program."""

import subprocess
import sys

import pytest

from gossamer.warm import WARM_VARIABLE, run_python, start_python

PROGRAM = """
import os, sys
print(sys.argv[1:], os.getcwd() == os.path.realpath(sys.argv[1]), sys.path[0] == os.path.dirname(
    os.path.abspath(__file__)), os.environ.get("GOSSAMER_WARM_TEST"), sys.stdin.read() == "")
print("to stderr", file=sys.stderr)
import atexit
atexit.register(lambda: print("at exit"))
if sys.argv[2] == "raise":
    raise ValueError("from the program")
sys.exit(int(sys.argv[2]))
"""


@pytest.mark.parametrize("last", ["0", "3", "raise"])
def test_a_script_runs_as_in_a_fresh_interpreter(tmp_path, last):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    env = {"GOSSAMER_WARM_TEST": "yes", "PATH": "/usr/bin:/bin"}
    warm = run_python([str(script), str(tmp_path), last], cwd=tmp_path, timeout=60, env=env)
    fresh = subprocess.run([sys.executable, str(script), str(tmp_path), last], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
    assert warm.stdout == fresh.stdout
    assert warm.stdout.startswith(f"['{tmp_path}', '{last}'] True True yes True\n")
    assert warm.stdout.endswith("at exit\n")
    assert warm.returncode == fresh.returncode == {"0": 0, "3": 3, "raise": 1}[last]
    assert warm.stderr.splitlines()[0] == fresh.stderr.splitlines()[0]  # "to stderr"
    if last == "raise":  # the report starts at the program's frame, as a fresh one's does
        assert warm.stderr == fresh.stderr


def test_a_module_and_code_run_with_their_arguments(tmp_path):
    done = run_python(["-m", "gossamer", "--version"], cwd=tmp_path, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("gossamer ")
    done = run_python(["-c", "import sys; print(sys.argv); sys.exit('no')", "x"], cwd=tmp_path,
                      timeout=60)
    assert (done.stdout, done.stderr, done.returncode) == ("['-c', 'x']\n", "no\n", 1)


@pytest.mark.slow
def test_a_program_past_its_timeout_is_killed(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(["-c", "import time; print('started', flush=True); time.sleep(60)"],
                   cwd=tmp_path, timeout=1)
    assert run_python(["-c", "print(1)"], cwd=tmp_path, timeout=60).stdout == "1\n"  # goes on


def test_fresh_interpreters_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv(WARM_VARIABLE, "0")
    done = run_python(["-c", "import sys; print('torch' in sys.modules)"], cwd=tmp_path,
                      timeout=60)
    assert done.stdout == "False\n"  # nothing imported before the program
    monkeypatch.delenv(WARM_VARIABLE)
    done = run_python(["-c", "import sys; print('torch' in sys.modules)"], cwd=tmp_path,
                      timeout=60)
    assert done.stdout == "True\n"  # forked from the warm process


def test_programs_started_together_run_together_and_answer_as_popen(tmp_path):
    """start_python: several programs at once (each waits for the other's file), their exit
    statuses, a kill (minus the signal's number), poll and a wait past its timeout."""
    wait_for = ("import os, sys, time\nopen(sys.argv[1], 'w').close()\n"
                "while not os.path.exists(sys.argv[2]): time.sleep(0.01)\n"
                "print('both', file=sys.stderr); sys.exit(int(sys.argv[3]))")
    a, b = tmp_path / "a", tmp_path / "b"
    first = start_python(["-c", wait_for, a, b, "4"], cwd=tmp_path, stderr=tmp_path / "1.err")
    second = start_python(["-c", wait_for, b, a, "5"], cwd=tmp_path, stderr=tmp_path / "2.err")
    assert (first.wait(timeout=60), second.wait(timeout=60)) == (4, 5)
    assert (tmp_path / "1.err").read_text() == (tmp_path / "2.err").read_text() == "both\n"
    sleeper = start_python(["-c", "import time; time.sleep(60)"], cwd=tmp_path)
    assert sleeper.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(timeout=0.2)
    sleeper.kill()
    assert sleeper.wait(timeout=60) == -9 and sleeper.returncode == -9
    assert run_python(["-c", "print(1)"], cwd=tmp_path, timeout=60).stdout == "1\n"  # goes on
