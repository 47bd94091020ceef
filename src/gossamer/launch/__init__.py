"""``gossamer launch``: start N workers of ``gossamer train``, optionally on an emulated network.

- :mod:`gossamer.launch.launcher`: ``gossamer launch`` itself: the workers' commands and
  environments, restarts, the emulated network's report.
- :mod:`gossamer.launch.supervisor`: start N worker processes, prefix their output, stop them
  all when one fails, times out or the launcher is interrupted, forward the exit code; also
  what :func:`gossamer.testing.spawn_gloo` and the benchmarks run their processes with.
- :mod:`gossamer.launch.netem`: one network namespace per worker, veth links to a bridge
  shaped with tc (tbf for bandwidth; netem for delay, jitter, loss), and a teardown that
  always runs; :func:`cleanup` removes what a killed launcher left behind.

Example::

    from gossamer.launch import LinkSpec, launch

    launch(["--steps", "100"], nproc=4, links=[LinkSpec(bandwidth="1gbit", delay=1e-3)] * 4)
"""

from gossamer.launch.launcher import launch
from gossamer.launch.netem import (
    EmulationUnavailable,
    LinkSpec,
    Network,
    NetworkSetupError,
    check_prerequisites,
    cleanup,
    leftovers,
    parse_link_spec,
)

__all__ = [
    "EmulationUnavailable",
    "LinkSpec",
    "Network",
    "NetworkSetupError",
    "check_prerequisites",
    "cleanup",
    "launch",
    "leftovers",
    "parse_link_spec",
]
