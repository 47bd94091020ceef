"""The entry point: put an algorithm around any model and optimizer, keep your training loop.

Example::

    import torch, gossamer

    model = torch.nn.Linear(10, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer = gossamer.distribute(model, optimizer, "allreduce")  # under torchrun
    for x, y in loader:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    optimizer.synchronize()  # exact average of the replicas, e.g. before saving
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from gossamer.algorithms import Algorithm, Runtime, create, model_tensors
from gossamer.algorithms.buckets import apply_flat
from gossamer.algorithms.nonfinite import check_policy
from gossamer.comm.base import Communicator


class DistributedOptimizer:
    """A ``torch.optim`` optimizer with a distributed algorithm around its ``step()``.

    ``step()`` marks the step's compute for the simulator, runs the algorithm's after-backward
    hook (e.g. gradient averaging), the wrapped optimizer's step (skipped for a non-finite
    gradient under ``nonfinite="skip"``), the after-step hook (e.g. gossip of parameters) and
    the before-forward hook of the next step. Everything else
    (``param_groups``, ``zero_grad``, ...) is the wrapped optimizer's: attach learning-rate
    schedulers to :attr:`optimizer`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, runtime: Runtime) -> None:
        self.optimizer = optimizer
        self.runtime = runtime

    @property
    def comm(self) -> Communicator:
        return self.runtime.comm

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One distributed optimizer step (closures are not supported: one backward per step)."""
        if closure is not None:
            raise ValueError("closure is not supported: call backward() before step()")
        runtime = self.runtime
        runtime.comm.compute_step()
        runtime.check_gradients()
        runtime.after_backward()
        if runtime.skip_update:  # a non-finite gradient under nonfinite="skip"
            runtime.skipped_steps += 1
        else:
            self.optimizer.step()
        runtime.after_step()
        runtime.step += 1
        runtime.before_forward()

    def synchronize(self) -> None:
        """Average the replicas exactly (collective: every worker must call it)."""
        self.runtime.average_parameters()

    def finish(self) -> None:
        """After the last step: settle messages in flight (and, where the algorithm is set to,
        average exactly). Collective: every worker must call it."""
        self.runtime.finish()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state and the algorithm's state, for checkpoints."""
        return {"optimizer": self.optimizer.state_dict(), "algorithm": self.runtime.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.runtime.load_state_dict(dict(state["algorithm"]))

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({type(self.runtime).__name__}, rank {self.comm.rank} "
                f"of {self.comm.world_size}, {self.optimizer.__class__.__name__})")


def distribute(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    algorithm: Algorithm | str = "allreduce",
    comm: Communicator | None = None,
    *,
    broadcast: bool = True,
    nonfinite: str = "raise",
) -> DistributedOptimizer:
    """Wire ``algorithm`` into ``model`` and ``optimizer`` on this worker.

    Args:
        model: the replica of this worker.
        optimizer: a ``torch.optim`` optimizer over ``model``'s parameters.
        algorithm: an :class:`~gossamer.algorithms.Algorithm` configuration, or a registered
            name (default ``"allreduce"``) built with default options.
        comm: the communicator; ``None`` (default) initialises torch.distributed from the
            environment (torchrun, SLURM or Open MPI; a single process when none is set).
        broadcast: copy rank 0's parameters and buffers to every worker first, so that all
            replicas start equal (default True, as DDP does).
        nonfinite: what a NaN or infinite gradient or parameter does, found before it is sent:
            ``"raise"`` (default: a :class:`~gossamer.algorithms.nonfinite.NonFiniteError`
            naming the rank and step) or ``"skip"`` (the update is skipped); see
            :mod:`gossamer.algorithms.nonfinite` for which algorithms agree on it.

    Returns:
        A :class:`DistributedOptimizer` to use in place of ``optimizer``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(algorithm, str):
        algorithm = create(algorithm)
    if not isinstance(algorithm, Algorithm):
        raise ValueError(f"algorithm must be an Algorithm or a name, got {algorithm!r}")
    check_policy(nonfinite)
    if comm is None:
        from gossamer.comm.torch_comm import TorchCommunicator

        comm = TorchCommunicator.from_env()
    algorithm.validate(comm.world_size)
    if broadcast and comm.world_size > 1:
        broadcast_model(comm, model)
    runtime = algorithm.bind(comm, model, optimizer)
    runtime.nonfinite = nonfinite
    runtime.before_forward()
    return DistributedOptimizer(optimizer, runtime)


@torch.no_grad()
def broadcast_model(comm: Communicator, model: nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and floating-point buffers to every worker."""
    apply_flat(model_tensors(model), lambda buffer: comm.broadcast(buffer, src=src))
