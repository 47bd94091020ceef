"""What a run counts as its algorithm's: the bytes, messages and seconds of one worker, and the
examples trained on by all workers.

A communicator counts everything that goes through it. The training loop also talks to check
its settings, to measure, to checkpoint and to let workers in; that traffic (and, mostly, that
time) is not the algorithm's. :class:`Accounting` keeps what was spent so and what was carried
over from before (a checkpoint, a member's counts, an earlier communicator), and gives the
algorithm's counts so far::

    accounting = Accounting(comm)
    accounting.excluding(comm.barrier)        # not the algorithm's
    sent, messages, seconds, examples = accounting.counters()
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from gossamer.comm.base import Communicator

__all__ = ["COUNTS", "Accounting", "raw_counts"]

#: The keys of :meth:`Accounting.totals`, in the order of :meth:`Accounting.counters`.
COUNTS = ("bytes", "messages", "time", "examples")

T = TypeVar("T")


def raw_counts(comm: Communicator) -> dict[str, float]:
    """What ``comm`` counted so far: bytes and messages sent, and its clock."""
    return {"bytes": comm.stats.total_bytes_sent, "messages": comm.stats.total_messages_sent,
            "time": comm.clock()}


class Accounting:
    """The algorithm's counts on one worker, over ``comm`` (the communicator it talks over
    now; :meth:`switch` changes it).

    ``offsets``: the counts carried over (from a checkpoint, from a member when rejoining,
    from the communicators before this one) and the examples trained on by all workers
    together. ``excluded``: what ``comm`` counted that is not the algorithm's. ``counted``:
    the last step whose examples ``offsets["examples"]`` holds.
    """

    def __init__(self, comm: Communicator, counted: int = 0) -> None:
        self.comm = comm
        self.offsets: dict[str, float] = {"bytes": 0, "messages": 0, "time": 0.0, "examples": 0}
        # nothing is excluded yet: what ``comm`` counted before is the algorithm's
        self.excluded: dict[str, float] = {"bytes": 0, "messages": 0, "time": 0.0}
        self.counted = counted

    def counters(self) -> tuple[float, float, float, float]:
        """(bytes, messages, seconds) of the algorithm so far, on this worker, and the
        examples trained on by all workers (each step's at that step's world size)."""
        comm, offsets, excluded = self.comm, self.offsets, self.excluded
        return (offsets["bytes"] + comm.stats.total_bytes_sent - excluded["bytes"],
                offsets["messages"] + comm.stats.total_messages_sent - excluded["messages"],
                offsets["time"] + comm.clock() - excluded["time"], offsets["examples"])

    def totals(self) -> dict[str, float]:
        """:meth:`counters` by name (the counts a checkpoint records, or a member sends)."""
        return dict(zip(COUNTS, self.counters(), strict=True))

    def excluding(self, fn: Callable[..., T], *args: Any, time: bool = True) -> T:
        """Run a collective ``fn(*args)`` without counting its traffic (and, with ``time``,
        its time) as the algorithm's; returns what it returns."""
        before = raw_counts(self.comm)
        out = fn(*args)
        for key, value in raw_counts(self.comm).items():
            if time or key != "time":
                self.excluded[key] += value - before[key]
        return out

    def catch_up(self) -> None:
        """Wait for every worker to reach this point (where collectives of the loop's own
        follow: an evaluation's, a checkpoint's, the look for restarted workers), and count
        that wait as the run's time and nothing else as the run's. A worker ahead (of an
        asynchronous method, or of a local one between its rounds, with a straggler) would
        wait for the others later as well, or the run would end only when the last worker
        ends; counted as the evaluation's, that wait made the reported wall-clock shrink the
        more often a run evaluated. The wait is the first barrier's time less the second's,
        in which nobody waits: the barrier's own cost."""
        comm = self.comm
        t0 = comm.clock()
        self.excluding(comm.barrier, time=False)  # the wait, and the barrier's own cost
        t1 = comm.clock()
        self.excluding(comm.barrier)  # the barrier's own cost
        self.excluded["time"] += min(comm.clock() - t1, t1 - t0)  # taken off the first

    def go_on_from(self, offsets: Mapping[str, float] | None = None) -> None:
        """Count on from ``offsets`` (default: the present ones), the counts of a checkpoint
        or of a member: what ``comm`` counted so far is in them, not the algorithm's again."""
        if offsets is not None:
            self.offsets = dict(offsets)
        self.excluded = raw_counts(self.comm)

    def switch(self, comm: Communicator) -> None:
        """Count over ``comm`` from now on (after a membership change): the algorithm's
        counts over the one before are carried over."""
        for key, total in raw_counts(self.comm).items():
            self.offsets[key] += total - self.excluded[key]
        self.comm = comm
        self.excluded = raw_counts(comm)

    def count_step(self, done: int, examples: int) -> None:
        """Step ``done`` trained on ``examples`` (all workers' together)."""
        self.offsets["examples"] += examples
        self.counted = done

    def count_until(self, step: int, examples_per_step: int) -> None:
        """The steps up to ``step`` are done, at ``examples_per_step``: count those not counted
        yet (a survivor that failed inside one, or was behind, did not count them)."""
        self.offsets["examples"] += max(0, step - self.counted) * examples_per_step
        self.counted = max(self.counted, step)
