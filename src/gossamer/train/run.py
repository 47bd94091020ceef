"""Running a training: check everything that can be checked before a worker starts, prepare
the run directory, then run :func:`~gossamer.train.loop.train_worker` in the simulator or in
this process of a launched job; resuming and elastic restarts.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gossamer.comm.base import default_timeout
from gossamer.comm.environment import launched
from gossamer.comm.membership import REJOIN_VARIABLE, STORE_VARIABLE, Membership
from gossamer.train import checkpoint as ckpt
from gossamer.train.config import TrainConfig, load_recipe
from gossamer.train.data import Dataset, describe_partition, load_dataset, partition
from gossamer.train.models import build_model, check_model_input, resolve_model

__all__ = ["check_resume", "check_shards", "elastic_restart", "finished_run",
           "launched_by_launcher", "prepare", "run_training"]


#: Whether a launcher started this process as one of several: the name this module had for
#: :func:`gossamer.comm.environment.launched`.
launched_by_launcher = launched


def prepare(config: TrainConfig) -> Dataset:
    """Check everything that can be checked before any worker starts; load the data."""
    config.check_mode(simulated=config.sim > 0)
    if config.run_dir:
        _check_run_dir(Path(config.run_dir))
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
    check_model_input(resolve_model(config), dataset.x_train.dtype, config.dataset)
    build_model(resolve_model(config), dataset.input_shape, dataset.num_classes)
    return dataset


def _check_run_dir(run_dir: Path) -> None:
    """``run_dir`` is a directory, or can be made one: neither it nor a parent is a file."""
    for path in (run_dir, *run_dir.parents):
        if path.exists():
            if not path.is_dir():
                where = "is" if path == run_dir else f"is under {str(path)!r}, which is"
                raise ValueError(f"run_dir {str(run_dir)!r} {where} a file, not a directory")
            return


# Settings that may differ between a run and its resumption: they change no trajectory, except
# steps, which may be raised to train longer (a cosine schedule then stretches).
_FREE_ON_RESUME = {"resume", "quiet", "tensorboard", "eval_every", "eval_workers", "log_every",
                   "checkpoint_every", "keep_checkpoints", "timeout", "run_dir", "world_size",
                   "steps", "faults", "bind_all", "loggers", "on_failure"}


def check_resume(config: TrainConfig) -> None:
    """A resumed run must have a checkpoint, and the settings its config.yaml records."""
    if not ckpt.checkpoint_candidates(config.run_dir):
        raise ValueError(f"run_dir {config.run_dir!r} has no checkpoint to resume from")
    _check_same_settings(config)


def _check_same_settings(config: TrainConfig) -> None:
    """``config`` has the settings its run_dir's config.yaml records (but those free to
    change on resume)."""
    path = Path(config.run_dir) / "config.yaml"
    if not path.is_file():
        # its settings are known from nowhere else: another algorithm or learning rate would
        # load a state it does not fit, or silently continue another run
        raise ValueError(f"resume: run_dir {config.run_dir!r} has no config.yaml, the settings "
                         "its run was started with, so this run's cannot be checked against "
                         "them; put config.yaml back, or start a new run_dir")
    try:  # config.yaml holds the model resolved from auto: a field like any other
        started = TrainConfig(**load_recipe(path)).as_dict()
    except (ValueError, TypeError) as error:
        raise ValueError(f"resume: run_dir {config.run_dir!r} has a config.yaml that cannot "
                         f"be read ({error}); start a new run_dir") from None
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
                       alpha=config.dirichlet_alpha, seed=config.seed)
    smallest = min(len(s) for s in shards)
    if config.batch_size > smallest:
        raise ValueError(
            f"batch_size={config.batch_size} is larger than this worker's shard of {smallest} "
            f"examples ({len(dataset.y_train)} training examples over {world_size} workers)"
        )


def _write_run_dir(config: TrainConfig, dataset: Dataset, world_size: int) -> None:
    run_dir = Path(config.run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"run_dir {str(run_dir)!r} cannot be made: "
                         f"{error.strerror or error}") from None
    pointer = run_dir / "checkpoints" / "latest"
    if pointer.is_file():
        # so that an elastic restart (or --resume) of this run never resumes the earlier one
        warnings.warn(f"run_dir {str(run_dir)!r} holds checkpoints of an earlier run; this run "
                      "starts over and replaces them (pass --resume to continue it instead)",
                      stacklevel=3)
        pointer.unlink()
    _write_config(config, world_size)
    shards = partition(dataset.y_train.numpy(), world_size, scheme=config.partition,
                       alpha=config.dirichlet_alpha, seed=config.seed)
    split = describe_partition(shards, dataset.y_train.numpy(), dataset.num_classes)
    ckpt.atomic_write_bytes(run_dir / "partition.json", json.dumps(split).encode())


def _write_config(config: TrainConfig, world_size: int) -> None:
    """Write run_dir's config.yaml: this run's settings, as a recipe that starts the same run
    (``resume`` false). A resumed run writes it again, since the settings free to change on
    resume (``steps`` raised, the evaluation's) are this run's now."""
    import yaml

    resolved = {**config.as_dict(), "resume": False, "model": resolve_model(config),
                "world_size": world_size}
    ckpt.atomic_write_bytes(Path(config.run_dir) / "config.yaml",
                            yaml.safe_dump(resolved, sort_keys=False).encode())


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
    count = _restart_count(config, environ)
    return count if count and ckpt.checkpoint_candidates(config.run_dir) else 0


def _restart_count(config: TrainConfig, environ: Mapping[str, str] | None = None) -> int:
    """``TORCHELASTIC_RESTART_COUNT`` for a real run with a ``run_dir`` and no ``--resume``;
    0 otherwise."""
    env = os.environ if environ is None else environ
    try:
        count = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        raise ValueError("TORCHELASTIC_RESTART_COUNT must be an integer, got "
                         f"{env['TORCHELASTIC_RESTART_COUNT']!r}") from None
    if count <= 0 or config.sim or config.resume or not config.run_dir:
        return 0
    return count


def finished_run(config: TrainConfig, environ: Mapping[str, str] | None = None
                 ) -> dict[str, Any] | None:
    """The summary of ``run_dir``'s run, as metrics.jsonl keeps it, when that run is already
    complete and this one (``--resume``, or an elastic restart) would only repeat its end; None
    when there is training left to do.

    Complete: the newest checkpoint is of the last step and verifies (a restarted run without
    checkpoints: metrics.jsonl ends with the summary of the last step, and config.yaml holds
    these settings). A summary lost to a crash after the last checkpoint is rebuilt from the
    last step's evaluation and written. A checkpoint beyond ``steps`` is a ValueError.
    """
    from gossamer.loggers import read_lines

    run_dir = Path(config.run_dir)
    candidates = ckpt.checkpoint_candidates(run_dir) if config.resume else []
    if candidates:
        step = ckpt.checkpoint_step(candidates[0])
        if step < config.steps:
            return None
        if step > config.steps:
            raise ValueError(f"resume: run_dir {str(run_dir)!r} was trained to step {step}, "
                             f"beyond steps={config.steps}; pass --steps {step} or more")
        try:
            ckpt.verify_checkpoint(candidates[0])
        except ValueError:  # damaged: resuming falls back to an earlier one, or says why not
            return None
    elif config.resume or not _restart_count(config, environ):
        return None
    metrics_path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in read_lines(metrics_path)]
    if not candidates:
        if not (records and records[-1].get("kind") == "summary"
                and records[-1].get("step") == config.steps):
            return None  # a restart before the end of a run without checkpoints starts over
        try:
            _check_same_settings(config)
        except ValueError:
            return None  # another run's records: this one starts over
    summary = next((r for r in reversed(records) if r.get("kind") == "summary"), None)
    if summary is None or summary.get("step") != config.steps:
        last = next((r for r in reversed(records) if r.get("kind") == "eval"
                     and r.get("step") == config.steps), None)
        if last is None:
            raise ValueError(
                f"resume: run_dir {str(run_dir)!r} is complete (its newest checkpoint is of "
                f"the last step, {config.steps}) but its metrics.jsonl has no record of that "
                f"step; pass a larger --steps to train on, or start a new run_dir")
        summary = {**last, "kind": "summary", "algorithm": config.algorithm.label,
                   "world_size": ckpt.read_meta(candidates[0])["world_size"]}
        if _launched_rank() == 0:  # the summary the finished run did not get to write
            kept = [r for r in records if r.get("kind") != "summary"]
            ckpt.atomic_write_bytes(metrics_path, "".join(
                json.dumps(r) + "\n" for r in [*kept, summary]).encode())
    result: dict[str, Any] = {k: float("nan") if v is None else v for k, v in summary.items()
                              if k != "kind"}
    result.update(kind="summary", rank=_launched_rank(), already_complete=True,
                  mode="simulated" if config.sim else "torch.distributed",
                  history=[r for r in records if r.get("kind") == "eval"])
    return result


def _surviving_worker(comm: Any, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
    """:func:`~gossamer.train.loop.train_worker` of a simulated run that goes on without
    its failed workers (on_failure="continue"): a worker that crashed or hung on purpose, or
    stopped at a non-finite value (nonfinite="raise"), returns None, as its process would
    exit; the others return their summaries."""
    from gossamer.comm.faults import InjectedFault
    from gossamer.train.loop import train_worker

    try:
        return train_worker(comm, *args, **kwargs)
    except InjectedFault:
        return None
    except FloatingPointError as error:  # its own values: the others go on without it
        print(f"gossamer train (rank {comm.rank}): {type(error).__name__}: {error}; the "
              "others go on without it", file=sys.stderr)
        return None


def membership_start(membership: Membership | None) -> bool:
    """Whether this worker starts the run with the others (not a restarted one rejoining)."""
    return membership is None or membership.joined_at is None


def _rejoin(config: TrainConfig) -> Membership | None:
    """A worker restarted by ``gossamer launch --on-failure continue --max-restarts N`` asks
    the members to let it in again (they look every few steps); None when the run ended
    first."""
    from gossamer.comm.environment import launch_env_from
    from gossamer.comm.membership import membership_window

    env = launch_env_from(os.environ)
    timeout = config.timeout if config.timeout is not None else default_timeout("gloo")
    membership = Membership.rejoin(env.rank, env.world_size, env.master_addr, env.master_port,
                                   timeout=timeout, wait=10 * membership_window(timeout))
    if membership is None:
        print(f"gossamer: rank {env.rank} restarted, but the run finished before it could "
              "rejoin", file=sys.stderr)
    else:
        print(f"gossamer: rank {env.rank} restarted and rejoined after step "
              f"{membership.joined_at}, as rank {membership.comm.rank} of "
              f"{membership.comm.world_size}", file=sys.stderr)
    return membership


def _check_store_outlives_workers() -> None:
    """on_failure="continue" on real processes needs ``gossamer launch``: it hosts the
    rendezvous store (no worker does) and lets the others go on when one fails."""
    if os.environ.get(STORE_VARIABLE) != "1":
        raise ValueError(
            "on_failure='continue' (--on-failure continue) needs gossamer launch, which hosts "
            "the rendezvous store and lets the others go on when a worker fails; here a "
            "worker would host it (its death would end the run), or the launcher (torchrun) "
            "stops every worker when one fails")


def _launched_rank() -> int:
    from gossamer.comm.environment import launched_rank

    return launched_rank() or 0


def _shard_layout(config: TrainConfig) -> Any:
    """A sharded run's :class:`~gossamer.sharding.ShardLayout`: ``config.shards`` must divide
    the launcher's world size (a ValueError naming ``--shards`` before any rendezvous)."""
    from gossamer.comm.environment import launch_env_from
    from gossamer.sharding import ShardLayout

    world_size = launch_env_from(os.environ).world_size
    if world_size % config.shards:
        raise ValueError(
            f"shards={config.shards} (--shards) must divide the world size, {world_size} "
            f"process{'es' if world_size != 1 else ''}: launch replicas x shards of them "
            "(gossamer launch --nproc R*S)")
    importlib.import_module("torch.distributed.fsdp")  # seconds: before the rendezvous
    return ShardLayout.from_env(shards=config.shards, timeout=config.timeout,
                                bind_all=config.bind_all)


def run_training(config: TrainConfig) -> dict[str, Any]:
    """Run ``config`` in the simulator (``sim > 0``) or in this process of a launched job.

    Returns this process's summary (rank 0's in the simulator), with ``mode``,
    ``world_size`` and ``history`` (rank 0's eval records) added.
    """
    if config.on_failure == "continue" and not config.sim:
        _check_store_outlives_workers()
    dataset = prepare(config)
    # a run that goes on without failed workers never restarts as a whole
    restart = elastic_restart(config) if config.on_failure == "stop" else 0
    if restart:
        config = config.replace(resume=True)
    if config.resume:
        check_resume(config)
    if config.run_dir:
        finished = finished_run(config)
        if finished is not None:  # nothing to train: the finished run's records stay as they are
            return finished
    from gossamer.train.loop import train_worker

    if config.sim > 0:
        from gossamer.comm import SimWorld

        algorithm = config.algorithm.resolve(config.sim)  # once, for every worker
        check_shards(config, dataset, config.sim)
        if config.run_dir:
            if config.resume:
                _write_config(config, config.sim)
            else:
                _write_run_dir(config, dataset, config.sim)
        world = SimWorld(
            config.sim,
            network=config.network_model(),
            compute=config.compute_model(),
            seed=config.seed,
            timeout=config.timeout if config.timeout is not None else default_timeout("sim"),
        )
        if config.on_failure == "continue":
            results = world.run(_surviving_worker, config, dataset, algorithm=algorithm)
            result = next(r for r in results if r is not None and r["rank"] == 0)
        else:
            result = world.run(train_worker, config, dataset, algorithm=algorithm)[0]
        result["mode"] = "simulated"
    else:
        from gossamer.comm.torch_comm import TorchCommunicator

        membership, layout = None, None
        if config.shards > 1:  # R x S: the method over the replicas, FSDP2 inside each
            layout = _shard_layout(config)
            comm = layout.world
        elif os.environ.get(REJOIN_VARIABLE) == "1":  # restarted: the others went on
            membership = _rejoin(config)
            if membership is None:
                return {"kind": "summary", "rank": -1, "mode": "torch.distributed"}
            comm = membership.comm
        else:
            comm = TorchCommunicator.from_env(timeout=config.timeout, bind_all=config.bind_all)
            if config.on_failure == "continue":
                membership = Membership(comm)
        try:
            if restart and comm.rank == 0:
                print(f"gossamer: restart {restart} of the worker group: resuming from "
                      f"{ckpt.checkpoint_candidates(config.run_dir)[0].name}", file=sys.stderr)
            # (a rejoining worker takes the members' settings, adapted as theirs were)
            algorithm = (config.algorithm.resolve if membership_start(membership)
                         else config.algorithm.for_members)(
                comm.world_size if layout is None else layout.replicas)
            check_shards(config, dataset, comm.world_size)
            if config.run_dir and not config.resume and membership_start(membership):
                if comm.rank == 0:
                    _write_run_dir(config, dataset, comm.world_size)
                comm.barrier()
            elif config.run_dir and comm.rank == 0 and membership_start(membership):
                # resumed: every worker has checked its settings against the old config.yaml
                # before the communicator's rendezvous, so none reads this one
                _write_config(config, comm.world_size)
            result = train_worker(comm, config, dataset, algorithm=algorithm,
                                  membership=membership, layout=layout)
        finally:
            if membership is not None:
                membership.comm.close()  # the communicator over the last members
            if layout is not None:
                layout.close()  # the replica dimension's communicator, then comm's
            else:
                comm.close()
        result["mode"] = "torch.distributed"
    if config.run_dir and result.get("rank") == 0:
        from gossamer.train.report import load_metrics, plot_runs

        plot_runs([load_metrics(config.run_dir)], Path(config.run_dir) / "plots")
    return result
