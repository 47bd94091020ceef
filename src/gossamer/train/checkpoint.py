"""Checkpoints that survive a crash at any moment.

Layout under ``RUN_DIR/checkpoints``::

    step-00000100/rank-00000.pt ...   one shard per worker (what differs between workers)
    step-00000100/shared.pt           what every worker holds alike (written by rank 0 once)
    step-00000100/meta.json           step, world size, files
    latest                            the name of the newest complete checkpoint

Every file is written under a temporary name, fsynced and renamed; the directory is renamed
from ``step-….tmp`` only when every shard is in it, and ``latest`` moves last. So a crash
during a save leaves ``latest`` on the previous complete checkpoint. Loading uses
``torch.load(weights_only=True)``: a checkpoint that holds anything but tensors and plain data
(a pickled callable, say) is refused.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from gossamer.comm.base import Communicator


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(
    comm: Communicator, run_dir: str | Path, step: int, shard: dict[str, Any],
    shared: dict[str, Any] | None = None, keep: int = 0,
) -> Path:
    """Save this worker's ``shard`` (and rank 0's ``shared``) as the checkpoint of ``step``;
    keep the newest ``keep`` checkpoints (0: all).

    Collective: every worker calls it. Returns the checkpoint's directory.
    """
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step:08d}"
    tmp = root / f"step-{step:08d}.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    atomic_torch_save(shard, tmp / f"rank-{comm.rank:05d}.pt")
    if comm.rank == 0 and shared is not None:
        atomic_torch_save(shared, tmp / "shared.pt")
    comm.barrier()  # every shard is on disk
    if comm.rank == 0:
        meta = {"step": step, "world_size": comm.world_size, "shared": shared is not None}
        atomic_write_bytes(tmp / "meta.json", json.dumps(meta).encode())
        _fsync_dir(tmp)
        if final.exists():  # a re-run of the same step replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        atomic_write_bytes(root / "latest", final.name.encode())
        if keep:  # only after `latest` moved: an older one is never the only complete one
            complete = sorted(p for p in root.glob("step-*") if p.suffix != ".tmp")
            for old in complete[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    comm.barrier()  # nobody goes on (and maybe crashes) before `latest` moved
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of ``run_dir``, or None when there is none."""
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    if not (path / "meta.json").is_file():
        raise ValueError(f"checkpoint pointer {pointer} names {path.name}, which is incomplete")
    return path


def safe_load(path: Path) -> Any:
    """``torch.load`` of tensors and plain data only; anything else is refused with a
    ValueError naming the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"checkpoint file {path} is missing") from None
    except Exception as exc:  # UnpicklingError and friends: refuse, say why
        raise ValueError(
            f"checkpoint file {path} was refused: it holds something other than tensors and "
            f"plain data ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        ) from exc


def load_checkpoint(
    run_dir: str | Path, rank: int, world_size: int
) -> tuple[int, dict[str, Any], dict[str, Any] | None]:
    """(step, this worker's shard, the shared part) of ``run_dir``'s latest checkpoint."""
    path = latest_checkpoint(run_dir)
    if path is None:
        raise ValueError(f"run_dir {str(run_dir)!r} has no checkpoint to resume from")
    meta = json.loads((path / "meta.json").read_text())
    if meta["world_size"] != world_size:
        raise ValueError(
            f"checkpoint {path} was written by {meta['world_size']} workers; this run has "
            f"{world_size}"
        )
    shard = safe_load(path / f"rank-{rank:05d}.pt")
    shared = safe_load(path / "shared.pt") if meta["shared"] else None
    return int(meta["step"]), shard, shared
