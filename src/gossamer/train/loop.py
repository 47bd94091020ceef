"""The training loop every worker runs, the same in the simulator and under torchrun.

Reads top to bottom: build the model (same seed on every worker), wrap the optimizer with the
algorithm, draw minibatches from this worker's shard, step, and every ``eval_every`` steps
measure: evaluate the average of the replicas and each replica, the consensus distance, the
bytes sent. Traffic and virtual time spent only to measure or checkpoint are not counted as the
algorithm's.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gossamer.algorithms import Algorithm
from gossamer.api import distribute
from gossamer.comm.base import CommError, Communicator, DeviceBound, VirtualClock
from gossamer.comm.faults import FaultInjector
from gossamer.comm.membership import REJOIN_EVERY, Membership
from gossamer.metrics import consensus_distance
from gossamer.train import checkpoint as ckpt
from gossamer.train import dcp
from gossamer.train.agreement import check_agreement, describe_run
from gossamer.train.config import TrainConfig, learning_rate
from gossamer.train.data import Dataset, ShardSampler, partition
from gossamer.train.elastic import share_state
from gossamer.train.metrics import (
    MetricsLog,
    Progress,
    evaluate,
    format_bytes,
    loss_fn,
    measure,
    read_lines,
)
from gossamer.train.models import build_model, resolve_model

__all__ = ["evaluate", "train_worker"]


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


def train_worker(comm: Communicator, config: TrainConfig, dataset: Dataset,
                 algorithm: Algorithm | None = None,
                 membership: Membership | None = None) -> dict[str, Any]:
    """Train this worker's replica; rank 0's result carries the run's metrics.

    ``algorithm``: ``config.algorithm`` resolved for the world size (default: resolved here);
    :func:`~gossamer.train.run.run_training` resolves it once for every worker.
    ``membership``: under ``on_failure="continue"``, who trains (default: made here over
    ``comm``); after a failure the survivors agree on the members and go on, and
    ``membership.comm`` is the communicator over them (its caller closes it).
    """
    # Every worker must train the same thing: a mismatch stops them all here, before the
    # algorithm's first collective. Its traffic and time are not the algorithm's.
    before = _raw_counts(comm)
    rejoining = membership is not None and membership.joined_at is not None
    # the worker's id and the world at the start: its shard, whatever the membership
    me, size = (membership.me, membership.size) if rejoining else (comm.rank, comm.world_size)
    if not rejoining:  # (a restarted worker receives the state of a member instead)
        check_agreement(comm, describe_run(config, comm.world_size, dataset))
    setup = {key: value - before[key] for key, value in _raw_counts(comm).items()}
    torch.manual_seed(config.seed)  # the same initial model on every worker
    device = comm.device if isinstance(comm, DeviceBound) else torch.device("cpu")  # NCCL: CUDA
    model = build_model(resolve_model(config), dataset.input_shape, dataset.num_classes)
    model.to(device)
    shards = partition(dataset.y_train.numpy(), size, scheme=config.partition,
                       alpha=config.dirichlet_alpha, seed=config.seed)
    sampler = ShardSampler(shards[me], config.batch_size, seed=config.seed * 7919 + me)
    if membership is None and config.on_failure == "continue":
        membership = Membership(comm)

    def training_inputs(count: int) -> Iterator[torch.Tensor]:
        """``count`` minibatches of this worker's shard for a method to re-estimate statistics
        before evaluating (local SGD's BatchNorm statistics): drawn apart from training's,
        seeded by the step, so that evaluating changes neither the training batches nor a
        resumed run."""
        seed = np.random.SeedSequence([config.seed, me, runtime.step]).generate_state(1)
        draw = ShardSampler(shards[me], config.batch_size, seed=int(seed[0]))
        for _ in range(count):
            yield dataset.x_train[draw.next_batch()].to(device)

    algorithm = algorithm if algorithm is not None else config.algorithm
    optimizer = distribute(model, make_optimizer(config, model), algorithm, comm,
                           nonfinite=config.nonfinite, total_steps=config.steps,
                           training_inputs=training_inputs, broadcast=not rejoining)
    runtime = optimizer.runtime
    # Traffic and time spent only to measure or checkpoint, not by the algorithm.
    excluded = dict(setup)
    # carried over from before a resume; examples: trained on by all workers together
    offsets = {"bytes": 0, "messages": 0, "time": 0.0, "examples": 0}
    start = 0
    examples_per_step = config.batch_size * config.accumulation * comm.world_size
    if config.resume:
        # the newest checkpoint that every worker verifies (the workers agree on its step)
        if config.checkpoint_format == "dcp":  # model, optimizer and algorithm loaded there
            start, shard = dcp.resume_dcp_checkpoint(comm, config.run_dir, model, optimizer)
        else:
            start, shard, shared = ckpt.resume_checkpoint(comm, config.run_dir)
            state = shared if shared is not None else shard
            model.load_state_dict(state["model"])
            for name, buffer in model.named_buffers():
                buffer.copy_(shard["buffers"][name])
            # each worker's own algorithm state, also where the optimizer's is shared
            optimizer.load_state_dict({**state["optimizer"], "algorithm": shard["algorithm"]})
        sampler.load_state_dict(shard["sampler"])
        torch.set_rng_state(shard["rng"])
        if "simulation" in shard and isinstance(comm, VirtualClock):
            comm.load_simulation_state(shard["simulation"])  # the compute model's draws
        # (a checkpoint from before the examples were counted: the steps at this world size)
        offsets = {"examples": start * examples_per_step, **shard["offsets"]}
        # the set-up broadcast was counted before the checkpoint already
        excluded = _raw_counts(comm)
    if rejoining:  # the members' model, optimizer and algorithm state, and their step
        # (and the counts of a member: bytes, messages, clock and examples go on from its,
        # not from 0; this traffic, as the members', is not the algorithm's)
        start = share_state(comm, membership.source(), model, optimizer, runtime, start,
                            joining=True, counters=offsets)
        runtime.rejoin(comm, algorithm)
        excluded = _raw_counts(comm)
    metrics = MetricsLog(config, enabled=comm.rank == 0, resume_step=start,
                         loggers=config.loggers)
    progress = Progress(config.steps, enabled=comm.rank == 0 and not config.quiet, start=start)
    params = [p for p in model.parameters()]

    def counters() -> tuple[float, float, float, float]:
        """(bytes, messages, seconds) of the algorithm so far, on this worker, and the
        examples trained on by all workers (each step's at that step's world size)."""
        return (offsets["bytes"] + comm.stats.total_bytes_sent - excluded["bytes"],
                offsets["messages"] + comm.stats.total_messages_sent - excluded["messages"],
                offsets["time"] + comm.clock() - excluded["time"], offsets["examples"])

    def excluding(fn, *args, time: bool = True):
        """Run a collective ``fn`` without counting its traffic (and, with ``time``, its time)
        as the algorithm's."""
        before = _raw_counts(comm)
        out = fn(*args)
        for key, value in _raw_counts(comm).items():
            if time or key != "time":
                excluded[key] += value - before[key]
        return out

    def catch_up() -> None:
        """Wait for every worker to reach this point (where collectives of the loop's own
        follow: an evaluation's, a checkpoint's, the look for restarted workers), and count
        that wait as the run's time and nothing else as the run's. A worker ahead (of an
        asynchronous method, or of a local one between its rounds, with a straggler) would
        wait for the others later as well, or the run would end only when the last worker
        ends; counted as the evaluation's, that wait made the reported wall-clock shrink the
        more often a run evaluated. The wait is the first barrier's time less the second's,
        in which nobody waits: the barrier's own cost."""
        t0 = comm.clock()
        excluding(comm.barrier, time=False)  # the wait, and the barrier's own cost
        t1 = comm.clock()
        excluding(comm.barrier)  # the barrier's own cost
        excluded["time"] += min(comm.clock() - t1, t1 - t0)  # taken off the first

    counted = start  # the last step whose examples offsets["examples"] holds

    window_loss, window_count = 0.0, 0
    last: dict[str, Any] = {}
    drift = 0.0  # the consensus distance at the last step, before finish()
    faults = FaultInjector(config.faults, me, size)  # --fault, for tests

    def finish() -> None:
        """After the last step's update."""
        nonlocal drift
        # how far the replicas drifted apart, before finish() makes them equal (once
        # nothing is in flight: an asynchronous method's rounds stop there)
        if not runtime.replicas_identical:
            runtime.settle()
            catch_up()  # (a worker ahead waits for the last one here, not in the measure)
            drift = excluding(consensus_distance, optimizer)
        optimizer.finish()

    def end_of_step(done: int) -> None:
        """After step ``done`` (and ``finish()`` after the last): evaluate and checkpoint,
        as due."""
        nonlocal last, window_loss, window_count
        evaluate = done == config.steps or bool(config.eval_every
                                                and done % config.eval_every == 0)
        save = bool(config.checkpoint_every) and (done % config.checkpoint_every == 0
                                                  or done == config.steps)
        if evaluate or save:
            # halting the exchanges for the collectives that follow (WAGMA's rounds): its
            # traffic is theirs; its time is the run's, as is the wait for the last worker,
            # since a worker ahead waits there for the others, as it would later without
            # the evaluation or the checkpoint
            excluding(runtime.pause, time=False)
            catch_up()
        if evaluate:
            # what before_eval does to the training (an exact average under
            # average_before_eval) is the algorithm's
            runtime.before_eval()
            excluding(runtime.prepare_eval)  # (local SGD's BatchNorm statistics)
            last = excluding(measure, comm, config, dataset, model, params, runtime,
                             window_loss / window_count if window_count else math.nan,
                             counters(), done)
            window_loss, window_count = 0.0, 0
            if comm.rank == 0:
                if done == config.steps:
                    last["consensus_distance_before_finish"] = drift
                metrics.write(last)
        if save:
            excluding(_save, comm, config, model, optimizer, runtime, sampler, done, counters())

    def regroup(error: CommError, done: int) -> int:
        """Go on with the survivors (on_failure="continue") from the step they agreed on,
        whose end (finish, evaluation, checkpoint) is done here; returns that step."""
        nonlocal counted
        assert membership is not None
        while True:
            old = comm
            agreed = membership.regroup(error, done)
            # the steps up to the agreed one are done, at the old world size (a survivor
            # that failed inside one, or was behind, did not count them)
            offsets["examples"] += max(0, agreed - counted) * examples_per_step
            counted = max(counted, agreed)
            switch(old, agreed)
            try:
                runtime.step = agreed
                excluding(runtime.change_membership, comm,
                          config.algorithm.for_members(comm.world_size))
                runtime.before_forward()
                if agreed == config.steps:
                    finish()
                end_of_step(agreed)
                return agreed
            except CommError as again:  # another failure while going on: agree again
                error, done = again, agreed

    def switch(old: Communicator, step: int) -> None:
        """Go on over ``membership.comm`` after the membership changed at ``step``."""
        nonlocal comm, metrics, progress, examples_per_step
        assert membership is not None
        leader, comm = old.rank == 0, membership.comm
        for key, total in _raw_counts(old).items():
            offsets[key] += total - excluded[key]
        excluded.update(_raw_counts(comm))
        examples_per_step = config.batch_size * config.accumulation * comm.world_size
        if comm.rank == 0 and not leader:  # the first member writes the records now
            metrics = MetricsLog(config, enabled=True, resume_step=step - 1,
                                 loggers=config.loggers)
            progress = Progress(config.steps, enabled=not config.quiet, start=step)
        if comm.rank == 0:
            metrics.write({"kind": "membership", "step": step,
                           "members": membership.history[-1]["members"]})

    def admit(step: int) -> None:
        """Let the restarted workers that wait to rejoin in, after ``step``: the members
        average exactly (DiLoCo: its one outer step), then one of them gives its state to
        every worker, and every worker rebuilds what depends on the ranks
        (``Runtime.rejoin``, which averages no second time)."""
        assert membership is not None
        excluding(runtime.pause, time=False)  # (WAGMA: nobody waits for a partner in the look)
        catch_up()
        ids = excluding(membership.waiting, step)
        if not ids:
            return
        # (the traffic of a membership change is not the algorithm's)
        excluding(runtime.settle)
        excluding(runtime.average_parameters)
        old = comm
        membership.admit(ids, step)
        switch(old, step)
        sent, messages, clock, examples = counters()
        excluding(share_state, comm, membership.source(), model, optimizer, runtime, step,
                  False, {"bytes": sent, "messages": messages, "time": clock,
                          "examples": examples})
        excluding(runtime.rejoin, comm, config.algorithm.for_members(comm.world_size))

    def one_step(done: int) -> float:
        """Step ``done`` (from 1): its update, then its end; the step's training loss."""
        nonlocal window_loss, window_count, counted
        step = done - 1
        if membership is not None and step > start and step % REJOIN_EVERY == 0:
            admit(step)  # restarted workers rejoin here
        faults.begin_step(comm, done)  # an injected crash, hang or slow-down starts here
        started = time.perf_counter()
        lr = learning_rate(config, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        step_loss = 0.0
        faults.before_backward(done, params)  # an injected NaN arrives during backward
        for micro in range(config.accumulation):
            batch = sampler.next_batch()
            final = micro == config.accumulation - 1
            with contextlib.nullcontext() if final else optimizer.no_sync():
                loss = loss_fn(model(dataset.x_train[batch].to(device)),
                               dataset.y_train[batch].to(device))
                (loss / config.accumulation).backward()
            step_loss += loss.item() / config.accumulation
        faults.after_backward(done, time.perf_counter() - started)
        optimizer.step()
        offsets["examples"] += examples_per_step
        counted = done
        if done == config.steps:
            finish()
        if math.isfinite(step_loss):
            window_loss, window_count = window_loss + step_loss, window_count + 1
        elif config.nonfinite == "raise":  # (under "skip", the step's update was skipped)
            raise FloatingPointError(f"rank {comm.rank}: the loss became {step_loss} at step "
                                     f"{done}; lower the learning rate")
        if comm.rank == 0 and done % config.log_every == 0:
            sent, _, clock, _ = counters()
            metrics.write({"kind": "train", "step": done, "train_loss": step_loss, "lr": lr,
                           "bytes_sent": sent, "wall_clock": clock})
        end_of_step(done)
        return step_loss

    skip_to = start  # steps up to this one are done (the members agreed to go on after it)
    for step in range(start, config.steps):
        done = step + 1
        if done <= skip_to:
            continue
        try:
            step_loss = one_step(done)
        except CommError as error:
            if membership is None:
                raise
            skip_to = regroup(error, done)
            continue
        if comm.rank == 0:
            acc = last.get("eval_accuracy", float("nan"))
            # this worker's bytes: the mean over workers (the summary's) would cost a
            # collective a step
            progress.update(done, **{
                "loss": f"{step_loss:.3f}",
                "acc": f"{100 * acc:.1f}%" if acc == acc else "-",
                "rank 0 sent": format_bytes(counters()[0]),
            })

    if membership is not None:
        membership.close()  # a worker still waiting to rejoin need not wait any longer
    summary = {**last, "kind": "summary", "algorithm": config.algorithm.name,
               "world_size": comm.world_size, "rank": comm.rank}
    if membership is not None:  # (step, members) of each change: the members at the start
        summary["membership"] = [{"step": 0, "members": list(range(size))},
                                 *membership.history]
    if comm.rank == 0:
        metrics.write({k: v for k, v in summary.items() if k != "rank"})
        metrics.close()
        if config.run_dir:  # the records from before a resume too
            lines = read_lines(Path(config.run_dir) / "metrics.jsonl")
            summary["history"] = [r for r in map(json.loads, lines) if r.get("kind") == "eval"]
        else:
            summary["history"] = [r for r in metrics.records if r.get("kind") == "eval"]
    return summary


def _simulation_state(comm: Communicator) -> dict[str, Any]:
    """A simulated worker's own state for a checkpoint (its compute model's random draws,
    ``--jitter``), so that a resumed simulation goes on as the uninterrupted one; nothing on
    real processes."""
    if not isinstance(comm, VirtualClock):
        return {}
    return {"simulation": _to_safe(comm.simulation_state())}


def _raw_counts(comm: Communicator) -> dict[str, float]:
    """What ``comm`` counted so far: bytes and messages sent, and its clock."""
    return {"bytes": comm.stats.total_bytes_sent, "messages": comm.stats.total_messages_sent,
            "time": comm.clock()}


def _save(comm, config, model, optimizer, runtime, sampler, step, counters) -> None:
    """Save the checkpoint of ``step`` (collective; the loop has paused the runtime)."""
    sent, messages, clock, examples = counters
    if config.checkpoint_format == "dcp":  # each worker's model and state under its rank
        extra = {"sampler": _to_safe(sampler.state_dict()), "rng": torch.get_rng_state(),
                 "offsets": {"bytes": sent, "messages": messages, "time": clock,
                             "examples": examples},
                 **_simulation_state(comm)}
        dcp.save_dcp_checkpoint(comm, config.run_dir, step, model, optimizer, extra,
                                keep=config.keep_checkpoints)
        return
    # the algorithm's state is taken once (taking it may settle messages in flight: WAGMA)
    # and saved once, in this worker's shard; the optimizer's may be shared
    optimizer_state = optimizer.state_dict()
    shard = {
        # BatchNorm statistics differ between workers even when parameters don't
        "buffers": dict(model.named_buffers()),
        "algorithm": optimizer_state.pop("algorithm"),
        "sampler": _to_safe(sampler.state_dict()),
        "rng": torch.get_rng_state(),
        "offsets": {"bytes": sent, "messages": messages, "time": clock, "examples": examples},
        **_simulation_state(comm),
    }
    state = {"model": model.state_dict(), "optimizer": optimizer_state}
    keep = config.keep_checkpoints
    if runtime.replicas_identical:
        ckpt.save_checkpoint(comm, config.run_dir, step, shard, shared=state, keep=keep)
    else:
        ckpt.save_checkpoint(comm, config.run_dir, step, {**shard, **state}, keep=keep)

