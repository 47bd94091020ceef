"""Sparse all-reduce: a partitioned sparse reduce-scatter, then an all-gather of the kept sums.

All-gathering sparse payloads (``aggregation="allgather"``) costs every worker ``n - 1``
payloads; this aggregation (``aggregation="sparse_allreduce"``) costs about two, whatever
``n``. It follows the two phases of Ok-Topk (Li & Hoefler, "Near-Optimal Sparse Allreduce for
Distributed Deep Learning", PPoPP 2022, section 3.1: split and reduce, then balance and
allgatherv) and the residual rule that Ok-Topk and gTop-k (Shi et al., "A Distributed
Synchronous SGD Algorithm with Global Top-k Sparsification for Low Bandwidth Networks", ICDCS
2019) share. For one bucket of ``T`` compressed tensors, on ``n`` workers:

1. **Index space.** The tensors are laid end to end (tensor ``t`` at offset ``o_t``, ``N``
   elements in all); worker ``i``'s payloads (its compressor's selection, e.g. DGC's or top-k's
   ``k_t`` elements of tensor ``t``) are the entries ``(o_t + index, value)``.
2. **Regions.** ``[0, N)`` is cut into ``n`` contiguous regions, ``R_j = [j N // n,
   (j + 1) N // n)``; worker ``j`` owns ``R_j``.
3. **Split and reduce.** Every worker sends to each owner ``j`` the entries it selected in
   ``R_j`` (point to point, ``Communicator.exchange``: first one int32 byte count per peer, then
   the entries as int32 positions and values in the payload's dtype; nothing is sent for an
   empty message). Owner ``j`` sums what it received with its own entries, in rank order, in
   float32 (float64 for a float64 model).
4. **Re-selection (the rule).** Owner ``j`` keeps, among the non-zero sums of its region,
   its quota, the ``q_j = ceil(K |R_j| / N)`` of largest magnitude (ties: the lower position
   first), and every sum of magnitude ``>= theta``, at most ``max(q_j, K)`` in all (the
   largest), where ``K = sum_t k_t`` is the bucket's per-worker target (the compressor's
   ``target_count``, warm-up included) and ``theta`` the bucket's global threshold: the
   ``K``-th largest magnitude that the bucket's previous reduction kept, which every worker
   computes alike from the all-gathered sums (none at a bucket's first reduction: the quotas
   alone; after a reduction that kept ``C < K``, the smallest kept magnitude times ``C / K``,
   as Ok-Topk lowers its threshold when too few entries pass it).

   This is Ok-Topk's selection, the sums of the reduced regions above one global threshold,
   reused from the previous iteration (no collective, nothing on the wire but the kept
   entries), with gTop-k's rule, "keep the k largest of the sum of the sparse vectors",
   applied to each region with the region's share of ``K`` as a floor. The floor keeps ``K``
   entries or more wherever the regions hold enough non-zero sums, and so makes the threshold
   exact from one step to the next without Ok-Topk's periodic re-evaluation: when ``theta``
   is not above this step's ``K``-th largest sum, the kept entries hold the whole global
   top ``K`` and the next ``theta`` is its smallest; a ``theta`` too high keeps little more
   than the quotas and gives a lower next ``theta``. The threshold lets the regions where the
   large sums are (the MNIST CNN's convolutions, few and with large gradients, at the end of
   its bucket) keep more than their share, as Ok-Topk's does, where quotas alone keep the
   same density everywhere. Kept in all: at most ``K + n - 1`` at the first reduction; then
   the quotas and about ``K`` above ``theta`` (DGC at 0.001 on the MNIST CNN, 16 workers,
   after warm-up: a median of 1.95 ``K`` a step, 1.4 to 3 ``K``), at most ``K`` per owner.
5. **All-gather.** The kept ``(position, sum)`` entries of every owner are all-gathered (int32
   positions, values in the sum's dtype: no rounding after the sum), and every worker writes
   them, divided by ``n``, into the averaged tensors: every worker gets the same sparse average.
6. **Error feedback.** Worker ``i``'s *sent* entries are those of its payload at positions some
   owner kept; only those leave its memory (:meth:`~gossamer.compress.Memory.update` is told
   the payload restricted to them). Its entries that the owners dropped stay in its memory
   (error feedback's residual, DGC's ``v`` and, unmasked, ``u``) for later steps, as gTop-k's
   residual keeps the local top-k entries that are not in the global top-k, and Ok-Topk's
   ``e = acc - (local values selected globally)``.

Conservation: with error feedback and ``c_i`` worker ``i``'s compensated gradient, ``p_i`` its
payload's values at its selected positions (after their rounding to the wire's dtype) and ``K``
the kept positions, ``sum_i e_i + n * update = sum_i c_i`` up to float rounding of the sums:
the update is ``sum_i p_i[K] / n``, and ``e_i = c_i - p_i[K]`` (the dropped entries and, with
fp16 values, the rounding of the sent ones stay in ``e_i``).

Bytes per worker per bucket: ``4 (n - 1)`` of byte counts, its selected entries outside its own
region (about ``k (n - 1) / n`` entries), and its share of the ring all-gather of the kept
entries (about ``2 K`` of them, times ``(n - 1) / n``): about three times ``k`` entries,
independent of ``n``. The reducer (:class:`~gossamer.compress.CompressedReducer`) holds each
bucket's threshold and checkpoints it.

Example::

    AllReduce(compressor=DGCCompressor(ratio=0.001), memory=DGCMemory(),
              aggregation="sparse_allreduce")
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gossamer.comm.base import Communicator, Handle
from gossamer.comm.mirror import Copies
from gossamer.compress.base import value_dtype
from gossamer.compress.payloads import SparsePayload
from gossamer.compress.sparse import MAX_NUMEL

__all__ = ["SparseReduction", "all_gather_with_flags", "keep_largest", "next_threshold",
           "owner_selection", "region_bounds", "region_quota", "sparse_allreduce"]


@dataclass
class SparseReduction:
    """What :func:`sparse_allreduce` returns to one worker."""

    sums: list[torch.Tensor]  # per tensor: flat, the sum over workers of the kept entries
    sent: list[SparsePayload]  # per tensor: this worker's entries that an owner kept
    nbytes: int  # this worker's own bytes: counts, entries sent to owners, its kept entries
    kept: int  # entries kept by every owner together
    threshold: float | None  # for the next reduction (see next_threshold)


def region_bounds(numel: int, parts: int) -> list[int]:
    """The ``parts + 1`` bounds of the contiguous regions: region ``j`` is
    ``[j numel // parts, (j + 1) numel // parts)``."""
    return [j * numel // parts for j in range(parts + 1)]


def region_quota(target: int, numel: int, length: int) -> int:
    """An owner's quota of a region of ``length`` positions out of ``numel``:
    ``ceil(target * length / numel)`` (0 for an empty region)."""
    return -(-target * length // numel) if numel and length else 0


def keep_largest(values: torch.Tensor, count: int) -> torch.Tensor:
    """The positions in ``values`` of its ``count`` non-zero entries of largest magnitude
    (ties: the lower position first), in increasing order."""
    candidates = values.nonzero().view(-1)  # increasing positions
    if candidates.numel() > count:
        order = torch.sort(values.index_select(0, candidates).abs(), descending=True,
                           stable=True).indices[:count]
        candidates = candidates.index_select(0, order.sort().values)
    return candidates


def owner_selection(region: torch.Tensor, quota: int, target: int,
                    threshold: float | None) -> torch.Tensor:
    """The positions an owner keeps of its ``region``'s sums, in increasing order: its
    ``quota`` non-zero sums of largest magnitude and, with a ``threshold``, every non-zero sum
    of magnitude ``>= threshold``; at most ``max(quota, target)``, the largest."""
    if threshold is None:
        return keep_largest(region, quota)
    above = int(((region.abs() >= threshold) & (region != 0)).sum())
    return keep_largest(region, min(max(quota, above), max(quota, target)))


def next_threshold(kept: torch.Tensor, target: int) -> float | None:
    """The global threshold for the next reduction, from the sums ``kept`` by every owner: the
    ``target``-th largest magnitude among them; if fewer were kept, the smallest magnitude
    lowered in proportion, times ``len(kept) / target``; None if none was kept."""
    if not kept.numel() or target < 1:
        return None
    if kept.numel() >= target:
        return float(torch.topk(kept.abs(), target, sorted=False).values.min())
    return float(kept.abs().min()) * kept.numel() / target


def sparse_allreduce(comm: Communicator, payloads: Sequence[SparsePayload], target: int,
                     rider: torch.Tensor | None = None,
                     threshold: float | None = None) -> SparseReduction:
    """Sum ``payloads`` (this worker's, one per tensor, the same tensors on every worker) over
    ``comm`` by the module's algorithm, keeping about ``target`` entries in all.

    ``rider`` (optional float flags, the same shape everywhere) is replaced by its sum over the
    workers; it rides at the end of the all-gather. ``threshold``: the bucket's global
    threshold, the ``threshold`` of its previous reduction's result (None: the quotas alone).
    """
    n, me = comm.world_size, comm.rank
    numels = [math.prod(p.shape) for p in payloads]
    offsets = [sum(numels[:t]) for t in range(len(numels))]
    total = sum(numels)
    if total > MAX_NUMEL:
        raise ValueError(f"a bucket of {total} elements is too large for int32 positions "
                         f"(at most {MAX_NUMEL}); give a smaller bucket size")
    device = payloads[0].values.device
    if device.type == "meta":
        raise ValueError(
            "aggregation='sparse_allreduce' cannot be timed from sizes alone (the timing-only "
            "simulator, gossamer plan): which entries go to which owner, and how many the "
            "owners keep, depends on the values; use the full simulator")
    wire_dtype = payloads[0].values.dtype
    for p in payloads[1:]:
        wire_dtype = torch.promote_types(wire_dtype, p.values.dtype)
    sum_dtype = value_dtype(wire_dtype)

    # 1-2. this worker's entries in the bucket's index space, by owner
    positions = torch.cat([p.indices.to(torch.int64) + o for p, o in zip(payloads, offsets,
                                                                           strict=True)])
    values = torch.cat([p.values.to(wire_dtype) for p in payloads])
    bounds = region_bounds(total, n)
    owners = torch.bucketize(positions, torch.tensor(bounds[1:-1], dtype=torch.int64,
                                                     device=device), right=True)
    order = torch.sort(owners, stable=True).indices
    counts = torch.bincount(owners, minlength=n).tolist()
    mine = [SparsePayload(i.to(torch.int32), v, torch.Size([total])) for i, v in zip(
        positions.index_select(0, order).split(counts),
        values.index_select(0, order).split(counts), strict=True)]

    # 3. split and reduce: byte counts, then the entries, to each owner
    messages = {j: mine[j].to_bytes() for j in range(n) if j != me and counts[j]}
    nbytes = 4 * (n - 1) + sum(m.numel() for m in messages.values())
    incoming = _byte_counts(comm, messages, device)
    handles: list[tuple[int, Handle]] = []
    for step in range(1, n):  # Ok-Topk's destination rotation: step s, to me + s
        dst, src = (me + step) % n, (me - step) % n
        sends = {dst: messages[dst]} if dst in messages else {}
        recv_from = [src] if incoming[src] else []
        if sends or recv_from:
            like = torch.empty(incoming[src], dtype=torch.uint8, device=device)
            handles.append((src, comm.exchange(sends, recv_from, like if recv_from else None)))
    received = {src: handle.wait()[src] for src, handle in handles if incoming[src]}
    start, end = bounds[me], bounds[me + 1]
    region = torch.zeros(end - start, dtype=sum_dtype, device=device)
    for rank in range(n):  # in rank order: the same sum on every backend
        entries = mine[me] if rank == me else (
            mine[me].from_bytes(received[rank]) if rank in received else None)
        if entries is not None and entries.indices.numel():
            region.index_add_(0, entries.indices.to(torch.int64) - start,
                              entries.values.to(sum_dtype))

    # 4. re-selection: the region's share of the target
    keep = owner_selection(region, region_quota(target, total, end - start), target,
                           threshold)
    kept = SparsePayload((keep + start).to(torch.int32), region.index_select(0, keep),
                         torch.Size([total]))

    # 5. all-gather of the kept entries (the flags ride at the end)
    packed = kept.to_bytes()
    nbytes += packed.numel()
    gathered = all_gather_with_flags(comm, packed, rider)
    flat = torch.zeros(total, dtype=sum_dtype, device=device)
    chosen = torch.zeros(total, dtype=torch.bool, device=device)
    count = 0
    for rank, data in enumerate(gathered):
        entries = kept if rank == me else kept.from_bytes(data)
        where = entries.indices.to(torch.int64)
        flat.index_copy_(0, where, entries.values)
        chosen.index_fill_(0, where, True)
        count += where.numel()

    # 6. what left this worker's memory: its entries at kept positions
    sent = []
    for p, o in zip(payloads, offsets, strict=True):
        hit = chosen.index_select(0, p.indices.to(torch.int64) + o)
        sent.append(SparsePayload(p.indices[hit], p.values[hit], p.shape))
    sums = [flat[o:o + k] for o, k in zip(offsets, numels, strict=True)]
    return SparseReduction(sums, sent, nbytes, count,
                           next_threshold(flat.index_select(0, chosen.nonzero().view(-1)), target))


def all_gather_with_flags(comm: Communicator, packed: torch.Tensor,
                          rider: torch.Tensor | None) -> list[torch.Tensor]:
    """``comm.all_gather(packed)`` (uint8), with ``rider`` (flags, or None) riding at the end of
    every worker's bytes and replaced by its sum over the workers."""
    if rider is None:
        return comm.all_gather(packed)
    gathered = comm.all_gather(torch.cat([packed, rider.reshape(-1).view(torch.uint8)]))
    tail = rider.numel() * rider.element_size()
    if isinstance(gathered, Copies):  # one worker for all: its flags, counted once per member
        rider.copy_(gathered.part[-tail:].clone().view(rider.dtype) * gathered.times)
        return Copies(gathered.part[:-tail], gathered.times)
    rider.copy_(sum(data[-tail:].clone().view(rider.dtype) for data in gathered))
    return [data[:-tail] for data in gathered]


def _byte_counts(comm: Communicator, messages: dict[int, torch.Tensor], device: torch.device
                 ) -> list[int]:
    """Tell each peer how many bytes this worker sends it (0: none); return what each peer
    sends here (this worker's own entry is 0). The counts travel on ``device``, the
    payloads' (a communicator may take no other: NCCL)."""
    n, me = comm.world_size, comm.rank
    incoming = [0] * n
    if n == 1:
        return incoming
    peers = [j for j in range(n) if j != me]
    sizes = {j: torch.tensor([messages[j].numel() if j in messages else 0], dtype=torch.int32,
                             device=device) for j in peers}
    got = comm.exchange(sizes, peers, torch.empty(1, dtype=torch.int32, device=device)).wait()
    for j in peers:
        incoming[j] = int(got[j].item())
    return incoming
