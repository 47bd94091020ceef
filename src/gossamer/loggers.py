"""Where a run's records go: a two-method :class:`Logger` protocol and its adapters.

A record is a dict with a ``kind``: ``train`` (every ``log_every`` steps), ``eval`` (every
``eval_every`` steps, see :func:`gossamer.train.metrics.measure`) or ``summary`` (once, at the
end: the last ``eval`` record with the algorithm's name and the world size). ``train`` and
``eval`` records carry their ``step``; each adapter turns their numeric fields into the tool's
scalars at that step, named ``KIND/FIELD`` (``eval/eval_loss``). Lists, strings and
non-finite numbers are left out (the JSONL log keeps everything).

=============== =============================== ======================================
name            adapter                         needs
=============== =============================== ======================================
``jsonl``       :class:`JSONLLogger`            nothing (``metrics.jsonl``)
``tensorboard`` :class:`TensorBoardLogger`      ``pip install gossamer[tensorboard]``
``wandb``       :class:`WandbLogger` (offline)  ``pip install gossamer[wandb]``
``mlflow``      :class:`MLflowLogger` (local)   ``pip install gossamer[mlflow]``
=============== =============================== ======================================

Example::

    from gossamer.loggers import make_logger
    logger = make_logger("mlflow", run_dir)
    logger.log({"kind": "train", "step": 10, "train_loss": 0.7})
    logger.close()
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "LOGGERS",
    "JSONLLogger",
    "Logger",
    "MLflowLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "make_logger",
    "scalars",
]


@runtime_checkable
class Logger(Protocol):
    """Takes a run's records one at a time; ``close()`` once at the end (flushes)."""

    def log(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: Mapping[str, Any]) -> tuple[int, dict[str, float]] | None:
    """``(step, {"KIND/FIELD": value})`` of a record with a ``kind`` and an integer ``step``:
    its finite numeric fields (booleans, lists and strings left out); None without them."""
    kind, step = record.get("kind"), record.get("step")
    if not isinstance(kind, str) or isinstance(step, bool) or not isinstance(step, int):
        return None
    values = {}
    for key, value in record.items():
        if key in ("kind", "step") or isinstance(value, bool):
            continue
        if isinstance(value, int | float) and math.isfinite(value):
            values[f"{kind}/{key}"] = float(value)
    return step, values


def _training_scalars(record: Mapping[str, Any]) -> tuple[int, dict[str, float]] | None:
    """:func:`scalars` of a ``train`` or ``eval`` record; None for other kinds."""
    return scalars(record) if record.get("kind") in ("train", "eval") else None


def _require(module: str, extra: str, who: str) -> Any:
    try:
        return __import__(module)
    except ImportError as error:
        raise ImportError(f"{who} needs the {module} package: pip install gossamer[{extra}] "
                          f"(or pip install {module})") from error


# ----------------------------------------------------------------------------- JSONL


