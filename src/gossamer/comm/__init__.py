"""Communicators: the only layer that moves tensors between workers.

- :class:`Communicator`: the protocol algorithms speak (all_reduce, all_gather, broadcast,
  exchange, group, barrier), with byte accounting and timeouts.
- :class:`TorchCommunicator`: over a c10d process group (gloo on CPU, NCCL on GPU).
- :class:`SimWorld`: n workers in one process, deterministic, in virtual time.
"""

from gossamer.comm.base import (
    DEFAULT_TIMEOUT,
    DEFAULT_TIMEOUTS,
    CommError,
    CommStats,
    CommTimeoutError,
    Communicator,
    Handle,
    default_timeout,
)
from gossamer.comm.network import ComputeModel, NetworkModel
from gossamer.comm.sim import SimReport, SimulationError, SimWorld
from gossamer.comm.torch_comm import TorchCommunicator

__all__ = [
    "DEFAULT_TIMEOUT",
    "DEFAULT_TIMEOUTS",
    "CommError",
    "CommStats",
    "CommTimeoutError",
    "Communicator",
    "ComputeModel",
    "Handle",
    "NetworkModel",
    "SimReport",
    "SimWorld",
    "SimulationError",
    "TorchCommunicator",
    "default_timeout",
]
