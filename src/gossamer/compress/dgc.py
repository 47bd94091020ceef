"""Deep Gradient Compression: threshold sparsification and momentum correction.

Lin, Han, Mao, Wang & Dally, "Deep Gradient Compression: Reducing the Communication Bandwidth
for Distributed Training" (ICLR 2018).

:class:`DGCCompressor` sends the elements of each tensor whose magnitude reaches a threshold,
about ``ratio`` of them (0.1% by default), as float16 values and int32 positions:

1. the threshold is the ``ratio`` quantile of the magnitudes in a strided sample (1% of the
   elements, in runs of 8 from a seeded offset);
2. one read-only pass over the tensor keeps, per block of 64 elements, its largest and smallest
   value (cache-sized chunks into preallocated buffers: no full-size temporary); only the
   blocks that can hold a selected element are read again;
3. if fewer than 0.8 k are selected (k = ``ceil(ratio * numel)``), the threshold is lowered
   along the sample's order statistics, at most ``max_adaptations`` times, and then to the
   k-th largest block maximum, which selects at least k; if more than 1.3 k are selected, the
   selection is refined exactly to the k largest among them. The count is thus in
   [0.8 k, 1.3 k], unless fewer than 0.8 k elements are non-zero: zeros are never sent, so a
   tensor of zeros sends nothing.

Small tensors (where the sample would be a quarter of the tensor) take the exact top-k, and
tensors of fewer than 2 dimensions (biases, BatchNorm) are not compressed: they are all-reduced
dense. During the warm-up the density falls exponentially from 25% to ``ratio`` in
``warmup_stages`` stages (the paper: 25%, 6.25%, 1.5625%, 0.4%, then 0.1%, one per epoch of its
first 4). Its length is ``warmup_steps``; by default (None) it is the paper's schedule fitted to
the run: its first quarter (:data:`WARMUP_FRACTION`), where the training loop tells the run's
length (:meth:`~gossamer.compress.Compressor.set_total_steps`: ``distribute(...,
total_steps=N)``, ``gossamer train``), and none where it does not (the steady-state density
from the first step, as ``warmup_steps=0``).

:class:`DGCMemory` is the paper's momentum correction and local gradient accumulation (section
3.2, with ``m`` the momentum):

    u = m u + g        (nesterov: u = m (u + g), and v += u + g)
    v = v + u
    send sparse(v); then v[sent] -= what was sent, and u[sent] = 0 (momentum factor masking)

With float16 values only ``fp16(v)`` is sent, so its rounding error stays in ``v`` for later
steps (as error feedback keeps it); with float32 values ``v[sent]`` becomes 0.

Since the momentum is applied here, before sparsification, the optimizer must not apply it
again: :func:`take_over_momentum` moves momentum, Nesterov and weight decay out of a
``torch.optim.SGD``'s parameter groups (the runtime and the DDP hook call it), and the optimizer
then steps with the averaged velocities. A scheduler that cycles the momentum (``OneCycleLR``,
``CyclicLR``) writes it back into the groups every step: :func:`follow_momentum`, called at
every step before the first gradient is compensated, takes the scheduled values over again, so
that DGC follows the schedule and the optimizer never applies momentum. Optional local gradient
clipping (section 3.2) clips each tensor's gradient before it enters ``u``.

Weight decay is applied by each worker to its own parameters, dense and never compressed, as
the reference implementation's optimizer does: after the exchange, ``b = m b + wd x`` (a
momentum buffer of its own, with the same ``m``; Nesterov: ``wd x + m b``) is added to the
averaged velocity before the optimizer steps (:meth:`DGCMemory.decay`). Every parameter thus
decays every step, as in SGD, instead of waiting in ``v`` until its decay is large enough to
be sent; and at full density without masking DGC is exactly momentum SGD with weight decay.
``DGCMemory(weight_decay_in_gradient=True)`` instead adds ``wd x`` to each gradient before
momentum correction, so that the decay is sparsified and delayed with the gradient.

Example::

    AllReduce(compressor=DGCCompressor(ratio=0.001), memory=DGCMemory(), bucket_mb=25)
    # or, from the registry: gossamer train --algorithm dgc --option ratio=0.001
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
import torch

from gossamer.checks import check_int, check_positive
from gossamer.compress.base import Aggregation, Compressor, Memory, check_ratio, value_dtype
from gossamer.compress.payloads import Payload, SharedIndexPayload, SparsePayload
from gossamer.compress.sparse import SparseCompressor, check_numel, selected_count, sparse_values
from gossamer.options import option

BLOCK_SHIFT = 6
BLOCK = 1 << BLOCK_SHIFT  # elements per block of the maxima pass (four cache lines)
SAMPLE_RUN = 8  # the sample is runs of this many consecutive elements
MIN_SAMPLE_SELECTED = 16  # the sample holds at least this many selected elements
CHUNK_ROWS = 2**14  # blocks per chunk of the maxima pass (4 MiB of float32)
LOWER, UPPER = 0.8, 1.3  # the accepted selected count, times k
WARMUP_START = 0.25  # the density at the start of warm-up
# the default warm-up's share of the run: the paper's 4 epochs are 2-4% of its 90-164 epoch
# runs, but a short run (a few epochs) would then warm up for most or all of it; a quarter
# brings DGC within a point of AllReduce on the digits MLP and the MNIST CNN
WARMUP_FRACTION = 0.25
_TINY = float(torch.finfo(torch.float32).tiny) * 2.0**-23  # the smallest positive float32


def default_warmup_steps(total_steps: int | None) -> int:
    """The default warm-up's length for a run of ``total_steps`` steps: its first
    :data:`WARMUP_FRACTION` (rounded, at least 1 step), or 0 (none) if the length is unknown."""
    if total_steps is None:
        return 0
    return max(1, round(WARMUP_FRACTION * total_steps))


def warmup_density(ratio: float, step: int, warmup_steps: int, stages: int) -> float:
    """The density of step ``step``: ``ratio`` after warm-up; during it, stage
    ``s = step * stages // warmup_steps`` has ``0.25 * (ratio / 0.25) ** (s / stages)``."""
    if warmup_steps <= 0 or step >= warmup_steps or ratio >= WARMUP_START:
        return ratio
    stage = step * stages // warmup_steps
    return max(ratio, WARMUP_START * (ratio / WARMUP_START) ** (stage / stages))


