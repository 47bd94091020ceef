"""The training loop every worker runs, the same in the simulator and under torchrun.

:class:`Trainer` reads top to bottom: build the model (same seed on every worker), wrap the
optimizer with the algorithm, draw minibatches from this worker's shard, step, and every
``eval_every`` steps measure: evaluate the average of the replicas and each replica, the
consensus distance, the bytes sent. Traffic and virtual time spent only to measure or
checkpoint are not counted as the algorithm's (:class:`~gossamer.train.accounting.Accounting`).
:func:`train_worker` builds a Trainer and runs it.
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
from gossamer.optim import muon
from gossamer.sharding import ShardLayout, is_dtensor, shard_model
from gossamer.train import checkpoint as ckpt
from gossamer.train import dcp
from gossamer.train.accounting import Accounting
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

__all__ = ["Trainer", "evaluate", "train_worker"]


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
    if config.optimizer == "muon":
        return muon(model, lr=config.lr, weight_decay=config.weight_decay)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=config.lr,
                                 weight_decay=config.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                           nesterov=config.nesterov, weight_decay=config.weight_decay)


def train_worker(comm: Communicator, config: TrainConfig, dataset: Dataset,
                 algorithm: Algorithm | None = None,
                 membership: Membership | None = None,
                 layout: ShardLayout | None = None) -> dict[str, Any]:
    """Train this worker's replica; rank 0's result carries the run's metrics.

    ``algorithm``: ``config.algorithm`` resolved for the world size (default: resolved here);
    :func:`~gossamer.train.run.run_training` resolves it once for every worker.
    ``membership``: under ``on_failure="continue"``, who trains (default: made here over
    ``comm``); after a failure the survivors agree on the members and go on, and
    ``membership.comm`` is the communicator over them (its caller closes it).
    ``layout``: a sharded run's (``config.shards`` > 1), whose ``world`` is ``comm``: the model
    is sharded with FSDP2 over ``layout.shard_mesh`` and the method runs over ``layout.comm``.
    """
    return Trainer(comm, config, dataset, algorithm, membership, layout).run()


class Trainer:
    """One worker's training: made ready by the constructor (collective), run by :meth:`run`.

    The parts, each callable alone: :meth:`step` (one step's update), :meth:`end_of_step`
    (evaluate and checkpoint, as :meth:`due`), :meth:`evaluate`, :meth:`save`,
    :meth:`finish` (after the last update), :meth:`summarize` (the result); under
    ``on_failure="continue"``, :meth:`admit`, :meth:`regroup` and :meth:`switch`.

    State: ``comm``, the communicator over the present members; ``accounting``, the
    algorithm's counts; ``model``, ``optimizer`` (what ``distribute()`` returned), ``runtime``
    and ``sampler``; ``start``, the step it started (or resumed, or rejoined) after;
    ``metrics`` and ``progress``, rank 0's records and progress bar; ``window_loss`` and
    ``window_count``, the training losses since the last evaluation; ``last``, the last
    evaluation's record; ``drift``, the consensus distance before :meth:`finish`.

    Sharded (``layout`` given, ``config.shards`` > 1): ``comm`` is every rank (R x S), over
    which the data are split, the run is checked, measured and checkpointed; the model is
    sharded with FSDP2 over the rank's replica (:func:`~gossamer.sharding.shard_model`), and
    the method runs, and ``accounting`` counts, over ``layout.comm``, the replica dimension.
    """

    def __init__(self, comm: Communicator, config: TrainConfig, dataset: Dataset,
                 algorithm: Algorithm | None = None,
                 membership: Membership | None = None,
                 layout: ShardLayout | None = None) -> None:
        self.comm, self.config, self.dataset = comm, config, dataset
        self.layout = layout
        method_comm = layout.comm if layout is not None else comm
        self.accounting = Accounting(method_comm)
        rejoining = membership is not None and membership.joined_at is not None
        # the worker's id and the world at the start: its shard, whatever the membership
        self.me, self.size = ((membership.me, membership.size) if rejoining
                              else (comm.rank, comm.world_size))
        if not rejoining:  # (a restarted worker receives the state of a member instead)
            # Every worker must train the same thing: a mismatch stops them all here, before
            # the algorithm's first collective. Its traffic and time are not the algorithm's.
            self.accounting.excluding(check_agreement, comm, describe_run(
                config, comm.world_size if layout is None else layout.replicas, dataset))
        torch.manual_seed(config.seed)  # the same initial model on every worker
        # (NCCL: the communicator's CUDA device)
        self.device = comm.device if isinstance(comm, DeviceBound) else torch.device("cpu")
        self.model = build_model(resolve_model(config), dataset.input_shape,
                                 dataset.num_classes)
        self.model.to(self.device)
        self.whole: nn.Module | None = None  # a sharded run's gathered replica, to measure
        if layout is not None:
            shard_model(self.model, layout.shard_mesh)
        self.shards = partition(dataset.y_train.numpy(), self.size, scheme=config.partition,
                                alpha=config.dirichlet_alpha, seed=config.seed)
        self.sampler = ShardSampler(self.shards[self.me], config.batch_size,
                                    seed=config.seed * 7919 + self.me)
        if membership is None and config.on_failure == "continue":
            membership = Membership(comm)
        self.membership = membership
        self.algorithm = algorithm if algorithm is not None else config.algorithm
        self.optimizer = distribute(self.model, make_optimizer(config, self.model),
                                    self.algorithm, method_comm, nonfinite=config.nonfinite,
                                    total_steps=config.steps,
                                    training_inputs=self.training_inputs,
                                    broadcast=not rejoining)
        self.runtime = self.optimizer.runtime
        self.start = self.resume() if config.resume else 0
        if rejoining:
            self.start = self.rejoin(self.start)
        self.accounting.counted = self.start
        self.metrics = MetricsLog(config, enabled=comm.rank == 0, resume_step=self.start,
                                  loggers=config.loggers)
        self.progress = Progress(config.steps, enabled=comm.rank == 0 and not config.quiet,
                                 start=self.start)
        self.params = list(self.model.parameters())
        self.window_loss, self.window_count = 0.0, 0
        self.last: dict[str, Any] = {}
        self.drift = 0.0  # the consensus distance at the last step, before finish()
        self.faults = FaultInjector(config.faults, self.me, self.size)  # --fault, for tests

    # ---- setting up

    @property
    def examples_per_step(self) -> int:
        """The examples of one step, all workers' together, at the present world size."""
        return self.config.batch_size * self.config.accumulation * self.comm.world_size

    def training_inputs(self, count: int) -> Iterator[torch.Tensor]:
        """``count`` minibatches of this worker's shard for a method to re-estimate statistics
        before evaluating (local SGD's BatchNorm statistics): drawn apart from training's,
        seeded by the step, so that evaluating changes neither the training batches nor a
        resumed run."""
        config = self.config
        seed = np.random.SeedSequence([config.seed, self.me, self.runtime.step]).generate_state(1)
        draw = ShardSampler(self.shards[self.me], config.batch_size, seed=int(seed[0]))
        for _ in range(count):
            yield self.dataset.x_train[draw.next_batch()].to(self.device)

    def resume(self) -> int:
        """Load the newest checkpoint that every worker verifies (the workers agree on its
        step); returns its step."""
        comm, config, model, optimizer = self.comm, self.config, self.model, self.optimizer
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
        self.sampler.load_state_dict(shard["sampler"])
        torch.set_rng_state(shard["rng"])
        if "simulation" in shard and isinstance(comm, VirtualClock):
            comm.load_simulation_state(shard["simulation"])  # the compute model's draws
        # carried over from before the resume (a checkpoint from before the examples were
        # counted: the steps at this world size); the set-up broadcast was counted before
        # the checkpoint already
        self.accounting.go_on_from({"examples": start * self.examples_per_step,
                                    **shard["offsets"]})
        return start

    def rejoin(self, start: int) -> int:
        """A restarted worker takes the members' model, optimizer and algorithm state, and
        their step, which it returns. Its bytes, messages, clock and examples go on from a
        member's, not from 0; this traffic, as the members', is not the algorithm's."""
        assert self.membership is not None
        offsets = dict(self.accounting.offsets)
        start = share_state(self.comm, self.membership.source(), self.model, self.optimizer,
                            self.runtime, start, joining=True, counters=offsets)
        self.runtime.rejoin(self.comm, self.algorithm)
        self.accounting.go_on_from(offsets)
        return start

    # ---- the loop

    def run(self) -> dict[str, Any]:
        """Train from :attr:`start` to ``config.steps``; returns :meth:`summarize`'s result."""
        skip_to = self.start  # steps up to this one are done (the members agreed to go on)
        for step in range(self.start, self.config.steps):
            done = step + 1
            if done <= skip_to:
                continue
            try:
                if (self.membership is not None and step > self.start
                        and step % REJOIN_EVERY == 0):
                    self.admit(step)  # restarted workers rejoin here
                step_loss = self.step(done)
                self.end_of_step(done)
            except CommError as error:
                if self.membership is None:
                    raise
                skip_to = self.regroup(error, done)
                continue
            if self.comm.rank == 0:
                self.show_progress(done, step_loss)
        return self.summarize()

    def step(self, done: int) -> float:
        """Step ``done`` (from 1): its learning rate, forward and backward passes (over
        ``config.accumulation`` minibatches), the optimizer's step, :meth:`finish` after the
        last, the training record; returns the step's training loss."""
        config, optimizer = self.config, self.optimizer
        step = done - 1
        self.faults.begin_step(self.comm, done)  # an injected crash, hang or slow-down
        started = time.perf_counter()
        lr = learning_rate(config, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        step_loss = 0.0
        self.faults.before_backward(done, self.params)  # an injected NaN arrives in backward
        for micro in range(config.accumulation):
            batch = self.sampler.next_batch()
            final = micro == config.accumulation - 1
            if self.layout is not None and config.accumulation > 1:
                # FSDP2 keeps the whole gradients of the micro-batches and reduce-scatters
                # their sum once, in the last backward
                self.model.set_requires_gradient_sync(final)
            with contextlib.nullcontext() if final else optimizer.no_sync():
                loss = loss_fn(self.model(self.dataset.x_train[batch].to(self.device)),
                               self.dataset.y_train[batch].to(self.device))
                (loss / config.accumulation).backward()
            step_loss += loss.item() / config.accumulation
        self.faults.after_backward(done, time.perf_counter() - started)
        optimizer.step()
        self.accounting.count_step(done, self.examples_per_step)
        if done == config.steps:
            self.finish()
        if math.isfinite(step_loss):
            self.window_loss += step_loss
            self.window_count += 1
        elif config.nonfinite == "raise":  # (under "skip", the step's update was skipped)
            raise FloatingPointError(f"rank {self.comm.rank}: the loss became {step_loss} at "
                                     f"step {done}; lower the learning rate")
        if self.comm.rank == 0 and done % config.log_every == 0:
            sent, _, clock, _ = self.accounting.counters()
            self.metrics.write({"kind": "train", "step": done, "train_loss": step_loss,
                                "lr": lr, "bytes_sent": sent, "wall_clock": clock})
        return step_loss

    def show_progress(self, done: int, step_loss: float) -> None:
        """Rank 0's progress bar after step ``done``."""
        acc = self.last.get("eval_accuracy", float("nan"))
        # this worker's bytes: the mean over workers (the summary's) would cost a
        # collective a step
        self.progress.update(done, **{
            "loss": f"{step_loss:.3f}",
            "acc": f"{100 * acc:.1f}%" if acc == acc else "-",
            "rank 0 sent": format_bytes(self.accounting.counters()[0]),
        })

    def finish(self) -> None:
        """After the last step's update: measure how far the replicas drifted apart, before
        ``optimizer.finish()`` makes them equal (once nothing is in flight: an asynchronous
        method's rounds stop there)."""
        if not self.runtime.replicas_identical:
            self.runtime.settle()
            # (a worker ahead waits for the last one here, not in the measure)
            self.accounting.catch_up()
            self.drift = self.accounting.excluding(
                consensus_distance, self.optimizer if self.layout is None
                else self.gathered(), None if self.layout is None else self.comm)
        self.optimizer.finish()

    # ---- the end of a step: evaluation and checkpoint

    def due(self, done: int) -> tuple[bool, bool]:
        """(evaluate, save): what is due after step ``done``. An evaluation every
        ``eval_every`` steps and after the last; a checkpoint every ``checkpoint_every``
        steps and after the last, where checkpoints are written at all."""
        config = self.config
        evaluate = done == config.steps or bool(config.eval_every
                                                and done % config.eval_every == 0)
        save = bool(config.checkpoint_every) and (done % config.checkpoint_every == 0
                                                  or done == config.steps)
        return evaluate, save

    def end_of_step(self, done: int) -> None:
        """After step ``done`` (and :meth:`finish` after the last): evaluate and checkpoint,
        as due."""
        evaluate, save = self.due(done)
        if evaluate or save:
            # halting the exchanges for the collectives that follow (WAGMA's rounds): its
            # traffic is theirs; its time is the run's, as is the wait for the last worker,
            # since a worker ahead waits there for the others, as it would later without
            # the evaluation or the checkpoint
            self.accounting.excluding(self.runtime.pause, time=False)
            self.accounting.catch_up()
        if evaluate:
            self.evaluate(done)
        if save:
            self.save(done)

    def evaluate(self, done: int) -> dict[str, Any]:
        """Evaluate after step ``done`` (collective): the average of the replicas, each
        replica, the consensus distance; rank 0 writes the record. Returns the record, which
        is kept as :attr:`last`, and starts a new window of training losses."""
        # what before_eval does to the training (an exact average under
        # average_before_eval) is the algorithm's
        self.runtime.before_eval()
        self.accounting.excluding(self.runtime.prepare_eval)  # (local SGD's BatchNorm)
        window = self.window_loss / self.window_count if self.window_count else math.nan
        model, params = self.model, self.params
        if self.layout is not None:  # each rank measures its replica's whole model
            model = self.accounting.excluding(self.gathered)
            params = list(model.parameters())
        self.last = self.accounting.excluding(
            measure, self.comm, self.config, self.dataset, model, params,
            self.runtime, window, self.accounting.counters(), done)
        if self.layout is not None and self.last:  # one figure per replica, not per rank
            shards = self.layout.shards
            for key in ("worker_eval_loss", "worker_eval_accuracy"):
                self.last[key] = self.last[key][::shards]
        self.window_loss, self.window_count = 0.0, 0
        if self.comm.rank == 0:
            if done == self.config.steps:
                self.last["consensus_distance_before_finish"] = self.drift
            self.metrics.write(self.last)
        return self.last

    def gathered(self) -> nn.Module:
        """A sharded run's: this rank's replica as a plain model, its whole tensors gathered
        from the replica's shards (an all-gather of each over the replica's ranks: every rank
        calls it at the same point). Made once, refilled at each call."""
        if self.whole is None:
            # (its initial values are overwritten: the run's random state must not move, or
            # a resumed run, which makes it at another step, would draw otherwise)
            with torch.random.fork_rng(devices=[]):
                self.whole = build_model(resolve_model(self.config), self.dataset.input_shape,
                                         self.dataset.num_classes).to(self.device)
        with torch.no_grad():
            state = {name: t.full_tensor() if is_dtensor(t) else t
                     for name, t in self.model.state_dict().items()}
            self.whole.load_state_dict(state)
        self.whole.train(self.model.training)
        return self.whole

    def save(self, step: int) -> None:
        """Save the checkpoint of ``step`` (collective; the loop has paused the runtime), with
        the algorithm's counts so far; its own traffic and time are not the algorithm's."""
        self.accounting.excluding(self._write_checkpoint, step, self.accounting.totals())

    def _write_checkpoint(self, step: int, offsets: dict[str, float]) -> None:
        comm, config, model, optimizer = self.comm, self.config, self.model, self.optimizer
        if config.checkpoint_format == "dcp":  # each worker's model and state under its rank
            extra = {"sampler": _to_safe(self.sampler.state_dict()),
                     "rng": torch.get_rng_state(), "offsets": offsets,
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
            "sampler": _to_safe(self.sampler.state_dict()),
            "rng": torch.get_rng_state(),
            "offsets": offsets,
            **_simulation_state(comm),
        }
        state = {"model": model.state_dict(), "optimizer": optimizer_state}
        keep = config.keep_checkpoints
        if self.runtime.replicas_identical:
            ckpt.save_checkpoint(comm, config.run_dir, step, shard, shared=state, keep=keep)
        else:
            ckpt.save_checkpoint(comm, config.run_dir, step, {**shard, **state}, keep=keep)

    # ---- membership (on_failure="continue")

    def regroup(self, error: CommError, done: int) -> int:
        """Go on with the survivors (on_failure="continue") from the step they agreed on,
        whose end (finish, evaluation, checkpoint) is done here; returns that step."""
        assert self.membership is not None
        while True:
            agreed = self.membership.regroup(error, done)
            # the steps up to the agreed one are done, at the old world size
            self.accounting.count_until(agreed, self.examples_per_step)
            self.switch(agreed)
            try:
                self.runtime.step = agreed
                self.accounting.excluding(self.runtime.change_membership, self.comm,
                                          self.config.algorithm.for_members(
                                              self.comm.world_size))
                self.runtime.before_forward()
                if agreed == self.config.steps:
                    self.finish()
                self.end_of_step(agreed)
                return agreed
            except CommError as again:  # another failure while going on: agree again
                error, done = again, agreed

    def switch(self, step: int) -> None:
        """Go on over ``membership.comm`` after the membership changed at ``step``."""
        assert self.membership is not None
        leader, comm = self.comm.rank == 0, self.membership.comm
        self.comm = comm
        self.accounting.switch(comm)
        config = self.config
        if comm.rank == 0 and not leader:  # the first member writes the records now
            self.metrics = MetricsLog(config, enabled=True, resume_step=step - 1,
                                      loggers=config.loggers)
            self.progress = Progress(config.steps, enabled=not config.quiet, start=step)
        if comm.rank == 0:
            self.metrics.write({"kind": "membership", "step": step,
                                "members": self.membership.history[-1]["members"]})

    def admit(self, step: int) -> None:
        """Let the restarted workers that wait to rejoin in, after ``step``: the members
        average exactly (DiLoCo: its one outer step), then one of them gives its state to
        every worker, and every worker rebuilds what depends on the ranks
        (``Runtime.rejoin``, which averages no second time)."""
        assert self.membership is not None
        accounting, runtime = self.accounting, self.runtime
        accounting.excluding(runtime.pause, time=False)  # (WAGMA: nobody waits in the look)
        accounting.catch_up()
        ids = accounting.excluding(self.membership.waiting, step)
        if not ids:
            return
        # (the traffic of a membership change is not the algorithm's)
        accounting.excluding(runtime.settle)
        accounting.excluding(runtime.average_parameters)
        self.membership.admit(ids, step)
        self.switch(step)
        accounting.excluding(share_state, self.comm, self.membership.source(), self.model,
                             self.optimizer, runtime, step, False, accounting.totals())
        accounting.excluding(runtime.rejoin, self.comm,
                             self.config.algorithm.for_members(self.comm.world_size))

    # ---- the result

    def summarize(self) -> dict[str, Any]:
        """After the last step: this worker's summary (rank 0 writes it, with the run's
        evaluation records as ``history``)."""
        config, comm, membership = self.config, self.comm, self.membership
        if membership is not None:
            membership.close()  # a worker still waiting to rejoin need not wait any longer
        summary = {**self.last, "kind": "summary", "algorithm": config.algorithm.label,
                   "world_size": comm.world_size, "rank": comm.rank}
        if self.layout is not None:
            summary.update(replicas=self.layout.replicas, shards=self.layout.shards)
        if membership is not None:  # (step, members) of each change: the members at the start
            summary["membership"] = [{"step": 0, "members": list(range(self.size))},
                                     *membership.history]
        if comm.rank == 0:
            self.metrics.write({k: v for k, v in summary.items() if k != "rank"})
            self.metrics.close()
            if config.run_dir:  # the records from before a resume too
                lines = read_lines(Path(config.run_dir) / "metrics.jsonl")
                summary["history"] = [r for r in map(json.loads, lines)
                                      if r.get("kind") == "eval"]
            else:
                summary["history"] = [r for r in self.metrics.records if r.get("kind") == "eval"]
        return summary


def _simulation_state(comm: Communicator) -> dict[str, Any]:
    """A simulated worker's own state for a checkpoint (its compute model's random draws,
    ``--jitter``), so that a resumed simulation goes on as the uninterrupted one; nothing on
    real processes."""
    if not isinstance(comm, VirtualClock):
        return {}
    return {"simulation": _to_safe(comm.simulation_state())}
