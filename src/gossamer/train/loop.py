"""The training loop every worker runs, the same in the simulator and under torchrun.

Reads top to bottom: build the model (same seed on every worker), wrap the optimizer with the
algorithm, draw minibatches from this worker's shard, step, and every ``eval_every`` steps
measure: evaluate the average of the replicas and each replica, the consensus distance, the
bytes sent. Traffic and virtual time spent only to measure or checkpoint are not counted as the
algorithm's.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gossamer.algorithms import create, model_tensors
from gossamer.api import distribute
from gossamer.comm.base import Communicator, default_timeout
from gossamer.comm.faults import FaultInjector
from gossamer.train import checkpoint as ckpt
from gossamer.train.agreement import check_agreement, describe_run
from gossamer.train.config import TrainConfig, learning_rate
from gossamer.train.data import (
    Dataset,
    ShardSampler,
    describe_partition,
    load_dataset,
    partition,
)
from gossamer.train.models import build_model

__all__ = ["TrainConfig", "evaluate", "run_training", "train_worker"]

DEFAULT_MODELS = {"digits": "mlp", "mnist": "cnn", "fashion-mnist": "cnn", "cifar10": "resnet20",
                  "text": "transformer"}
EVAL_BATCH = 1024  # examples per forward pass when evaluating: bounds memory on big test sets


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


class _Metrics:
    """Rank 0's records: kept in memory, appended to metrics.jsonl, optionally TensorBoard."""

    def __init__(self, config: TrainConfig, enabled: bool, resume_step: int) -> None:
        self.records: list[dict[str, Any]] = []
        self.file = None
        self.tensorboard = None
        if not enabled or not config.run_dir:
            return
        path = Path(config.run_dir) / "metrics.jsonl"
        if resume_step:  # drop what the interrupted run recorded after its checkpoint
            records = [json.loads(line) for line in _read_lines(path)]
            kept = [r for r in records
                    if r.get("step", 0) <= resume_step and r.get("kind") != "summary"]
            path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        else:
            path.write_text("")
        self.file = path.open("a")
        if config.tensorboard:
            from gossamer.train.report import TensorBoardLogger

            self.tensorboard = TensorBoardLogger(Path(config.run_dir) / "tensorboard")

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self.file is not None:
            self.file.write(json.dumps(_json_safe(record)) + "\n")
            self.file.flush()
        if self.tensorboard is not None:
            self.tensorboard.log(record)

    def close(self) -> None:
        if self.file is not None:
            os.fsync(self.file.fileno())
            self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def _json_safe(value: Any) -> Any:
    """NaN and infinities (not JSON) become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _read_lines(path: Path) -> list[str]:
    lines = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash
            lines.append(line)
    return lines


def _to_safe(obj: Any) -> Any:
    """numpy arrays become tensors, so that a checkpoint loads with weights_only."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.copy())
    if isinstance(obj, dict):
        return {k: _to_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_safe(v) for v in obj)
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def make_optimizer(config: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    if config.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=config.lr,
                                 weight_decay=config.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                           nesterov=config.nesterov, weight_decay=config.weight_decay)


def resolve_model(config: TrainConfig) -> str:
    return DEFAULT_MODELS.get(config.dataset, "mlp") if config.model == "auto" else config.model


