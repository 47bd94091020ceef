"""Compressed gradient averaging: compensate, compress, send, update memory, in one place.

:class:`CompressedReducer` is shared by :class:`~gossamer.algorithms.AllReduce` (with a
compressor) and the DDP hooks of :mod:`gossamer.hooks.compression`, so both compute the same
thing. For each bucket of tensors it makes one collective per round:

- ``"allreduce"``: the payloads' flat wires are concatenated and all-reduced (summed), and
  the sum decompressed and divided by the world size; fp16 and bf16 send each worker's share
  of the average instead (divided before the sum, as DDP's ``fp16_compress_hook``), so that the
  narrow sum does not overflow where the average fits (:mod:`gossamer.compress.cast`);
- ``"allgather"``: the payloads are packed into one uint8 tensor (an int32 header of their
  lengths, then their bytes) and all-gathered, sizes differing per worker (a worker that
  selects nothing sends only the header); each worker decodes and adds everyone's.
- ``"sparse_allreduce"`` (top-k, DGC): a partitioned sparse reduce-scatter over
  point-to-point exchanges, a re-selection by each region's owner, and an all-gather of the
  kept sums: about three payloads per worker whatever the world size; the entries the owners
  drop stay in the memory (:mod:`gossamer.compress.sparse_allreduce`).

Tensors the compressor does not take (DGC's and PowerSGD's biases...) are all-reduced dense in
float32 (float64 for a float64 model, see :func:`~gossamer.compress.base.value_dtype`); with
``"allreduce"`` they ride in the first bucket's first all-reduce (the same sums, one collective
and its latency less per step), otherwise in an all-reduce of their own. Every byte goes
through the communicator, so its ``stats`` count the compressed bytes.

Hierarchy (``node_size > 1``): the gradients are first averaged dense inside each node (groups
of ``node_size`` consecutive ranks, where bandwidth is plentiful), then every worker exchanges
the compressed node average with the workers of the same local rank in the other nodes. The
members of a node compress the same tensor with the same seeds and memory, so they all end
with the same average, without a broadcast.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from gossamer.checks import check_int
from gossamer.comm.base import Communicator
from gossamer.comm.mirror import Copies
from gossamer.compress.base import Compressor, Memory, resolve_aggregation, value_dtype
from gossamer.compress.cast import NoCompression
from gossamer.compress.payloads import (
    DensePayload,
    Payload,
    SparsePayload,
    pack_bytes,
    unpack_bytes,
)
from gossamer.compress.sparse import SparseCompressor
from gossamer.compress.sparse_allreduce import all_gather_with_flags, sparse_allreduce

NamedTensors = Sequence[tuple[str, torch.Tensor]]


def buckets(
    items: NamedTensors, bucket_bytes: int | None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of ``items`` of at most ``bucket_bytes`` (float32 size) each; a
    larger tensor gets a bucket of its own. None: a single bucket."""
    run: list[tuple[str, torch.Tensor]] = []
    size = 0
    for key, tensor in items:
        nbytes = 4 * tensor.numel()
        if run and bucket_bytes is not None and size + nbytes > bucket_bytes:
            yield run
            run, size = [], 0
        run.append((key, tensor))
        size += nbytes
    if run:
        yield run


