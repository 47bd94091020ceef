"""gossamer.loggers: each adapter against the real package, read back from what the tool stored.

A package that is missing skips its tests with the extra that installs it; ``.[dev]`` installs
them all, so CI runs every test here.
"""

import importlib.util
import json
import math
import struct
import time
from pathlib import Path

import pytest

from gossamer.loggers import (
    LOGGERS,
    JSONLLogger,
    Logger,
    MLflowLogger,
    TensorBoardLogger,
    WandbLogger,
    make_logger,
    scalars,
)
from gossamer.train.config import TrainConfig
from gossamer.train.metrics import MetricsLog

RECORDS = [
    {"kind": "train", "step": 5, "train_loss": 2.5, "lr": 0.1, "bytes_sent": 1000.0,
     "wall_clock": 0.5},
    {"kind": "train", "step": 10, "train_loss": 1.5, "lr": 0.1, "bytes_sent": 2000.0,
     "wall_clock": 1.0},
    {"kind": "eval", "step": 10, "train_loss": 1.25, "eval_loss": 1.75, "eval_accuracy": 0.5,
     "worker_eval_loss": [1.5, 2.0], "consensus_distance": 0.25, "synchronizations": 3,
     "skipped_steps": 0, "examples_per_second": float("nan")},
    {"kind": "train", "step": 15, "train_loss": 0.5, "lr": 0.05, "bytes_sent": 3000.0,
     "wall_clock": 1.5},
    {"kind": "summary", "step": 15, "eval_loss": 1.75, "eval_accuracy": 0.5,
     "algorithm": "sgp", "world_size": 4},
]

#: what every adapter must store: (scalar name) -> [(step, value)]
EXPECTED = {
    "train/train_loss": [(5, 2.5), (10, 1.5), (15, 0.5)],
    "train/lr": [(5, 0.1), (10, 0.1), (15, 0.05)],
    "eval/eval_loss": [(10, 1.75)],
    "eval/consensus_distance": [(10, 0.25)],
    "eval/synchronizations": [(10, 3.0)],
}


def needs(package: str):
    """Skip, naming the extra, where ``package`` is not installed."""
    return pytest.mark.skipif(
        importlib.util.find_spec(package) is None,
        reason=f"{package} is not installed: pip install gossamer[{package}] (or .[dev])",
    )


def _assert_points(stored, expected, name: str) -> None:
    """The same steps, and the same values to float32 precision (TensorBoard's)."""
    assert [step for step, _ in stored] == [step for step, _ in expected], name
    values = [value for _, value in stored]
    assert values == pytest.approx([value for _, value in expected], rel=1e-6), name


def _log_all(logger: Logger) -> None:
    for record in RECORDS:
        logger.log(record)
    logger.close()


def test_scalars_keeps_finite_numbers_named_by_kind():
    step, values = scalars(RECORDS[2])
    assert step == 10
    assert values == {"eval/train_loss": 1.25, "eval/eval_loss": 1.75,
                      "eval/eval_accuracy": 0.5, "eval/consensus_distance": 0.25,
                      "eval/synchronizations": 3.0, "eval/skipped_steps": 0.0}
    assert scalars({"kind": "train"}) is None and scalars({"step": 1}) is None
    assert scalars({"kind": "train", "step": True, "x": 1.0}) is None


def test_make_logger_names_the_loggers_it_knows(tmp_path):
    with pytest.raises(ValueError, match="jsonl, mlflow, tensorboard, wandb"):
        make_logger("neptune", tmp_path)
    assert set(LOGGERS) == {"jsonl", "tensorboard", "wandb", "mlflow"}


def test_jsonl_logger_writes_every_record_and_resumes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    logger = JSONLLogger(path)
    assert isinstance(logger, Logger)
    _log_all(logger)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["kind"] for r in lines] == [r["kind"] for r in RECORDS]
    assert lines[2]["examples_per_second"] is None  # NaN is not JSON
    # a run resumed from step 10 keeps the records up to it, without the summary
    JSONLLogger(path, resume_step=10).close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [5, 10, 10]


@needs("tensorboard")
def test_tensorboard_logger_stores_the_scalars_at_their_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log_all(TensorBoardLogger(tmp_path / "tb"))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for name, points in EXPECTED.items():
        stored = [(e.step, e.value) for e in events.Scalars(name)]
        _assert_points(stored, points, name)
    assert "summary/eval_loss" not in events.Tags()["scalars"]
    assert not any("worker_eval_loss" in tag for tag in events.Tags()["scalars"])


