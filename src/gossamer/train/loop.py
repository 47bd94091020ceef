"""The training loop every worker runs, the same in the simulator and under torchrun.

Reads top to bottom: build the model (same seed on every worker), wrap the optimizer with the
algorithm, draw minibatches from this worker's shard, step, and every ``eval_every`` steps
evaluate the average of the replicas on the test set. Traffic and virtual time spent only to
evaluate are not counted as the algorithm's.
"""

from __future__ import annotations

import copy
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gossamer.algorithms import average_tensors, create, model_tensors
from gossamer.api import distribute
from gossamer.comm.base import Communicator
from gossamer.train.data import Dataset, ShardSampler, load_dataset, partition_iid
from gossamer.train.models import build_model


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that defines a training run (see ``gossamer train --help``)."""

    algorithm: str = "allreduce"  # a registered name: `gossamer algorithms` lists them
    options: Mapping[str, Any] = field(default_factory=dict)  # the algorithm's options
    dataset: str = "digits"  # embedded, needs no download
    model: str = "mlp"
    steps: int = 300  # optimizer steps per worker; ~20 epochs of digits with 4 workers
    batch_size: int = 32  # per worker; the global batch is world_size times larger
    lr: float = 0.05  # SGD learning rate, constant
    momentum: float = 0.9
    weight_decay: float = 0.0
    seed: int = 0  # model init, data split and sampling
    eval_every: int = 50  # steps between evaluations of the averaged model (0: only at the end)
    sim: int = 0  # simulated workers; 0: real processes from the launcher environment
    latency: float = 50e-6  # simulator: seconds per message
    bandwidth: float = 125e6  # simulator: bytes per second per link (1 Gbit/s)
    compute_time: float = 0.01  # simulator: seconds of compute per step
    quiet: bool = False  # no progress bar, summary only

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("eval_every", "sim", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        from gossamer.comm.network import check_positive

        check_positive("latency", self.latency, allow_zero=True)
        check_positive("bandwidth", self.bandwidth, allow_zero=False)
        check_positive("compute_time", self.compute_time, allow_zero=True)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["options"] = dict(self.options)
        return d


class Progress:
    """A one-line progress bar on stderr (a line per 10% when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.last_decile = -1
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


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of ``model`` on ``(x, y)``."""
    was_training = model.training
    model.eval()
    logits = model(x)
    loss = F.cross_entropy(logits, y).item()
    accuracy = (logits.argmax(dim=1) == y).float().mean().item()
    model.train(was_training)
    return loss, accuracy


def format_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def train_worker(comm: Communicator, config: TrainConfig, dataset: Dataset) -> dict[str, Any]:
    """Train this worker's replica; rank 0's result carries the run's metrics."""
    torch.manual_seed(config.seed)  # the same initial model on every worker
    model = build_model(config.model, dataset.input_shape, dataset.num_classes)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=config.lr, momentum=config.momentum,
        weight_decay=config.weight_decay,
    )
    optimizer = distribute(model, optimizer, create(config.algorithm, config.options), comm)
    runtime = optimizer.runtime
    shards = partition_iid(len(dataset.y_train), comm.world_size, config.seed)
    sampler = ShardSampler(
        shards[comm.rank], config.batch_size, seed=config.seed * 7919 + comm.rank
    )
    progress = Progress(config.steps, enabled=comm.rank == 0 and not config.quiet)

    excluded_bytes = 0  # sent only to evaluate, not by the algorithm
    excluded_time = 0.0
    history: list[dict[str, Any]] = []
    loss_sum, loss_count = 0.0, 0
    eval_loss, eval_acc = float("nan"), float("nan")
    for step in range(1, config.steps + 1):
        batch = sampler.next_batch()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(dataset.x_train[batch]), dataset.y_train[batch])
        loss.backward()
        optimizer.step()
        loss_sum, loss_count = loss_sum + loss.item(), loss_count + 1

        if step == config.steps or (config.eval_every and step % config.eval_every == 0):
            bytes_before, clock_before = comm.stats.total_bytes_sent, comm.clock()
            if runtime.replicas_identical:
                averaged = model
            else:
                averaged = copy.deepcopy(model)
                average_tensors(comm, model_tensors(averaged))
            excluded_bytes += comm.stats.total_bytes_sent - bytes_before
            excluded_time += comm.clock() - clock_before
            if comm.rank == 0:
                eval_loss, eval_acc = evaluate(averaged, dataset.x_test, dataset.y_test)
                history.append({
                    "step": step,
                    "train_loss": loss_sum / loss_count,
                    "eval_loss": eval_loss,
                    "eval_accuracy": eval_acc,
                    "bytes_sent": comm.stats.total_bytes_sent - excluded_bytes,
                    "wall_clock": comm.clock() - excluded_time,
                })
            loss_sum, loss_count = 0.0, 0
        progress.update(
            step,
            loss=f"{loss.item():.3f}",
            acc=f"{100 * eval_acc:.1f}%" if eval_acc == eval_acc else "-",
            sent=format_bytes(comm.stats.total_bytes_sent - excluded_bytes),
        )

    wall_clock = comm.clock() - excluded_time
    sent = float(comm.stats.total_bytes_sent - excluded_bytes)
    # The mean over workers of bytes sent and of wall-clock (one tiny all-reduce, not counted).
    totals = torch.tensor([sent, wall_clock], dtype=torch.float64)
    comm.all_reduce(totals, op="mean")
    return {
        "rank": comm.rank,
        "history": history,
        "eval_loss": eval_loss,
        "eval_accuracy": eval_acc,
        "bytes_sent_per_worker": totals[0].item(),
        "wall_clock": wall_clock,
        "synchronizations": runtime.synchronizations,
        "steps": config.steps,
    }


def launched_by_launcher(environ: Mapping[str, str] | None = None) -> bool:
    """True when torchrun, SLURM or Open MPI started this process as one of several."""
    env = os.environ if environ is None else environ
    return any(k in env for k in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"))


def run_training(config: TrainConfig) -> dict[str, Any]:
    """Run ``config`` in the simulator (``sim > 0``) or in this process of a launched job.

    Returns rank 0's result (other ranks of a launched job return their own) with
    ``world_size``, ``mode`` and ``examples_per_second`` added.
    """
    create(config.algorithm, config.options)  # bad names and options fail before any worker
    dataset = load_dataset(config.dataset, seed=config.seed)
    if config.sim > 0:
        from gossamer.comm import ComputeModel, NetworkModel, SimWorld

        world = SimWorld(
            config.sim,
            network=NetworkModel(latency=config.latency, bandwidth=config.bandwidth),
            compute=ComputeModel(step_time=config.compute_time),
            seed=config.seed,
        )
        result = world.run(train_worker, config, dataset)[0]
        result["mode"] = "simulated"
        world_size = config.sim
    else:
        from gossamer.comm.torch_comm import TorchCommunicator

        comm = TorchCommunicator.from_env()
        try:
            result = train_worker(comm, config, dataset)
        finally:
            comm.close()
        result["mode"] = "torch.distributed"
        world_size = comm.world_size
    result["world_size"] = world_size
    result["examples_per_second"] = (
        config.steps * config.batch_size * world_size / result["wall_clock"]
        if result["wall_clock"] > 0 else float("nan")
    )
    return result
