"""Test-wide settings."""

import os

import pytest
import torch

# The models under test are small: one thread is as fast, and OpenMP threads spinning on a
# 2-core machine next to the gloo test processes would only slow everything down. The same
# for every process a test starts (the command line, the documentation's examples, a
# launcher's workers): `gossamer train --sim 8 --algorithm wagma` took 3.4 times as long with
# torch's default of one thread per core as with one, on 2 cores.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The heartbeat's and the failure diagnosis's intervals at half their defaults, in this process
# and every process a test starts: a dead peer is noticed and named in half the time. What a
# job runs with is tested too (tests/test_liveness.py runs a diagnosis at the defaults).
os.environ.setdefault("GOSSAMER_LIVENESS_SCALE", "0.5")


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (the default, pyproject.toml's addopts): a whole run (no test named on the
    command line, no ``-k``) in one pytest-xdist worker per core, up to 4, since the fast tier
    computes; a selection in this process alone, since a worker costs seconds to start
    (imports and collection). ``-n N`` chooses."""
    if config.args_source != pytest.Config.ArgsSource.TESTPATHS or config.option.keyword:
        return 0
    return max(1, min(os.cpu_count() or 1, 4))


def pytest_addoption(parser):
    parser.addoption(
        "--timing", choices=("with", "without", "only"), default="with",
        help="the `timing` tests: with the others (default), without them, or only them. "
             "scripts/test runs the others in pytest-xdist workers, then these in one process")


def pytest_collection_modifyitems(config, items):
    which = config.getoption("timing")
    if which == "with":
        return
    keep, drop = [], []
    for item in items:
        timing = item.get_closest_marker("timing") is not None
        (keep if timing == (which == "only") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(autouse=True)
def _timing_tests_run_alone(request, tmp_path_factory):
    """Under pytest-xdist, a ``timing`` test runs while no other test runs: its processes must
    each get the CPU within seconds (short timeouts, wall-clock ratios), which another worker's
    processes on the same 2 cores would take. Every other test holds a shared lock on a file of
    the run, a timing test an exclusive one; while a timing test waits for it, no other test
    takes the shared lock (a pending file), so that it waits only for the tests already
    running. (scripts/test runs the timing tests apart, after the others, in one process: no
    worker waits idle then.)"""
    if not hasattr(request.config, "workerinput"):  # one process: the tests run one at a time
        yield
        return
    import fcntl
    import time

    # the workers' base directories share this parent, which is new for each run
    base = tmp_path_factory.getbasetemp().parent
    exclusive = request.node.get_closest_marker("timing") is not None
    pending = base / f"timing.pending.{request.config.workerinput['workerid']}"
    with open(base / "timing.lock", "a") as lock:
        if exclusive:
            pending.touch()
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
            finally:
                pending.unlink()
        else:
            while any(base.glob("timing.pending.*")):
                time.sleep(0.05)
            fcntl.flock(lock, fcntl.LOCK_SH)
        yield
