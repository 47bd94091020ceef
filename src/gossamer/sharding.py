"""Models that do not fit one device: R replicas x S shards.

The ranks form a 2-D layout. Inside a replica, FSDP2 (``torch.distributed.fsdp.fully_shard``)
shards the parameters, gradients and optimizer state over S ranks and does its own all-gather
and reduce-scatter. Between replicas, a gossamer method runs on each rank's local shards
(``DTensor.to_local()``) with the ranks that hold the same shard in the other replicas: the
method's communicator is the replica dimension, and the method never sees the sharding.

Rank ``r * S + s`` is shard ``s`` of replica ``r`` (the row-major order of a
``DeviceMesh`` of shape ``(R, S)``): a replica's shards are consecutive ranks, so that they
share a node, where FSDP's all-gathers and reduce-scatters are the fastest, and the replica
dimension, which a low-communication method uses, crosses the nodes. Example::

    layout = ShardLayout.from_env(shards=2)  # under torchrun with 4 processes: 2 x 2
    for block in model.blocks:
        fully_shard(block, mesh=layout.shard_mesh)
    fully_shard(model, mesh=layout.shard_mesh)
    optimizer = gossamer.distribute(model, torch.optim.AdamW(model.parameters()), "diloco",
                                    layout.comm)

:class:`LocalShards` is what :func:`gossamer.distribute` makes of a sharded model: a module of
plain parameters that share their storage with the local shards, whose gradients are the local
shards' of the gradients FSDP reduce-scattered. The method binds to it as to any model.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gossamer.checks import check_int
from gossamer.comm.base import Communicator, CommunicatorBase, ProcessGroupBacked
from gossamer.comm.torch_comm import TorchCommunicator
from gossamer.patterns.parts import mark_part

__all__ = ["LocalShards", "ShardLayout", "check_replica_comm", "is_dtensor", "is_sharded",
           "local_shards",
           "shard_model"]

#: the names of the layout's mesh dimensions
REPLICA, SHARD = "replica", "shard"


def _dtensor_type() -> type | None:
    """torch's DTensor class, or None where it was never imported: then no DTensor exists,
    and importing it (seconds: it brings in dynamo) would slow down every unsharded run."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor (without importing DTensor where nothing did)."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def is_sharded(model: nn.Module) -> bool:
    """Whether a parameter of ``model`` is a DTensor (sharded by FSDP2 or another
    ``torch.distributed.tensor`` API)."""
    return any(is_dtensor(p) for p in model.parameters())


@dataclass
class ShardLayout:
    """This rank's place in R replicas x S shards, with the mesh and communicators of both.

    Attributes:
        replicas: R, the number of replicas (the world size over ``shards``).
        shards: S, the ranks each replica's model is sharded over.
        replica: this rank's replica, ``rank // shards``.
        shard: this rank's shard, ``rank % shards``.
        mesh: the 2-D ``DeviceMesh`` of shape ``(replicas, shards)``, dimensions named
            ``"replica"`` and ``"shard"``.
        comm: the replica dimension: a :class:`~gossamer.comm.TorchCommunicator` over the
            ranks that hold this rank's shard in every replica (``shard``, ``shards +
            shard``, ...), its rank this rank's replica. Give it to
            :func:`gossamer.distribute`; its byte counters are the method's.
        world: the communicator over every rank that :meth:`from_env` made (it owns the
            default process group).
    """

    replicas: int
    shards: int
    replica: int
    shard: int
    mesh: Any  # torch.distributed.device_mesh.DeviceMesh
    comm: TorchCommunicator
    world: TorchCommunicator

    @property
    def shard_mesh(self) -> Any:
        """The 1-D mesh of this replica's ranks: ``fully_shard(module, mesh=...)`` takes it."""
        return self.mesh[SHARD]

    @classmethod
    def from_env(cls, shards: int, *, backend: str | None = None,
                 timeout: float | None = None, bind_all: bool = False) -> ShardLayout:
        """Initialise torch.distributed from the launcher's environment
        (:meth:`TorchCommunicator.from_env`, with its ``backend``, ``timeout`` and
        ``bind_all``) and lay the
        world's ranks out as ``world_size // shards`` replicas of ``shards`` ranks each.

        ``shards`` must divide the world size (ValueError naming it otherwise). A collective
        over every rank: each must call it with the same ``shards``."""
        check_int("shards", shards, 1)
        world = TorchCommunicator.from_env(backend=backend, timeout=timeout, bind_all=bind_all)
        try:
            if world.world_size % shards:
                raise ValueError(f"shards={shards} must divide the world size, "
                                 f"{world.world_size} ranks")
            from torch.distributed.device_mesh import init_device_mesh

            replicas = world.world_size // shards
            device = "cuda" if world.backend == "nccl" else "cpu"
            mesh = init_device_mesh(device, (replicas, shards), mesh_dim_names=(REPLICA, SHARD))
            comm = TorchCommunicator(mesh.get_group(REPLICA), timeout=world.timeout,
                                     store=world.store)
        except BaseException:
            world.close()
            raise
        rank = world.rank
        return cls(replicas=replicas, shards=shards, replica=rank // shards,
                   shard=rank % shards, mesh=mesh, comm=comm, world=world)

    def close(self) -> None:
        """Close the replica communicator, then the world's (which destroys the process
        groups that :meth:`from_env` made)."""
        self.comm.close()
        self.world.close()

    def __enter__(self) -> ShardLayout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ShardLayout(replica {self.replica} of {self.replicas}, shard {self.shard} of "
                f"{self.shards})")