def train_worker(comm: Communicator, config: TrainConfig, dataset: Dataset) -> dict[str, Any]:
    """Train this worker's replica; rank 0's result carries the run's metrics."""
    # Every worker must train the same thing: a mismatch stops them all here, before the
    # algorithm's first collective. Its traffic and time are not the algorithm's.
    b, m, t = comm.stats.total_bytes_sent, comm.stats.total_messages_sent, comm.clock()
    check_agreement(comm, describe_run(config, comm.world_size, dataset))
    setup = {"bytes": comm.stats.total_bytes_sent - b,
             "messages": comm.stats.total_messages_sent - m, "time": comm.clock() - t}
    torch.manual_seed(config.seed)  # the same initial model on every worker
    device = getattr(comm, "device", torch.device("cpu"))  # CUDA under NCCL
    model = build_model(resolve_model(config), dataset.input_shape, dataset.num_classes)
    model.to(device)
    optimizer = distribute(model, make_optimizer(config, model),
                           create(config.algorithm, config.options), comm,
                           nonfinite=config.nonfinite)
    runtime = optimizer.runtime
    runtime.total_steps = config.steps
    shards = partition(dataset.y_train.numpy(), comm.world_size, scheme=config.partition,
                       alpha=config.alpha, seed=config.seed)
    sampler = ShardSampler(shards[comm.rank], config.batch_size,
                           seed=config.seed * 7919 + comm.rank)

    def training_inputs(count: int) -> Iterator[torch.Tensor]:
        """``count`` minibatches of this worker's shard for a method to re-estimate statistics
        before evaluating (local SGD's BatchNorm statistics): drawn apart from training's,
        seeded by the step, so that evaluating changes neither the training batches nor a
        resumed run."""
        seed = np.random.SeedSequence([config.seed, comm.rank, runtime.step]).generate_state(1)
        draw = ShardSampler(shards[comm.rank], config.batch_size, seed=int(seed[0]))
        for _ in range(count):
            yield dataset.x_train[draw.next_batch()].to(device)

    runtime.training_inputs = training_inputs  # a Runtime field: read by those that need it
    # Traffic and time spent only to measure or checkpoint, not by the algorithm.
    excluded = dict(setup)
    offsets = {"bytes": 0, "messages": 0, "time": 0.0}  # carried over from before a resume
    start = 0
    if config.resume:
        # the newest checkpoint that every worker verifies (the workers agree on its step)
        start, shard, shared = ckpt.resume_checkpoint(comm, config.run_dir)
        state = shared if shared is not None else shard
        model.load_state_dict(state["model"])
        for name, buffer in model.named_buffers():
            buffer.copy_(shard["buffers"][name])
        optimizer.load_state_dict(state["optimizer"] if shared is None else {
            "optimizer": shared["optimizer"]["optimizer"],
            "algorithm": shard["algorithm"],
        })
        sampler.load_state_dict(shard["sampler"])
        torch.set_rng_state(shard["rng"])
        offsets = dict(shard["offsets"])
        # the set-up broadcast was counted before the checkpoint already
        excluded = {"bytes": comm.stats.total_bytes_sent,
                    "messages": comm.stats.total_messages_sent, "time": comm.clock()}
    metrics = _Metrics(config, enabled=comm.rank == 0, resume_step=start)
    progress = Progress(config.steps, enabled=comm.rank == 0 and not config.quiet, start=start)
    params = [p for p in model.parameters()]
    examples_per_step = config.batch_size * config.accumulation * comm.world_size

    def counters() -> tuple[float, float, float]:
        """(bytes, messages, seconds) of the algorithm so far, on this worker."""
        return (offsets["bytes"] + comm.stats.total_bytes_sent - excluded["bytes"],
                offsets["messages"] + comm.stats.total_messages_sent - excluded["messages"],
                offsets["time"] + comm.clock() - excluded["time"])

    def excluding(fn, *args):
        """Run a collective ``fn`` without counting its traffic or time as the algorithm's."""
        b, m, t = comm.stats.total_bytes_sent, comm.stats.total_messages_sent, comm.clock()
        out = fn(*args)
        excluded["bytes"] += comm.stats.total_bytes_sent - b
        excluded["messages"] += comm.stats.total_messages_sent - m
        excluded["time"] += comm.clock() - t
        return out

    window_loss, window_count = 0.0, 0
    last: dict[str, Any] = {}
    faults = FaultInjector(config.faults, comm.rank, comm.world_size)  # --fault, for tests
    for step in range(start, config.steps):
        done = step + 1
        faults.begin_step(comm, done)  # an injected crash, hang or slow-down starts here
        started = time.perf_counter()
        lr = learning_rate(config, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        step_loss = 0.0
        for _ in range(config.accumulation):
            batch = sampler.next_batch()
            loss = loss_fn(model(dataset.x_train[batch].to(device)),
                           dataset.y_train[batch].to(device))
            (loss / config.accumulation).backward()
            step_loss += loss.item() / config.accumulation
        faults.after_backward(done, params, time.perf_counter() - started)
        optimizer.step()
        if done == config.steps:
            optimizer.finish()
        if math.isfinite(step_loss):
            window_loss, window_count = window_loss + step_loss, window_count + 1
        elif config.nonfinite == "raise":  # (under "skip", the step's update was skipped)
            raise FloatingPointError(f"rank {comm.rank}: the loss became {step_loss} at step "
                                     f"{done}; lower the learning rate")
        if comm.rank == 0 and done % config.log_every == 0:
            sent, _, clock = counters()
            metrics.write({"kind": "train", "step": done, "train_loss": step_loss, "lr": lr,
                           "bytes_sent": sent, "wall_clock": clock})
        if done == config.steps or (config.eval_every and done % config.eval_every == 0):
            runtime.before_eval()
            last = excluding(_measure, comm, config, dataset, model, params, runtime,
                             window_loss / window_count if window_count else math.nan,
                             counters(), examples_per_step, done)
            window_loss, window_count = 0.0, 0
            if comm.rank == 0:
                metrics.write(last)
        if config.checkpoint_every and (done % config.checkpoint_every == 0
                                        or done == config.steps):
            excluding(_save, comm, config, model, optimizer, runtime, sampler, done, counters())
        if comm.rank == 0:
            acc = last.get("eval_accuracy", float("nan"))
            progress.update(
                done, loss=f"{step_loss:.3f}",
                acc=f"{100 * acc:.1f}%" if acc == acc else "-",
                sent=format_bytes(counters()[0]),
            )
    summary = {**last, "kind": "summary", "algorithm": config.algorithm,
               "world_size": comm.world_size, "rank": comm.rank}
    if comm.rank == 0:
        metrics.write({k: v for k, v in summary.items() if k != "rank"})
        metrics.close()
        if config.run_dir:  # the records from before a resume too
            lines = _read_lines(Path(config.run_dir) / "metrics.jsonl")
            summary["history"] = [r for r in map(json.loads, lines) if r.get("kind") == "eval"]
        else:
            summary["history"] = [r for r in metrics.records if r.get("kind") == "eval"]
    return summary


def _measure(
    comm: Communicator, config: TrainConfig, dataset: Dataset, model: nn.Module,
    params: list[torch.Tensor], runtime: Any, train_loss: float,
    counters: tuple[float, float, float], examples_per_step: int, step: int,
) -> dict[str, Any]:
    """Collective: evaluate the averaged model and each replica, and the consensus distance."""
    with torch.no_grad():
        tensors = model_tensors(model)  # parameters first, then float buffers
        # In float64, so that the mean of identical replicas is exact and their consensus
        # distance exactly 0 (float32 sums would leave rounding noise).
        own = [t.detach().double() for t in tensors]
        mean = torch.cat([t.reshape(-1) for t in own])
        comm.all_reduce(mean, op="mean")
        means = list(torch.split(mean, [t.numel() for t in own]))
        # consensus distance over parameters only: mean over workers of ||x_i - mean||^2
        own_sq = sum(float((t.reshape(-1) - m).pow(2).sum())
                     for t, m in zip(own[: len(params)], means, strict=False))
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
        sent, messages, clock = counters
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
        "examples_per_second": examples_per_step * step / mean_clock if mean_clock > 0
        else float("nan"),
        "lr": learning_rate(config, step - 1),
    }


