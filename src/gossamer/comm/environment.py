"""The launcher's environment: which launcher started this process, and where it sits in the job.

One place reads the variables of every launcher gossamer runs under, in this order:

========== ======================== ======================== ===========================
launcher   rank                     world size               local rank
========== ======================== ======================== ===========================
torchrun   ``RANK``                 ``WORLD_SIZE``           ``LOCAL_RANK``
SLURM      ``SLURM_PROCID``         ``SLURM_NTASKS``         ``SLURM_LOCALID``
Open MPI   ``OMPI_COMM_WORLD_RANK`` ``OMPI_COMM_WORLD_SIZE`` ``OMPI_COMM_WORLD_LOCAL_RANK``
========== ======================== ======================== ===========================

``gossamer launch`` and the test helper :func:`gossamer.testing.spawn_gloo` give their workers
torchrun's variables (:func:`torchrun_variables`), after removing those of any launcher that
started them (:func:`without_launcher`).

- :func:`launch_env_from`: rank, world size, local rank and rendezvous address (a pure
  function of the mapping it is given).
- :func:`launched`: whether a launcher started this process.
- :data:`LAUNCHER_VARIABLES`: every variable a launcher sets that decides where a process sits.

Example::

    if launched():
        env = launch_env_from(os.environ)   # LaunchEnv(rank=3, world_size=8, ...)
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "BACKEND_VARIABLE",
    "DEFAULT_MASTER_ADDR",
    "DEFAULT_MASTER_PORT",
    "LAUNCHER_VARIABLES",
    "LaunchEnv",
    "expand_nodelist",
    "free_port",
    "launch_env_from",
    "launched",
    "launched_rank",
    "torchrun_variables",
    "without_launcher",
]

DEFAULT_MASTER_ADDR = "127.0.0.1"  # loopback: nothing is exposed beyond this machine by default
DEFAULT_MASTER_PORT = 29500
# TorchCommunicator.from_env's backend when none is given (e.g. gloo on a machine with CUDA)
BACKEND_VARIABLE = "GOSSAMER_BACKEND"

Source = Literal["torchrun", "slurm", "mpi", "single"]


@dataclass(frozen=True)
class _Launcher:
    """The variables one launcher sets: the three that place a process, and the others."""

    source: Source
    rank: str
    world_size: tuple[str, ...]  # the first one set is read
    local_rank: str
    others: tuple[str, ...]


# In the order they are tried: a process started by gossamer launch under SLURM sees both
# torchrun's variables (its own place) and SLURM's (the launcher's).
_LAUNCHERS = (
    _Launcher("torchrun", "RANK", ("WORLD_SIZE",), "LOCAL_RANK",
              ("LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
               "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")),
    _Launcher("slurm", "SLURM_PROCID", ("SLURM_NTASKS", "SLURM_NPROCS"), "SLURM_LOCALID", ()),
    _Launcher("mpi", "OMPI_COMM_WORLD_RANK", ("OMPI_COMM_WORLD_SIZE",),
              "OMPI_COMM_WORLD_LOCAL_RANK", ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
)
LAUNCHER_VARIABLES: tuple[str, ...] = tuple(
    name for launcher in _LAUNCHERS
    for name in (launcher.rank, *launcher.world_size, launcher.local_rank, *launcher.others)
)
"""Every variable by which torchrun, SLURM or Open MPI tells a process where it sits (with
``MASTER_ADDR`` and ``MASTER_PORT``); torchrun's agent also sets ``TORCHELASTIC_*``."""
_AGENT_PREFIX = "TORCHELASTIC_"


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as read from the launcher's environment variables."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: Source


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (the OS picked it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launcher_of(environ: Mapping[str, str]) -> _Launcher | None:
    for launcher in _LAUNCHERS:
        # torchrun's WORLD_SIZE alone counts too: launch_env_from then says RANK is missing
        if launcher.rank in environ or (launcher.source == "torchrun"
                                        and "WORLD_SIZE" in environ):
            return launcher
    return None


def launched(environ: Mapping[str, str] | None = None) -> bool:
    """Whether torchrun, SLURM, Open MPI or ``gossamer launch`` started this process as one of
    its workers: whether one of their rank variables (or torchrun's ``WORLD_SIZE``) is set.

    ``environ`` defaults to ``os.environ``. Nothing is parsed: :func:`launch_env_from` reports
    a malformed value.
    """
    return _launcher_of(os.environ if environ is None else environ) is not None


def launched_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's rank as its launcher set it; None when no launcher did, or the value is
    malformed (for messages that name the rank, where raising would hide the real error)."""
    try:
        env = launch_env_from(os.environ if environ is None else environ)
    except ValueError:
        return None
    return None if env.source == "single" else env.rank


def without_launcher(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``environ`` (default ``os.environ``) without :data:`LAUNCHER_VARIABLES` and
    ``TORCHELASTIC_*``: the environment for the workers of a new job started from a process
    that a launcher may have started itself, so that nothing of the outer job leaks in."""
    environ = os.environ if environ is None else environ
    drop = set(LAUNCHER_VARIABLES)
    return {k: v for k, v in environ.items() if k not in drop and not k.startswith(_AGENT_PREFIX)}


def torchrun_variables(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    *,
    local_rank: int | None = None,
    local_world_size: int | None = None,
) -> dict[str, str]:
    """The variables torchrun gives a worker: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.

    ``local_rank`` defaults to ``rank`` and ``local_world_size`` to ``world_size`` (every worker
    on one node). :func:`launch_env_from` reads them back.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank if local_rank is None else local_rank),
        "LOCAL_WORLD_SIZE": str(world_size if local_world_size is None else local_world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def launch_env_from(environ: Mapping[str, str]) -> LaunchEnv:
    """Read rank, world size and rendezvous address from a launcher's environment.

    Tried in order: torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), SLURM
    (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``; the master defaults to the first host
    of ``SLURM_JOB_NODELIST``), Open MPI (``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``,
    ``OMPI_COMM_WORLD_LOCAL_RANK``); with none of them, a single process. ``MASTER_ADDR`` and
    ``MASTER_PORT`` override the address (default 127.0.0.1:29500). A pure function, so it can
    be tested without a launcher; raises ValueError naming the variable that is malformed.
    """
    master_addr = environ.get("MASTER_ADDR", "").strip()
    launcher = _launcher_of(environ)
    if launcher is None:
        source: Source = "single"
        rank, world_size, local_rank = 0, 1, 0
        rank_var = size_var = local_var = ""
    else:
        source, rank_var, local_var = launcher.source, launcher.rank, launcher.local_rank
        size_var = next((v for v in launcher.world_size if v in environ),
                        launcher.world_size[0])
        world_size = _env_int(environ, size_var)
        rank = _env_int(environ, rank_var)
        # Without a local rank, assume one node: the local rank is the rank.
        local_rank = _env_int(environ, local_var, default=rank)
    if source == "slurm" and not master_addr:
        master_addr = _first_slurm_host(environ)
    if world_size < 1:
        raise ValueError(f"environment variable {size_var}={world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"environment variable {rank_var}={rank} is not a rank of a world of size "
            f"{world_size} ({size_var})"
        )
    if local_rank < 0:
        raise ValueError(f"environment variable {local_var}={local_rank} must be >= 0")
    master_port = _env_int(environ, "MASTER_PORT", default=DEFAULT_MASTER_PORT)
    if not 0 < master_port < 65536:
        raise ValueError(f"environment variable MASTER_PORT={master_port} is not a TCP port")
    return LaunchEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        master_addr=master_addr or DEFAULT_MASTER_ADDR,
        master_port=master_port,
        source=source,
    )


def _first_slurm_host(environ: Mapping[str, str]) -> str:
    """The first host of the job's node list, where srun's block distribution puts rank 0."""
    var = "SLURM_JOB_NODELIST" if environ.get("SLURM_JOB_NODELIST") else "SLURM_NODELIST"
    nodelist = environ.get(var)
    if not nodelist:
        return ""
    try:
        hosts = expand_nodelist(nodelist)
    except ValueError as exc:
        raise ValueError(f"environment variable {var}: {exc}") from None
    if not hosts:
        raise ValueError(f"environment variable {var}={nodelist!r} names no host")
    return hosts[0]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list such as ``node[01-04,07],gpu2`` into host names.

    Zero padding is kept (``node[08-10]`` gives ``node08 node09 node10``) and several bracket
    groups in one name expand to their product (``r[1-2]n[1-2]``). Raises ValueError on
    unbalanced brackets or bad ranges.
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        hosts.extend(_expand_host(item, nodelist))
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split at the commas that are outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested brackets in host list {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {text!r}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in host list {text!r}")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_host(item: str, whole: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        return [item]
    prefix, suffix = item[: match.start()], item[match.end():]
    values: list[str] = []
    for part in match.group(1).split(","):
        part = part.strip()
        bounds = part.split("-")
        if len(bounds) == 1 and bounds[0].isdigit():
            values.append(bounds[0])
        elif len(bounds) == 2 and bounds[0].isdigit() and bounds[1].isdigit():
            lo, hi = int(bounds[0]), int(bounds[1])
            if lo > hi:
                raise ValueError(f"descending range {part!r} in host list {whole!r}")
            width = len(bounds[0])
            values.extend(str(v).zfill(width) for v in range(lo, hi + 1))
        else:
            raise ValueError(f"bad range {part!r} in host list {whole!r}")
    return [h for v in values for h in _expand_host(prefix + v + suffix, whole)]


def _env_int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value is None or value.strip() == "":
        if default is None:
            raise ValueError(f"environment variable {name} is required but not set")
        return default
    try:
        return int(value.strip())
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
