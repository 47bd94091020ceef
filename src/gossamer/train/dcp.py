"""Checkpoints through ``torch.distributed.checkpoint`` (DCP), beside gossamer's own format.

A DCP checkpoint holds, under these keys:

- ``model.<name>``: the averaged model, the exact mean over workers of every floating-point
  parameter and buffer (other buffers are rank 0's). Saved once. A plain ``nn.Module`` loads
  it in one process, with no process group (:func:`load_averaged_model`).
- ``workers.<rank>.…``: each worker's own state, under its own rank: its model, its optimizer
  (with the algorithm's state under ``"algorithm"``) and ``extra`` (sampler, RNG, ...).
- ``step`` and ``world_size``.

Why per-rank keys: DCP keys state by name and saves a name that several ranks hold once (it
assumes replicated state is identical), but gossip methods leave every replica different, and
the algorithm's state (push-sum weights, messages in flight) is always a worker's own. Keys of
their own keep all of it in one checkpoint with one metadata file, instead of a file per rank
beside it. Only tensors are stored: the shape of a worker's state (nested dicts, lists, numbers)
is a uint8 tensor ``workers.<rank>.structure`` that is read back with
``torch.load(weights_only=True)``, because DCP itself unpickles non-tensor values with
``weights_only=False``, and so that loading needs no template of the state (a fresh optimizer
has no momentum yet).

A model sharded with FSDP2 (``gossamer train --shards S``, :mod:`gossamer.sharding`): each
rank's ``workers.<rank>.…`` hold its local shards of the model's and the optimizer's DTensors
(their global shapes in the structure, from which loading makes them DTensors again over the
model's mesh), so every rank keeps its own shard of its own replica; ``model.<name>`` is the
whole averaged model, gathered from the shards. The communicator is then every rank's.

Example::

    save_dcp("ckpt/step-100", model, optimizer, comm, step=100)     # collective
    step, extra = load_dcp("ckpt/step-100", model, optimizer, comm)  # collective, same size
    load_averaged_model("ckpt/step-100", plain_model)                # one process

:func:`save_dcp_checkpoint` and :func:`resume_dcp_checkpoint` do the same in a run
directory's ``checkpoints/`` as :mod:`gossamer.train.checkpoint` lays it out (``step-…``
directories, ``latest``, sha256 of every file in ``meta.json``, pruning, falling back past a
damaged checkpoint).
"""

from __future__ import annotations

import importlib
import io
import json
import os
import shutil
import warnings
from collections.abc import Hashable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from gossamer.comm.base import Communicator, ProcessGroupBacked
from gossamer.sharding import is_dtensor
from gossamer.train import checkpoint as ckpt

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["load_averaged_model", "load_dcp", "resume_dcp_checkpoint", "save_dcp",
           "save_dcp_checkpoint"]

FORMAT = "dcp"  # meta.json's "format" of a DCP checkpoint in a run directory


def _dcp() -> Any:
    """``torch.distributed.checkpoint``, imported when a DCP checkpoint is saved or loaded:
    importing it takes half a second, which every worker of a run without one would pay."""
    return importlib.import_module("torch.distributed.checkpoint")


def _process_group(comm: Communicator) -> dist.ProcessGroup:
    if not isinstance(comm, ProcessGroupBacked) or not dist.is_initialized():
        raise ValueError(f"comm: DCP checkpoints need workers on torch.distributed (torchrun, "
                         f"SLURM, mpirun); {type(comm).__name__} has no process group")
    return comm.process_group


# -- a worker's state as named tensors and a structure ------------------------------------