def _save(comm, config, model, optimizer, runtime, sampler, step, counters) -> None:
    sent, messages, clock = counters
    shard = {
        # BatchNorm statistics differ between workers even when parameters don't
        "buffers": dict(model.named_buffers()),
        "algorithm": runtime.state_dict(),
        "sampler": _to_safe(sampler.state_dict()),
        "rng": torch.get_rng_state(),
        "offsets": {"bytes": sent, "messages": messages, "time": clock},
    }
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    keep = config.keep_checkpoints
    if runtime.replicas_identical:
        ckpt.save_checkpoint(comm, config.run_dir, step, shard, shared=state, keep=keep)
    else:
        ckpt.save_checkpoint(comm, config.run_dir, step, {**shard, **state}, keep=keep)


def launched_by_launcher(environ: Mapping[str, str] | None = None) -> bool:
    """True when torchrun, SLURM or Open MPI started this process as one of several."""
    env = os.environ if environ is None else environ
    return any(k in env for k in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"))


def prepare(config: TrainConfig) -> Dataset:
    """Check everything that can be checked before any worker starts; load the data."""
    algorithm = create(config.algorithm, config.options)  # bad names and options fail here
    if config.sim:
        algorithm.validate(config.sim)
    if config.tensorboard:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise ValueError("tensorboard needs the tensorboard package: "
                             "pip install tensorboard") from None
    options = {"block_size": config.block_size} if config.dataset == "text" else {}
    # The evaluation split does not depend on the run's seed: runs of different seeds are
    # scored on the same examples.
    dataset = load_dataset(config.dataset, seed=0, path=config.data_path, **options)
    build_model(resolve_model(config), dataset.input_shape, dataset.num_classes)
    return dataset


# Settings that may differ between a run and its resumption: they change no trajectory, except
# steps, which may be raised to train longer (a cosine schedule then stretches).
_FREE_ON_RESUME = {"resume", "quiet", "tensorboard", "eval_every", "eval_workers", "log_every",
                   "checkpoint_every", "keep_checkpoints", "timeout", "run_dir", "world_size",
                   "steps", "faults", "bind_all"}


def check_resume(config: TrainConfig) -> None:
    """A resumed run must have a checkpoint and the settings it was started with."""
    import yaml

    if not ckpt.checkpoint_candidates(config.run_dir):
        raise ValueError(f"run_dir {config.run_dir!r} has no checkpoint to resume from")
    path = Path(config.run_dir) / "config.yaml"
    if not path.is_file():
        return
    started = yaml.safe_load(path.read_text()) or {}
    now = {**config.as_dict(), "model": resolve_model(config)}
    differ = [k for k in sorted(started) if k not in _FREE_ON_RESUME and k in now
              and started[k] != now[k]]
    if differ:
        changes = ", ".join(f"{k}={started[k]!r} (now {now[k]!r})" for k in differ)
        raise ValueError(
            f"resume: run_dir {config.run_dir!r} was started with {changes}; pass the same "
            "settings to resume, or start a new run_dir"
        )


def check_shards(config: TrainConfig, dataset: Dataset, world_size: int) -> None:
    """Every worker's shard must hold at least one minibatch."""
    shards = partition(dataset.y_train.numpy(), world_size, scheme=config.partition,
                       alpha=config.alpha, seed=config.seed)
    smallest = min(len(s) for s in shards)
    if config.batch_size > smallest:
        raise ValueError(
            f"batch_size={config.batch_size} is larger than this worker's shard of {smallest} "
            f"examples ({len(dataset.y_train)} training examples over {world_size} workers)"
        )


def _write_run_dir(config: TrainConfig, dataset: Dataset, world_size: int) -> None:
    import yaml

    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    pointer = run_dir / "checkpoints" / "latest"
    if pointer.is_file():
        # so that an elastic restart (or --resume) of this run never resumes the earlier one
        warnings.warn(f"run_dir {str(run_dir)!r} holds checkpoints of an earlier run; this run "
                      "starts over and replaces them (pass --resume to continue it instead)",
                      stacklevel=3)
        pointer.unlink()
    resolved = {**config.as_dict(), "model": resolve_model(config), "world_size": world_size}
    ckpt.atomic_write_bytes(run_dir / "config.yaml",
                            yaml.safe_dump(resolved, sort_keys=False).encode())
    shards = partition(dataset.y_train.numpy(), world_size, scheme=config.partition,
                       alpha=config.alpha, seed=config.seed)
    split = describe_partition(shards, dataset.y_train.numpy(), dataset.num_classes)
    ckpt.atomic_write_bytes(run_dir / "partition.json", json.dumps(split).encode())


def elastic_restart(config: TrainConfig, environ: Mapping[str, str] | None = None) -> int:
    """The restart count when this worker group restarted and resumes by itself; 0 otherwise.

    torchrun ``--max-restarts N`` (and ``gossamer launch --max-restarts N``) restarts every
    worker when one fails, with ``TORCHELASTIC_RESTART_COUNT`` counting the restarts. A
    restarted real (not simulated) run with a ``run_dir`` and no ``--resume`` resumes from
    the run's newest checkpoint as if ``--resume`` had been given; with no checkpoint yet
    (the failure came before the first), it starts over from step 0. Each worker decides from
    what it sees in ``run_dir``; the agreement check at the start of training and the agreed
    step of the checkpoint stop every worker if they saw different things.
    """
    env = os.environ if environ is None else environ
    try:
        count = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        raise ValueError("TORCHELASTIC_RESTART_COUNT must be an integer, got "
                         f"{env['TORCHELASTIC_RESTART_COUNT']!r}") from None
    if count <= 0 or config.sim or config.resume or not config.run_dir:
        return 0
    return count if ckpt.checkpoint_candidates(config.run_dir) else 0


def run_training(config: TrainConfig) -> dict[str, Any]:
    """Run ``config`` in the simulator (``sim > 0``) or in this process of a launched job.

    Returns this process's summary (rank 0's in the simulator), with ``mode``,
    ``world_size`` and ``history`` (rank 0's eval records) added.
    """
    dataset = prepare(config)
    restart = elastic_restart(config)
    if restart:
        config = config.replace(resume=True)
    if config.resume:
        check_resume(config)
    if config.sim > 0:
        from gossamer.comm import ComputeModel, NetworkModel, SimWorld

        check_shards(config, dataset, config.sim)
        if config.run_dir and not config.resume:
            _write_run_dir(config, dataset, config.sim)
        world = SimWorld(
            config.sim,
            network=NetworkModel(latency=config.latency, bandwidth=config.bandwidth),
            compute=ComputeModel(step_time=config.compute_time),
            seed=config.seed,
            timeout=config.timeout if config.timeout is not None else default_timeout("sim"),
        )
        result = world.run(train_worker, config, dataset)[0]
        result["mode"] = "simulated"
    else:
        from gossamer.comm.torch_comm import TorchCommunicator

        comm = TorchCommunicator.from_env(timeout=config.timeout, bind_all=config.bind_all)
        try:
            if restart and comm.rank == 0:
                print(f"gossamer: restart {restart} of the worker group: resuming from "
                      f"{ckpt.checkpoint_candidates(config.run_dir)[0].name}", file=sys.stderr)
            check_shards(config, dataset, comm.world_size)
            if config.run_dir and not config.resume:
                if comm.rank == 0:
                    _write_run_dir(config, dataset, comm.world_size)
                comm.barrier()
            result = train_worker(comm, config, dataset)
        finally:
            comm.close()
        result["mode"] = "torch.distributed"
    if config.run_dir and result.get("rank") == 0:
        from gossamer.train.report import load_metrics, plot_runs

        plot_runs([load_metrics(config.run_dir)], Path(config.run_dir) / "plots")
    return result