@dataclasses.dataclass
class Selection:
    """How the last tensor was sparsified (for tests and benchmarks)."""

    target: int  # k
    selected: int
    path: str  # "exact" (small tensor), "threshold", or "refined"
    adaptations: int  # times the threshold was lowered


class _Workspace:
    """Buffers of the maxima pass and of the candidate blocks, grown as needed and reused."""

    def __init__(self) -> None:
        self.rows = -1
        self.candidates = -1
        self.device: torch.device | None = None

    def blocks(self, rows: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(largest, smallest, peak magnitude, flags) buffers for ``rows`` blocks."""
        if rows > self.rows or device != self.device:
            self.high = torch.empty(rows, device=device)
            self.low = torch.empty(rows, device=device)
            self.peaks = torch.empty(rows, device=device)
            self.flags = torch.empty(rows, dtype=torch.bool, device=device)
            self.rows, self.device = rows, device
            self.candidates = -1
        return self.high[:rows], self.low[:rows], self.peaks[:rows], self.flags[:rows]

    def chosen(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two (count, BLOCK) buffers: the candidate blocks, and what passes the threshold."""
        if count > self.candidates:
            size = max(count, 1024)
            self.gathered = torch.empty(size, BLOCK, device=self.device)
            self.shrunk = torch.empty(size, BLOCK, device=self.device)
            self.candidates = size
        return self.gathered[:count], self.shrunk[:count]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DGCCompressor(SparseCompressor):
    """DGC's sparsifier: a sampled threshold, adapted, with fp16 values and int32 positions.

    Args:
        ratio: target density, in (0, 1] (default 0.001: 0.1% of each tensor). Lower: fewer
            bytes, more gradient delayed in the memory.
        sample_ratio: fraction of the elements sampled to estimate the threshold, in (0, 1]
            (default 0.01). Higher: a better first threshold, a slower sample.
        warmup_steps: steps of density warm-up; 0: none (default None: the first quarter of
            the run where its length is known, :func:`default_warmup_steps`, else none). The
            paper warms up over 4 epochs.
        warmup_stages: stages of the warm-up, the density falling exponentially from 25% to
            ``ratio`` (default 4).
        fp16_values: send values as float16 (default True, an option of the authors' code);
            False: float32 (float64 for a float64 model).
        max_adaptations: times the threshold may be lowered along the sample before the
            block-maximum fallback (default 3).
        seed: seeds the sample offsets (default 0).
    """

    aggregations: ClassVar[tuple[Aggregation, ...]] = ("allgather", "sparse_allreduce")

    ratio: float = option(0.001, "density: fraction of each tensor sent, in (0, 1]; lower: "
                          "fewer bytes, more gradient delayed")
    sample_ratio: float = option(0.01, "fraction of the elements sampled to estimate the "
                                 "threshold; higher: a better first threshold, slower")
    warmup_steps: int | None = option(
        None, "density warm-up: falls exponentially from 25% to ratio over these steps (the "
        "paper: 4 epochs); none: over the first quarter of the run where its length is known "
        "(gossamer train, distribute(total_steps=N)), else no warm-up; 0: no warm-up. A run "
        "of ~100 steps stays behind AllReduce whatever the warm-up (docs/compression.md)")
    warmup_stages: int = option(4, "stages of the warm-up (the paper: one per epoch)")
    fp16_values: bool = option(True, "values as float16: 6 bytes per sent element (false: 8)")
    max_adaptations: int = option(3, "times the threshold may be lowered along the sample")
    seed: int = option(0, "seeds the threshold samples")

    # internal state: reusable buffers and the last selection's statistics
    _workspace: _Workspace = dataclasses.field(default_factory=_Workspace, init=False,
                                               repr=False, compare=False)
    _last: list[Selection] = dataclasses.field(default_factory=list, init=False, repr=False,
                                               compare=False)

    def __post_init__(self) -> None:
        check_ratio("ratio", self.ratio)
        check_ratio("sample_ratio", self.sample_ratio)
        if self.warmup_steps is not None:
            check_int("warmup_steps", self.warmup_steps, minimum=0)
        check_int("warmup_stages", self.warmup_stages, minimum=1)
        check_int("max_adaptations", self.max_adaptations, minimum=0)
        check_int("seed", self.seed, minimum=0)

    def compresses(self, tensor: torch.Tensor) -> bool:
        return tensor.dim() >= 2  # biases and BatchNorm go dense, as the paper

    @property
    def warmup_length(self) -> int:
        """The steps of density warm-up: ``warmup_steps``, or by default the first quarter of
        the run where its length is known (0 where it is not)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return default_warmup_steps(self.total_steps)

    def density(self, step: int | None = None) -> float:
        """The density of ``step`` (default: the current step), warm-up included."""
        return warmup_density(self.ratio, self.step if step is None else step,
                              self.warmup_length, self.warmup_stages)

    def target_count(self, numel: int) -> int:
        """k of a tensor of ``numel`` elements at the current step (warm-up included)."""
        return selected_count(self.density(), numel)

    @property
    def last_selection(self) -> Selection | None:
        """How the last compressed tensor was sparsified."""
        return self._last[-1] if self._last else None

    def compress(self, tensor: torch.Tensor, key: str) -> SparsePayload:
        check_numel(tensor)
        flat = tensor.detach().reshape(-1)
        if flat.dtype != value_dtype(flat.dtype):
            flat = flat.to(value_dtype(flat.dtype))
        numel = flat.numel()
        density = self.density()
        k = selected_count(density, numel)
        samples = max(math.ceil(self.sample_ratio * numel),
                      math.ceil(MIN_SAMPLE_SELECTED / density))
        if 4 * samples >= numel or numel < 4 * BLOCK * SAMPLE_RUN:
            indices, values = self._exact(flat, k)
            selection = Selection(k, indices.numel(), "exact", 0)
        elif flat.dtype == torch.float32:
            indices, values, selection = self._threshold(flat, k, density, samples, key)
        else:  # the workspace is float32: select there, send the values at full precision
            indices, _, selection = self._threshold(flat.to(torch.float32), k, density,
                                                    samples, key)
            values = flat.index_select(0, indices)
        self._last[:] = [selection]
        return SparsePayload(indices.to(torch.int32), sparse_values(values, self.fp16_values),
                             tensor.shape)

    # -- the two paths ------------------------------------------------------------------------

    @staticmethod
    def _exact(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        indices = torch.topk(flat.abs(), k, sorted=False).indices
        values = flat.index_select(0, indices)
        keep = values != 0  # zeros carry nothing
        return indices[keep], values[keep]

    def _threshold(
        self, flat: torch.Tensor, k: int, density: float, samples: int, key: str
    ) -> tuple[torch.Tensor, torch.Tensor, Selection]:
        numel = flat.numel()
        rows = numel // BLOCK
        body = flat[: rows * BLOCK].view(rows, BLOCK)
        tail = flat[rows * BLOCK :]

        # 1. the sample: runs of SAMPLE_RUN elements, every `stride` runs, from a seeded offset
        runs = flat[: numel // SAMPLE_RUN * SAMPLE_RUN].view(-1, SAMPLE_RUN)
        stride = max(1, runs.shape[0] * SAMPLE_RUN // samples)
        start = int(torch.randint(stride, (1,), generator=self.generator(key, torch.device(
            "cpu")))) if stride > 1 else 0
        sample = runs[start::stride].abs().view(-1)
        sample_k = min(sample.numel(), max(1, math.ceil(density * sample.numel())))
        rank = sample_k
        threshold = max(float(torch.topk(sample, rank, sorted=False).values.min()), _TINY)
        order: torch.Tensor | None = None  # the sample's top, sorted, if it must be lowered

        # 2. per block, the largest and smallest value: one read of the tensor
        high, low, peaks, flags = self._workspace.blocks(rows, flat.device)
        for first in range(0, rows, CHUNK_ROWS):
            part = body[first : first + CHUNK_ROWS]
            torch.amax(part, dim=1, out=high[first : first + CHUNK_ROWS])
            torch.amin(part, dim=1, out=low[first : first + CHUNK_ROWS])
        torch.maximum(torch.neg(low, out=peaks), high, out=peaks)  # largest magnitude
        pair = torch.arange(2, device=flat.device)

        def select(t: float) -> tuple[torch.Tensor, torch.Tensor]:
            """Every element with |x| >= t (t > 0): only the blocks whose peak reaches t are
            read again."""
            below = float(np.nextafter(np.float32(t), np.float32(0)))  # |x| > below: |x| >= t
            blocks = torch.ge(peaks, t, out=flags).nonzero().view(-1)
            gathered, shrunk = self._workspace.chosen(blocks.numel())
            torch.index_select(body, 0, blocks, out=gathered)
            torch.hardshrink(gathered, below, out=shrunk)  # zero below the threshold
            # survivors are rare: find them two floats (one int64 word) at a time
            words = shrunk.view(-1).view(torch.int64).nonzero().view(-1)
            where = (words.unsqueeze(1) * 2 + pair).view(-1)
            values = shrunk.view(-1).index_select(0, where)
            keep = values.ne(0).nonzero().view(-1)  # (masked_select is slower)
            where, values = where.index_select(0, keep), values.index_select(0, keep)
            indices = blocks[where >> BLOCK_SHIFT] * BLOCK + (where & (BLOCK - 1))
            if tail.numel():
                extra = (tail.abs() >= t).nonzero().view(-1)
                indices = torch.cat([indices, extra + rows * BLOCK])
                values = torch.cat([values, tail[extra]])
            return indices, values

        # 3. adapt: lower the threshold along the sample's order, then to the block maxima
        indices, values = select(threshold)
        adaptations = 0
        while indices.numel() < LOWER * k and adaptations < self.max_adaptations \
                and threshold > _TINY:
            adaptations += 1
            if order is None:
                order = torch.topk(sample, min(sample.numel(), 8 * sample_k)).values
            rank = math.ceil(rank * k / max(indices.numel(), k / 8))
            if rank <= order.numel():
                threshold = max(float(order[rank - 1]), _TINY)
            elif order.numel() == sample.numel():
                threshold = _TINY  # below every sample: all the non-zeros
            else:
                threshold = max(float(order[-1]), _TINY)
            indices, values = select(threshold)
        if indices.numel() < LOWER * k and threshold > _TINY:
            adaptations += 1
            threshold = max(float(torch.topk(peaks, min(k, rows)).values[-1]), _TINY)
            indices, values = select(threshold)  # >= k selected, unless there are fewer
        path = "threshold"
        if indices.numel() > UPPER * k:
            keep = torch.topk(values.abs(), k, sorted=False).indices
            indices, values = indices[keep], values[keep]
            path = "refined"
        return indices, values, Selection(k, indices.numel(), path, adaptations)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DGCMemory(Memory):
    """Momentum correction, local gradient accumulation and momentum factor masking.

    Args:
        momentum: the momentum ``m`` in [0, 1), or None (default): taken over from the
            optimizer when bound (see :func:`take_over_momentum`).
        nesterov: Nesterov momentum (default False; with ``momentum=None``, the optimizer's).
        masking: momentum factor masking, zero ``u`` where ``v`` was sent (default True).
        clip_norm: local gradient clipping: each tensor of this worker's gradient (its own
            mean gradient) is clipped to this norm before it is accumulated (default None: no
            clipping). The paper clips each node's share ``g / n`` of the averaged gradient at
            a global threshold times ``n ** -0.5``, which is ``g`` clipped at the global
            threshold times ``n ** 0.5``; :class:`~gossamer.algorithms.DGC`'s ``clip_norm`` is
            that global threshold, and it builds this memory so.
        weight_decay_in_gradient: where the weight decay taken over from the optimizer (or
            given to a DDP hook state) goes. False (default): each worker applies it to its own
            parameters after the exchange, dense and never compressed, through a momentum
            buffer of its own (:meth:`decay`), as the reference implementation does: every
            parameter decays every step. True: ``wd * x`` is added to each gradient before
            momentum correction, so it is sparsified, and delayed in ``v`` like the gradient.
    """

    momentum: float | None = option(None, "momentum correction's m; none: the optimizer's")
    nesterov: bool = option(False, "Nesterov momentum (with momentum=None: the optimizer's)")
    masking: bool = option(True, "zero the momentum of the elements just sent (no stale "
                           "momentum)")
    clip_norm: float | None = option(None, "clip each tensor's gradient norm to this, per "
                                     "worker; none: no clipping")
    weight_decay_in_gradient: bool = option(False, "add the weight decay to the gradient, "
                                            "sparsified and delayed with it (false: dense and "
                                            "local, after the exchange)")

    # internal state: momentum u and velocity v of each tensor; the weight decay's momentum
    _u: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict, init=False,
                                                    repr=False, compare=False)
    _v: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict, init=False,
                                                    repr=False, compare=False)
    _decay: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict, init=False,
                                                        repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.momentum is not None:
            _check_momentum("momentum", self.momentum)
        if self.clip_norm is not None:
            check_positive("clip_norm", self.clip_norm, allow_zero=False)
        if not isinstance(self.weight_decay_in_gradient, bool):
            raise ValueError(f"weight_decay_in_gradient must be a bool, "
                             f"got {self.weight_decay_in_gradient!r}")

    def compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.detach()
        if self.clip_norm is not None:
            norm = float(torch.linalg.vector_norm(grad))
            if norm > self.clip_norm:
                grad = grad * (self.clip_norm / (norm + 1e-6))
        u = self._u.get(key)
        if u is None or u.shape != grad.shape:
            u = self._u[key] = torch.zeros_like(grad, dtype=value_dtype(grad.dtype))
            self._v[key] = torch.zeros_like(grad, dtype=value_dtype(grad.dtype))
        v = self._v[key]
        m = self.momentum or 0.0
        if self.nesterov:
            u.add_(grad).mul_(m)
            v.add_(u).add_(grad)
        else:
            u.mul_(m).add_(grad)
            v.add_(u)
        return v

    def update(self, key: str, compensated: torch.Tensor, payload: Payload,
               compressor: Compressor) -> None:
        v = self._v[key]
        if isinstance(payload, (SparsePayload, SharedIndexPayload)):
            sent = payload.indices.to(torch.int64)
            # what was sent leaves v: with fp16 values their rounding error stays (v - v is 0)
            v.view(-1).index_add_(0, sent, payload.values.to(v.dtype), alpha=-1)
            if self.masking:
                self._u[key].view(-1).index_fill_(0, sent, 0.0)
        else:  # a dense payload sent every element: keep only its rounding error
            v.sub_(compressor.decompress(payload, key).view_as(v))

    def follow(self, momentum: float, nesterov: bool) -> None:
        """Use ``momentum`` and ``nesterov`` from now on: a bound worker's memory follows the
        momentum schedule of the optimizer it took them over from (:func:`follow_momentum`).
        The configuration is otherwise frozen; ``u``, ``v`` and the decay buffers are kept."""
        _check_momentum("momentum", momentum)
        object.__setattr__(self, "momentum", float(momentum))
        object.__setattr__(self, "nesterov", bool(nesterov))

    def decay(self, key: str, param: torch.Tensor, grad: torch.Tensor,
              weight_decay: float) -> None:
        """Add this worker's weight-decay step of ``param`` (tensor ``key``) to ``grad``, the
        averaged gradient, after the exchange: ``b = m b + wd * param`` and ``grad += b``
        (Nesterov: ``grad += wd * param + m b``), dense, in ``param``'s dtype.

        This is SGD's momentum applied to the decay alone; the gradient's momentum is already
        in the averaged velocity, so the sum is momentum SGD with weight decay on every
        parameter, every step. Every worker holds the same parameters, so all add the same.
        """
        step = param.detach() * weight_decay
        m = self.momentum or 0.0
        if m:
            buffer = self._decay.get(key)
            if buffer is None or buffer.shape != step.shape:
                buffer = self._decay[key] = torch.zeros_like(step)
            buffer.mul_(m).add_(step)
            step = step.add_(buffer, alpha=m) if self.nesterov else buffer
        grad.add_(step.view_as(grad))

    def momentum_of(self, key: str) -> torch.Tensor | None:
        """``u`` of tensor ``key`` (None before its first step)."""
        return self._u.get(key)

    def velocity_of(self, key: str) -> torch.Tensor | None:
        """``v`` of tensor ``key``: the accumulated gradient not sent yet."""
        return self._v.get(key)

    def state_dict(self) -> dict[str, Any]:
        """``u``, ``v`` and the decay buffers; and the momentum and Nesterov in use, once
        known (a schedule's, followed since the memory was built: see :meth:`follow`)."""
        state: dict[str, Any] = {"momentum": {k: t.clone() for k, t in self._u.items()},
                                 "velocity": {k: t.clone() for k, t in self._v.items()},
                                 "decay": {k: t.clone() for k, t in self._decay.items()}}
        if self.momentum is not None:
            state["schedule"] = {"momentum": self.momentum, "nesterov": self.nesterov}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for own, saved in ((self._u, state["momentum"]), (self._v, state["velocity"]),
                           (self._decay, state.get("decay", {}))):
            own.clear()
            own.update({k: t.clone() for k, t in saved.items()})
        if "schedule" in state:
            self.follow(state["schedule"]["momentum"], state["schedule"]["nesterov"])


# What a take-over leaves in a group: the int 0, which a scheduler never writes (it writes
# floats, 0.0 included), so that any value written since, zero or not, is seen as new.
_TAKEN = (0, False, 0)


def _written(value: object) -> bool:
    return type(value) is not int or value != 0


def _check_momentum(name: str, momentum: object) -> None:
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) \
            or not 0 <= momentum < 1:
        raise ValueError(f"{name} must be in [0, 1) or None, got {momentum!r}")


def _groups(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> list[dict]:
    """The parameter groups of ``optimizer`` that hold one of ``params``."""
    wanted = {id(p) for p in params}
    return [g for g in optimizer.param_groups if any(id(p) in wanted for p in g["params"])]


def take_over_momentum(
    optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]
) -> tuple[float, bool, dict[torch.Tensor, float]]:
    """Move momentum, Nesterov and weight decay of ``params`` out of a ``torch.optim.SGD``.

    DGC's momentum correction applies momentum before sparsification, so the optimizer must
    not apply it again; weight decay is moved with it, so that it goes through the same
    momentum as SGD would put it (see :func:`apply_weight_decay`). Returns ``(momentum,
    nesterov, {param: weight_decay})``, and sets those groups' ``momentum``, ``nesterov`` and
    ``weight_decay`` to 0. Other optimizers (Adam...) are left alone: ``(0.0, False, {})``, the
    memory is then plain gradient accumulation and the optimizer applies its own weight decay.
    Raises ValueError if the groups disagree on momentum or Nesterov, or use dampening.
    """
    if not isinstance(optimizer, torch.optim.SGD):
        return 0.0, False, {}
    params = list(params)
    wanted = {id(p) for p in params}
    groups = _groups(optimizer, params)
    momenta = sorted({float(g["momentum"]) for g in groups})
    nesterovs = sorted({bool(g["nesterov"]) for g in groups})
    if len(momenta) > 1 or len(nesterovs) > 1:
        raise ValueError(f"optimizer: DGC's momentum correction needs one momentum for every "
                         f"parameter group, got momentum {momenta}, nesterov {nesterovs}")
    if any(g.get("dampening", 0) for g in groups):
        raise ValueError("optimizer: DGC's momentum correction does not support dampening")
    decays: dict[torch.Tensor, float] = {}
    for g in groups:
        for p in g["params"]:
            if id(p) in wanted and g["weight_decay"]:
                decays[p] = float(g["weight_decay"])
        g["momentum"], g["nesterov"], g["weight_decay"] = _TAKEN
    return (momenta[0] if momenta else 0.0), (nesterovs[0] if nesterovs else False), decays


def follow_momentum(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor],
                    memory: DGCMemory, decays: dict[torch.Tensor, float]) -> None:
    """Take over again what was written into the groups of ``params`` since the last take-over.

    Called at every step before the first gradient is compensated (by the runtime and the DDP
    hook): a scheduler that cycles the momentum (``OneCycleLR``, ``CyclicLR`` with
    ``cycle_momentum=True``) writes ``momentum`` back into the groups every step, and the
    optimizer would then apply momentum a second time, on the averaged velocities. A momentum
    (or Nesterov) written there becomes ``memory``'s for this step and later ones
    (:meth:`DGCMemory.follow`), a weight decay replaces the one in ``decays`` of the group's
    parameters, and the groups are zeroed again: DGC follows the schedule (without Nesterov,
    at full density, exactly as SGD does; Nesterov's ``u = m (u + g)`` is SGD's only at a
    constant ``m``). Nothing else
    happens when nothing was written, or for an optimizer other than ``torch.optim.SGD``.
    Raises ValueError, as :func:`take_over_momentum` does, if the groups then disagree.
    """
    if not isinstance(optimizer, torch.optim.SGD):
        return
    params = list(params)
    groups = _groups(optimizer, params)
    if not any(_written(g["momentum"]) or g["nesterov"] or _written(g["weight_decay"])
               for g in groups):
        return
    momenta = sorted({float(g["momentum"]) for g in groups})
    nesterovs = sorted({bool(g["nesterov"]) for g in groups})
    if len(momenta) > 1 or len(nesterovs) > 1:
        raise ValueError(f"optimizer: DGC's momentum correction needs one momentum for every "
                         f"parameter group, but a scheduler (or something else) wrote "
                         f"momentum {momenta}, nesterov {nesterovs} into the groups")
    if any(g.get("dampening", 0) for g in groups):
        raise ValueError("optimizer: DGC's momentum correction does not support dampening")
    written = any(_written(g["momentum"]) for g in groups)
    if written or nesterovs[0]:
        memory.follow(momenta[0] if written else memory.momentum or 0.0,
                      nesterovs[0] or memory.nesterov)
    wanted = {id(p) for p in params}
    for g in groups:
        if _written(g["weight_decay"]):
            for p in g["params"]:
                if id(p) not in wanted:
                    continue
                if g["weight_decay"]:
                    decays[p] = float(g["weight_decay"])
                else:
                    decays.pop(p, None)
        g["momentum"], g["nesterov"], g["weight_decay"] = _TAKEN