def _wandb_records(run_dir: Path):
    """The records of an offline run's ``run-ID.wandb`` file: W&B's transaction log, a
    7-byte header then LevelDB log blocks of 32 KiB, each record a protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # a record still being written
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):  # full, first
            pending = chunk
        elif kind == 3:  # middle
            pending += chunk
        elif kind == 4:  # last
            pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _finished_wandb_records(run_dir: Path, patience: float = 60.0) -> list:
    """The run's records once its log holds the ``exit`` record, which W&B's service writes
    after the last history: ``finish()`` can return before the service's writer has flushed
    the file (seen once on a loaded machine), so the reader waits, at most ``patience`` s."""
    end = time.monotonic() + patience
    while True:
        records = list(_wandb_records(run_dir))
        kinds = [r.WhichOneof("record_type") for r in records]
        if "exit" in kinds:
            return records
        if time.monotonic() > end:
            raise AssertionError(f"no exit record in {run_dir} after {patience:.0f} s: "
                                 f"{sorted(set(kinds))}")
        time.sleep(0.2)


@pytest.mark.slow  # starts the tool's service or database
@needs("wandb")
def test_wandb_logger_stores_history_at_steps_and_the_summary(tmp_path):
    logger = WandbLogger(tmp_path, name="test-run", config={"algorithm": "sgp"})
    _log_all(logger)
    assert logger.dir.name.startswith("offline-run-")
    history: dict[str, list[tuple[int, float]]] = {}
    summary: dict[str, object] = {}
    for record in _finished_wandb_records(logger.dir):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                history.setdefault(key, []).append((record.history.step.num,
                                                    json.loads(item.value_json)))
        elif kind == "summary":
            for item in record.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    for name, points in EXPECTED.items():
        _assert_points(history[name], points, name)
    assert "eval/worker_eval_loss" not in history
    assert not any(math.isnan(v) for _, v in history.get("eval/examples_per_second", []))
    assert summary["algorithm"] == "sgp" and summary["eval_accuracy"] == 0.5


@pytest.mark.slow  # starts the tool's service or database
@needs("mlflow")
def test_mlflow_logger_stores_metrics_at_steps_in_a_local_store(tmp_path):
    from mlflow.tracking import MlflowClient

    logger = MLflowLogger(tmp_path / "mlflow", run_name="test-run", params={"lr": 0.1})
    _log_all(logger)
    assert logger.tracking_uri.startswith("sqlite:///")
    assert (tmp_path / "mlflow" / "mlflow.db").is_file()
    client = MlflowClient(logger.tracking_uri)
    for name, points in EXPECTED.items():
        stored = sorted((m.step, m.value) for m in client.get_metric_history(logger.run_id, name))
        _assert_points(stored, points, name)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "test-run"
    assert run.data.tags["algorithm"] == "sgp" and run.data.params["lr"] == "0.1"
    assert run.data.metrics["summary/eval_accuracy"] == 0.5
    assert "eval/worker_eval_loss" not in run.data.metrics
    assert "eval/examples_per_second" not in run.data.metrics  # NaN left out


class _Recorder:
    def __init__(self) -> None:
        self.records: list[dict] = []
        self.closed = False

    def log(self, record) -> None:
        self.records.append(dict(record))

    def close(self) -> None:
        self.closed = True


def test_metrics_log_keeps_its_file_and_adds_the_loggers_given(tmp_path):
    recorder = _Recorder()
    config = TrainConfig(run_dir=str(tmp_path))
    log = MetricsLog(config, enabled=True, resume_step=0, loggers=("jsonl", recorder))
    for record in RECORDS:
        log.write(record)
    log.close()
    assert recorder.records == RECORDS and recorder.closed
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == len(RECORDS)
    # other ranks record nothing, but a bad name fails everywhere
    other = _Recorder()
    MetricsLog(config, enabled=False, resume_step=0, loggers=(other,)).write(RECORDS[0])
    assert other.records == []
    with pytest.raises(ValueError, match="'neptune'"):
        MetricsLog(config, enabled=False, resume_step=0, loggers=("neptune",))


@pytest.mark.slow  # starts the tool's service or database
@needs("mlflow")
def test_metrics_log_makes_a_logger_by_name_under_the_run_directory(tmp_path):
    from mlflow.tracking import MlflowClient

    log = MetricsLog(TrainConfig(run_dir=str(tmp_path), algorithm="sgp",
                                 options={"tau": "1"}, lr=0.2),
                     enabled=True, resume_step=0, loggers=("mlflow",))
    for record in RECORDS:
        log.write(record)
    log.close()
    (logger,) = [x for x in log.loggers if isinstance(x, MLflowLogger)]
    history = MlflowClient(logger.tracking_uri).get_metric_history(logger.run_id,
                                                                   "train/train_loss")
    assert sorted((m.step, m.value) for m in history) == [(5, 2.5), (10, 1.5), (15, 0.5)]
    assert (tmp_path / "mlflow" / "mlflow.db").is_file()
    params = MlflowClient(logger.tracking_uri).get_run(logger.run_id).data.params
    assert params["lr"] == "0.2"  # the run's settings, as its params
    assert json.loads(params["algorithm"]) == {"name": "sgp", "options": {"tau": 1}}