def shard_model(model: nn.Module, mesh: Any) -> nn.Module:
    """Shard ``model`` in place with FSDP2 over ``mesh`` (``layout.shard_mesh``), as
    ``gossamer train --shards`` does: an FSDP unit for each block of ``model.blocks`` where it
    has them (a transformer's), otherwise for each top-level child that holds parameters,
    then the root for the rest. Returns ``model``."""
    from torch.distributed.fsdp import fully_shard

    blocks = getattr(model, "blocks", None)
    units = (list(blocks.children()) if isinstance(blocks, nn.Module)
             else list(model.children()))
    for unit in units:
        if any(True for _ in unit.parameters()):
            fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local part of a DTensor (a view of its storage: writes reach it), or ``t``."""
    return t.to_local() if is_dtensor(t) else t


class LocalShards:
    """The local shards of a model sharded with FSDP2, as a module of plain tensors.

    :attr:`view` mirrors the model's modules, parameters and buffers under the same names;
    each of its parameters is a plain ``nn.Parameter`` that shares its storage with the local
    shard of the model's (what a method writes into it, the sharded parameter holds), and the
    buffers are the model's own (FSDP2 leaves them unsharded). A method binds to :attr:`view`
    as to any model. Its gradients are set from the sharded ones before the method's hooks
    (:meth:`pull_gradients`) and written back after them (:meth:`push_gradients`).

    Args:
        model: a model whose parameters are DTensors sharded over one 1-D mesh (every one of
            them: a plain parameter among them is a ValueError naming it, since FSDP would not
            reduce its gradient inside the replica).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        named = list(model.named_parameters())
        plain = [name for name, p in named if not is_dtensor(p)]
        if plain:
            raise ValueError(
                f"model: its parameters are sharded (DTensors) but {_names(plain)} "
                f"{'is' if len(plain) == 1 else 'are'} not: shard every parameter "
                "(fully_shard(model, mesh=layout.shard_mesh) on the root module covers those "
                "no inner fully_shard took)")
        meshes = {_mesh_ranks(p) for _, p in named}
        if len(meshes) > 1:
            raise ValueError(f"model: its parameters are sharded over different meshes "
                             f"(ranks {sorted(meshes)}); shard them all over one, "
                             "layout.shard_mesh")
        first = named[0][1]
        if first.device_mesh.ndim != 1:
            raise ValueError(
                f"model: its parameters are sharded over a {first.device_mesh.ndim}-D mesh "
                "(HSDP): FSDP2 would then average across the replicas itself, and the method "
                "again; shard over the shard dimension only, fully_shard(module, "
                "mesh=layout.shard_mesh)")
        #: the global ranks of this replica, which hold the other shards
        self.shard_ranks: tuple[int, ...] = meshes.pop()
        self.shards = len(self.shard_ranks)
        self.shard = first.device_mesh.get_local_rank()
        #: the sharded parameters and their local views, in the model's order
        self.sharded: list[nn.Parameter] = [p for _, p in named]
        self.local: list[nn.Parameter] = [
            nn.Parameter(_local(p).detach(), requires_grad=p.requires_grad) for p in self.sharded]
        for (name, p), view in zip(named, self.local, strict=True):
            mark_part(view, p.numel(), _start(name, p, view, self.shard, self.shards),
                      held_as=p)
        #: the model's structure, with the local views for parameters
        self.view = self._mirror(model, {id(p): v for p, v in zip(self.sharded, self.local,
                                                                   strict=True)}, {})
        self._pulled: list[torch.Tensor | None] = [None] * len(self.local)

    def _mirror(self, module: nn.Module, locals_: dict[int, nn.Parameter],
                made: dict[int, nn.Module]) -> nn.Module:
        if id(module) in made:  # a module used twice stays one module
            return made[id(module)]
        view = nn.Module()
        made[id(module)] = view
        view.train(module.training)
        for name, p in module.named_parameters(recurse=False):
            view.register_parameter(name, locals_[id(p)])
        for name, b in module.named_buffers(recurse=False):
            view.register_buffer(name, b)  # the view is never saved: persistence is moot
        for name, child in module.named_children():
            view.add_module(name, self._mirror(child, locals_, made))
        return view

    def refresh(self) -> None:
        """Point every local view at its shard's storage again where FSDP2 moved it (its lazy
        initialisation pads an empty shard; ``load_state_dict(assign=True)`` replaces one)."""
        with torch.no_grad():
            for p, view in zip(self.sharded, self.local, strict=True):
                local = _local(p)
                if (local.data_ptr() != view.data_ptr() or local.shape != view.shape):
                    view.data = local.detach()

    def pull_gradients(self) -> None:
        """Give each local view its shard of the gradient FSDP2 reduce-scattered (the same
        storage, so that what the method writes into it in place, the optimizer steps with),
        or None where the sharded parameter has none."""
        self.refresh()
        for i, (p, view) in enumerate(zip(self.sharded, self.local, strict=True)):
            grad = None if p.grad is None else _local(p.grad)
            self._pulled[i] = grad
            view.grad = grad

    def push_gradients(self) -> None:
        """Write back a gradient that the method set anew instead of in place (one a parameter
        unused here had none of: a method that averages gradients gives it the average)."""
        dtensor = _dtensor_type()
        assert dtensor is not None
        with torch.no_grad():
            for i, (p, view) in enumerate(zip(self.sharded, self.local, strict=True)):
                grad = view.grad
                if grad is self._pulled[i]:
                    continue
                if grad is None:
                    p.grad = None
                elif p.grad is None:
                    p.grad = dtensor.from_local(grad.detach(), p.device_mesh, p.placements,
                                                run_check=False, shape=p.shape,
                                                stride=p.stride())
                else:
                    _local(p.grad).copy_(grad)

    def drop_gradients(self) -> None:
        """Let go of the local views' gradients (the optimizer's ``zero_grad`` frees the
        sharded ones)."""
        for view in self.local:
            view.grad = None
        self._pulled = [None] * len(self.local)

    def __repr__(self) -> str:
        return (f"LocalShards(shard {self.shard} of {self.shards}, "
                f"{len(self.local)} parameters)")