class JSONLLogger:
    """Every record as one JSON line (NaN and infinities as null), flushed at once.

    Args:
        path: the file (``RUN_DIR/metrics.jsonl``).
        resume_step: 0 starts the file afresh; a resumed run's step keeps the records up to it
            (without the interrupted run's summary) and appends after them.
    """

    def __init__(self, path: str | Path, resume_step: int = 0) -> None:
        path = Path(path)
        if resume_step:  # drop what the interrupted run recorded after its checkpoint
            records = [json.loads(line) for line in read_lines(path)]
            kept = [r for r in records
                    if r.get("step", 0) <= resume_step and r.get("kind") != "summary"]
            path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        else:
            path.write_text("")
        self.path = path
        self._file = path.open("a")

    def log(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(_json_safe(dict(record))) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            os.fsync(self._file.fileno())
            self._file.close()


def _json_safe(value: Any) -> Any:
    """NaN and infinities (not JSON) become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def read_lines(path: Path) -> list[str]:
    """The complete JSON lines of ``path`` (none if it is missing; a line cut by a crash is
    left out)."""
    lines = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                json.loads(line)
            except json.JSONDecodeError:
                continue
            lines.append(line)
    return lines


# ----------------------------------------------------------------------------- TensorBoard


class TensorBoardLogger:
    """Mirror ``train`` and ``eval`` records to TensorBoard scalars, at their step.

    Scalars are named ``KIND/FIELD`` (``eval/eval_loss``); lists and non-numeric fields are
    skipped, and so are ``summary`` records (the last ``eval`` record again). Needs the
    optional ``tensorboard`` package.

    Example::

        with TensorBoardLogger(run_dir / "tb") as tb:
            for record in records:
                tb.log(record)
    """

    def __init__(self, log_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError(
                "TensorBoardLogger needs the tensorboard package: pip install tensorboard"
            ) from error
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, record: Mapping[str, Any]) -> None:
        """Write the numeric fields of a ``train`` or ``eval`` record; ignore other kinds."""
        converted = _training_scalars(record)
        if converted is None:
            return
        step, values = converted
        for key, value in values.items():
            self._writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------- Weights & Biases


class WandbLogger:
    """Weights & Biases, offline: the run is written under ``dir`` and nothing is sent (``wandb
    sync DIR/wandb/offline-run-*`` uploads it later, if wanted).

    ``train`` and ``eval`` records become history rows at their step; the ``summary`` record
    becomes the run's summary. Steps must not decrease (W&B drops rows logged at an earlier
    step), which holds for one run's records.

    Args:
        dir: where wandb writes (it makes ``dir/wandb``).
        project: the W&B project name.
        name: the run's name; default: wandb's.
        config: the run's configuration (e.g. ``TrainConfig.as_dict()``).
        mode: ``"offline"`` (default) or whatever ``wandb.init`` takes, for a user who wants
            ``"online"``.
    """

    def __init__(self, dir: str | Path, *, project: str = "gossamer", name: str | None = None,
                 config: Mapping[str, Any] | None = None, mode: str = "offline") -> None:
        wandb = _require("wandb", "wandb", "WandbLogger")
        Path(dir).mkdir(parents=True, exist_ok=True)
        # no capture of the console (the progress bar is not a metric), no system metrics
        settings = wandb.Settings(console="off", x_disable_stats=True)
        self._run = wandb.init(dir=str(dir), project=project, name=name, mode=mode,
                               config=dict(config or {}), reinit="create_new",
                               settings=settings)
        self.dir = Path(self._run.dir).parent  # the run's own directory (files/ inside)

    def log(self, record: Mapping[str, Any]) -> None:
        if record.get("kind") == "summary":
            for key, value in record.items():
                if key != "kind" and not isinstance(value, list):
                    self._run.summary[key] = value
            return
        converted = _training_scalars(record)
        if converted is not None and converted[1]:
            self._run.log(converted[1], step=converted[0])

    def close(self) -> None:
        self._run.finish()


# ----------------------------------------------------------------------------- MLflow


class MLflowLogger:
    """MLflow, local: a SQLite store (``sqlite:///DIR/mlflow.db``) unless a tracking URI is given.

    ``train`` and ``eval`` records become metrics at their step; the ``summary`` record's
    numbers become metrics ``summary/FIELD`` at its step and its strings become tags
    (``algorithm``).

    Args:
        dir: the store's directory (made if missing): ``DIR/mlflow.db`` and ``DIR/artifacts``.
        experiment: the experiment's name (made if missing).
        run_name: the run's name; default: MLflow's.
        tracking_uri: another store (e.g. a server's URL); then ``dir`` holds only artifacts.
        params: the run's parameters (e.g. the flat fields of ``TrainConfig.as_dict()``).

    Read back with ``MlflowClient(logger.tracking_uri).get_metric_history(logger.run_id,
    "eval/eval_loss")``.
    """

    def __init__(self, dir: str | Path, *, experiment: str = "gossamer",
                 run_name: str | None = None, tracking_uri: str | None = None,
                 params: Mapping[str, Any] | None = None) -> None:
        _require("mlflow", "mlflow", "MLflowLogger")
        from mlflow.tracking import MlflowClient

        root = Path(dir).resolve()
        root.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = tracking_uri or f"sqlite:///{root / 'mlflow.db'}"
        self._client = MlflowClient(self.tracking_uri)
        found = self._client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else \
            self._client.create_experiment(experiment,
                                           artifact_location=(root / "artifacts").as_uri())
        run = self._client.create_run(experiment_id, run_name=run_name)
        self.run_id: str = run.info.run_id
        for key, value in (params or {}).items():
            self._client.log_param(self.run_id, key, value)

    def log(self, record: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric, RunTag

        kind = record.get("kind")
        converted = scalars(record) if kind in ("train", "eval", "summary") else None
        if converted is None:
            return
        step, values = converted
        now = int(time.time() * 1000)
        tags = [RunTag(k, v) for k, v in record.items()
                if kind == "summary" and k != "kind" and isinstance(v, str)]
        self._client.log_batch(self.run_id, tags=tags,
                               metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


# ----------------------------------------------------------------------------- by name


#: Loggers by name, each made from a run directory and the run's settings (a plain mapping,
#: e.g. ``TrainConfig.as_dict()``, or None), which is what ``gossamer train`` has.
LOGGERS: dict[str, Callable[..., Logger]] = {
    "jsonl": lambda run_dir, config=None: JSONLLogger(run_dir / "metrics.jsonl"),
    "tensorboard": lambda run_dir, config=None: TensorBoardLogger(run_dir / "tensorboard"),
    "wandb": lambda run_dir, config=None: WandbLogger(run_dir, name=run_dir.name,
                                                      config=config),
    "mlflow": lambda run_dir, config=None: MLflowLogger(
        run_dir / "mlflow", run_name=run_dir.name,
        params={k: v if isinstance(v, (str, int, float, bool)) else json.dumps(v)
                for k, v in (config or {}).items()}),
}


def make_logger(name: str, run_dir: str | Path,
                config: Mapping[str, Any] | None = None) -> Logger:
    """The logger called ``name`` (a key of :data:`LOGGERS`), writing under ``run_dir``;
    W&B and MLflow record ``config`` (the run's settings) as the run's config and params."""
    if name not in LOGGERS:
        raise ValueError(f"logger {name!r} is not one of {', '.join(sorted(LOGGERS))}")
    return LOGGERS[name](Path(run_dir), config)
