"""A PyTorch Lightning strategy that trains with any of gossamer's methods.

Example::

    import lightning.pytorch as pl
    from gossamer.integrations.lightning import GossamerStrategy

    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=1000,
                         strategy=GossamerStrategy("sgp"))
    trainer.fit(module, datamodule)

:class:`GossamerStrategy` is Lightning's ``DDPStrategy`` (the same launching, process group,
distributed samplers, ``reduce``/``barrier``/``broadcast`` and checkpoint saving on rank 0)
with two changes: the module is not wrapped in ``DistributedDataParallel``, and the optimizer
that ``configure_optimizers`` returns is put through :func:`gossamer.distribute`. The
algorithm then does its communication in ``optimizer.step()``, which Lightning calls with its
closure (forward and backward) in automatic optimization and ``opt.step()`` calls in manual
optimization. DDP must not also run: it would average the gradients a second time, and for
the gossip and local methods it would undo the very point of not averaging every step.

Needs ``pip install gossamer[lightning]``; importing :mod:`gossamer` does not import Lightning.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
from torch import nn

try:
    import lightning.pytorch as pl
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "gossamer.integrations.lightning needs PyTorch Lightning (the `lightning` package): "
        "pip install gossamer[lightning]"
    ) from error
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from gossamer.algorithms import Algorithm, create
from gossamer.api import DistributedOptimizer, distribute
from gossamer.comm.torch_comm import TorchCommunicator

__all__ = ["GossamerStrategy"]

_NONFINITE = ("raise", "skip")


class GossamerStrategy(DDPStrategy):
    """Data-parallel training in Lightning with a gossamer method instead of DDP.

    Args:
        algorithm: an :class:`~gossamer.algorithms.Algorithm` configuration (e.g.
            ``gossamer.LocalSGD(period=8)``) or a registered name built with its default
            options (default ``"allreduce"``, which is DDP's arithmetic).
        nonfinite: ``"raise"`` (default) or ``"skip"``: what a NaN or infinite gradient does
            (see :func:`gossamer.distribute`).
        total_steps: the optimizer steps of the fit (default None: the trainer's
            ``estimated_stepping_batches``, which counts ``max_steps``, ``max_epochs`` and
            gradient accumulation). QSR's schedule needs it, and local SGD ends its last round
            on it, so that the last step averages.
        training_inputs: ``training_inputs(k)`` yields k batches of this worker's model
            inputs (default None), for local SGD's re-estimation of BatchNorm statistics
            before each validation; Lightning's batches are the module's business, so the
            strategy cannot draw them itself.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, timeout, start_method: as for Lightning's ``DDPStrategy``;
            ``timeout`` also bounds each of gossamer's collectives.

    What it does in the fit, on every worker:

    - ``setup``: the module is moved to its device but not wrapped in DDP; the one optimizer
      of ``configure_optimizers`` becomes a :class:`~gossamer.DistributedOptimizer` (rank
      0's parameters are broadcast first, as DDP does). Learning-rate schedulers keep working:
      the distributed optimizer's ``param_groups`` are the wrapped optimizer's. Under
      ``precision="16-mixed"`` the precision plugin's GradScaler is given to ``distribute``
      so that every worker skips the same overflowing steps.
    - ``on_validation_start`` (during the fit): the method's before-evaluation hook, e.g.
      an exact average under ``average_before_eval=True``.
    - ``on_train_end``: :meth:`~gossamer.DistributedOptimizer.finish`, which settles the
      messages in flight and, for the methods set to (``average_at_end``), averages the
      replicas exactly, so that the fit ends with equal replicas.
    - Checkpoints (``trainer.save_checkpoint`` and ``ModelCheckpoint``) resume every worker
      where it was: the optimizer state is the wrapped optimizer's plus the method's under
      ``"algorithm"``; for the all-reduce methods (equal replicas after every step) the
      strategy adds each worker's algorithm state (``"algorithm_by_rank"``), and for the
      others (gossip, local SGD) each worker's whole replica and optimizer state
      (``"gossamer_workers"``: the file grows with the number of workers). The checkpoint's
      own ``state_dict`` is rank 0's replica, which a plain ``load_from_checkpoint`` reads.
      Resuming needs the same number of workers.

    Limits: one optimizer (gossamer binds the method to the whole module);
    ``BaseFinetuning``-style ``add_param_group`` is refused; gradient clipping
    (``gradient_clip_val``) applies to each worker's local gradients, before the method
    averages them (DDP clips the averaged ones), and Lightning refuses it under
    ``16-mixed``, because the distributed optimizer unscales the gradients in its step.
    """

    strategy_name = "gossamer"

    def __init__(
        self,
        algorithm: Algorithm | str = "allreduce",
        *,
        nonfinite: str = "raise",
        total_steps: int | None = None,
        training_inputs: Callable[[int], Iterable[torch.Tensor]] | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
    ) -> None:
        if isinstance(algorithm, str):
            algorithm = create(algorithm)  # an unknown name fails here, not in the fit
        if not isinstance(algorithm, Algorithm):
            raise ValueError(f"algorithm: an Algorithm or a registered name, got {algorithm!r}")
        if nonfinite not in _NONFINITE:
            raise ValueError(f"nonfinite: one of {', '.join(_NONFINITE)}, got {nonfinite!r}")
        if total_steps is not None and (isinstance(total_steps, bool)
                                        or not isinstance(total_steps, int) or total_steps < 1):
            raise ValueError(f"total_steps: a positive int or None, got {total_steps!r}")
        if training_inputs is not None and not callable(training_inputs):
            raise ValueError(f"training_inputs: a callable or None, got {training_inputs!r}")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,  # type: ignore[arg-type]
        )
        self.algorithm = algorithm
        self.nonfinite = nonfinite
        self.total_steps = total_steps
        self.training_inputs = training_inputs
        self._finished = False

    # -- no DDP --------------------------------------------------------------------------

    def configure_ddp(self) -> None:
        """Leave the module unwrapped: the method communicates in the optimizer's step."""

    def _setup_model(self, model: nn.Module) -> nn.Module:  # type: ignore[override]
        return model

    # -- the optimizer -------------------------------------------------------------------

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's optimizers and schedulers, with the optimizer put through
        :func:`gossamer.distribute` (collective: every worker calls it in ``setup``)."""
        super().setup_optimizers(trainer)
        if not self.optimizers:
            return
        if len(self.optimizers) > 1:
            raise ValueError(
                f"configure_optimizers: GossamerStrategy takes one optimizer, got "
                f"{len(self.optimizers)}; gossamer binds its method to the whole module")
        module = self.lightning_module
        assert module is not None
        timeout = self._timeout.total_seconds() if self._timeout is not None else None
        comm = TorchCommunicator(timeout=timeout)  # the process group Lightning initialised
        self.optimizers = [distribute(
            module, self.optimizers[0], self.algorithm, comm,
            nonfinite=self.nonfinite,
            scaler=getattr(self.precision_plugin, "scaler", None),
            total_steps=self._fit_steps(trainer),
            training_inputs=self.training_inputs,
        )]
        self._finished = False

    def _fit_steps(self, trainer: pl.Trainer) -> int | None:
        if self.total_steps is not None:
            return self.total_steps
        steps = trainer.estimated_stepping_batches
        return int(steps) if steps != float("inf") and steps > 0 else None

    @property
    def distributed_optimizers(self) -> list[DistributedOptimizer]:
        """The fit's :class:`~gossamer.DistributedOptimizer` (its ``comm.stats`` count the
        bytes sent); empty before ``setup``."""
        found = []
        for optimizer in self.optimizers:
            if isinstance(optimizer, LightningOptimizer):
                optimizer = optimizer._optimizer
            if isinstance(optimizer, DistributedOptimizer):
                found.append(optimizer)
        return found

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's gradient accumulation (``accumulate_grad_batches``): the micro-batches
        but the last accumulate without communicating, every optimizer's ``no_sync`` (as
        ``DDPStrategy`` uses DDP's); needed where the method communicates during backward
        (AllReduce, whose compressed form refuses a second backward before the step)."""
        with contextlib.ExitStack() as stack:
            for optimizer in self.distributed_optimizers:
                stack.enter_context(optimizer.no_sync())
            yield

    def _fitting(self) -> bool:
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        return trainer is not None and trainer.state.fn == TrainerFn.FITTING

    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self._fitting():
            for optimizer in self.distributed_optimizers:
                optimizer.before_eval()

    def on_train_end(self) -> None:
        """Settle the method after the last step (collective), so the replicas end equal."""
        super().on_train_end()
        if not self._finished:
            for optimizer in self.distributed_optimizers:
                optimizer.finish()
            self._finished = True

    # -- checkpoints ---------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore after ``setup``: ``distribute`` broadcasts rank 0's weights there, which
        would overwrite the workers' own replicas loaded before it."""
        return True

    def _replicas_identical(self) -> bool:
        return all(type(optimizer.runtime).replicas_identical
                   for optimizer in self.distributed_optimizers)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state dict; for a method whose replicas are equal after every step,
        with every worker's algorithm state under ``"algorithm_by_rank"`` (e.g. the error
        feedback of a compressed all-reduce is each worker's own). Collective, as
        Lightning's ``dump_checkpoint`` runs on every worker."""
        state = dict(super().optimizer_state(optimizer))
        if "algorithm" in state and self.world_size > 1 and self._replicas_identical():
            state["algorithm_by_rank"] = self._gather(state["algorithm"])
        return state

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        """Lightning's checkpoint (rank 0's replica and optimizer state), and for a method
        whose replicas differ between averages (gossip, local SGD) every worker's own replica
        and optimizer state under ``"gossamer_workers"``, so that each worker resumes exactly
        where it was. Collective (``trainer.save_checkpoint`` runs on every worker); the
        other workers' states travel to rank 0, which holds them all while it writes."""
        if self.world_size > 1 and self.distributed_optimizers and not self._replicas_identical():
            mine = {"state_dict": checkpoint["state_dict"],
                    "optimizer_states": checkpoint.get("optimizer_states")}
            workers: list[Any] = self._gather(mine)
            workers[0] = None  # rank 0's are the checkpoint's own
            checkpoint = {**checkpoint, "gossamer_workers": workers}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _gather(self, state: Any) -> list[Any]:
        """Every worker's ``state`` (tensors and plain data), by rank. Collective. Each travels
        as the bytes of ``torch.save`` through the communicator and is read back with
        ``weights_only=True``: no object is unpickled from a peer (``all_gather_object`` would
        unpickle anything)."""
        import io

        from gossamer.train.checkpoint import safe_loads

        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        comm = self.distributed_optimizers[0].comm
        return [safe_loads(bytes(part.numpy()), "a worker's checkpoint state")
                for part in comm.all_gather(data)]

    def _own(self, checkpoint: Mapping[str, Any]) -> Mapping[str, Any]:
        """The checkpoint as this worker saved it: its own replica and optimizer state where
        the checkpoint holds every worker's."""
        workers = checkpoint.get("gossamer_workers")
        if workers is None:
            return checkpoint
        if len(workers) != self.world_size:
            raise ValueError(
                f"checkpoint: saved by {len(workers)} workers, resumed by {self.world_size}; "
                "the workers' own replicas cannot be mapped (resume with the same number)")
        mine = workers[self.global_rank]
        return checkpoint if mine is None else {**checkpoint, **mine}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(self._own(checkpoint), strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load each optimizer's state, with this worker's own algorithm state when the
        checkpoint holds every worker's (from a run of the same world size)."""
        checkpoint = self._own(checkpoint)
        states = []
        for state in checkpoint["optimizer_states"]:
            state = dict(state)
            by_rank = state.pop("algorithm_by_rank", None)
            if by_rank is not None:
                if len(by_rank) != self.world_size:
                    raise ValueError(
                        f"checkpoint: saved by {len(by_rank)} workers, resumed by "
                        f"{self.world_size}; the method's per-worker state cannot be mapped")
                state["algorithm"] = by_rank[self.global_rank]
            states.append(state)
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": states})

    def __repr__(self) -> str:
        return f"GossamerStrategy({self.algorithm!r})"