def local_shards(model: nn.Module) -> LocalShards | None:
    """The :class:`LocalShards` of ``model`` when its parameters are DTensors; None when none
    is (a model that is not sharded)."""
    return LocalShards(model) if is_sharded(model) else None


def _start(name: str, p: Any, local: torch.Tensor, shard: int, shards: int) -> int:
    """The flat position in ``p`` (a DTensor sharded on dimension 0, as FSDP2 shards: chunks
    of ``ceil(rows / shards)`` rows, the last ones shorter or empty) of its local part's first
    element; ValueError naming the parameter for another placement."""
    from torch.distributed.tensor import Shard

    if tuple(p.placements) != (Shard(0),):
        raise ValueError(f"model: parameter {name!r} is placed {tuple(p.placements)}; a method "
                         "runs on shards of dimension 0 only (Shard(0), FSDP2's default: give "
                         "fully_shard no shard_placement_fn)")
    if p.dim() == 0:
        return 0
    rows = p.shape[0]
    first = min(shard * -(-rows // shards), rows)
    if local.shape[0] != min(-(-rows // shards), rows - first):
        raise ValueError(f"model: parameter {name!r} holds rows {tuple(local.shape)} of "
                         f"{tuple(p.shape)} on shard {shard} of {shards}, not the chunk of "
                         "dimension 0 that FSDP2 places there")
    return first * (p.numel() // rows if rows else 0)


def _mesh_ranks(p: Any) -> tuple[int, ...]:
    return tuple(int(r) for r in p.device_mesh.mesh.flatten().tolist())


def _names(names: Iterable[str]) -> str:
    names = [repr(n) for n in names]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


_HOW = ("pass the communicator of the replica dimension, the ranks that hold the same shard in "
       "the other replicas: ShardLayout.from_env(shards=S).comm (gossamer.sharding)")


def check_replica_comm(comm: Communicator | None, shards: LocalShards) -> None:
    """Check that ``comm`` is the replica dimension of ``shards``'s model: a communicator over
    a process group that holds this rank and, of this replica's ranks, no other, whose
    members hold the same shard (of the same number) as this rank. ValueError naming what is
    missing otherwise. Collective over ``comm`` (a barrier and one small all-gather, which
    ``comm`` does not count)."""
    where = (f"the model's parameters are DTensors sharded by FSDP2 over ranks "
             f"{list(shards.shard_ranks)} (this rank holds shard {shards.shard} of "
             f"{shards.shards})")
    if comm is None:
        raise ValueError(f"comm: none given, and {where}: gossamer cannot tell the replica "
                         f"dimension from the environment; {_HOW}")
    if not isinstance(comm, ProcessGroupBacked):
        raise ValueError(f"comm: a {type(comm).__name__}, and {where}: the method's "
                         "communicator must be a TorchCommunicator over the replica "
                         f"dimension; {_HOW}")
    members = tuple(dist.get_process_group_ranks(comm.process_group))
    inside = sorted(set(members) & set(shards.shard_ranks))
    if len(inside) > 1:
        raise ValueError(
            f"comm: it spans ranks {inside}, which hold different shards of one replica "
            f"({where}), so the method would mix shards; {_HOW}")
    if comm.world_size == 1:
        return
    mine = torch.tensor([shards.shards, shards.shard, len(shards.local),
                         sum(v.numel() for v in shards.local)], dtype=torch.int64)
    # over a group of every rank, uncounted: the method's counters hold the method's bytes.
    # The barrier first: a point-to-point exchange on gloo gives up on a peer that comes
    # later than its first heartbeat (a rank still importing FSDP, say); a collective waits.
    with comm.uncounted() if isinstance(comm, CommunicatorBase) else nullcontext():
        comm.barrier()
    everyone = comm.group(range(comm.world_size))
    with everyone.uncounted() if isinstance(everyone, CommunicatorBase) else nullcontext():
        gathered = [t.tolist() for t in everyone.all_gather(mine.to(shards.local[0].device))]
    odd = [r for r, g in enumerate(gathered) if g != gathered[comm.rank]]
    if odd:
        def shard(g: list[int]) -> str:
            return f"shard {g[1]} of {g[0]}, {g[2]} tensors of {g[3]} elements"

        raise ValueError(
            f"comm: its rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} "
            f"{'hold' if len(odd) > 1 else 'holds'} another shard "
            f"({'; '.join(shard(gathered[r]) for r in odd)}) than its rank {comm.rank} "
            f"({shard(gathered[comm.rank])}); {_HOW}")