def _split(obj: Any, path: tuple[Hashable, ...], tensors: dict[str, torch.Tensor],
           where: list[tuple[tuple[Hashable, ...], str]],
           sharded: dict[str, tuple[list[int], list[int]]] | None = None) -> Any:
    """``obj`` without its tensors (None in their place); each tensor goes into ``tensors``
    under a name made of its path, and (path, name) into ``where``. A DTensor (a parameter of
    a model sharded with FSDP2, its optimizer state) goes in as this rank's local shard, its
    global shape and stride into ``sharded`` under its name (:func:`_rewrap` makes it a
    DTensor again)."""
    if isinstance(obj, torch.Tensor):
        name = ".".join(map(str, path))
        while name in tensors:  # two paths that read alike (key 0 and key "0")
            name += "_"
        if is_dtensor(obj):
            if sharded is None:
                raise ValueError(f"state {name!r} is a DTensor: save it with its model's "
                                 "shards (save_dcp)")
            sharded[name] = (list(obj.shape), list(obj.stride()))
            obj = obj.to_local()
        tensors[name] = obj.detach()
        where.append((path, name))
        return None
    if isinstance(obj, dict):
        return {k: _split(v, (*path, k), tensors, where, sharded) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split(v, (*path, i), tensors, where, sharded)
                         for i, v in enumerate(obj))
    return obj


def _rewrap(local: torch.Tensor, shape: list[int], stride: list[int],
            model: nn.Module) -> torch.Tensor:
    """The DTensor whose local shard on this rank is ``local``, sharded as ``model``'s
    parameters are (one mesh, dimension 0: :class:`gossamer.sharding.LocalShards` holds every
    sharded model to that)."""
    from torch.distributed.tensor import DTensor

    like = next(p for p in model.parameters() if is_dtensor(p))
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=torch.Size(shape), stride=tuple(stride))


def _join(obj: Any, path: tuple[Hashable, ...], found: dict[tuple[Hashable, ...], Any]) -> Any:
    if path in found:
        return found[path]
    if isinstance(obj, dict):
        return {k: _join(v, (*path, k), found) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_join(v, (*path, i), found) for i, v in enumerate(obj))
    return obj


