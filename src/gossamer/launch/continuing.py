"""``gossamer launch`` of a run that goes on when workers fail (``--on-failure continue``).

The launcher hosts the rendezvous store (a TCPStore on 127.0.0.1) and the workers connect to
it as clients, as under torchrun's agent (``TORCHELASTIC_USE_AGENT_STORE=True``), so that
the store outlives any worker: the survivors agree on their new membership there
(:mod:`gossamer.comm.membership`). A worker that fails does not stop the others. Once one
worker has finished, the others get the time the survivors may take to agree and finish
(``linger``), then a worker still running (hung) is stopped.

The launcher exits 0 when at least one worker finished the run, and names each worker the
others went on without; when none finished, it exits with the first failed worker's code.
"""

from __future__ import annotations

import sys
from datetime import timedelta

from gossamer.comm.base import default_timeout
from gossamer.comm.environment import torchrun_variables
from gossamer.comm.membership import membership_window
from gossamer.launch.netem import SignalGuard
from gossamer.launch.supervisor import Output, Supervisor, describe_exit, shell_code

__all__ = ["run_continuing"]

_FINISH_MARGIN = 30.0  # seconds on top of the membership window for the others to finish


def run_continuing(train_args: list[str], nproc: int, env: dict[str, str],
                   guard: SignalGuard, grace: float, output: Output,
                   timeout: float | None) -> int:
    """Run ``nproc`` workers of ``gossamer train TRAIN_ARGS`` around a store of the
    launcher's; the exit code (see the module)."""
    import torch.distributed as dist

    from gossamer.launch.launcher import wait_or_stop  # (it imports this module)

    timeout = timeout if timeout is not None else default_timeout("gloo")
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=timeout),
                          wait_for_workers=False)
    linger = membership_window(timeout) + _FINISH_MARGIN
    with Supervisor(output=output, grace=grace, linger=linger, shield=guard.shielded,
                    is_failure=lambda rank, code: code == 0) as workers:
        for rank in range(nproc):
            worker_env = {**env, **torchrun_variables(rank, nproc, "127.0.0.1", store.port),
                          "GROUP_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0",
                          "TORCHELASTIC_MAX_RESTARTS": "0",
                          "TORCHELASTIC_USE_AGENT_STORE": "True"}
            cmd = [sys.executable, "-m", "gossamer", "train", *train_args]
            workers.start(rank, cmd, worker_env, echo=f"[rank {rank}] ")
        outcome = wait_or_stop(workers, guard, output)
        if isinstance(outcome, int):  # the launcher was interrupted
            return outcome
    failed = {r: c for r, c in sorted(outcome.codes.items()) if c != 0}
    if len(failed) == len(outcome.codes):
        first = next(iter(failed))
        _say(output, f"failed: every worker failed, first rank {first} "
             f"{describe_exit(failed[first])}")
        return shell_code(failed[first])
    for rank, code in failed.items():
        _say(output, f"rank {rank} {describe_exit(code)}; the others went on without it "
             "(--on-failure continue)")
    return 0


def _say(output: Output, message: str) -> None:
    output.write(output.err, f"gossamer launch: {message}")
