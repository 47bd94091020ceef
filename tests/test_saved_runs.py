"""Run directories written by an earlier version still load and resume, to the same run.

``tests/data/runs-v1`` holds six short simulated runs (2 workers, 8 steps, a checkpoint every
3 steps) written before the methods' configurations were composed of period rules and outer
steps, and before the compression aliases became presets of ``allreduce``: QSR, DiLoCo with
QSR and a compressor, Streaming DiLoCo (a checkpoint with an exchange in flight), DGC, top-k
and fp16. Each was made by::

    gossamer train --sim 2 --model tinynet:make --steps 8 --checkpoint-every 3 \\
        --keep-checkpoints 5 --eval-every 0 --log-every 1 --run-dir NAME --quiet \\
        --no-tensorboard --algorithm ... --option ...   # OMP_NUM_THREADS=1

(``tinynet.py`` beside them; the options are in each ``config.yaml``). Kept: its config.yaml,
metrics.jsonl, and the checkpoints after steps 3 and 8. The test resumes each from step 3 with
today's code and asserts the same bytes and synchronisations at every step after it, and the
same losses and parameters at the end (to float32's last bits: they were written with one
torch thread, as the tests run, and another CPU's kernels may round differently).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from gossamer.train.checkpoint import load_checkpoint
from gossamer.train.config import TrainConfig, load_recipe, resolve_algorithm
from gossamer.train.run import run_training

RUNS = Path(__file__).parent / "data" / "runs-v1"
NAMES = ["qsr", "diloco", "streaming", "dgc", "topk", "fp16"]
EXACT = ("lr", "bytes_sent")


def _records(path: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r for r in records if r["kind"] == "train"}


def _model_state(path: Path, rank: int) -> dict[str, torch.Tensor]:
    """The model's state of worker ``rank`` in the checkpoint at ``path``: its own, or the
    one every worker shared."""
    _, shard, shared = load_checkpoint(path.parent.parent, rank, 2, path)
    return shard["model"] if "model" in shard else shared["model"]


@pytest.mark.parametrize("name", NAMES)
def test_saved_config_loads(name):
    settings = load_recipe(RUNS / name / "config.yaml")
    config = TrainConfig(**settings)
    algorithm = resolve_algorithm(config.algorithm, config.options)
    assert algorithm is not None


@pytest.mark.parametrize("name", NAMES)
def test_saved_checkpoint_resumes_to_the_same_run(name, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(RUNS))  # tinynet:make
    saved = RUNS / name
    run_dir = tmp_path / name
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(saved / "checkpoints" / "step-00000003",
                    run_dir / "checkpoints" / "step-00000003")
    (run_dir / "checkpoints" / "latest").write_text("step-00000003")
    for file in ("partition.json", "config.yaml"):
        shutil.copy(saved / file, run_dir / file)
    settings = load_recipe(saved / "config.yaml")
    config = TrainConfig(**{**settings, "run_dir": str(run_dir), "resume": True})
    run_training(config)

    before, after = _records(saved / "metrics.jsonl"), _records(run_dir / "metrics.jsonl")
    assert sorted(after) == list(range(4, 9))
    for step in range(4, 9):
        for key in EXACT:
            assert after[step][key] == before[step][key], (name, step, key)
        # to float32's last bits, which a CPU's other kernels may change (and the simulated
        # clock, summed again from the checkpoint's)
        for key, rel in (("train_loss", 1e-6), ("wall_clock", 1e-12)):
            assert after[step][key] == pytest.approx(before[step][key], rel=rel), (name, step)
    summary_before = [json.loads(line) for line in
                      (saved / "metrics.jsonl").read_text().splitlines()][-1]
    summary_after = [json.loads(line) for line in
                     (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    for key in ("synchronizations", "bytes_sent", "messages_sent"):
        assert summary_after[key] == summary_before[key], (name, key)
    assert summary_after["eval_loss"] == pytest.approx(summary_before["eval_loss"], rel=1e-6)
    for rank in range(2):
        old, new = (_model_state(directory / "checkpoints" / "step-00000008", rank)
                    for directory in (saved, run_dir))
        assert old.keys() == new.keys()
        for key in old:
            torch.testing.assert_close(new[key], old[key], rtol=1e-5, atol=1e-7,
                                       msg=lambda m, r=rank, k=key: f"{name} {r} {k}: {m}")