def _encode(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


@torch.no_grad()
def _averaged(comm: Communicator, model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the model's state dict with every floating-point entry the exact mean over
    workers (summed in float64, as evaluation does) and the others rank 0's."""
    # a sharded model's whole tensors: an all-gather over each replica's ranks; the mean over
    # every rank is then the mean over the replicas (each counted once per shard)
    state = {n: t.full_tensor() if is_dtensor(t) else t for n, t in model.state_dict().items()}
    floats = [n for n, t in state.items() if torch.is_floating_point(t)]
    others = [n for n, t in state.items() if not torch.is_floating_point(t)]
    out = {}
    if floats:
        flat = torch.cat([state[n].detach().double().reshape(-1).cpu() for n in floats])
        comm.all_reduce(flat, op="mean")
        for n, part in zip(floats, torch.split(flat, [state[n].numel() for n in floats]),
                           strict=True):
            out[n] = part.view(state[n].shape).to(state[n].dtype)
    for n in others:
        out[n] = comm.broadcast(state[n].detach().clone().cpu(), src=0)
    return {n: out[n] for n in state}  # in the model's order


def save_dcp(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
             comm: Communicator, step: int, extra: dict[str, Any] | None = None) -> Path:
    """Collective: save the averaged model and every worker's own model, optimizer (with the
    algorithm's state) and ``extra`` as the DCP checkpoint at ``path`` (a directory).

    It is written under ``<path>.tmp`` and renamed when every worker's part is on disk, so
    ``path`` is either the earlier checkpoint or the whole new one. Returns ``path``.
    """
    group = _process_group(comm)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if comm.rank == 0 and tmp.exists():  # a crashed save's
        shutil.rmtree(tmp)
    comm.barrier()
    # taken once: taking the algorithm's state may settle messages in flight (WAGMA)
    own = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
           "extra": extra or {}}
    tensors: dict[str, torch.Tensor] = {}
    where: list[tuple[tuple[Hashable, ...], str]] = []
    sharded: dict[str, tuple[list[int], list[int]]] = {}
    structure = _split(own, (), tensors, where, sharded)
    tensors["structure"] = _encode({"structure": structure, "where": where,
                                    "sharded": sharded})
    state = {
        "model": _averaged(comm, model),
        "step": torch.tensor(step, dtype=torch.int64),
        "world_size": torch.tensor(comm.world_size, dtype=torch.int64),
        "workers": {str(comm.rank): tensors},
    }
    steps = comm.all_gather(torch.tensor([step], dtype=torch.int64))
    ckpt.check_same_step("save", [int(t[0]) for t in steps])
    _dcp().save(state, checkpoint_id=tmp, process_group=group)  # returns once .metadata is written
    if comm.rank == 0:
        if path.exists():
            ckpt.remove_checkpoint(path)
        os.replace(tmp, path)
        ckpt.fsync_dir(path.parent)
    comm.barrier()
    return path


def _metadata(path: Path) -> dict[str, TensorStorageMetadata]:
    if not (path / ".metadata").is_file():
        raise ckpt.DamagedCheckpoint(f"checkpoint {path} is not a DCP checkpoint: it has no "
                                     ".metadata")
    dcp = _dcp()
    entries = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {k: m for k, m in entries.items()
            if isinstance(m, dcp.metadata.TensorStorageMetadata)}


def _empty(meta: TensorStorageMetadata) -> torch.Tensor:
    return torch.empty(meta.size, dtype=meta.properties.dtype)


def load_dcp(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
             comm: Communicator) -> tuple[int, dict[str, Any]]:
    """Collective: load this worker's own model, optimizer and algorithm state from the DCP
    checkpoint at ``path``; returns (step, this worker's ``extra``).

    The number of workers must be the one that saved (a ValueError says both).
    """
    group = _process_group(comm)
    path = Path(path)
    tensors = _metadata(path)
    saved = sum(1 for k in tensors if k.startswith("workers.") and k.endswith(".structure"))
    if saved != comm.world_size:
        raise ValueError(f"checkpoint {path} was written by {saved} workers; this run has "
                         f"{comm.world_size}")
    prefix = f"workers.{comm.rank}."
    state = {k: _empty(m) for k, m in tensors.items() if k.startswith(prefix) or k == "step"}
    _dcp().load(state, checkpoint_id=path, process_group=group)
    encoded = state.pop(prefix + "structure")
    saved_state = ckpt.safe_loads(encoded.numpy().tobytes(),
                                  f"checkpoint {path}: rank {comm.rank}'s state")
    sharded = saved_state.get("sharded", {})
    found = {tuple(p): _rewrap(state[prefix + name], *sharded[name], model) if name in sharded
             else state[prefix + name] for p, name in saved_state["where"]}
    own = _join(saved_state["structure"], (), found)
    model.load_state_dict(own["model"])
    optimizer.load_state_dict(own["optimizer"])
    return int(state["step"]), own["extra"]


def load_averaged_model(path: str | Path, model: nn.Module) -> int:
    """Load the averaged model of the DCP checkpoint at ``path`` into ``model`` (any module of
    the same architecture), in one process with no process group; returns its step."""
    state = {"model": model.state_dict(), "step": torch.tensor(0, dtype=torch.int64)}
    with warnings.catch_warnings():  # DCP's note that it loads in one process: we asked it to
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _dcp().load(state, checkpoint_id=Path(path), no_dist=True)
    model.load_state_dict(state["model"])
    return int(state["step"])


# -- in a run directory, as gossamer's own checkpoints --------------------------------------

def save_dcp_checkpoint(comm: Communicator, run_dir: str | Path, step: int, model: nn.Module,
                        optimizer: torch.optim.Optimizer, extra: dict[str, Any] | None = None,
                        keep: int = 0) -> Path:
    """Collective: :func:`save_dcp` as ``run_dir/checkpoints/step-<step>`` with a
    ``meta.json`` (the sha256 of every file), then move ``latest`` and keep the newest ``keep``
    checkpoints (0: all), as :func:`~gossamer.train.checkpoint.save_checkpoint` does."""
    root = Path(run_dir) / "checkpoints"
    tmp = root / f"step-{step:08d}.tmp"
    final = root / f"step-{step:08d}"
    if comm.rank == 0 and tmp.exists():  # a crashed save of this step's
        shutil.rmtree(tmp)
    root.mkdir(parents=True, exist_ok=True)
    save_dcp(tmp / "dcp", model, optimizer, comm, step, extra)
    if comm.rank == 0:
        files = {f"dcp/{p.name}": ckpt.file_sha256(p) for p in sorted((tmp / "dcp").iterdir())}
        for path in root.iterdir():  # what crashed saves left
            if path != tmp and ckpt.LEFTOVER.fullmatch(path.name):
                shutil.rmtree(path, ignore_errors=True)
        meta = {"step": step, "world_size": comm.world_size, "shared": False,
                "format": FORMAT, "files": files}
        ckpt.atomic_write_bytes(tmp / "meta.json", json.dumps(meta, indent=1).encode())
        ckpt.fsync_dir(tmp)
        if final.exists():
            ckpt.remove_checkpoint(final)
        os.replace(tmp, final)
        ckpt.fsync_dir(root)
        ckpt.atomic_write_bytes(root / "latest", final.name.encode())
        ckpt.prune_checkpoints(root, step, keep)
    comm.barrier()
    return final


def resume_dcp_checkpoint(comm: Communicator, run_dir: str | Path, model: nn.Module,
                          optimizer: torch.optim.Optimizer) -> tuple[int, dict[str, Any]]:
    """Collective: load the newest DCP checkpoint of ``run_dir`` that verifies on every worker
    (sha256 of its files); returns (step, this worker's ``extra``).

    A damaged checkpoint is passed over with a warning, as
    :func:`~gossamer.train.checkpoint.resume_checkpoint` does; one of gossamer's own format,
    or of another world size, is refused with a ValueError.
    """
    _process_group(comm)
    problems: list[str] = []
    for path in [*ckpt.checkpoint_candidates(run_dir), None]:
        step, status, error = -1, ckpt.FOUND_OK, ""
        if path is not None:
            step = int(ckpt.STEP_DIR.fullmatch(path.name).group(1))  # type: ignore[union-attr]
            try:
                meta = ckpt.verify_checkpoint(path)
                if meta.get("format", "gossamer") != FORMAT:
                    raise ValueError(f"checkpoint {path} is in gossamer's own format, not DCP; "
                                     "resume it with checkpoint_format 'gossamer'")
                if meta["world_size"] != comm.world_size:
                    raise ValueError(f"checkpoint {path} was written by {meta['world_size']} "
                                     f"workers; this run has {comm.world_size}")
            except ckpt.DamagedCheckpoint as exc:
                status, error = ckpt.FOUND_DAMAGED, str(exc)
            except ValueError as exc:
                status, error = ckpt.FOUND_FATAL, str(exc)
        gathered = comm.all_gather(torch.tensor([step, status], dtype=torch.int64))
        ckpt.check_same_step("resume from", [int(t[0]) for t in gathered],
                              {-1: "sees no checkpoint"})
        statuses = [int(t[1]) for t in gathered]
        if path is None:
            detail = "; ".join(problems) or f"run_dir {str(run_dir)!r} has none"
            raise ValueError(f"no DCP checkpoint of run_dir {str(run_dir)!r} verifies on every "
                             f"worker ({detail})")
        if ckpt.FOUND_FATAL in statuses:
            raise ValueError(error or f"checkpoint {path} does not fit this run (see rank "
                             f"{statuses.index(ckpt.FOUND_FATAL)}'s error)")
        if ckpt.FOUND_DAMAGED not in statuses:
            loaded_step, extra = load_dcp(path / "dcp", model, optimizer, comm)
            return loaded_step, extra
        bad = [r for r, s in enumerate(statuses) if s == ckpt.FOUND_DAMAGED]
        problems.append(f"{path.name} fails on rank(s) {bad}" + (f" ({error})" if error else ""))
        if comm.rank == 0 or error:
            warnings.warn(f"checkpoint {problems[-1]}; falling back to the previous complete "
                          "checkpoint", stacklevel=2)
    raise AssertionError("unreachable: the last round has no candidate")
