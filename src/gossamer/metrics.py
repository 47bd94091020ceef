"""What a training loop can measure about the workers, from the object ``distribute()`` returned.

Two calls, usable in any loop (``gossamer train`` uses the same ones):

- :func:`consensus_distance` (collective: every worker calls it at the same point) is how far
  the replicas are apart: the mean over workers of ``||x_i - mean(x)||^2`` over the parameters.
- :func:`snapshot` (local: no communication) is what this worker's communicator counted: bytes
  and messages sent and received per peer and in total, the synchronisations and skipped steps
  of the algorithm, and the time spent waiting for communication where the communicator
  measures it.

And :class:`Recorder`, which writes them as ``gossamer train`` does (a run directory's
``config.yaml`` and ``metrics.jsonl``), for ``gossamer plot`` and ``gossamer bench report``:
one call per step and one per evaluation.

Example::

    optimizer = gossamer.distribute(model, optimizer, "sgp")
    for step, (x, y) in enumerate(loader, 1):
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
        if step % 100 == 0:
            distance = gossamer.metrics.consensus_distance(optimizer)  # on every worker
            counts = gossamer.metrics.snapshot(optimizer)
            print(step, distance, counts["bytes_sent"], counts["idle_time"])
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gossamer.algorithms import Algorithm, Runtime, model_tensors
from gossamer.algorithms.base import RuntimeHolder
from gossamer.comm.base import Communicator, IdleTime
from gossamer.loggers import JSONLLogger, Logger

__all__ = ["Recorder", "consensus_distance", "replica_mean", "snapshot"]


@torch.no_grad()
def replica_mean(model: nn.Module, comm: Communicator) -> tuple[list[torch.Tensor], float]:
    """Collective: the mean over workers of each of ``model``'s tensors, and this worker's
    squared distance to it.

    Returns the means, in float64, of the parameters then the floating-point buffers
    (:func:`gossamer.algorithms.model_tensors`), and ``||x_i - mean||^2`` of this worker's
    parameters (buffers left out). One all-reduce.
    """
    tensors = model_tensors(model)  # parameters first, then float buffers
    # In float64, so that the mean of identical replicas is exact and their consensus
    # distance exactly 0 (float32 sums would leave rounding noise).
    own = [t.detach().double() for t in tensors]
    mean = torch.cat([t.reshape(-1) for t in own])
    comm.all_reduce(mean, op="mean")
    means = list(torch.split(mean, [t.numel() for t in own]))
    n_params = sum(1 for _ in model.parameters())
    own_sq = sum(float((t.reshape(-1) - m).pow(2).sum())
                 for t, m in zip(own[:n_params], means, strict=False))
    return means, own_sq


def consensus_distance(target: Any, comm: Communicator | None = None) -> float:
    """Collective: the mean over workers of ``||x_i - mean(x)||^2`` over the parameters.

    Computed in float64, so that identical replicas give exactly 0. Every worker must call it
    at the same point of its loop; every worker gets the same value. Its traffic goes through
    ``comm`` and is counted in its stats like any other.

    Args:
        target: the :class:`~gossamer.DistributedOptimizer` that ``distribute()`` returned, or
            the model (then ``comm`` is needed).
        comm: the communicator; default: the optimizer's.

    Example::

        distance = gossamer.metrics.consensus_distance(optimizer)
    """
    model, comm = _model_and_comm(target, comm)
    _, own_sq = replica_mean(model, comm)
    total = torch.tensor([own_sq], dtype=torch.float64)
    comm.all_reduce(total, op="mean")
    return float(total[0])


def snapshot(target: Any) -> dict[str, Any]:
    """Local (no communication): what this worker has counted so far.

    Args:
        target: the :class:`~gossamer.DistributedOptimizer` that ``distribute()`` returned, or
            a communicator (then the algorithm's fields are None).

    Returns a dict of:

    - ``rank``, ``world_size``;
    - ``bytes_sent``, ``bytes_received``, ``messages_sent``, ``messages_received``: totals;
    - the same four with ``_per_peer``: ``{peer rank: count}``; collectives are counted as the
      ring algorithm moves them (:mod:`gossamer.comm.cost`);
    - ``synchronizations``: exact averages of the whole world; ``skipped_steps``: updates this
      worker skipped (or gradients it dropped) for non-finite values; ``step``: the steps taken;
    - ``clock``: seconds since the communicator started (virtual in the simulator);
    - ``idle_time``: seconds this worker spent blocked waiting for communication to complete:
      virtual seconds waiting for other workers or the network in :class:`~gossamer.SimWorld`;
      real seconds in the waits of :class:`~gossamer.TorchCommunicator` (which include the
      transfer itself); None for a communicator that does not measure it.

    The counts only grow; subtract two snapshots for an interval.
    """
    runtime = _runtime_of(target)
    comm = runtime.comm if runtime is not None else target
    stats = comm.stats
    idle = comm.idle_time if isinstance(comm, IdleTime) else None
    return {
        "rank": comm.rank,
        "world_size": comm.world_size,
        "bytes_sent": stats.total_bytes_sent,
        "bytes_received": stats.total_bytes_received,
        "messages_sent": stats.total_messages_sent,
        "messages_received": sum(stats.messages_received.values()),
        "bytes_sent_per_peer": dict(sorted(stats.bytes_sent.items())),
        "bytes_received_per_peer": dict(sorted(stats.bytes_received.items())),
        "messages_sent_per_peer": dict(sorted(stats.messages_sent.items())),
        "messages_received_per_peer": dict(sorted(stats.messages_received.items())),
        "synchronizations": runtime.synchronizations if runtime is not None else None,
        "skipped_steps": runtime.skipped_steps if runtime is not None else None,
        "step": runtime.step if runtime is not None else None,
        "clock": comm.clock(),
        "idle_time": float(idle) if idle is not None else None,
    }


def _runtime_of(target: Any) -> Runtime | None:
    """The runtime of the optimizer that ``distribute()`` returned; None for anything else."""
    if isinstance(target, RuntimeHolder) and isinstance(target.runtime, Runtime):
        return target.runtime
    return None


def _model_and_comm(target: Any, comm: Communicator | None) -> tuple[nn.Module, Communicator]:
    runtime = _runtime_of(target)
    if runtime is not None:
        return runtime.model, comm if comm is not None else runtime.comm
    if isinstance(target, nn.Module):
        if comm is None:
            raise ValueError("comm is needed with a model (or pass the optimizer that "
                             "distribute() returned)")
        return target, comm
    raise ValueError(f"target must be the optimizer distribute() returned or an nn.Module, "
                     f"got {type(target).__name__}")


class Recorder:
    """Records a training loop's metrics as ``gossamer train`` does, for ``gossamer plot`` and
    ``gossamer bench report``: ``RUN_DIR/config.yaml`` (the algorithm, the number of workers,
    your settings) and ``RUN_DIR/metrics.jsonl`` (``train``, ``eval`` and ``summary`` records).

    Every worker makes one and calls it at the same points; rank 0 writes. The numbers come
    from the optimizer that :func:`gossamer.distribute` returned: bytes and messages from its
    communicator, the synchronisations and skipped steps from its algorithm, the learning
    rate from its first parameter group, the clock from the communicator (virtual in the
    simulator). Its own traffic and time (the consensus distance's all-reduce, the wait for
    every worker) are left out of bytes, messages and wall-clock, as ``gossamer train`` leaves
    out its evaluations'.

    Args:
        run_dir: the run directory (made if needed); its files are replaced.
        optimizer: what ``distribute()`` returned.
        algorithm: the name (or configuration) you gave ``distribute()``, for the records;
            default: the one the optimizer runs (a compressor such as ``"dgc"`` then shows as
            the ``allreduce`` that carries it).
        config: settings of yours to keep in config.yaml (``dataset`` and ``model`` name the
            task in plot titles; ``steps``, ``seed``, ``lr`` ...).
        batch_size: examples per worker per step, for ``examples_per_second`` (default:
            not recorded).
        log_every: steps between ``train`` records (default 10, as ``gossamer train``).
        loggers: more :class:`~gossamer.loggers.Logger` objects that get every record on
            rank 0 (TensorBoard, W&B, MLflow adapters); closed by :meth:`close`.

    Example::

        optimizer = gossamer.distribute(model, optimizer, "sgp", comm)
        with gossamer.metrics.Recorder("runs/sgp", optimizer, algorithm="sgp") as recorder:
            for step in range(1, 301):
                ...  # zero_grad, forward, backward
                optimizer.step()
                recorder.step(loss)  # local
                if step % 50 == 0:
                    recorder.eval(eval_loss=..., eval_accuracy=...)  # on every worker
    """

    def __init__(self, run_dir: str | Path, optimizer: Any, *,
                 algorithm: str | Algorithm | None = None,
                 config: Mapping[str, Any] | None = None, batch_size: int | None = None,
                 log_every: int = 10, loggers: Sequence[Logger] = ()) -> None:
        runtime = _runtime_of(optimizer)
        if runtime is None:
            raise ValueError(f"optimizer must be the optimizer distribute() returned, got "
                             f"{type(optimizer).__name__}")
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
            raise ValueError(f"log_every must be an int >= 1, got {log_every!r}")
        if batch_size is not None and (isinstance(batch_size, bool)
                                       or not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be an int >= 1 or None, got {batch_size!r}")
        if algorithm is not None and not isinstance(algorithm, str | Algorithm):
            raise ValueError(f"algorithm must be a name or an Algorithm, got {algorithm!r}")
        self.runtime = runtime
        self.comm = runtime.comm
        self.optimizer = optimizer
        self.batch_size = batch_size
        self.log_every = log_every
        # internal state
        if algorithm is None:  # the configuration the runtime was bound from
            algorithm = runtime.config
            if not isinstance(algorithm, Algorithm):
                raise ValueError("algorithm is needed: the optimizer's runtime does not say "
                                 "which method it runs")
        self.spec = _algorithm_spec(algorithm)
        self.last: dict[str, Any] = {}  # the last eval record
        self._loss_sum, self._loss_count = 0.0, 0  # the train losses since the last eval
        # what the recorder's own collectives cost on this worker: not the algorithm's
        self._excluded = {"bytes": 0.0, "messages": 0.0, "time": 0.0}
        self._start = self._raw()  # what was counted before the recorder (the broadcast)
        self.loggers: list[Logger] = []
        self.closed = False
        if self.comm.rank != 0:
            return
        import yaml

        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        size = self.comm.world_size
        settings = {**dict(config or {}), "algorithm": self.spec, "world_size": size,
                    "sim": size if _simulated(self.comm) else 0}
        (run_dir / "config.yaml").write_text(yaml.safe_dump(_plain(settings), sort_keys=False))
        self.loggers = [JSONLLogger(run_dir / "metrics.jsonl"), *loggers]

    # ---------------------------------------------------------------- the loop's calls

    def step(self, loss: float | torch.Tensor | None = None) -> None:
        """Local: after ``optimizer.step()``, with this worker's training loss of the step.
        Every ``log_every`` steps rank 0 writes a ``train`` record (its loss, learning rate,
        bytes sent and clock)."""
        self._check_open()
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
        value = math.nan if loss is None else float(loss)
        if math.isfinite(value):
            self._loss_sum, self._loss_count = self._loss_sum + value, self._loss_count + 1
        step = self.runtime.step
        if self.comm.rank == 0 and step % self.log_every == 0:
            sent, _, clock = self._counts()
            self._write({"kind": "train", "step": step, "train_loss": value, "lr": self._lr(),
                         "bytes_sent": sent, "wall_clock": clock})

    def eval(self, eval_loss: float | None = None, eval_accuracy: float | None = None,
             **fields: Any) -> dict[str, Any]:
        """Collective (every worker, after the same step): measure and record an evaluation.

        ``eval_loss``, ``eval_accuracy`` (in [0, 1]) and any other ``fields`` are rank 0's
        (the other workers may pass nothing): evaluate the model you want recorded. Added
        here: the consensus distance (:func:`consensus_distance`), the mean over workers of
        the bytes and messages sent, of the clock and of the training loss since the last
        evaluation, the synchronisations, the skipped steps of all workers, and
        ``examples_per_second`` with ``batch_size``. Returns the record (on every worker).
        """
        self._check_open()
        comm, runtime = self.comm, self.runtime
        self._excluding(runtime.pause, time=False)  # (WAGMA halts its rounds: see Runtime)
        self._catch_up()
        before = self._raw()
        _, own_sq = replica_mean(runtime.model, comm)
        sent, messages, clock = self._counts(before)
        loss = self._loss_sum / self._loss_count if self._loss_count else math.nan
        scalars = torch.tensor([own_sq, loss, sent, messages, clock, runtime.skipped_steps],
                               dtype=torch.float64)
        comm.all_reduce(scalars, op="mean")
        self._exclude(before, time=True)
        self._loss_sum, self._loss_count = 0.0, 0
        consensus, mean_loss, mean_sent, mean_messages, mean_clock, skipped = scalars.tolist()
        step = runtime.step
        record: dict[str, Any] = {"kind": "eval", "step": step, "train_loss": mean_loss}
        if eval_loss is not None:
            record["eval_loss"] = float(eval_loss)
        if eval_accuracy is not None:
            record["eval_accuracy"] = float(eval_accuracy)
        record.update({
            "consensus_distance": consensus, "bytes_sent": mean_sent,
            "messages_sent": mean_messages, "synchronizations": runtime.synchronizations,
            "skipped_steps": round(skipped * comm.world_size), "wall_clock": mean_clock,
        })
        if self.batch_size is not None:
            examples = self.batch_size * comm.world_size * step
            record["examples_per_second"] = examples / mean_clock if mean_clock > 0 else math.nan
        record["lr"] = self._lr()
        record.update(fields)
        self.last = record
        if comm.rank == 0:
            self._write(record)
        return record

    def close(self) -> None:
        """Local: write the ``summary`` (the last evaluation's record with the algorithm, the
        number of workers and the mode) and close the files. Call :meth:`eval` after the last
        step first, for the summary to hold the final numbers. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.comm.rank != 0:
            return
        summary = {**self.last, "kind": "summary", "step": self.runtime.step,
                   "algorithm": self.spec["name"], "world_size": self.comm.world_size,
                   "mode": "simulated" if _simulated(self.comm) else "torch.distributed"}
        self._write(summary)
        for logger in self.loggers:
            logger.close()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- counting

    def _raw(self) -> dict[str, float]:
        stats = self.comm.stats
        return {"bytes": float(stats.total_bytes_sent),
                "messages": float(stats.total_messages_sent), "time": self.comm.clock()}

    def _counts(self, now: dict[str, float] | None = None) -> tuple[float, float, float]:
        """This worker's bytes, messages and seconds since the recorder started, less its
        own."""
        now = now or self._raw()
        bytes_, messages, time = (now[k] - self._start[k] - self._excluded[k]
                                  for k in ("bytes", "messages", "time"))
        return bytes_, messages, time

    def _exclude(self, before: dict[str, float], time: bool) -> None:
        for key, value in self._raw().items():
            if time or key != "time":
                self._excluded[key] += value - before[key]

    def _excluding(self, fn: Any, time: bool = True) -> None:
        before = self._raw()
        fn()
        self._exclude(before, time)

    def _catch_up(self) -> None:
        """Wait for every worker, counting the wait as the run's time (a worker ahead would
        wait later anyway) and the barrier's own cost as nobody's: as gossamer train does."""
        t0 = self.comm.clock()
        self._excluding(self.comm.barrier, time=False)
        t1 = self.comm.clock()
        self._excluding(self.comm.barrier)
        self._excluded["time"] += min(self.comm.clock() - t1, t1 - t0)

    def _lr(self) -> float:
        groups = self.optimizer.param_groups
        return float(groups[0]["lr"]) if groups else math.nan

    def _write(self, record: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.log(record)

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("the recorder is closed")


def _simulated(comm: Communicator) -> bool:
    from gossamer.comm.sim import SimComm

    return isinstance(comm, SimComm)


def _algorithm_spec(algorithm: str | Algorithm) -> dict[str, Any]:
    """``{"name", "options"}`` as config.yaml writes an algorithm: the options that differ
    from its defaults (a name alone has none)."""
    if isinstance(algorithm, str):
        return {"name": algorithm, "options": {}}
    defaults = type(algorithm)()
    options = {f.name: _plain(getattr(algorithm, f.name)) for f in dataclasses.fields(algorithm)
               if f.init and getattr(algorithm, f.name) != getattr(defaults, f.name)}
    return {"name": algorithm.name, "options": options}


def _plain(value: Any) -> Any:
    """``value`` as plain YAML data: a nested object by its ``as_dict()``, else its repr."""
    if isinstance(value, str | int | float | bool | type(None)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "as_dict"):
        return _plain(value.as_dict())
    return repr(value)
