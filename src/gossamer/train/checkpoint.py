"""Checkpoints that survive a crash at any moment, verified when they are read.

Layout under ``RUN_DIR/checkpoints``::

    step-00000100/rank-00000.pt ...   one shard per worker (what differs between workers)
    step-00000100/shared.pt           what every worker holds alike (written by rank 0 once)
    step-00000100/meta.json           step, world size, the sha256 of every file
    latest                            the name of the newest complete checkpoint

Atomic: every file is written under a temporary name, fsynced and renamed; the directory is
renamed from ``step-….tmp`` only when every shard is in it, and ``latest`` moves last. So a
crash during a save leaves ``latest`` on the previous complete checkpoint. The next save
removes what a crashed one left (``step-….tmp`` directories, and ``step-….old`` ones of a
crashed pruning).

Verified: ``meta.json`` records the sha256 of every file, and loading checks the files it
reads: a mismatch is a ValueError naming the file. Loading uses
``torch.load(weights_only=True)``: a checkpoint that holds anything but tensors and plain data
(a pickled callable, say) is refused.

Agreed: saving and resuming are collective, and the workers compare the step they save or
load (an all-gather of a few int64 per worker: tensors only, nothing pickled). A worker at
another step stops every worker with a ValueError naming its rank. :func:`resume_checkpoint`
falls back to the previous complete checkpoint, with a warning, when the newest one does not
verify on every worker (a shard damaged on disk); it refuses when none does.

Example::

    save_checkpoint(comm, "runs/a", step=100, shard={"sampler": ...}, shared={"model": ...})
    step, shard, shared = resume_checkpoint(comm, "runs/a")  # 100, on every worker
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from gossamer.comm.base import Communicator

__all__ = [
    "DamagedCheckpoint",
    "atomic_torch_save",
    "atomic_write_bytes",
    "checkpoint_candidates",
    "checkpoint_step",
    "latest_checkpoint",
    "load_checkpoint",
    "resume_checkpoint",
    "safe_load",
    "save_checkpoint",
    "verify_checkpoint",
]

# Shared with gossamer.train.dcp, which lays out a run directory's DCP checkpoints alike: the
# directories' names, and the steps of a save and a resume (fsync_dir, remove_checkpoint,
# prune_checkpoints, check_same_step, the FOUND_* statuses).
STEP_DIR = re.compile(r"step-(\d+)")  # a checkpoint's directory: step-<step>
LEFTOVER = re.compile(r"step-\d+\.(tmp|old)")  # a crashed save's or a crashed pruning's
_DIGEST_WORDS = 4  # a sha256 digest as int64 words, for the all-gather


class DamagedCheckpoint(ValueError):
    """A file of a checkpoint is missing, unreadable, or not what its meta.json records."""


def fsync_dir(path: Path) -> None:
    """Make the entries of the directory ``path`` durable: a file created, renamed or removed
    in it survives a crash once this returns."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    """The sha256 of the file at ``path``, in hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_torch_save(obj: Any, path: Path) -> str:
    """``torch.save`` to ``path`` atomically (temporary name, fsync, rename); the sha256 of
    what was written, read back from the file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    digest = file_sha256(tmp)
    os.replace(tmp, path)
    return digest


def _encode(step: int, digest: str) -> torch.Tensor:
    words = torch.frombuffer(bytearray.fromhex(digest), dtype=torch.int64)
    return torch.cat([torch.tensor([step], dtype=torch.int64), words])


def _decode(words: torch.Tensor) -> str:
    return words.numpy().tobytes().hex()


def check_same_step(action: str, steps: list[int], shown: dict[int, str] | None = None) -> None:
    """Every worker must ``action`` the same step; else a ValueError naming those that differ
    from rank 0 (the same message on every worker)."""
    if all(s == steps[0] for s in steps):
        return
    shown = shown or {}
    name = lambda s: shown.get(s, f"step {s}")  # noqa: E731
    odd = ", ".join(f"rank {r} {name(s)}" for r, s in enumerate(steps) if s != steps[0])
    raise ValueError(f"the workers do not {action} the same checkpoint: rank 0 {name(steps[0])}, "
                     f"{odd}; every worker must {action} the same step")


def save_checkpoint(
    comm: Communicator, run_dir: str | Path, step: int, shard: dict[str, Any],
    shared: dict[str, Any] | None = None, keep: int = 0,
) -> Path:
    """Save this worker's ``shard`` (and rank 0's ``shared``) as the checkpoint of ``step``;
    keep the newest ``keep`` checkpoints (0: all).

    Collective: every worker calls it with the same ``step`` (checked: a ValueError names the
    ranks at another step). Checkpoints of later steps, left by a run that was resumed from
    an earlier one, are removed. Returns the checkpoint's directory.
    """
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step:08d}"
    tmp = root / f"step-{step:08d}.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    name = f"rank-{comm.rank:05d}.pt"
    digest = atomic_torch_save(shard, tmp / name)
    shared_digest = None
    if comm.rank == 0 and shared is not None:
        shared_digest = atomic_torch_save(shared, tmp / "shared.pt")
    # Each worker sends its step and its shard's digest once the shard is on disk: when the
    # gather returns, every shard is.
    gathered = comm.all_gather(_encode(step, digest))
    check_same_step("save", [int(t[0]) for t in gathered])
    if comm.rank == 0:
        files = {f"rank-{r:05d}.pt": _decode(t[1:]) for r, t in enumerate(gathered)}
        if shared_digest is not None:
            files["shared.pt"] = shared_digest
        _remove_leftovers(root, tmp, files)
        meta = {"step": step, "world_size": comm.world_size, "shared": shared is not None,
                "files": files}
        atomic_write_bytes(tmp / "meta.json", json.dumps(meta, indent=1).encode())
        fsync_dir(tmp)
        if final.exists():  # a re-run of the same step replaces it
            remove_checkpoint(final)
        os.replace(tmp, final)
        fsync_dir(root)
        atomic_write_bytes(root / "latest", final.name.encode())
        # only after `latest` moved: an older one is never the only complete one
        prune_checkpoints(root, step, keep)
    comm.barrier()  # nobody goes on (and maybe crashes) before `latest` moved
    return final


def remove_checkpoint(path: Path) -> None:
    """Remove a checkpoint directory: renamed first, so that a crash half-way never leaves a
    half-deleted directory that looks complete."""
    trash = path.with_name(path.name + ".old")
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _remove_leftovers(root: Path, current: Path, files: dict[str, str]) -> None:
    """What crashed saves left: other ``step-….tmp`` (and ``.old``) directories, and in
    ``current`` any file that is not one of ``files`` (a half-written ``*.tmp``)."""
    for path in root.iterdir():
        if path != current and LEFTOVER.fullmatch(path.name):
            shutil.rmtree(path, ignore_errors=True)
    for path in current.iterdir():
        if path.name not in files:
            path.unlink(missing_ok=True)


def _complete(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of the complete checkpoints under ``root``, oldest first."""
    found = []
    if root.is_dir():
        for path in root.iterdir():
            match = STEP_DIR.fullmatch(path.name)
            if match and (path / "meta.json").is_file():
                found.append((int(match.group(1)), path))
    return sorted(found)


