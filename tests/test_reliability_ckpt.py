"""Reliability of checkpoints, elastic restarts and the start of training.

- checkpoints carry the sha256 of every file and are verified when read; a damaged newest
  checkpoint makes a resumed run fall back to the previous one;
- every worker saves and loads the same step, or all stop naming the one that differs;
- 20 ``kill -9`` at random moments of a loop of saves: ``latest`` always loads and verifies;
- under ``torchrun --max-restarts 1`` (and ``gossamer launch --max-restarts 1``) a worker
  killed with SIGKILL is restarted with the others, the run resumes from its newest
  checkpoint, and ends with the parameters of a run without the fault, bit for bit;
- workers started with different settings all stop at the start, naming the rank and field.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from resume_helpers import crash_at

import gossamer.train.loop as loop
from gossamer.comm import SimWorld
from gossamer.train import checkpoint as ckpt
from gossamer.train.agreement import check_agreement, describe_run, flatten
from gossamer.train.config import TrainConfig
from gossamer.train.data import load_dataset
from gossamer.train.loop import train_worker
from gossamer.train.run import elastic_restart, run_training

# ------------------------------------------------------------------------------ checkpoints


def _save(comm, run_dir, step, keep=0, size=1000):
    shard = {"x": torch.arange(size, dtype=torch.float32) + 1000 * step + comm.rank}
    shared = {"model": torch.full((size,), float(step))}
    return ckpt.save_checkpoint(comm, run_dir, step, shard, shared=shared, keep=keep)


def test_checksums_are_recorded_and_a_damaged_file_is_named(tmp_path):
    SimWorld(2).run(_save, tmp_path, 10)
    path = ckpt.latest_checkpoint(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    assert sorted(meta["files"]) == ["rank-00000.pt", "rank-00001.pt", "shared.pt"]
    for name, digest in meta["files"].items():
        assert ckpt.file_sha256(path / name) == digest
    assert ckpt.verify_checkpoint(path)["step"] == 10
    target = path / "rank-00001.pt"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit
    target.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="rank-00001.pt is damaged"):
        ckpt.verify_checkpoint(path)
    with pytest.raises(ckpt.DamagedCheckpoint, match="rank-00001.pt is damaged"):
        ckpt.load_checkpoint(tmp_path, 1, 2)
    step, shard, shared = ckpt.load_checkpoint(tmp_path, 0, 2)  # rank 0's files are intact
    assert step == 10 and torch.equal(shared["model"], torch.full((1000,), 10.0))
    target.unlink()
    with pytest.raises(ValueError, match="rank-00001.pt is missing"):
        ckpt.verify_checkpoint(path)


def test_every_worker_saves_the_same_step_or_all_stop_naming_the_rank(tmp_path):
    def worker(comm):
        try:
            _save(comm, tmp_path, 20 if comm.rank == 2 else 10)
        except ValueError as exc:
            return str(exc)
        return None

    errors = SimWorld(3).run(worker)
    assert all(e is not None and "rank 2 step 20" in e and "rank 0 step 10" in e
               for e in errors), errors
    assert ckpt.latest_checkpoint(tmp_path) is None  # nothing was committed


def test_every_worker_resumes_the_same_step_or_all_stop_naming_the_rank(tmp_path):
    SimWorld(2).run(_save, tmp_path / "a", 10)
    SimWorld(2).run(_save, tmp_path / "b", 20)

    def worker(comm):  # rank 1 looks at another run directory, as a node with a stale view
        try:
            ckpt.resume_checkpoint(comm, tmp_path / ("a" if comm.rank == 0 else "b"))
        except ValueError as exc:
            return str(exc)
        return None

    for error in SimWorld(2).run(worker):
        assert error is not None and "rank 1 step 20" in error, error


def test_leftovers_of_crashed_saves_are_removed_by_the_next_save(tmp_path):
    world = SimWorld(2)
    world.run(_save, tmp_path, 10)
    root = tmp_path / "checkpoints"
    (root / "step-00000015.tmp").mkdir()  # a save that died half-way
    (root / "step-00000015.tmp" / "rank-00000.pt.tmp").write_bytes(b"half")
    (root / "step-00000005.old").mkdir()  # a pruning that died half-way
    (root / "step-00000020.tmp").mkdir()  # the next save's own, with a half-written file
    (root / "step-00000020.tmp" / "shared.pt.tmp").write_bytes(b"half")
    world.run(_save, tmp_path, 20)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000010",
                                                      "step-00000020"]
    assert sorted(p.name for p in (root / "step-00000020").iterdir()) == [
        "meta.json", "rank-00000.pt", "rank-00001.pt", "shared.pt"]


@pytest.mark.slow
def test_resume_falls_back_past_a_damaged_checkpoint_and_ends_equal(tmp_path, monkeypatch):
    cfg = dict(sim=2, steps=40, eval_every=0, checkpoint_every=10, keep_checkpoints=3,
               quiet=True)
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run_training(TrainConfig(run_dir=str(straight), **cfg))
    monkeypatch.setattr(loop, "learning_rate", crash_at(35))
    with pytest.raises(Exception, match="stopped at step 35"):
        run_training(TrainConfig(run_dir=str(stopped), **cfg))
    monkeypatch.undo()
    damaged = ckpt.latest_checkpoint(stopped) / "rank-00001.pt"
    assert damaged.parent.name == "step-00000030"
    damaged.write_bytes(damaged.read_bytes()[:-10])  # truncated
    with pytest.warns(UserWarning, match=r"step-00000030 fails on rank\(s\) \[1\]"):
        run_training(TrainConfig(run_dir=str(stopped), resume=True, **cfg))
    a = ckpt.safe_load(ckpt.latest_checkpoint(straight) / "shared.pt")["model"]
    b = ckpt.safe_load(ckpt.latest_checkpoint(stopped) / "shared.pt")["model"]
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # the damaged one was replaced when the resumed run saved step 30 again
    assert ckpt.verify_checkpoint(stopped / "checkpoints" / "step-00000030")["step"] == 30
    # when nothing verifies, resuming refuses and says why
    for path in (stopped / "checkpoints").glob("step-*"):
        (path / "rank-00000.pt").write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="falling back"), \
            pytest.raises(Exception, match="no checkpoint of run_dir .* verifies on every"):
        run_training(TrainConfig(run_dir=str(stopped), resume=True, **cfg))


def test_resuming_earlier_removes_the_abandoned_later_checkpoints(tmp_path):
    world = SimWorld(2)
    for step in (10, 20, 30):
        world.run(_save, tmp_path, step)
    (tmp_path / "checkpoints" / "latest").write_text("step-00000010")  # as after a fallback
    world.run(_save, tmp_path, 20)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000010", "step-00000020"]


@pytest.mark.slow
def test_a_fresh_run_in_a_used_run_dir_never_resumes_the_earlier_one(tmp_path):
    run_training(TrainConfig(sim=2, steps=10, eval_every=0, checkpoint_every=5, quiet=True,
                             run_dir=str(tmp_path)))
    config = TrainConfig(steps=10, checkpoint_every=5, quiet=True, run_dir=str(tmp_path))
    restarted = {"TORCHELASTIC_RESTART_COUNT": "1"}
    assert elastic_restart(config, restarted) == 1  # a restart resumes the checkpoint...
    assert elastic_restart(config, {"TORCHELASTIC_RESTART_COUNT": "0"}) == 0
    assert elastic_restart(config, {}) == 0
    assert elastic_restart(config.replace(resume=True), restarted) == 0  # resumes anyway
    with pytest.warns(UserWarning, match="checkpoints of an earlier run"):
        run_training(TrainConfig(sim=2, steps=3, eval_every=0, quiet=True,
                                 run_dir=str(tmp_path)))
    # ... but not one of the earlier run, once a new run started in the directory
    assert elastic_restart(config, restarted) == 0
    with pytest.raises(ValueError, match="no checkpoint to resume from"):
        run_training(TrainConfig(sim=2, steps=10, quiet=True, run_dir=str(tmp_path),
                                 resume=True))


# ------------------------------------------------------------------ kill -9 during saves

_STATE = 1_000_000  # float32 per file: 4 MB, so that a save takes tens of milliseconds


def _saver(run_dir: str, ready, duration) -> None:
    """Save checkpoints of 2 simulated workers in a loop, from the step after ``latest``;
    ``ready`` once the first save is done, and how long it took in ``duration``."""
    path = ckpt.latest_checkpoint(run_dir)
    step = int(path.name.split("-")[1]) + 1
    world = SimWorld(2)
    while True:
        began = time.perf_counter()
        world.run(_save, run_dir, step, 2, _STATE)
        if not ready.is_set():
            duration.value = time.perf_counter() - began
            ready.set()
        step += 1


@pytest.mark.slow
def test_kill_9_during_saves_always_leaves_a_loadable_verified_latest(tmp_path):
    SimWorld(2).run(_save, tmp_path, 0, 2, _STATE)
    ctx = mp.get_context("forkserver")  # torch is imported once, not in each of 20 children
    ctx.set_forkserver_preload(["torch", "gossamer.comm", "gossamer.train.checkpoint"])
    rng = random.Random(9)
    root = tmp_path / "checkpoints"
    mid_save, steps = 0, []
    for _ in range(20):
        ready, duration = ctx.Event(), ctx.Value("d", 0.0)
        child = ctx.Process(target=_saver, args=(str(tmp_path), ready, duration), daemon=True)
        child.start()
        assert ready.wait(timeout=60), "the saving child did not save"
        # at a random moment of the next two saves, however fast the disk is today
        time.sleep(rng.uniform(0.0, 2.0) * duration.value)
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL
        mid_save += any(p.name.endswith((".tmp", ".old")) for p in root.iterdir())
        path = ckpt.latest_checkpoint(tmp_path)  # never None, never incomplete
        meta = ckpt.verify_checkpoint(path)  # every file's sha256 matches
        for rank in range(2):
            step, shard, shared = ckpt.load_checkpoint(tmp_path, rank, 2)
            assert step == meta["step"]
            assert torch.equal(shard["x"], torch.arange(_STATE, dtype=torch.float32)
                               + 1000 * step + rank)
            assert torch.equal(shared["model"], torch.full((_STATE,), float(step)))
        steps.append(meta["step"])
    assert mid_save >= 5, f"only {mid_save} of 20 kills landed during a save"
    assert steps == sorted(set(steps)), steps  # every child completed a save or more
    SimWorld(2).run(_save, tmp_path, steps[-1] + 1, 2, 10)
    assert sorted(p.name for p in root.iterdir()) == [  # leftovers removed
        "latest", f"step-{steps[-1]:08d}", f"step-{steps[-1] + 1:08d}"]


# ------------------------------------------------------------------ elastic restarts


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("TORCHELASTIC_")}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _worker_pid(parent: int, rank: int) -> int:
    """The pid of the child of ``parent`` whose environment says RANK=``rank``."""
    for pid in _children(parent):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no worker of rank {rank} under pid {parent}")


def _kill_after_first_checkpoint(process: subprocess.Popen, run_dir: Path, rank: int) -> int:
    """SIGKILL rank ``rank``'s worker once ``run_dir`` has a checkpoint; the step it had."""
    pointer = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 60
    while not pointer.is_file():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    os.kill(_worker_pid(process.pid, rank), signal.SIGKILL)
    return int(pointer.read_text().split("-")[1])