def decay_in_gradient(memory: Memory | None) -> bool:
    """Whether the weight decay taken over for ``memory`` is added to the gradient before
    compression (``DGCMemory(weight_decay_in_gradient=True)``) rather than after the exchange."""
    return isinstance(memory, DGCMemory) and memory.weight_decay_in_gradient


def apply_weight_decay(memory: Memory | None, key: str, param: torch.Tensor,
                       grad: torch.Tensor, weight_decay: float) -> None:
    """Add the weight decay of ``param`` (tensor ``key``) to ``grad``, the averaged gradient,
    on this worker after the exchange: through :meth:`DGCMemory.decay` (its momentum), or
    plainly ``grad += wd * param`` with another memory. Nothing of it is sent."""
    if isinstance(memory, DGCMemory):
        memory.decay(key, param, grad, weight_decay)
    else:
        grad.add_(param.detach().view_as(grad), alpha=weight_decay)


def check_no_momentum(optimizer: torch.optim.Optimizer) -> None:
    """ValueError if ``optimizer`` applies momentum (when a DGCMemory has its own)."""
    for g in optimizer.param_groups:
        if g.get("momentum", 0):
            raise ValueError(
                f"optimizer: momentum={g['momentum']} would be applied twice, by the optimizer "
                "and by DGCMemory(momentum=...): build the optimizer with momentum=0 (and a "
                "scheduler with cycle_momentum=False), or give DGCMemory(momentum=None) to "
                "take the optimizer's over"
            )