def prune_checkpoints(root: Path, step: int, keep: int) -> None:
    """Remove the complete checkpoints under ``root`` later than ``step`` (saved on a trajectory
    that resuming earlier abandoned) and, with ``keep`` > 0, all but the newest ``keep`` of
    the others."""
    complete = _complete(root)
    # later than this one: from a trajectory that was abandoned by resuming earlier
    stale = [p for s, p in complete if s > step]
    older = [p for s, p in complete if s <= step]
    for path in stale + (older[:-keep] if keep else []):
        remove_checkpoint(path)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of ``run_dir``, or None when there is none."""
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    if not (path / "meta.json").is_file():
        raise ValueError(f"checkpoint pointer {pointer} names {path.name}, which is incomplete")
    return path


def checkpoint_candidates(run_dir: str | Path) -> list[Path]:
    """The checkpoints a resumed run may start from, best first: the one ``latest`` names
    (even if it is damaged), then the older complete ones, newest first. Empty without a
    ``latest`` pointer (a run that started over in ``run_dir`` removed it)."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    if not pointer.is_file():
        return []
    name = pointer.read_text().strip()
    match = STEP_DIR.fullmatch(name)
    if match is None:
        raise ValueError(f"checkpoint pointer {pointer} holds {name!r}, not a checkpoint name")
    newest = int(match.group(1))
    return [root / name] + [p for s, p in reversed(_complete(root)) if s < newest]


