"""How a TorchCommunicator tells a dead peer (gossamer.comm.torch_comm.Liveness): the intervals,
their scale from the environment (the suite runs at GOSSAMER_LIVENESS_SCALE=0.5, set in
conftest.py), and a dead worker named at the default intervals and at the suite's."""

import os
import time
from datetime import timedelta

import pytest
import torch

from gossamer.comm.base import CommError
from gossamer.comm.torch_comm import LIVENESS_VARIABLE, Liveness, TorchCommunicator
from gossamer.testing import spawn_gloo


def test_the_default_intervals_and_their_scale():
    default = Liveness.from_env({})
    assert default == Liveness()
    assert (default.heartbeat, default.dead_after, default.diagnose_gap, default.store_settle,
            default.close_wait) == (0.5, 3.0, 1.5, 0.25, 3.0)
    half = Liveness.from_env({LIVENESS_VARIABLE: "0.5"})
    assert half == Liveness(heartbeat=0.25, dead_after=1.5, diagnose_gap=0.75,
                            store_settle=0.125, close_wait=1.5)


@pytest.mark.parametrize("text", ["0", "-1", "fast", "nan", "inf"])
def test_a_bad_scale_is_an_error_naming_the_variable(text):
    with pytest.raises(ValueError, match=LIVENESS_VARIABLE):
        Liveness.from_env({LIVENESS_VARIABLE: text})


def test_a_bad_interval_is_an_error_naming_it():
    with pytest.raises(ValueError, match="dead_after"):
        Liveness(dead_after=0)


def _dies_before_second_all_reduce(scale: str | None) -> dict | None:
    """Rank 1 exits before its 2nd all-reduce; the others report their error, how long it
    took, and the intervals they ran with."""
    if scale is None:
        os.environ.pop(LIVENESS_VARIABLE, None)
    else:
        os.environ[LIVENESS_VARIABLE] = scale
    comm = TorchCommunicator.from_env(timeout=10)
    for i in range(1, 3):
        if comm.rank == 1 and i == 2:
            os._exit(1)
        start = time.monotonic()
        try:
            comm.all_reduce(torch.ones(10))
        except CommError as exc:
            elapsed = time.monotonic() - start
            other = 2 - comm.rank  # alive until the other survivor has diagnosed too
            comm._store.set(f"test/diagnosed/{comm.rank}", "1")
            comm._store.wait([f"test/diagnosed/{other}"], timedelta(seconds=30))
            return {"message": str(exc), "elapsed": elapsed, "liveness": comm.liveness}
    return None


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("scale", [None, "0.5"], ids=["default", "suite"])
def test_a_dead_worker_is_named_after_the_diagnosis_intervals(scale):
    """At the default intervals (what a job runs with) and at the suite's: the survivors name
    rank 1, and the diagnosis took its two waits (so the scale is what shortens it)."""
    results = spawn_gloo(_dies_before_second_all_reduce, 3, args=(scale,), timeout=60,
                         allow_exit={1})
    expected = Liveness.from_env({} if scale is None else {LIVENESS_VARIABLE: scale})
    for r in (0, 2):
        seen = results[r]
        assert seen is not None and "rank 1" in seen["message"], seen
        assert seen["liveness"] == expected
        assert seen["elapsed"] >= expected.store_settle + expected.diagnose_gap
        assert seen["elapsed"] < 10