def _final_models(run_dir: Path, world_size: int) -> list[dict[str, torch.Tensor]]:
    path = ckpt.latest_checkpoint(run_dir)
    ckpt.verify_checkpoint(path)
    shared = path / "shared.pt"
    if shared.is_file():
        return [ckpt.safe_load(shared)["model"]]
    return [ckpt.safe_load(path / f"rank-{r:05d}.pt")["model"] for r in range(world_size)]


def _assert_equal_models(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for ma, mb in zip(a, b, strict=True):
        assert ma.keys() == mb.keys()
        for key in ma:
            assert torch.equal(ma[key], mb[key]), key


_TRAIN = ["--steps", "150", "--checkpoint-every", "20", "--eval-every", "0", "--quiet",
          "--timeout", "30"]


def _reference_and_faulty(tmp_path: Path, reference: list[str], faulty: list[str],
                          rank: int) -> tuple[str, int, Path, Path]:
    """Run ``reference`` and ``faulty`` (commands to which ``--run-dir DIR`` is appended) side
    by side; SIGKILL ``faulty``'s worker of ``rank`` after its first checkpoint. Both must
    succeed. Returns ``faulty``'s output, the step it was killed at, and both run dirs."""
    env = _clean_env()
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "faulty"
    procs = [subprocess.Popen([*cmd, "--run-dir", str(d)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for cmd, d in ((reference, ref_dir), (faulty, run_dir))]
    try:
        killed_at = _kill_after_first_checkpoint(procs[1], run_dir, rank=rank)
        out, _ = procs[1].communicate(timeout=120)
        ref_out, _ = procs[0].communicate(timeout=120)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode == 0, ref_out[-3000:]
    assert procs[1].returncode == 0, out[-3000:]
    return out, killed_at, ref_dir, run_dir


@pytest.mark.slow
@pytest.mark.gloo
def test_torchrun_restart_after_kill_9_resumes_and_ends_equal(tmp_path):
    """allreduce, 2 workers under torchrun --max-restarts 1; rank 1 killed with SIGKILL."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "--monitor-interval", "0.1"]
    train = ["-m", "gossamer", "train", *_TRAIN]
    out, killed_at, ref_dir, run_dir = _reference_and_faulty(
        tmp_path, [*torchrun, *train], [*torchrun, "--max-restarts", "1", *train], rank=1)
    assert "exitcode: -9" in out  # the kill was seen...
    assert "restart 1 of the worker group: resuming from step-" in out  # ...and recovered
    assert 20 <= killed_at < 150
    _assert_equal_models(_final_models(ref_dir, 2), _final_models(run_dir, 2))
    # the metrics went on where the checkpoint was: one summary, nothing counted twice
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records].count("summary") == 1


@pytest.mark.slow
@pytest.mark.gloo
def test_gossamer_launch_restart_after_kill_9_resumes_local_sgd_equal(tmp_path):
    """local SGD, 2 workers under gossamer launch --max-restarts 1; rank 0 (which hosts the
    rendezvous store) killed with SIGKILL."""
    train = [*_TRAIN, "--algorithm", "localsgd", "--option", "period=4"]
    launch = [sys.executable, "-m", "gossamer", "launch", "--nproc", "2"]
    out, _, ref_dir, run_dir = _reference_and_faulty(
        tmp_path, [*launch, "--", *train], [*launch, "--max-restarts", "1", "--", *train],
        rank=0)
    assert "rank 0 was killed by SIGKILL" in out
    assert "restarting every worker (restart 1 of 1)" in out
    assert "restart 1 of the worker group: resuming from step-" in out
    _assert_equal_models(_final_models(ref_dir, 2), _final_models(run_dir, 2))


# ------------------------------------------------------------------ agreement at start


def test_flatten_names_nested_fields():
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": {}}) == {"a.b": 1, "a.c.d": 2, "e": {}}


def test_agreement_names_the_rank_and_field_that_differ_on_every_rank():
    def worker(comm):
        description = {"world_size": 4, "algorithm": {"name": "localsgd",
                                                      "options": {"period": 4}}}
        if comm.rank == 2:
            description["algorithm"]["options"]["period"] = 8
        try:
            check_agreement(comm, description)
        except ValueError as exc:
            return str(exc)
        return None

    errors = SimWorld(4).run(worker)
    for rank, error in enumerate(errors):
        assert error is not None, rank
        assert "rank 2 differs in algorithm.options.period" in error
        assert "from rank 0, whose settings 3 of 4 workers share" in error
        assert f"Here, on rank {rank}: algorithm.options.period=" in error
    assert "period=8" in errors[2] and "period=4" in errors[0]
    assert SimWorld(3).run(lambda comm: check_agreement(comm, {"a": 1})) == [None] * 3


def test_training_workers_with_other_options_all_stop_at_the_start():
    dataset = load_dataset("digits", seed=0)
    base = TrainConfig(sim=3, steps=5, eval_every=0, quiet=True, algorithm="localsgd")

    def worker(comm):
        # rank 1 was given period=8 (resolved: "8" from a command line is the int 8)
        config = base.replace(options={"period": "8"}) if comm.rank == 1 else base
        try:
            train_worker(comm, config, dataset)
        except ValueError as exc:
            return str(exc)
        return None

    errors = SimWorld(3).run(worker)
    for error in errors:
        assert error is not None and "rank 1 differs in algorithm.options.period" in error
    same = SimWorld(2).run(lambda comm: train_worker(comm, base.replace(
        options={"period": "4"} if comm.rank else {}), dataset)["algorithm"])
    assert same == ["localsgd"] * 2  # "4" and the default 4 are the same setting


def test_run_description_covers_algorithm_topology_and_world_size():
    d = describe_run(TrainConfig(algorithm="sgp"), 8)
    assert d["world_size"] == 8
    assert d["algorithm"]["name"] == "sgp" and d["algorithm"]["options"]["topology"] == \
        "exponential"
    assert d["topology"]["name"] == "exponential" and d["topology"]["world_size"] == 8
    assert "run_dir" not in d["training"] and d["training"]["steps"] == 300
    from gossamer.topology import ring

    custom = describe_run(TrainConfig(algorithm="dpsgd", options={"topology": ring(4)}), 4)
    assert len(custom["topology"]["matrices"]) == 16  # a Topology object by its matrices


def _gloo_mismatch(period: int) -> str | None:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    config = TrainConfig(sim=0, steps=5, eval_every=0, quiet=True, timeout=30,
                         algorithm="localsgd", options={"period": period + rank})
    try:
        run_training(config)
    except ValueError as exc:
        return str(exc)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return None


@pytest.mark.slow
@pytest.mark.gloo
def test_gloo_workers_with_other_options_all_stop_naming_the_rank():
    from gossamer.testing import spawn_gloo

    errors = spawn_gloo(_gloo_mismatch, 2, args=(4,), timeout=120)
    for rank, error in enumerate(errors):
        assert error is not None, rank
        assert "rank 1 differs in algorithm.options.period" in error
        assert f"Here, on rank {rank}: algorithm.options.period={4 + rank}" in error


def test_launch_rejects_a_negative_max_restarts(capsys):
    from gossamer.cli import main

    assert main(["launch", "--nproc", "2", "--max-restarts", "-1", "--", "--steps", "5"]) == 2
    assert "--max-restarts must be an integer >= 0" in capsys.readouterr().err