class CompressedReducer:
    """Average named gradients over the workers through a compressor and a memory.

    Args:
        comm: the communicator of every worker.
        compressor: the compressor; this reducer uses its own copy
            (:meth:`~gossamer.compress.Compressor.for_worker`).
        memory: error feedback or DGC's memory (a copy is used), or None (default).
        aggregation: ``"allreduce"``, ``"allgather"``, ``"sparse_allreduce"`` (top-k and DGC),
            or None (default: the compressor's first); a combination the compressor does not
            support is a ValueError.
        node_size: ranks per node for hierarchical aggregation (default 1: flat); must divide
            the world size.
        bucket_bytes: float32 bytes of the tensors that one collective carries at most
            (default None: all in one).

    Example::

        reducer = CompressedReducer(comm, DGCCompressor(ratio=0.001), DGCMemory(momentum=0.9))
        reducer.reduce([(name, p.grad) for name, p in sorted(model.named_parameters())], step)
    """

    def __init__(
        self,
        comm: Communicator,
        compressor: Compressor,
        memory: Memory | None = None,
        *,
        aggregation: str | None = None,
        node_size: int = 1,
        bucket_bytes: int | None = None,
    ) -> None:
        if not isinstance(compressor, Compressor):
            raise ValueError(f"compressor must be a Compressor, got {compressor!r}")
        if memory is not None and not isinstance(memory, Memory):
            raise ValueError(f"memory must be a Memory or None, got {memory!r}")
        self.aggregation = resolve_aggregation(compressor, aggregation)
        check_node_size(node_size, comm.world_size)
        if bucket_bytes is not None:
            check_int("bucket_bytes", bucket_bytes, minimum=1)
        self.comm = comm
        self.bucket_bytes = bucket_bytes
        self.node_size = node_size
        node, local = divmod(comm.rank, node_size)
        nodes = comm.world_size // node_size
        self.intra: Communicator | None = None
        self.cross: Communicator = comm
        if node_size > 1:
            self.intra = comm.group(list(range(node * node_size, (node + 1) * node_size)))
            self.cross = comm.group([local + j * node_size for j in range(nodes)])
        self.compressor = compressor.for_worker(node)
        self.memory = memory.fresh() if memory is not None else None
        self._dense = NoCompression()
        # statistics: this worker's own payload bytes (not the ring's forwarding)
        self.payload_bytes = 0  # compressed tensors, headers included
        self.dense_bytes = 0  # tensors all-reduced dense across nodes
        self.kept_entries = 0  # sparse_allreduce: entries the owners kept, every owner's
        # sparse_allreduce: each bucket's threshold, the target-th largest magnitude that its
        # last reduction kept (Ok-Topk's global threshold, reused at the next step)
        self._thresholds: dict[tuple[str, ...], float | None] = {}
        # flags summed along with the step's first collective of each stage (see reduce)
        self._rider: torch.Tensor | None = None
        self._rider_stages: list[Communicator] = []

    @torch.no_grad()
    def reduce(self, grads: NamedTensors, step: int, flags: torch.Tensor | None = None,
               checked: bool = False) -> None:
        """Replace each gradient by the (compressed) average over the workers, in place.

        Every worker must pass the same names, shapes and order. ``step`` is the optimizer
        step (it seeds the randomness and drives warm-up schedules). ``flags`` (optional, a
        float32 tensor of the same shape on every worker) is replaced by its sum over the
        workers: it rides at the end of the step's first collective (no message of its own)
        and never touches a memory; the algorithms agree on non-finite gradients with it.

        Without ``flags`` and unless ``checked`` (the caller made sure that the gradients are
        finite), a non-finite gradient is a FloatingPointError before anything is compressed,
        since a memory (error feedback's residual, DGC's momentum) would keep it for ever.
        """
        if flags is None and self.memory is not None and not checked:
            # one sum per tensor (NaN and inf survive a sum) and one synchronisation
            sums = [g.detach().sum(dtype=torch.float32) for _, g in grads if g is not None]
            if sums and not math.isfinite(torch.stack(sums).sum().item()):
                bad = [k for k, g in grads if g is not None and not bool(torch.isfinite(g).all())]
                raise FloatingPointError(
                    f"compressed reduce: the gradient(s) {', '.join(map(repr, bad))} hold "
                    "non-finite values; nothing was compressed, and the memory does not keep "
                    "them (skip the step, or lower the learning rate)")
        self.compressor.set_step(step)
        self._rider = flags
        self._rider_stages = [] if flags is None else [
            c for c in (self.intra, self.cross) if c is not None]
        if self.intra is not None:
            averaged = self._dense_mean(self.intra, [g for _, g in grads])
            for (_, g), mean in zip(grads, averaged, strict=True):
                g.copy_(mean.view_as(g))
        compensated = [
            (key, g, self.memory.compensate(key, g) if self.memory is not None else g)
            for key, g in grads
        ]
        dense = [item for item in compensated if not self.compressor.compresses(item[2])]
        sparse = [item for item in compensated if self.compressor.compresses(item[2])]
        # all-reduced payloads: the dense tensors ride in the first one (the same sums);
        # otherwise they are all-reduced first, on their own
        riding = [c for _, _, c in dense] if sparse and self.aggregation == "allreduce" else []
        if dense and not riding:
            self._set_dense(dense, self._dense_mean(self.cross, [c for _, _, c in dense]))
        means: list[torch.Tensor] = []  # of the riding dense tensors
        targets = {key: g for key, g, _ in sparse}
        for index, run in enumerate(buckets([(key, c) for key, _, c in sparse],
                                            self.bucket_bytes)):
            if self.aggregation == "allreduce":
                results, ridden = self._all_reduce(run, riding if index == 0 else [])
                if index == 0:  # the riding tensors' means come with the first run only
                    means = ridden
            elif self.aggregation == "sparse_allreduce":
                results = self._sparse_all_reduce(run)
            else:
                results = self._all_gather(run)
            for (key, _), mean in zip(run, results, strict=True):
                targets[key].copy_(mean.view_as(targets[key]))
        if riding:
            self._set_dense(dense, means)
        for comm in self._rider_stages:  # a stage that made no collective (nothing to send)
            comm.all_reduce(self._take_rider(comm))
        self._rider = None

    def _set_dense(self, dense: list[tuple[str, torch.Tensor, torch.Tensor]],
                   means: list[torch.Tensor]) -> None:
        """The dense tensors' ``(key, gradient, compensated)``: their means into the gradients,
        the memory updated."""
        for (key, g, c), mean in zip(dense, means, strict=True):
            if self.memory is not None:
                self.memory.update(key, c, DensePayload(c.reshape(-1), c.shape), self._dense)
            g.copy_(mean.view_as(g))
        self.dense_bytes += sum(value_dtype(c.dtype).itemsize * c.numel() for _, _, c in dense)

    def _take_rider(self, comm: Communicator) -> torch.Tensor | None:
        """The flags to sum along with this collective on ``comm``: once per stage."""
        if self._rider_stages and self._rider_stages[0] is comm:
            self._rider_stages.pop(0)
            return self._rider
        return None

    # -- the two aggregations ------------------------------------------------------------------

    def _all_reduce(self, run: list[tuple[str, torch.Tensor]], riding: Sequence[torch.Tensor]
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The run's averages, and the means of the dense tensors ``riding`` in its first round
        (none when none ride)."""
        compressor, n = self.compressor, self.cross.world_size
        # (fp16's: each worker's share of the average, so that the narrow sum is in range)
        payloads: list[Payload] = [compressor.share(c, key, n) for key, c in run]
        summed: list[Payload] = []
        means: list[torch.Tensor] = []
        for r in range(compressor.rounds):
            if r:
                payloads = [compressor.next_round(s, key)
                            for s, (key, _) in zip(summed, run, strict=True)]
            wires = [p.wire().reshape(-1) for p in payloads]
            self.payload_bytes += sum(w.numel() * w.element_size() for w in wires)
            rider = self._take_rider(self.cross)
            dense = [_flat(t) for t in riding] if not r else []
            sums = _sum_flat(self.cross, wires + dense + ([rider] if rider is not None else []))
            if rider is not None:
                rider.copy_(sums.pop())
            if dense:  # the dense tensors' means, once
                means, sums = [s.div_(n) for s in sums[len(wires):]], sums[:len(wires)]
            summed = [p.with_wire(s) for p, s in zip(payloads, sums, strict=True)]
        self._update(run, payloads)
        return [compressor.decompress_average(s, key, n)
                for s, (key, _) in zip(summed, run, strict=True)], means

    def _all_gather(self, run: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        compressor, cross = self.compressor, self.cross
        payloads = [compressor.compress(c, key) for key, c in run]
        packed = pack_bytes(payloads)
        self.payload_bytes += packed.numel()
        gathered = all_gather_with_flags(cross, packed, self._take_rider(cross))
        self._update(run, payloads)
        outs = [torch.zeros(c.numel(), dtype=value_dtype(c.dtype), device=c.device)
                for _, c in run]
        if isinstance(gathered, Copies):  # one worker for all: its payloads, once per member
            for payload, (key, _), out in zip(payloads, run, outs, strict=True):
                compressor.decompress_add(payload, key, out)
            return [out.mul_(gathered.times).div_(cross.world_size) for out in outs]
        for rank, data in enumerate(gathered):
            theirs = payloads if rank == cross.rank else unpack_bytes(data, payloads)
            for payload, (key, _), out in zip(theirs, run, outs, strict=True):
                compressor.decompress_add(payload, key, out)
        return [out.div_(cross.world_size) for out in outs]

    def _sparse_all_reduce(self, run: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        compressor, cross = self.compressor, self.cross
        assert isinstance(compressor, SparseCompressor)
        payloads = [compressor.compress(c, key) for key, c in run]
        assert all(isinstance(p, SparsePayload) for p in payloads)
        target = sum(compressor.target_count(c.numel()) for _, c in run)
        keys = tuple(key for key, _ in run)
        result = sparse_allreduce(cross, payloads, target,  # type: ignore[arg-type]
                                  self._take_rider(cross), self._thresholds.get(keys))
        self._thresholds[keys] = result.threshold
        self.payload_bytes += result.nbytes
        self.kept_entries += result.kept
        self._update(run, result.sent)
        return [s.div_(cross.world_size) for s in result.sums]

    def _update(self, run: list[tuple[str, torch.Tensor]], payloads: Sequence[Payload]) -> None:
        if self.memory is not None:
            for (key, c), payload in zip(run, payloads, strict=True):
                self.memory.update(key, c, payload, self.compressor)

    def _dense_mean(self, comm: Communicator, tensors: Sequence[torch.Tensor]
                    ) -> list[torch.Tensor]:
        """The mean over ``comm`` of each tensor, in float32 (float64 for float64 tensors), one
        all-reduce per bucket."""
        out: list[torch.Tensor] = []
        items = [(str(i), t) for i, t in enumerate(tensors)]
        for run in buckets(items, self.bucket_bytes):
            rider = self._take_rider(comm)
            flats = [_flat(t) for _, t in run]
            sums = _sum_flat(comm, flats + ([rider] if rider is not None else []))
            if rider is not None:
                rider.copy_(sums.pop())
            out += [s.div_(comm.world_size) for s in sums]
        return out

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The compressor's and the memory's state (never the communicator)."""
        return {
            "compressor": self.compressor.state_dict(),
            "memory": self.memory.state_dict() if self.memory is not None else None,
            "payload_bytes": self.payload_bytes,
            "dense_bytes": self.dense_bytes,
            "kept_entries": self.kept_entries,
            "thresholds": [[list(keys), value] for keys, value in self._thresholds.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.compressor.load_state_dict(state["compressor"])
        if self.memory is not None:
            self.memory.load_state_dict(state["memory"])
        self.payload_bytes = int(state.get("payload_bytes", 0))
        self.dense_bytes = int(state.get("dense_bytes", 0))
        self.kept_entries = int(state.get("kept_entries", 0))
        self._thresholds = {tuple(keys): value for keys, value in state.get("thresholds", [])}


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` flat, in the dtype its sums are taken in (float32, float64 for float64)."""
    return tensor.detach().reshape(-1).to(value_dtype(tensor.dtype))


def _sum_flat(comm: Communicator, flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The sum over ``comm`` of each flat tensor (new tensors): one all-reduce per dtype."""
    out: list[torch.Tensor | None] = [None] * len(flats)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(flats):
        by_dtype.setdefault(t.dtype, []).append(i)
    for indices in by_dtype.values():
        buffer = torch.cat([flats[i] for i in indices])
        comm.all_reduce(buffer, op="sum")
        for i, part in zip(indices, buffer.split([flats[i].numel() for i in indices]),
                           strict=True):
            out[i] = part
    return out  # type: ignore[return-value]


def check_node_size(node_size: int, world_size: int | None = None) -> None:
    """``node_size`` must be an int >= 1 that divides ``world_size`` (when known)."""
    check_int("node_size", node_size, minimum=1)
    if world_size is not None and world_size % node_size:
        raise ValueError(f"node_size={node_size} must divide the world size {world_size}")
