"""The training loop's parts, each alone: the accounting of what the algorithm spent."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gossamer.comm import ComputeModel, NetworkModel, SimWorld
from gossamer.train.accounting import Accounting, raw_counts

# ---- Accounting


def _counted(comm, time: bool):
    """(counters before, after a counted all-reduce, after one run by ``excluding``)."""
    accounting = Accounting(comm)
    comm.compute_step()
    start = accounting.counters()
    comm.all_reduce(torch.ones(1000))
    counted = accounting.counters()
    accounting.excluding(comm.all_reduce, torch.ones(1000), time=time)
    return start, counted, accounting.counters(), raw_counts(comm)


def test_excluding_takes_a_collectives_bytes_messages_and_time_out_of_the_counters():
    for start, counted, after, raw in SimWorld(2).run(_counted, True):
        assert start == (0, 0, 0.01, 0)  # the step's compute is the run's time
        sent, messages, seconds, _ = counted
        assert sent > 0 and messages > 0 and seconds > 0.01  # a counted one is counted
        assert after == counted  # the excluded one: nothing more
        assert raw["bytes"] == 2 * sent and raw["messages"] == 2 * messages  # (it did talk)
        assert raw["time"] > seconds


def test_excluding_without_time_takes_out_only_bytes_and_messages():
    for _, counted, after, _ in SimWorld(2).run(_counted, False):
        assert after[:2] == counted[:2]
        assert after[2] == pytest.approx(counted[2] + (counted[2] - 0.01))  # as long again


def test_excluding_returns_what_the_collective_returns():
    def worker(comm):
        return Accounting(comm).excluding(comm.all_reduce, torch.full((2,), comm.rank + 1.0))

    assert [t.tolist() for t in SimWorld(2).run(worker)] == [[3.0, 3.0]] * 2


def _catch_up(comm):
    accounting = Accounting(comm)
    comm.compute_step()  # rank 1 (3 times slower) arrives 20 ms after rank 0
    arrived = comm.clock()
    accounting.catch_up()
    return arrived, comm.clock(), accounting.counters()


def test_catch_up_counts_the_wait_for_the_last_worker_but_not_the_barriers():
    world = SimWorld(2, network=NetworkModel(latency=1e-3),
                     compute=ComputeModel(step_time=0.01, stragglers={1: 3.0}))
    (arrived_0, clock_0, counters_0), (arrived_1, clock_1, counters_1) = world.run(_catch_up)
    assert (arrived_0, arrived_1) == pytest.approx((0.01, 0.03))
    # the barriers cost time, which the clocks show...
    assert clock_0 == clock_1 and clock_0 > 0.03 + 1e-3
    # ...and the counters do not: both workers count up to the last one's arrival, rank 0's
    # wait for it included; no barrier traffic
    assert counters_0 == pytest.approx((0, 0, 0.03, 0))
    assert counters_1 == pytest.approx((0, 0, 0.03, 0))


class _Counting:
    """A communicator as Accounting sees it: its stats and its clock, set by hand."""

    def __init__(self, sent: int = 0, messages: int = 0, now: float = 0.0) -> None:
        self.stats = SimpleNamespace(total_bytes_sent=sent, total_messages_sent=messages)
        self.now = now

    def clock(self) -> float:
        return self.now


def test_switch_carries_the_algorithms_counts_over_to_the_next_communicator():
    old = _Counting(100, 4, 2.0)
    accounting = Accounting(old)
    accounting.excluding(lambda: setattr(old.stats, "total_bytes_sent", 130))  # 30 not counted
    new = _Counting(7, 1, 5.0)  # what the new one counted before is not the algorithm's
    accounting.switch(new)
    assert accounting.counters() == (100, 4, 2.0, 0)
    new.stats.total_bytes_sent, new.now = 17, 6.0
    assert accounting.counters() == (110, 4, 3.0, 0)


def test_go_on_from_counts_on_from_carried_over_counts():
    comm = _Counting(50, 5, 1.5)
    accounting = Accounting(comm)
    accounting.go_on_from({"bytes": 1000, "messages": 10, "time": 9.0, "examples": 64})
    assert accounting.counters() == (1000, 10, 9.0, 64)
    assert accounting.totals() == {"bytes": 1000, "messages": 10, "time": 9.0, "examples": 64}
    comm.stats.total_bytes_sent = 80
    assert accounting.counters()[0] == 1030


def test_count_until_counts_only_the_steps_not_counted_yet():
    accounting = Accounting(_Counting())
    accounting.count_step(1, 32)
    accounting.count_step(2, 32)
    accounting.count_until(5, 16)  # steps 3 to 5, at a smaller world
    assert (accounting.offsets["examples"], accounting.counted) == (2 * 32 + 3 * 16, 5)
    accounting.count_until(4, 16)  # behind what was counted: nothing
    assert (accounting.offsets["examples"], accounting.counted) == (112, 5)
