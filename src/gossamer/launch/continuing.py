"""``gossamer launch`` of a run that goes on when workers fail (``--on-failure continue``).

The launcher hosts the rendezvous store (a TCPStore on 127.0.0.1) and the workers connect to
it as clients, as under torchrun's agent (``TORCHELASTIC_USE_AGENT_STORE=True``), so that
the store outlives any worker: the survivors agree on their new membership there
(:mod:`gossamer.comm.membership`). A worker that fails does not stop the others; with
``--max-restarts N`` it is started again (at most N restarts in all, while others still
train), with ``GOSSAMER_REJOIN=1``: it asks the members to let it in, and they do at their
next look (every few steps: they wait for it there), giving it their state. Once one worker
has finished, the others get the time the survivors may take to agree and finish
(``linger``), then a worker still running is stopped; one the others went on without (hung)
is stopped at once.

The launcher exits 0 when at least one worker finished the run, and names each worker the
others went on without; when none finished, it exits with the first failed worker's code.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from datetime import timedelta

from gossamer.comm.base import default_timeout
from gossamer.comm.environment import torchrun_variables
from gossamer.comm.membership import (
    REJOIN_VARIABLE,
    STORE_VARIABLE,
    announce_restart,
    last_members,
    membership_window,
)
from gossamer.launch.netem import SignalGuard
from gossamer.launch.supervisor import TIMED_OUT, Output, Supervisor, describe_exit, shell_code

__all__ = ["run_continuing"]

_FINISH_MARGIN = 30.0  # seconds on top of the membership window for the others to finish
_SLICE = 1.0  # the longest single wait for a worker's exit


def run_continuing(train_args: list[str], nproc: int, env: dict[str, str],
                   guard: SignalGuard, grace: float, output: Output,
                   timeout: float | None, max_restarts: int = 0) -> int:
    """Run ``nproc`` workers of ``gossamer train TRAIN_ARGS`` around a store of the
    launcher's, restarting failed ones up to ``max_restarts`` times; the exit code (see the
    module)."""
    import torch.distributed as dist

    timeout = timeout if timeout is not None else default_timeout("gloo")
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=timeout),
                          wait_for_workers=False)
    exits: queue.Queue[tuple[int, int | None]] = queue.Queue()
    workers: dict[int, Supervisor] = {}  # one supervisor per rank, replaced at a restart
    restarts = 0

    def start(rank: int) -> None:
        variables = {**env, **torchrun_variables(rank, nproc, "127.0.0.1", store.port),
                     "GROUP_RANK": "0", "TORCHELASTIC_RESTART_COUNT": str(restarts),
                     "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
                     "TORCHELASTIC_USE_AGENT_STORE": "True", STORE_VARIABLE: "1"}
        if restarts:
            variables[REJOIN_VARIABLE] = "1"
        supervisor = Supervisor(output=output, grace=grace, shield=guard.shielded)
        supervisor.start(rank, [sys.executable, "-m", "gossamer", "train", *train_args],
                         variables, echo=f"[rank {rank}] ")
        workers[rank] = supervisor

        def watch() -> None:  # (an interruption reaches the main thread, which stops all)
            exits.put((rank, supervisor.wait().codes[rank]))

        threading.Thread(target=watch, name=f"gossamer-continue-{rank}", daemon=True).start()

    codes: dict[int, int | None] = {}
    try:
        for rank in range(nproc):
            start(rank)
        running, finish_by = set(range(nproc)), None
        while running:
            if finish_by is not None and time.monotonic() > finish_by:
                _say(output, f"ranks {sorted(running)} still run {_linger(timeout):g} s after "
                     "the first finished; stopping them")
                for rank in running:
                    workers[rank].stop()
            try:
                rank, code = exits.get(timeout=_SLICE)
            except queue.Empty:
                continue
            running.discard(rank)
            codes[rank] = code
            if code == 0 and finish_by is None:
                finish_by = time.monotonic() + _linger(timeout)
                left = sorted(set(running) - set(last_members(store) or range(nproc)))
                if left:  # the run is over for them: the others went on without them
                    _say(output, f"stopping ranks {left}: the others finished without them")
                    for other in left:
                        workers[other].stop()
            elif code != 0 and restarts < max_restarts and running and finish_by is None:
                restarts += 1
                _say(output, f"rank {rank} {describe_exit(code)}; restarting it (restart "
                     f"{restarts} of {max_restarts}): it rejoins the others")
                announce_restart(store, rank)  # the others wait for it at their next look
                start(rank)
                running.add(rank)
    finally:
        for supervisor in workers.values():
            supervisor.stop()
    failed = {r: c for r, c in sorted(codes.items()) if c != 0}
    if len(failed) == len(codes):
        first = next(iter(failed))
        _say(output, f"failed: every worker failed, first rank {first} "
             f"{describe_exit(failed[first])}")
        return TIMED_OUT if failed[first] is None else shell_code(failed[first])
    for rank, code in failed.items():
        _say(output, f"rank {rank} {describe_exit(code)}; the others went on without it "
             "(--on-failure continue)")
    return 0


def _linger(timeout: float) -> float:
    return membership_window(timeout) + _FINISH_MARGIN


def _say(output: Output, message: str) -> None:
    output.write(output.err, f"gossamer launch: {message}")
