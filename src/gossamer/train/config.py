"""The configuration of a training run: one frozen dataclass, from flags and YAML recipes.

Precedence: the dataclass defaults, then a recipe file (``--config recipe.yaml``), then the
flags given on the command line. Every field is a flag (``--batch-size`` for ``batch_size``)
and a recipe key; an unknown recipe key is an error that names it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import InitVar, dataclass
from pathlib import Path
from typing import Any

from gossamer.algorithms import (
    Algorithm,
    AllReduce,
    CompressionPreset,
    create,
    lookup,
    with_compression,
)
from gossamer.checks import check_int, check_positive
from gossamer.comm.faults import check_faults
from gossamer.comm.network import ComputeModel, NetworkModel
from gossamer.comm.rate import parse_rate
from gossamer.options import option, option_help, read_renamed
from gossamer.patterns.nonfinite import POLICIES as NONFINITE_POLICIES

OPTIMIZERS = ("sgd", "adamw", "muon")
SCHEDULES = ("constant", "step", "cosine")
PARTITIONS = ("iid", "dirichlet")
CHECKPOINT_FORMATS = ("gossamer", "dcp")
ON_FAILURE = ("stop", "continue")


# The settings that only the simulator reads, and the one only real processes read: given in
# the other mode they would have no effect, which is an error (see TrainConfig.check_mode).
#: The workers ``gossamer train`` simulates when neither --sim nor a launcher says otherwise.
DEFAULT_SIM_WORKERS = 4
SIM_ONLY = ("latency", "bandwidth", "compute_time", "stragglers", "jitter", "links")
REAL_ONLY = ("bind_all",)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that defines a training run (see ``gossamer train --help``).

    ``algorithm`` is the method's configuration object, resolved once: give it as an
    :class:`~gossamer.algorithms.Algorithm` or as a registered name with ``options`` (strings
    are converted to the options' types) and ``compressor`` (``NAME[:KEY=VALUE...]``, for the
    gradient-level methods); either way the field then holds the object. ``replace(options=...)``
    changes options of the algorithm held.
    """

    # what to train
    algorithm: Algorithm = option(factory=AllReduce,
                                  help="a registered name: `gossamer algorithms` lists them")
    options: InitVar[Mapping[str, Any] | None] = None  # the algorithm's options, by name
    compressor: InitVar[Any] = None  # a compressor spec NAME[:KEY=VALUE...], by name
    dataset: str = option("digits", "digits (embedded), mnist, fashion-mnist, cifar10, text, or "
                          "MODULE:FACTORY for your own (see docs/training.md)")
    data_path: str | None = option(None, "directory (or text file) of the data set; not for "
                                   "digits; passed as path= to a dataset factory that takes one")
    model: str = option("auto", "mlp, cnn, resnet20, transformer, or MODULE:FACTORY for your "
                        "own; auto: the data set's usual one")
    block_size: int = option(64, "text: characters of context")
    # optimisation
    steps: int = option(300, "optimizer steps per worker; ~20 epochs of digits with 4 workers")
    batch_size: int = option(32, "per worker and micro-batch; the global batch is world_size x "
                             "this")
    accumulation: int = option(1, "micro-batches per optimizer step (gradient accumulation)")
    optimizer: str = option("sgd", "sgd, adamw, or muon: Muon for the hidden matrices and AdamW "
                            "for the rest (embeddings, output head, biases, norms), both at "
                            "--lr (Muon's scaled per matrix to AdamW's update size)")
    lr: float = option(0.05, "peak learning rate")
    momentum: float = option(0.9, "sgd only")
    nesterov: bool = option(False, "sgd only")
    weight_decay: float = option(0.0, "decoupled for adamw and muon, L2 for sgd")
    schedule: str = option("constant", "constant, step (x gamma at each milestone), cosine (to "
                           "min_lr)")
    warmup_steps: int = option(0, "linear warm-up from lr / warmup_steps, before the schedule")
    milestones: tuple[int, ...] = option((), "step schedule: steps where lr is multiplied by "
                                         "gamma")
    gamma: float = option(0.1, "step schedule factor")
    min_lr: float = option(0.0, "cosine schedule floor")
    # data split across workers
    partition: str = option("iid", "iid, or dirichlet (non-IID label skew)")
    dirichlet_alpha: float = option(0.5, "the Dirichlet concentration of partition "
                                    "'dirichlet' (the flag was --alpha): lower is more skewed")
    seed: int = option(0, "model init, data split and sampling")
    # evaluation and records
    eval_every: int = option(50, "steps between evaluations (0: only at the end)")
    eval_workers: bool = option(True, "also evaluate each worker's replica, not only the "
                                "average")
    log_every: int = option(10, "steps between train-loss records")
    run_dir: str | None = option(None, "where config, metrics, checkpoints and plots go")
    checkpoint_every: int = option(0, "steps between checkpoints (0: none); needs run_dir")
    keep_checkpoints: int = option(3, "newest checkpoints kept on disk (0: all)")
    checkpoint_format: str = option("gossamer", "gossamer (its own: per-worker shards, "
                                    "checksums) or dcp (torch.distributed.checkpoint; real "
                                    "processes only)")
    resume: bool = option(False, "continue from run_dir's latest checkpoint")
    tensorboard: bool = option(False, "also log to TensorBoard in run_dir/tensorboard")
    loggers: tuple[str, ...] = option((), "repeatable NAME: also send the records to tensorboard, "
                                      "wandb (offline) or mlflow (a local store in run_dir); "
                                      "needs run_dir")
    # torch.distributed has no authentication: whoever reaches the store's port can join
    bind_all: bool = option(False, "real runs: rendezvous on all interfaces, not only "
                            "MASTER_ADDR")
    shards: int = option(1, "real runs: ranks each replica's model is sharded over with FSDP2 "
                         "(rank r*S+s is shard s of replica r); the method runs between the "
                         "world_size / shards replicas (docs/sharding.md)")
    # simulator (sim > 0)
    sim: int = option(0, "simulated workers; 0: real processes from the launcher environment")
    latency: float = option(50e-6, "simulator: seconds per message")
    bandwidth: float = option(125e6, "simulator: every link's rate, e.g. 1gbit, 100mbit, "
                              "125MB/s (a bare number is bytes per second)")
    links: tuple[str, ...] = option((), "simulator: repeatable SRC:DST:RATE[:LATENCY], one "
                                    "directed link's rate (and seconds per message)")
    compute_time: float = option(0.01, "simulator: seconds of compute per step")
    # RANK=FACTOR as gossamer plan takes it; RANK:FACTOR, the older form, is read as well
    stragglers: tuple[str, ...] = option((), "simulator: repeatable RANK=FACTOR, that worker's "
                                         "steps take FACTOR times compute_time")
    jitter: float = option(0.0, "simulator: relative spread of step times (seeded)")
    timeout: float | None = option(None, "seconds to wait for a peer (virtual in sim); "
                                   "default: the backend's, 300 (NCCL 600)")
    # failures (see gossamer.comm.faults and gossamer.patterns.nonfinite)
    faults: tuple[str, ...] = option((), "repeatable RANK:STEP:KIND, KIND "
                                     "crash|hang|slow:FACTOR|nan")
    nonfinite: str = option("raise", "a NaN/inf gradient or parameter: raise (stop), or skip "
                            "(that update)")
    on_failure: str = option("stop", "a worker fails: stop (every worker exits), or continue "
                             "(the others go on without it: every method but AllReduce and "
                             "the compressed all-reduces; simulated or under gossamer launch)")
    quiet: bool = option(False, "no progress bar, summary only")

    def __post_init__(self, options: Mapping[str, Any] | None, compressor: Any) -> None:
        object.__setattr__(self, "algorithm", resolve_algorithm(self.algorithm, options,
                                                                compressor))
        for name in ("steps", "batch_size", "accumulation", "block_size", "log_every",
                     "shards"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("eval_every", "sim", "seed", "checkpoint_every", "warmup_steps",
                     "keep_checkpoints"):
            check_int(name, getattr(self, name), minimum=0)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check_choice("schedule", self.schedule, SCHEDULES)
        _check_choice("partition", self.partition, PARTITIONS)
        _check_choice("checkpoint_format", self.checkpoint_format, CHECKPOINT_FORMATS)
        check_positive("lr", self.lr, allow_zero=False)
        check_positive("weight_decay", self.weight_decay, allow_zero=True)
        check_positive("min_lr", self.min_lr, allow_zero=True)
        check_positive("gamma", self.gamma, allow_zero=False)
        check_positive("dirichlet_alpha", self.dirichlet_alpha, allow_zero=False)
        check_positive("latency", self.latency, allow_zero=True)
        object.__setattr__(self, "bandwidth", parse_rate(self.bandwidth, arg="bandwidth"))
        check_positive("compute_time", self.compute_time, allow_zero=True)
        check_positive("jitter", self.jitter, allow_zero=True)
        if self.timeout is not None:
            check_positive("timeout", self.timeout, allow_zero=False)
        _check_choice("nonfinite", self.nonfinite, NONFINITE_POLICIES)
        _check_choice("on_failure", self.on_failure, ON_FAILURE)
        if self.on_failure == "continue":
            _check_continues(self.algorithm)
        if self.shards > 1:
            self._check_shards()
        for name in ("faults", "stragglers", "links"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        object.__setattr__(self, "faults", tuple(
            str(f) for f in check_faults(self.faults, world_size=self.sim or None,
                                         steps=self.steps)))
        self.network_model()  # checks links (and their ranks, when simulated)
        self.compute_model()  # checks stragglers, as written
        object.__setattr__(self, "stragglers", tuple(
            _normal_straggler(spec) for spec in self.stragglers))
        for name in ("lr", "weight_decay", "min_lr", "gamma", "dirichlet_alpha", "latency",
                     "compute_time", "jitter"):
            if math.isinf(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        if self.schedule == "cosine" and self.min_lr > self.lr:
            raise ValueError(f"min_lr={self.min_lr} is above lr={self.lr}: the cosine schedule "
                             "would raise the learning rate from lr to min_lr; give --min-lr at "
                             "most --lr")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.nesterov and (self.optimizer != "sgd" or self.momentum == 0):
            raise ValueError("nesterov needs optimizer 'sgd' with momentum > 0")
        refusal = self.algorithm.optimizer_refusal(self.optimizer, self.momentum)
        if refusal is not None:
            raise ValueError(f"optimizer (--optimizer {self.optimizer}, --momentum "
                             f"{self.momentum:g}): {refusal}")
        object.__setattr__(self, "milestones", tuple(int(m) for m in self.milestones))
        if any(m < 1 for m in self.milestones) or list(self.milestones) != sorted(self.milestones):
            raise ValueError(f"milestones must be increasing steps >= 1, got {self.milestones}")
        if self.checkpoint_every and not self.run_dir:
            raise ValueError("checkpoint_every needs run_dir (where checkpoints go)")
        if self.resume and not self.run_dir:
            raise ValueError("resume needs run_dir (whose latest checkpoint to continue)")
        if self.tensorboard and not self.run_dir:
            raise ValueError("tensorboard needs run_dir (the logs go to run_dir/tensorboard)")
        object.__setattr__(self, "loggers", (self.loggers,) if isinstance(self.loggers, str)
                           else tuple(self.loggers))
        if self.loggers:
            from gossamer.loggers import LOGGERS

            unknown = [name for name in self.loggers if name not in LOGGERS]
            if unknown:
                raise ValueError(f"loggers: {unknown[0]!r} is unknown; known: "
                                 f"{', '.join(sorted(LOGGERS))}")
            if not self.run_dir:
                raise ValueError("loggers need run_dir (where their records go)")

    def _check_shards(self) -> None:
        """What a sharded run (``shards`` > 1) cannot do: a ValueError naming it and why."""
        flag = f"shards={self.shards} (--shards)"
        if self.sim:
            raise ValueError(f"{flag} needs real processes: the simulator has no FSDP (its "
                             "workers hold whole models); launch R x S processes with "
                             "gossamer launch --nproc or torchrun")
        refusal = self.algorithm.sharding_refusal()
        if refusal is not None:
            raise ValueError(f"{flag}: {self.algorithm.label} does not run on a model sharded "
                             f"with FSDP2: {refusal}")
        refused = {
            "on_failure": (self.on_failure != "stop", "a replica cannot go on without one of "
                           "its shards yet; use on_failure='stop'"),
            "nonfinite": (self.nonfinite != "raise", "each shard's ranks would decide alone "
                          "whether to skip a step, and a replica's shards could then differ"),
            "optimizer": (self.optimizer == "muon", "Muon orthogonalises whole matrices, and "
                          "each rank holds only its rows of them; use sgd or adamw"),
            "checkpoint_format": (bool(self.checkpoint_every or self.resume)
                                  and self.checkpoint_format != "dcp",
                                  "a sharded run's checkpoints are saved through DCP, every "
                                  "rank its own shard: pass --checkpoint-format dcp"),
        }
        for name, (no, why) in refused.items():
            if no:
                raise ValueError(f"{flag}: {name}={getattr(self, name)!r} is refused on "
                                 f"shards: {why}")

    def check_effect(self) -> None:
        """A setting changed from its default where it does nothing is an error saying why
        (the command line and recipes check it: a flag that silently does nothing misleads)."""
        unused = {
            "momentum": (self.optimizer != "sgd", "applies to optimizer 'sgd' only"),
            "milestones": (self.schedule != "step", "applies to schedule 'step' only"),
            "gamma": (self.schedule != "step", "applies to schedule 'step' only"),
            "min_lr": (self.schedule != "cosine", "applies to schedule 'cosine' only"),
            "dirichlet_alpha": (self.partition != "dirichlet",
                                "applies to partition 'dirichlet' only"),
            "block_size": (self.dataset != "text", "applies to dataset 'text' only"),
            "data_path": (self.dataset == "digits",
                          "the digits data set is embedded: it reads no files"),
            "keep_checkpoints": (not self.checkpoint_every,
                                 "applies when checkpoints are written (checkpoint_every > 0)"),
            "checkpoint_format": (not self.checkpoint_every and not self.resume,
                                  "applies when checkpoints are written or resumed"),
        }
        for name, (no_effect, why) in unused.items():
            if no_effect and getattr(self, name) != _DEFAULTS[name]:
                raise ValueError(f"{name}={getattr(self, name)!r} has no effect here: it {why}")

    def check_mode(self, simulated: bool) -> None:
        """Settings of the other mode would have no effect: an error that says why."""
        if simulated:
            given = [n for n in REAL_ONLY if getattr(self, n) != _DEFAULTS[n]]
            if given:
                raise ValueError(f"{given[0]} applies to real processes only (the "
                                 "torch.distributed rendezvous); this run is simulated")
            if self.checkpoint_format == "dcp":
                raise ValueError("checkpoint_format 'dcp' needs real processes "
                                 "(torch.distributed.checkpoint); this run is simulated")
            return
        given = [n for n in SIM_ONLY if getattr(self, n) != _DEFAULTS[n]]
        if given:
            raise ValueError(
                f"{', '.join(given)} set{'s' if len(given) == 1 else ''} the simulator's "
                "network or compute and has no effect on real processes: their network is the "
                "one they run on (`gossamer launch --emulate bandwidth=...` emulates one)")

    def network_model(self) -> NetworkModel:
        """The simulator's network: ``latency``, ``bandwidth`` and the per-link ``links``."""
        rates, latencies = {}, {}
        for spec in self.links:
            (src, dst), rate, latency = _parse_link(spec, self.sim)
            rates[(src, dst)] = rate
            if latency is not None:
                latencies[(src, dst)] = latency
        return NetworkModel(latency=self.latency, bandwidth=self.bandwidth,
                            link_bandwidth=rates, link_latency=latencies)

    def compute_model(self) -> ComputeModel:
        """The simulator's compute: ``compute_time``, ``stragglers`` and ``jitter``."""
        factors = {}
        for spec in self.stragglers:
            rank, factor = _parse_straggler(spec, self.sim)
            factors[rank] = factor
        return ComputeModel(step_time=self.compute_time, stragglers=factors, jitter=self.jitter)

    def as_dict(self) -> dict[str, Any]:
        """Plain values (YAML), the algorithm as ``{"name": ..., "options": {...}}`` with the
        options that differ from their defaults: ``TrainConfig(**load_settings(d))`` is equal
        to this config."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["algorithm"] = algorithm_spec(self.algorithm)
        for name in ("milestones", "faults", "stragglers", "links", "loggers"):
            d[name] = list(d[name])
        return d

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


_DEFAULTS: dict[str, Any] = {}  # filled below, once TrainConfig exists


def resolve_algorithm(algorithm: Algorithm | str | Mapping[str, Any],
                      options: Mapping[str, Any] | None = None,
                      compressor: Any = None) -> Algorithm:
    """The algorithm's configuration object from a name (or a spec mapping, as in a recipe or
    config.yaml) with ``options``, or an object whose ``options`` change; then sent through
    ``compressor`` where one is given. Bad names and options fail here, naming them."""
    name = None  # the registry name given, if any
    if isinstance(algorithm, Mapping):
        spec = dict(algorithm)
        if "name" not in spec:
            raise ValueError(f"algorithm: a mapping needs a name, got {spec!r}")
        name = spec["name"]
        algorithm = create(name, {**dict(spec.get("options") or {}), **(options or {})})
    elif isinstance(algorithm, str):
        name = algorithm
        algorithm = create(algorithm, options)
    elif isinstance(algorithm, Algorithm):
        if options:
            current = {f.name: getattr(algorithm, f.name) for f in dataclasses.fields(algorithm)
                       if f.init}
            algorithm = create(algorithm.name, {**current, **options})
    else:
        raise ValueError(f"algorithm must be an Algorithm or a registered name, got "
                         f"{algorithm!r}")
    if compressor is not None:
        if isinstance(name, str) and isinstance(lookup(name), CompressionPreset):
            raise ValueError(f"compressor: algorithm {name!r} is allreduce with {name}'s "
                             "compressor already; for another, give algorithm 'allreduce' "
                             "with this compressor")
        algorithm = with_compression(algorithm, compressor)
    return algorithm


def algorithm_spec(algorithm: Algorithm) -> dict[str, Any]:
    """``{"name": ..., "options": {...}}``: the options that differ from the defaults, as plain
    values (a topology or compressor object by its own spec)."""
    defaults = type(algorithm)()
    options = {}
    for f in dataclasses.fields(algorithm):
        value = getattr(algorithm, f.name)
        if f.init and value != getattr(defaults, f.name):
            options[f.name] = _plain_option(value)
    return {"name": algorithm.name, "options": options}


def _plain_option(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain_option(v) for v in value]
    if hasattr(value, "as_dict"):
        return value.as_dict()
    return repr(value)


def _parse_link(spec: str, world_size: int) -> tuple[tuple[int, int], float, float | None]:
    parts = str(spec).split(":")
    try:
        if len(parts) not in (3, 4):
            raise ValueError
        src, dst = int(parts[0]), int(parts[1])
        latency = float(parts[3]) if len(parts) == 4 else None
    except ValueError:
        raise ValueError(f"links: {spec!r} is not SRC:DST:RATE[:LATENCY] (e.g. 0:1:100mbit or "
                         "0:1:12.5e6:0.001)") from None
    rate = parse_rate(parts[2], arg=f"links {spec!r}")
    for rank in (src, dst):
        _check_rank(f"links {spec!r}", rank, world_size)
    if src == dst:
        raise ValueError(f"links {spec!r}: a link joins two different ranks")
    if latency is not None:
        check_positive(f"links {spec!r}: latency", latency, allow_zero=True)
    return (src, dst), rate, latency


def _check_rank(what: str, rank: int, world_size: int) -> None:
    """``rank`` must exist: >= 0, and below ``world_size`` when that is known (not 0)."""
    if rank < 0 or (world_size and rank >= world_size):
        raise ValueError(f"{what}: rank {rank} does not exist"
                         + (f" (ranks 0 to {world_size - 1})" if world_size else ""))


def _straggler_parts(spec: str) -> tuple[str, str]:
    """``"3=4"`` (or the older ``"3:4"``) -> ``("3", "4")``."""
    text = str(spec)
    rank_text, sep, factor_text = text.partition("=")
    if not sep:
        rank_text, sep, factor_text = text.partition(":")
    return rank_text.strip(), factor_text.strip()


def _normal_straggler(spec: str) -> str:
    """A straggler in the form ``gossamer plan`` shares, ``RANK=FACTOR``; one that is neither
    form is kept as it is, for :func:`_parse_straggler` to refuse."""
    rank_text, factor_text = _straggler_parts(spec)
    return f"{rank_text}={factor_text}" if rank_text and factor_text else str(spec)


def _parse_straggler(spec: str, world_size: int) -> tuple[int, float]:
    rank_text, factor_text = _straggler_parts(spec)
    try:
        rank, factor = int(rank_text), float(factor_text)
    except ValueError:
        raise ValueError(f"stragglers: {spec!r} is not RANK=FACTOR (e.g. 3=4; RANK:FACTOR is "
                         "read as well)") from None
    _check_rank(f"stragglers {spec!r}", rank, world_size)
    if not factor > 0 or math.isinf(factor):
        raise ValueError(f"stragglers {spec!r}: the factor must be a finite number > 0")
    return rank, factor


def continues_after_failure(algorithm: Algorithm | type[Algorithm]) -> bool:
    """Whether a method's workers can go on without a failed one (``on_failure="continue"``):
    it needs no step in which every worker takes part, and its runtime implements
    ``change_membership(comm, algorithm)`` (its class says so with
    ``continues_after_failure = True``; :class:`~gossamer.algorithms.Algorithm`'s default is
    False)."""
    return algorithm.continues_after_failure


def _check_continues(algorithm: Algorithm) -> None:
    """``on_failure='continue'`` with a method that cannot go on without a failed worker is
    an error naming the setting, the method and those that can."""
    if continues_after_failure(algorithm):
        refusal = algorithm.failure_refusal()
        if refusal is not None:
            raise ValueError(f"on_failure='continue' (--on-failure continue): {refusal}")
        return
    from gossamer.algorithms.registry import available, lookup

    able = ", ".join(n for n in available() if continues_after_failure(lookup(n)))
    raise ValueError(
        f"on_failure='continue' (--on-failure continue): {algorithm.label} cannot go on "
        "without a failed worker (its steps need every worker, or its state cannot be "
        f"rebuilt for fewer); the methods that can: {able}. Use on_failure='stop' with "
        "--max-restarts to restart from a checkpoint instead")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} {value!r} is unknown; known: {', '.join(choices)}")


def learning_rate(config: TrainConfig, step: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based): warm-up, then the schedule.

    A pure function of the step, so that a resumed run continues on the same curve.
    """
    if config.warmup_steps and step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.schedule == "step":
        return config.lr * config.gamma ** sum(step >= m for m in config.milestones)
    if config.schedule == "cosine":
        span = max(1, config.steps - config.warmup_steps)
        progress = min(1.0, (step - config.warmup_steps) / span)
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return config.min_lr + (config.lr - config.min_lr) * cosine
    return config.lr


# ---------------------------------------------------------------------------- recipes and flags

_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_DEFAULTS.update({name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                  for name, f in _FIELDS.items()})
_INIT_ONLY = ("options", "compressor")  # recipe keys and flags that resolve the algorithm
_RECORD_ONLY = ("world_size",)  # written into a run directory's config.yaml for the record
#: old name -> new name, of recipe keys and (as --old-name) flags, read for one more release
_RENAMED = {"alpha": "dirichlet_alpha"}
_REPEATED = {"faults": ("--fault", "RANK:STEP:KIND"), "stragglers": ("--straggler", "RANK=FACTOR"),
             "loggers": ("--logger", "NAME"),
             "links": ("--link", "SRC:DST:RATE[:LATENCY]")}
#: The flags of ``gossamer train --help``, by concern.
GROUPS = {
    "algorithm": ("algorithm",),
    "data": ("dataset", "data_path", "block_size", "partition", "dirichlet_alpha", "seed"),
    "model": ("model",),
    "optimisation": ("steps", "batch_size", "accumulation", "optimizer", "lr", "momentum",
                     "nesterov", "weight_decay", "schedule", "warmup_steps", "milestones",
                     "gamma", "min_lr"),
    "evaluation and run directory": ("eval_every", "eval_workers", "log_every", "run_dir",
                                     "checkpoint_every", "keep_checkpoints",
                                     "checkpoint_format", "resume", "tensorboard", "loggers",
                                     "quiet"),
    "simulator": ("sim", "latency", "bandwidth", "links", "compute_time", "stragglers",
                  "jitter"),
    "real processes (torchrun, SLURM, mpirun, gossamer launch)": ("bind_all", "shards"),
    "reliability": ("timeout", "faults", "nonfinite", "on_failure"),
}


def load_recipe(path: str | Path) -> dict[str, Any]:
    """Read a YAML recipe (or a run directory's config.yaml): a mapping of TrainConfig fields.

    ``algorithm`` is a name with ``options`` beside it, or ``{name: ..., options: {...}}`` as
    config.yaml writes it; ``compressor`` a spec ``NAME[:KEY=VALUE...]`` or a mapping.
    """
    import yaml

    path = Path(path)
    if path.is_dir():
        raise ValueError(f"config file {str(path)!r} is a directory, not a YAML file")
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    try:
        with path.open(encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except yaml.constructor.ConstructorError as error:
        # a tag such as !!python/object/apply: recipes are plain data, nothing is constructed
        raise ValueError(f"config file {str(path)!r} is refused: {error.problem} (a recipe "
                         "holds plain YAML values only)") from None
    except yaml.YAMLError as error:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: "
                         f"{' '.join(str(error).split())}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"config file {str(path)!r} is not UTF-8 text (byte "
                         f"{error.object[error.start]:#04x} at offset {error.start})") from None
    except OSError as error:
        raise ValueError(f"config file {str(path)!r} cannot be read: "
                         f"{error.strerror or error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of settings")
    read_renamed(data, _RENAMED, f"config file {str(path)!r}", "setting")
    for key in list(data):
        if key in _RECORD_ONLY:
            del data[key]
        elif key not in _FIELDS and key not in _INIT_ONLY:
            raise ValueError(
                f"config file {str(path)!r}: unknown key {key!r}; known keys: "
                f"{', '.join(sorted([*_FIELDS, *_INIT_ONLY]))}"
            )
    if "options" in data and not isinstance(data["options"], dict):
        raise ValueError(f"config file {str(path)!r}: options must be a mapping")
    if isinstance(data.get("algorithm"), dict):
        algorithm = data["algorithm"]
        if not isinstance(algorithm.get("options", {}) or {}, dict):
            raise ValueError(f"config file {str(path)!r}: algorithm options must be a mapping")
        data["options"] = {**(algorithm.get("options") or {}), **data.get("options", {})}
        data["algorithm"] = algorithm.get("name")
    for name in ("milestones", *_REPEATED):
        if name in data:
            value = data[name]
            data[name] = tuple(value) if isinstance(value, (list, tuple)) else (
                () if value is None else (value,))
    hints = typing.get_type_hints(TrainConfig)
    for key, value in data.items():
        if key in hints:
            _check_recipe_type(path, key, value, hints[key])
        # YAML reads 1e-3 as a string: numbers are taken in any spelling float() accepts
        if key in hints and hints[key] is float and key != "bandwidth" and isinstance(
                value, (str, int)) and not isinstance(value, bool):
            try:
                data[key] = float(value)
            except ValueError:
                raise ValueError(
                    f"config file {str(path)!r}: {key} must be a number, got {value!r}"
                ) from None
    return data


_TYPE_NAMES = {str: "a string", bool: "true or false", int: "an integer"}


def _check_recipe_type(path: Path, key: str, value: Any, hint: Any) -> None:
    """A recipe's string, boolean and list settings must be of that type (numbers are checked,
    and converted, by the fields' own checks): ValueError naming the file and the key."""
    def fits(v: Any, tp: Any) -> bool:
        return isinstance(v, tp) and (tp is bool or not isinstance(v, bool))

    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        bad = [v for v in value if item in _TYPE_NAMES and not fits(v, item)]
        if bad:
            raise ValueError(f"config file {str(path)!r}: each of {key} must be "
                             f"{_TYPE_NAMES[item]}, got {bad[0]!r}")
        return
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None:
            return
        hint = next(t for t in typing.get_args(hint) if t is not type(None))
    if hint in _TYPE_NAMES and not fits(value, hint) and hint is not int:
        raise ValueError(f"config file {str(path)!r}: {key} must be {_TYPE_NAMES[hint]}, got "
                         f"{value!r}")


def add_config_arguments(parser: argparse.ArgumentParser,
                         hidden: tuple[str, ...] = ()) -> None:
    """One flag per TrainConfig field, grouped by concern, with the field's help and default.
    The flags of the fields in ``hidden`` are parsed but not shown in the help (``algorithm``
    hides ``--option`` and ``--compressor`` with it): a command that does not take them says
    so itself."""
    import inspect

    helps = option_help(TrainConfig)
    hints = typing.get_type_hints(TrainConfig)
    parser.add_argument("--config", metavar="RECIPE.yaml", default=None,
                        help="a YAML recipe; flags given here override it")
    for title, names in GROUPS.items():
        group = parser.add_argument_group(title)
        for name in names:
            flag = "--" + name.replace("_", "-")
            default = _DEFAULTS[name]
            shown = repr(default.name if isinstance(default, Algorithm) else default)
            if name == "sim":  # what the command does, not the dataclass
                shown = f"{DEFAULT_SIM_WORKERS} without a launcher, 0 under one"
            help_text = f"{helps[name]} (default: {shown})"
            if name in hidden:
                help_text = argparse.SUPPRESS
            tp = hints[name]
            if name == "algorithm":
                group.add_argument(flag, default=None, metavar="NAME", help=help_text)
                group.add_argument("--option", action="append", default=None,
                                   metavar="KEY=VALUE",
                                   help=help_text if name in hidden else "an option of the "
                                   "algorithm, repeatable (e.g. --option bucket_mb=10); see "
                                   "`gossamer algorithms`")
                group.add_argument("--group-size", type=int, default=None, metavar="G",
                                   help=help_text if name in hidden else "workers per "
                                   "averaging group of wagma (the paper's group size): "
                                   "--option group_size=G")
                group.add_argument("--replica-size", type=int, default=None, metavar="R",
                                   help=help_text if name in hidden else "workers per replica "
                                   "of diloco and streaming-diloco: they all-reduce gradients "
                                   "every step, and the method runs between the replicas: "
                                   "--option replica_size=R")
                group.add_argument("--compressor", default=None, metavar="NAME[:KEY=VALUE...]",
                                   help=help_text if name in hidden else "send a "
                                   "gradient-level method's gradients through this compressor "
                                   "(e.g. dgc:ratio=0.001); see `gossamer algorithms`")
            elif tp is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                   help=help_text)
            elif name == "milestones":
                group.add_argument(flag, type=int, nargs="*", default=None, help=help_text)
            elif name in _REPEATED:  # one per flag: --fault 1:5:crash --fault 2:9:nan
                repeated, metavar = _REPEATED[name]
                group.add_argument(repeated, dest=name, action="append", default=None,
                                   metavar=metavar, help=help_text)
            elif name == "bandwidth":
                group.add_argument(flag, default=None, metavar="RATE", help=help_text)
            elif name in _RENAMED.values():
                base = next((t for t in typing.get_args(tp) if t is not type(None)), tp)
                group.add_argument(flag, type=base, default=None, help=help_text)
                old = next(k for k, v in _RENAMED.items() if v == name)
                group.add_argument("--" + old.replace("_", "-"), dest=f"renamed_{old}",
                                   type=base, default=None, help=argparse.SUPPRESS)
            else:
                base = next((t for t in typing.get_args(tp) if t is not type(None)), tp)
                group.add_argument(flag, type=base if inspect.isclass(base) else str,
                                   default=None, help=help_text)


def config_from_args(args: argparse.Namespace, **overrides: Any) -> TrainConfig:
    """Defaults, then the recipe (``--config``), then the flags that were given."""
    settings: dict[str, Any] = {}
    if getattr(args, "config", None):
        settings.update(load_recipe(args.config))
        _drop_options_of_replaced_algorithm(settings, getattr(args, "algorithm", None))
    for old, new in _RENAMED.items():
        value = getattr(args, f"renamed_{old}", None)
        if value is not None:
            flag, now = "--" + old.replace("_", "-"), "--" + new.replace("_", "-")
            if getattr(args, new, None) is not None:
                raise ValueError(f"{flag} and {now} are the same setting ({flag} is its old "
                                 f"name); give {now} only")
            print(f"note: {flag} is now {now} (the old flag works for one more release)",
                  file=sys.stderr)
            setattr(args, new, value)
    for name in _FIELDS:
        value = getattr(args, name, None)
        if value is not None:
            settings[name] = tuple(value) if name in ("milestones", *_REPEATED) else value
    sizes = {key: getattr(args, key, None) for key in ("group_size", "replica_size")}
    if getattr(args, "option", None) or any(v is not None for v in sizes.values()):
        options = dict(settings.get("options", {}))
        options.update(parse_options(args.option or []))
        given: dict[str, str] = {}  # option -> the flag that set it
        for key, value in sizes.items():
            if value is not None:
                option_name = _renamed_flag(settings.get("algorithm"), key)
                flag = "--" + key.replace("_", "-")
                if option_name in given:
                    raise ValueError(f"{given[option_name]} and {flag} are the same setting of "
                                     f"{settings.get('algorithm')}; give "
                                     f"--{option_name.replace('_', '-')} only")
                given[option_name] = flag
                options[option_name] = str(value)
        settings["options"] = options
    if getattr(args, "compressor", None):
        settings["compressor"] = args.compressor
    settings.update(overrides)
    config = TrainConfig(**settings)
    config.check_effect()
    return config


def _renamed_flag(algorithm: Any, key: str) -> str:
    """The option a size flag sets: ``key``, or its new name where ``algorithm`` renamed it
    (``--group-size`` for diloco is ``--replica-size``, with a note)."""
    from gossamer.algorithms import lookup

    if not isinstance(algorithm, str):
        return key
    try:
        renamed = lookup(algorithm).renamed_options
    except ValueError:  # an unknown algorithm is reported where it is resolved
        return key
    if key not in renamed:
        return key
    new = renamed[key]
    print(f"note: --{key.replace('_', '-')} for {algorithm} is now --{new.replace('_', '-')} "
          "(the old flag works for one more release)", file=sys.stderr)
    return new


def _drop_options_of_replaced_algorithm(settings: dict[str, Any], algorithm: Any) -> None:
    """A recipe's ``options`` belong to its algorithm: where ``--algorithm`` names another one,
    they are dropped (with a note), not applied to it. (A QSR recipe's ``alpha`` would
    otherwise turn on DiLoCo's QSR period unasked, or fail on an algorithm without it.)"""
    recipe_algorithm = settings.get("algorithm", AllReduce.name)  # TrainConfig's default
    if not algorithm or not settings.get("options") or not isinstance(recipe_algorithm, str):
        return
    from gossamer.algorithms import lookup
    from gossamer.comm.environment import launched_rank

    if lookup(algorithm) is lookup(recipe_algorithm):
        return
    dropped = settings.pop("options")
    if launched_rank() in (None, 0):  # once, not once per process of a launch
        print(f"note: --algorithm {algorithm} replaces the recipe's {recipe_algorithm}, whose "
              f"options ({', '.join(sorted(dropped))}) are not used; give --option for "
              f"{algorithm}'s", file=sys.stderr)


def parse_options(pairs: list[str]) -> dict[str, str]:
    """``["a=1", "b=x"]`` -> ``{"a": "1", "b": "x"}``."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--option expects KEY=VALUE, got {pair!r}")
        options[key.strip().replace("-", "_")] = value.strip()
    return options
