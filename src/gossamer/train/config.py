"""The configuration of a training run: one frozen dataclass, from flags and YAML recipes.

Precedence: the dataclass defaults, then a recipe file (``--config recipe.yaml``), then the
flags given on the command line. Every field is a flag (``--batch-size`` for ``batch_size``)
and a recipe key; an unknown recipe key is an error that names it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gossamer.algorithms.nonfinite import POLICIES as NONFINITE_POLICIES
from gossamer.checks import check_int, check_positive
from gossamer.comm.faults import check_faults

OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("constant", "step", "cosine")
PARTITIONS = ("iid", "dirichlet")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that defines a training run (see ``gossamer train --help``)."""

    # what to train
    algorithm: str = "allreduce"  # a registered name: `gossamer algorithms` lists them
    options: Mapping[str, Any] = field(default_factory=dict)  # the algorithm's options
    dataset: str = "digits"  # digits (embedded), mnist, fashion-mnist, cifar10, text
    data_path: str | None = None  # directory (or text file) of the data set; not for digits
    model: str = "auto"  # mlp, cnn, resnet20, transformer; auto: the data set's usual one
    block_size: int = 64  # text: characters of context
    # optimisation
    steps: int = 300  # optimizer steps per worker; ~20 epochs of digits with 4 workers
    batch_size: int = 32  # per worker and micro-batch; the global batch is world_size x this
    accumulation: int = 1  # micro-batches per optimizer step (gradient accumulation)
    optimizer: str = "sgd"  # sgd or adamw
    lr: float = 0.05  # peak learning rate
    momentum: float = 0.9  # sgd only
    nesterov: bool = False  # sgd only
    weight_decay: float = 0.0  # decoupled for adamw, L2 for sgd
    schedule: str = "constant"  # constant, step (x gamma at each milestone), cosine (to min_lr)
    warmup_steps: int = 0  # linear warm-up from lr / warmup_steps, before the schedule
    milestones: tuple[int, ...] = ()  # step schedule: steps where lr is multiplied by gamma
    gamma: float = 0.1  # step schedule factor
    min_lr: float = 0.0  # cosine schedule floor
    # data split across workers
    partition: str = "iid"  # iid, or dirichlet (non-IID label skew)
    alpha: float = 0.5  # dirichlet concentration: lower is more skewed
    seed: int = 0  # model init, data split and sampling
    # evaluation and records
    eval_every: int = 50  # steps between evaluations (0: only at the end)
    eval_workers: bool = True  # also evaluate each worker's replica, not only the average
    log_every: int = 10  # steps between train-loss records
    run_dir: str | None = None  # where config, metrics, checkpoints and plots go
    checkpoint_every: int = 0  # steps between checkpoints (0: none); needs run_dir
    keep_checkpoints: int = 3  # newest checkpoints kept on disk (0: all)
    resume: bool = False  # continue from run_dir's latest checkpoint
    tensorboard: bool = False  # also log to TensorBoard in run_dir/tensorboard
    # torch.distributed has no authentication: whoever reaches the store's port can join
    bind_all: bool = False  # real runs: rendezvous on all interfaces, not only MASTER_ADDR
    # simulator (sim > 0)
    sim: int = 0  # simulated workers; 0: real processes from the launcher environment
    latency: float = 50e-6  # seconds per message
    bandwidth: float = 125e6  # bytes per second per link (1 Gbit/s)
    compute_time: float = 0.01  # seconds of compute per step
    # None: the backend's default (gossamer.comm.DEFAULT_TIMEOUTS)
    timeout: float | None = None  # seconds to wait for a peer (virtual in sim); 300, NCCL 600
    # failures (see gossamer.comm.faults and gossamer.algorithms.nonfinite)
    faults: tuple[str, ...] = ()  # repeatable RANK:STEP:KIND, KIND crash|hang|slow:FACTOR|nan
    nonfinite: str = "raise"  # a NaN/inf gradient or parameter: raise (stop), or skip (that update)
    quiet: bool = False  # no progress bar, summary only

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "accumulation", "block_size", "log_every"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("eval_every", "sim", "seed", "checkpoint_every", "warmup_steps",
                     "keep_checkpoints"):
            check_int(name, getattr(self, name), minimum=0)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check_choice("schedule", self.schedule, SCHEDULES)
        _check_choice("partition", self.partition, PARTITIONS)
        check_positive("lr", self.lr, allow_zero=False)
        check_positive("weight_decay", self.weight_decay, allow_zero=True)
        check_positive("min_lr", self.min_lr, allow_zero=True)
        check_positive("gamma", self.gamma, allow_zero=False)
        check_positive("alpha", self.alpha, allow_zero=False)
        check_positive("latency", self.latency, allow_zero=True)
        check_positive("bandwidth", self.bandwidth, allow_zero=False)
        check_positive("compute_time", self.compute_time, allow_zero=True)
        if self.timeout is not None:
            check_positive("timeout", self.timeout, allow_zero=False)
        _check_choice("nonfinite", self.nonfinite, NONFINITE_POLICIES)
        faults = (self.faults,) if isinstance(self.faults, str) else tuple(self.faults)
        object.__setattr__(self, "faults", tuple(
            str(f) for f in check_faults(faults, world_size=self.sim or None, steps=self.steps)))
        for name in ("lr", "weight_decay", "min_lr", "gamma", "alpha", "latency",
                     "compute_time"):
            if math.isinf(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.nesterov and (self.optimizer != "sgd" or self.momentum == 0):
            raise ValueError("nesterov needs optimizer 'sgd' with momentum > 0")
        object.__setattr__(self, "milestones", tuple(int(m) for m in self.milestones))
        if any(m < 1 for m in self.milestones) or list(self.milestones) != sorted(self.milestones):
            raise ValueError(f"milestones must be increasing steps >= 1, got {self.milestones}")
        if self.checkpoint_every and not self.run_dir:
            raise ValueError("checkpoint_every needs run_dir (where checkpoints go)")
        if self.resume and not self.run_dir:
            raise ValueError("resume needs run_dir (whose latest checkpoint to continue)")
        if self.tensorboard and not self.run_dir:
            raise ValueError("tensorboard needs run_dir (the logs go to run_dir/tensorboard)")

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["options"] = dict(self.options)
        d["milestones"] = list(self.milestones)
        d["faults"] = list(self.faults)
        return d

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


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
_NOT_FLAGS = {"options"}  # given as repeated --option KEY=VALUE


def load_recipe(path: str | Path) -> dict[str, Any]:
    """Read a YAML recipe: a mapping of TrainConfig fields (``options`` a mapping too)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    with path.open() as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of settings")
    for key in data:
        if key not in _FIELDS:
            raise ValueError(
                f"config file {str(path)!r}: unknown key {key!r}; known keys: "
                f"{', '.join(sorted(_FIELDS))}"
            )
    if "options" in data and not isinstance(data["options"], dict):
        raise ValueError(f"config file {str(path)!r}: options must be a mapping")
    if "milestones" in data:
        value = data["milestones"]
        data["milestones"] = tuple(value) if isinstance(value, (list, tuple)) else (
            () if value is None else (value,))
    if "faults" in data:
        value = data["faults"]
        data["faults"] = tuple(value) if isinstance(value, (list, tuple)) else (
            () if value is None else (value,))
    hints = typing.get_type_hints(TrainConfig)
    for key, value in data.items():
        # YAML reads 1e-3 as a string: numbers are taken in any spelling float() accepts
        if hints[key] is float and isinstance(value, (str, int)) and not isinstance(value, bool):
            try:
                data[key] = float(value)
            except ValueError:
                raise ValueError(
                    f"config file {str(path)!r}: {key} must be a number, got {value!r}"
                ) from None
    return data


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, with its comment as help and its default shown."""
    import inspect

    comments = _field_comments()
    hints = typing.get_type_hints(TrainConfig)
    defaults = TrainConfig()
    parser.add_argument("--config", metavar="RECIPE.yaml", default=None,
                        help="a YAML recipe; flags given here override it")
    parser.add_argument("--option", action="append", default=None, metavar="KEY=VALUE",
                        help="an option of the algorithm, repeatable (e.g. --option "
                        "bucket_mb=10); see `gossamer algorithms`")
    for name in _FIELDS:
        if name in _NOT_FLAGS:
            continue
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        help_text = f"{comments.get(name, '')} (default: {default!r})"
        tp = hints[name]
        if tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        elif name == "milestones":
            parser.add_argument(flag, type=int, nargs="*", default=None, help=help_text)
        elif name == "faults":  # one fault per flag: --fault 1:5:crash --fault 2:9:nan
            parser.add_argument("--fault", dest="faults", action="append", default=None,
                                metavar="RANK:STEP:KIND", help=help_text)
        else:
            base = next((t for t in typing.get_args(tp) if t is not type(None)), tp)
            parser.add_argument(flag, type=base if inspect.isclass(base) else str,
                                default=None, help=help_text)


def config_from_args(args: argparse.Namespace, **overrides: Any) -> TrainConfig:
    """Defaults, then the recipe (``--config``), then the flags that were given."""
    settings: dict[str, Any] = {}
    if getattr(args, "config", None):
        settings.update(load_recipe(args.config))
    for name in _FIELDS:
        value = getattr(args, name, None)
        if value is not None and name not in _NOT_FLAGS:
            settings[name] = tuple(value) if name in ("milestones", "faults") else value
    if getattr(args, "option", None):
        options = dict(settings.get("options", {}))
        options.update(parse_options(args.option))
        settings["options"] = options
    settings.update(overrides)
    return TrainConfig(**settings)


def parse_options(pairs: list[str]) -> dict[str, str]:
    """``["a=1", "b=x"]`` -> ``{"a": "1", "b": "x"}``."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--option expects KEY=VALUE, got {pair!r}")
        options[key.strip().replace("-", "_")] = value.strip()
    return options


def _field_comments() -> dict[str, str]:
    """The ``# comment`` after each field in this file's TrainConfig, as flag help."""
    import inspect

    comments = {}
    for line in inspect.getsource(TrainConfig).splitlines():
        stripped = line.strip()
        if ":" in stripped and "#" in stripped and not stripped.startswith("#"):
            name = stripped.split(":", 1)[0].strip()
            if name in _FIELDS:
                comments[name] = stripped.split("#", 1)[1].strip()
    return comments
