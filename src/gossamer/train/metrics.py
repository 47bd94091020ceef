"""What every run measures, the same way for every algorithm: evaluation of the averaged model
and of each replica, the consensus distance, bytes and messages sent, wall-clock; the records
(metrics.jsonl, TensorBoard) and the progress bar.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gossamer.algorithms import model_tensors
from gossamer.comm.base import Communicator
from gossamer.loggers import LOGGERS, JSONLLogger, Logger, make_logger, read_lines
from gossamer.metrics import replica_mean
from gossamer.train.config import TrainConfig, learning_rate
from gossamer.train.data import Dataset

__all__ = ["MetricsLog", "Progress", "evaluate", "format_bytes", "loss_fn", "measure", "read_lines"]


EVAL_BATCH = 1024  # examples per forward pass when evaluating: bounds memory on big test sets


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy; for sequence models over every position."""
    if logits.dim() == 3:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return F.cross_entropy(logits, y)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of ``model`` on ``(x, y)``, in chunks."""
    was_training = model.training
    model.eval()
    total_loss, correct, count = 0.0, 0.0, 0
    device = next(model.parameters()).device
    for start in range(0, len(y), EVAL_BATCH):
        xb = x[start : start + EVAL_BATCH].to(device)
        yb = y[start : start + EVAL_BATCH].to(device)
        logits = model(xb)
        weight = yb.numel()
        total_loss += loss_fn(logits, yb).item() * weight
        correct += (logits.argmax(dim=-1) == yb).sum().item()
        count += weight
    model.train(was_training)
    return total_loss / count, correct / count


class Progress:
    """A one-line progress bar on stderr (a line per 10% when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool, start: int = 0) -> None:
        self.total = total
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.last_decile = 10 * start // total
        self.started = time.perf_counter()

    def update(self, step: int, **fields: str) -> None:
        if not self.enabled:
            return
        decile = 10 * step // self.total
        if not self.tty and decile == self.last_decile and step != self.total:
            return
        self.last_decile = decile
        width = 24
        filled = width * step // self.total
        bar = "=" * filled + (">" if filled < width else "") + " " * (width - filled - 1)
        info = "  ".join(f"{k} {v}" for k, v in fields.items())
        elapsed = time.perf_counter() - self.started
        line = f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] {info}  {elapsed:.1f}s"
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if step == self.total else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def format_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


class MetricsLog:
    """Rank 0's records: kept in memory and given to each logger (:mod:`gossamer.loggers`).

    Only where ``enabled`` (rank 0). With a run directory: ``metrics.jsonl`` always (a resumed
    run keeps the records up to ``resume_step``), TensorBoard with ``config.tensorboard``, and
    each name in ``loggers`` (of :data:`gossamer.loggers.LOGGERS`), made under the run
    directory. The :class:`~gossamer.loggers.Logger` objects in ``loggers`` get the records
    with or without a run directory; ``close()`` closes them too.
    """

    def __init__(self, config: TrainConfig, enabled: bool, resume_step: int,
                 loggers: Sequence[str | Logger] = ()) -> None:
        self.records: list[dict[str, Any]] = []
        self.loggers: list[Logger] = []
        for logger in loggers:  # names are checked on every rank, before any file is made
            if isinstance(logger, str) and logger not in LOGGERS:
                raise ValueError(f"loggers: {logger!r} is not one of "
                                 f"{', '.join(sorted(LOGGERS))}")
        if not enabled:
            return
        if config.run_dir:
            run_dir = Path(config.run_dir)
            self.loggers.append(JSONLLogger(run_dir / "metrics.jsonl", resume_step))
            names = [x for x in loggers if isinstance(x, str) and x != "jsonl"]
            if config.tensorboard and "tensorboard" not in names:
                names.insert(0, "tensorboard")
            settings = config.as_dict() if names else None  # the run's, for W&B and MLflow
            self.loggers += [make_logger(name, run_dir, settings) for name in names]
        self.loggers += [x for x in loggers if not isinstance(x, str)]

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        for logger in self.loggers:
            logger.log(record)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def measure(
    comm: Communicator, config: TrainConfig, dataset: Dataset, model: nn.Module,
    params: list[torch.Tensor], runtime: Any, train_loss: float,
    counters: tuple[float, float, float, float], step: int,
) -> dict[str, Any]:
    """Collective: evaluate the averaged model and each replica, and the consensus distance.
    ``counters``: this worker's (bytes, messages, seconds) and the examples of all workers."""
    with torch.no_grad():
        # own_sq is averaged below with the other scalars, in one all-reduce: the same figure
        # as gossamer.metrics.consensus_distance
        means, own_sq = replica_mean(model, comm)
        tensors = model_tensors(model)
        if runtime.replicas_identical and len(tensors) == len(params):
            averaged = model  # identical replicas, no per-worker statistics to average
        else:
            averaged = copy.deepcopy(model)
            for t, m in zip(model_tensors(averaged), means, strict=True):
                t.copy_(m.view_as(t))
        if config.eval_workers:
            own_loss, own_acc = evaluate(model, dataset.x_test, dataset.y_test)
        else:
            own_loss, own_acc = float("nan"), float("nan")
        sent, messages, clock, examples = counters
        scalars = torch.tensor([own_sq, train_loss, sent, messages, clock,
                                runtime.skipped_steps], dtype=torch.float64)
        comm.all_reduce(scalars, op="mean")
        per_worker = comm.all_gather(torch.tensor([own_loss, own_acc], dtype=torch.float64))
        if comm.rank != 0:
            return {}
        eval_loss, eval_acc = evaluate(averaged, dataset.x_test, dataset.y_test)
    consensus, mean_loss, mean_sent, mean_messages, mean_clock, mean_skipped = scalars.tolist()
    return {
        "kind": "eval",
        "step": step,
        "train_loss": mean_loss,
        "eval_loss": eval_loss,
        "eval_accuracy": eval_acc,
        "worker_eval_loss": [float(t[0]) for t in per_worker],
        "worker_eval_accuracy": [float(t[1]) for t in per_worker],
        "consensus_distance": consensus,
        "bytes_sent": mean_sent,
        "messages_sent": mean_messages,
        "synchronizations": runtime.synchronizations,
        # updates skipped (or own gradients dropped) for non-finite values, over all workers
        "skipped_steps": round(mean_skipped * comm.world_size),
        "wall_clock": mean_clock,
        "examples_per_second": examples / mean_clock if mean_clock > 0
        else float("nan"),
        "lr": learning_rate(config, step - 1),
    }