def checkpoint_step(path: str | Path) -> int:
    """The step of the checkpoint directory ``path`` (``step-00000100``), from its name."""
    match = STEP_DIR.fullmatch(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint directory (step-NNNNNNNN)")
    return int(match.group(1))


def read_meta(path: Path) -> dict[str, Any]:
    """The ``meta.json`` of the checkpoint at ``path``; ValueError when it is missing or
    unreadable."""
    meta_path = Path(path) / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise DamagedCheckpoint(f"checkpoint {path} is incomplete: it has no meta.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DamagedCheckpoint(f"checkpoint file {meta_path} is unreadable ({exc})") from None
    if not isinstance(meta, dict) or not {"step", "world_size", "shared"} <= set(meta):
        raise DamagedCheckpoint(f"checkpoint file {meta_path} lacks step, world_size or shared")
    return meta


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check the sha256 of every file of the checkpoint at ``path`` against its meta.json;
    ValueError naming the first file that is missing or differs. Returns the meta data.

    Checkpoints written before checksums were recorded have nothing to verify.
    """
    path = Path(path)
    meta = read_meta(path)
    for name, expected in meta.get("files", {}).items():
        _check_digest(path / name, _read(path / name), expected)
    return meta


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise DamagedCheckpoint(f"checkpoint file {path} is missing") from None


def _check_digest(path: Path, data: bytes, expected: str | None) -> None:
    if expected is None:
        return
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise DamagedCheckpoint(f"checkpoint file {path} is damaged: its sha256 is {actual[:16]}…, "
                         f"meta.json records {expected[:16]}…")


def safe_load(path: Path, sha256: str | None = None) -> Any:
    """``torch.load`` of tensors and plain data only; anything else is refused with a
    ValueError naming the file. A file that is missing, or whose sha256 is not ``sha256``
    (when given), raises :class:`DamagedCheckpoint` (a ValueError)."""
    path = Path(path)
    data = _read(path)
    _check_digest(path, data, sha256)
    return safe_loads(data, f"checkpoint file {path}")


def safe_loads(data: bytes, what: str) -> Any:
    """``torch.load`` of ``data`` (bytes) with tensors and plain data only; anything else is
    refused with a ValueError naming ``what``. The one place that unpickles a checkpoint."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError and friends: refuse, say why
        raise ValueError(
            f"{what} was refused: it holds something other than tensors and "
            f"plain data ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        ) from exc


def load_checkpoint(
    run_dir: str | Path, rank: int, world_size: int, path: str | Path | None = None,
) -> tuple[int, dict[str, Any], dict[str, Any] | None]:
    """(step, this worker's shard, the shared part) of ``run_dir``'s latest checkpoint (or of
    the checkpoint at ``path``), each file verified against its recorded sha256."""
    if path is None:
        path = latest_checkpoint(run_dir)
        if path is None:
            raise ValueError(f"run_dir {str(run_dir)!r} has no checkpoint to resume from")
    path = Path(path)
    meta = read_meta(path)
    if meta["world_size"] != world_size:
        raise ValueError(
            f"checkpoint {path} was written by {meta['world_size']} workers; this run has "
            f"{world_size}"
        )
    if meta.get("format", "gossamer") != "gossamer":  # see gossamer.train.dcp
        raise ValueError(f"checkpoint {path} is in the {meta['format']!r} format; resume it "
                         f"with checkpoint_format {meta['format']!r}")
    files = meta.get("files", {})
    name = f"rank-{rank:05d}.pt"
    shard = safe_load(path / name, files.get(name))
    shared = safe_load(path / "shared.pt", files.get("shared.pt")) if meta["shared"] else None
    return int(meta["step"]), shard, shared


#: what a worker found when it loaded a candidate, all-gathered to agree on it: the checkpoint,
#: a damaged one (every worker falls back to the previous), one that does not fit (refused)
FOUND_OK, FOUND_DAMAGED, FOUND_FATAL = 0, 1, 2


def resume_checkpoint(
    comm: Communicator, run_dir: str | Path
) -> tuple[int, dict[str, Any], dict[str, Any] | None]:
    """Collective: (step, this worker's shard, the shared part) of the newest checkpoint of
    ``run_dir`` that every worker loads and verifies.

    The workers go through :func:`checkpoint_candidates` together and agree on each: they
    must see the same step (else a ValueError naming the ranks that differ). When a file of
    the candidate is missing or damaged on some worker, every worker warns and falls back to
    the previous complete checkpoint; when none is left, or a checkpoint does not fit this
    run (another world size), every worker raises a ValueError.
    """
    candidates = checkpoint_candidates(run_dir)
    problems: list[str] = []
    for index in range(len(candidates) + 1):
        path = candidates[index] if index < len(candidates) else None
        step, status, error, loaded = -1, FOUND_OK, "", None
        if path is not None:
            step = int(STEP_DIR.fullmatch(path.name).group(1))  # type: ignore[union-attr]
            try:
                loaded = load_checkpoint(run_dir, comm.rank, comm.world_size, path)
                if loaded[0] != step:
                    raise DamagedCheckpoint(f"checkpoint {path} holds step {loaded[0]}")
            except DamagedCheckpoint as exc:
                status, error = FOUND_DAMAGED, str(exc)
            except ValueError as exc:  # another world size, refused content: no fallback
                status, error = FOUND_FATAL, str(exc)
        gathered = comm.all_gather(torch.tensor([step, status], dtype=torch.int64))
        steps = [int(t[0]) for t in gathered]
        statuses = [int(t[1]) for t in gathered]
        check_same_step("resume from", steps, {-1: "sees no checkpoint"})
        if step < 0:
            detail = "; ".join(problems) or f"run_dir {str(run_dir)!r} has none"
            raise ValueError(f"no checkpoint of run_dir {str(run_dir)!r} verifies on every "
                             f"worker ({detail})")
        if FOUND_FATAL in statuses:
            raise ValueError(error or f"checkpoint {path} does not fit this run (see rank "
                             f"{statuses.index(FOUND_FATAL)}'s error)")
        if FOUND_DAMAGED not in statuses:
            assert loaded is not None
            return loaded
        bad = [r for r, s in enumerate(statuses) if s == FOUND_DAMAGED]
        problem = f"{path.name} fails on rank(s) {bad}" + (f" ({error})" if error else "")
        problems.append(problem)
        if comm.rank == 0 or error:  # rank 0 for the record, and whoever knows the detail
            warnings.warn(f"checkpoint {problem}; falling back to the previous complete "
                          "checkpoint", stacklevel=2)
    raise AssertionError("unreachable: the last round has no candidate")
