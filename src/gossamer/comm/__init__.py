"""Communicators: the only layer that moves tensors between workers.

- :class:`Communicator`: the protocol algorithms speak (all_reduce, all_gather, broadcast,
  exchange, group, barrier), with byte accounting and timeouts; :class:`CommunicatorBase`:
  what gossamer's communicators share (rank, world size, the accounting).
- the capabilities that only some communicators have, declared by deriving from them and
  checked with ``isinstance``: :class:`AsyncCollectives`, :class:`IdleTime`,
  :class:`VirtualClock`, :class:`DeviceBound`, :class:`FaultInjection`,
  :class:`MembershipChange`, :class:`SharedState`, :class:`ProcessGroupBacked`.
- :class:`TorchCommunicator`: over a c10d process group (gloo on CPU, NCCL on GPU).
- :class:`SimWorld`: n workers in one process, deterministic, in virtual time.
- :mod:`gossamer.comm.environment`: where a launcher (torchrun, SLURM, Open MPI, ``gossamer
  launch``) placed this process: :func:`launch_env_from`, :func:`launched`.
- :mod:`gossamer.comm.rate`: rates in bytes per second: :func:`parse_rate`,
  :func:`format_rate`.
"""

from gossamer.comm.base import (
    DEFAULT_TIMEOUT,
    DEFAULT_TIMEOUTS,
    AsyncCollectives,
    CommError,
    CommStats,
    CommTimeoutError,
    Communicator,
    CommunicatorBase,
    DeviceBound,
    FaultInjection,
    Handle,
    IdleTime,
    MembershipChange,
    ProcessGroupBacked,
    SharedState,
    VirtualClock,
    default_timeout,
)
from gossamer.comm.environment import LaunchEnv, launch_env_from, launched
from gossamer.comm.network import ComputeModel, NetworkModel
from gossamer.comm.rate import format_rate, parse_rate
from gossamer.comm.sim import SimReport, SimulationError, SimWorld
from gossamer.comm.torch_comm import Liveness, TorchCommunicator

__all__ = [
    "DEFAULT_TIMEOUT",
    "DEFAULT_TIMEOUTS",
    "AsyncCollectives",
    "CommError",
    "CommStats",
    "CommTimeoutError",
    "Communicator",
    "CommunicatorBase",
    "ComputeModel",
    "DeviceBound",
    "FaultInjection",
    "Handle",
    "IdleTime",
    "LaunchEnv",
    "Liveness",
    "MembershipChange",
    "NetworkModel",
    "ProcessGroupBacked",
    "SharedState",
    "SimReport",
    "SimWorld",
    "SimulationError",
    "TorchCommunicator",
    "VirtualClock",
    "default_timeout",
    "format_rate",
    "launch_env_from",
    "launched",
    "parse_rate",
]
