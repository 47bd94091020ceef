"""SparseLoCo: DiLoCo whose outer momentum is replaced by error feedback, and whose
pseudo-gradients travel as a chunked top-k of 2-bit values.

Sarfi, Therien, Lidin, Belilovsky, "Communication Efficient LLM Pre-training with SparseLoCo"
(2025, arXiv 2508.15706), Algorithm 1. Every worker r starts a round from the global
parameters ``theta^(t-1)``, takes H steps of its inner optimizer, and then

    Delta_r = theta^(t-1) - theta_r^(t)          its pseudo-gradient
    e_r     = beta e_r + Delta_r                 the error-feedback accumulator
    D_r     = Q(TopK(e_r))                       k per chunk, the kept values quantised
    e_r     = e_r - D_r                          what was not sent stays
    Delta   = (1/R) sum_r D_r                    every worker's D_r, all-gathered
    theta^(t) = theta^(t-1) - alpha Delta        plain outer SGD: no momentum

The decayed accumulator plays the part of DiLoCo's outer momentum (the paper's observation),
so the outer step here is SGD of learning rate alpha without momentum.

- **Chunks** (``chunk``): a tensor is viewed as a matrix (a vector as one row, more than two
  dimensions as ``(shape[0], rest)``) and cut into blocks of ``n1 x n2``, each side the largest
  divisor of the dimension not above ``chunk``: 64 x 64 = 4096 elements for the usual sizes,
  the authors' chunking (DeMo's, without its DCT).
- **Top-k** (``topk``, k): the k entries of largest magnitude of each chunk (all of a smaller
  chunk's), their positions inside the chunk sent as int16.
- **Quantisation** (``bits``, 2 by default; 4 and 8; 32: the values unquantised): the
  authors' statistical quantiser, over the kept values v of one tensor: ``shift = mean(v)``,
  ``c = v - shift``, ``scale = range_in_sigmas * std(c) / B`` (B = 2^bits bins, std
  unbiased; 1 where that is 0 or not finite), the code ``clamp(round(c / scale + B / 2), 0,
  B - 1)``; each bin decodes to the mean of the centred values it holds (a table of B
  float32), plus the shift. A tensor's payload: its positions, then ``shift`` and the table
  (float32), then the codes packed ``8 / bits`` to a byte
  (:class:`~gossamer.compress.statistical.StatisticalQuantiser`, which MuLoCo shares).
- **Aggregation**: each worker's payloads, one uint8 tensor for the whole model, are
  all-gathered; every worker decodes every one and averages them, summing in rank order, as
  the simulator's all-reduce does. The library's sparse all-reduce is not used: its owners
  re-select among the sums and send float32 sums with int32 positions (8 bytes an entry
  against about 2.25 here), so it changes the paper's arithmetic and sends more bytes below
  about ten workers.

Everything else is DiLoCo's: the rounds' schedule (constant period or the QSR rule, the
synchronous warm-up), replicas of several workers (``replica_size``, alias ``group_size``),
the averaging options, checkpoints (the accumulators are part of the runtime's state) and
continuing after a failure (each survivor keeps its own accumulator; a lost worker's is lost
with it, as in any error-feedback method).

Example::

    inner = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1)
    optimizer = gossamer.distribute(model, inner, SparseLoCo(period=50, topk=64, bits=2))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import nn

from gossamer.algorithms.base import Algorithm
from gossamer.algorithms.demo import chunk_side, matrix_shape
from gossamer.algorithms.diloco import DiLoCo, DiLoCoRuntime, check_rounds
from gossamer.algorithms.outer import OuterStep, check_replicas_divide
from gossamer.algorithms.rounds import RoundSchedule
from gossamer.checks import check_int
from gossamer.comm.base import Communicator
from gossamer.comm.mirror import Copies
from gossamer.comm.p2p_group import divide_
from gossamer.compress.memory import check_decay
from gossamer.compress.statistical import StatisticalQuantiser, check_range
from gossamer.options import option, option_of

__all__ = ["BITS", "ChunkedTopK", "SparseLoCo", "SparseLoCoRuntime", "StatisticalQuantiser"]

#: the values' widths ``bits`` takes; 32: unquantised
BITS = (2, 4, 8, 32)


def field(payloads: torch.Tensor, offset: int, width: int, dtype: torch.dtype
          ) -> torch.Tensor:
    """Bytes ``offset`` to ``offset + width`` of each row of ``payloads``, read as ``dtype``
    (a copy: a row's bytes at an odd offset cannot be viewed as a wider type)."""
    part = payloads[:, offset:offset + width].clone(memory_format=torch.contiguous_format)
    return part.view(dtype)


class ChunkedTopK:
    """One tensor shape's chunks (``chunks`` blocks of ``size`` elements) and its top-k."""

    def __init__(self, shape: torch.Size, chunk: int, topk: int) -> None:
        self.shape = shape
        self.rows, self.cols = matrix_shape(shape)
        self.n1, self.n2 = chunk_side(self.rows, chunk), chunk_side(self.cols, chunk)
        self.chunks = (self.rows // self.n1) * (self.cols // self.n2)
        self.size = self.n1 * self.n2
        self.k = min(topk, self.size)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as (chunks, size)."""
        blocks = x.reshape(self.rows // self.n1, self.n1, self.cols // self.n2, self.n2)
        return blocks.permute(0, 2, 1, 3).reshape(self.chunks, self.size)

    def join(self, chunks: torch.Tensor) -> torch.Tensor:
        """The tensor of ``chunks`` (chunks, size)."""
        blocks = chunks.reshape(self.rows // self.n1, self.cols // self.n2, self.n1, self.n2)
        return blocks.permute(0, 2, 1, 3).reshape(self.shape)

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """The positions inside each chunk of its k entries of largest magnitude,
        (chunks, k)."""
        return torch.topk(self.split(x).abs(), self.k, dim=-1, sorted=False).indices


@dataclass(frozen=True, kw_only=True)
class SparseLoCo(Algorithm):
    """SparseLoCo (Sarfi et al. 2025): DiLoCo with error feedback instead of outer momentum,
    its pseudo-gradients sent as the top k of each chunk in ``bits`` bits, all-gathered.

    Args:
        error_decay: beta, the decay of each worker's error-feedback accumulator (default
            0.95); in [0, 1].
        topk: k, entries sent per chunk (default 64: 1.56% of a 64 x 64 chunk).
        chunk: the chunk side (default 64): each dimension is cut in blocks of its largest
            divisor not above it, 4096-element chunks for the usual sizes.
        bits: the kept values' width: 2 (default), 4 or 8 with the statistical quantiser,
            32 unquantised.
        range_in_sigmas: the quantiser's range, in standard deviations of the kept values
            (default 6): the bins are ``range_in_sigmas * std / 2^bits`` wide.
        outer_lr: alpha, the outer learning rate (default 1.0) of the outer SGD, which has
            no momentum.
        period, alpha, power, warmup, warmup_steps, warmup_period, replica_size, bucket_mb,
            average_optimizer_state, average_buffers, reestimate_batchnorm, average_at_end:
            as :class:`DiLoCo`'s.
    """

    name: ClassVar[str] = "sparseloco"
    continues_after_failure: ClassVar[bool] = True
    renamed_options: ClassVar[Mapping[str, str]] = MappingProxyType(
        {"group_size": "replica_size"})
    #: the runtime is DiLoCo's, whose reduction this method replaces
    compression: ClassVar[None] = None

    period: int = option_of(DiLoCo, "period")
    warmup_steps: int = option_of(DiLoCo, "warmup_steps")
    warmup_period: int = option_of(DiLoCo, "warmup_period")
    average_optimizer_state: bool = option_of(DiLoCo, "average_optimizer_state")
    average_buffers: bool = option_of(DiLoCo, "average_buffers")
    reestimate_batchnorm: int = option_of(DiLoCo, "reestimate_batchnorm")
    average_at_end: bool = option_of(DiLoCo, "average_at_end")
    alpha: float = option_of(DiLoCo, "alpha")
    power: float = option_of(DiLoCo, "power")
    warmup: str = option_of(DiLoCo, "warmup")
    replica_size: int = option_of(DiLoCo, "replica_size")
    bucket_mb: float = option_of(DiLoCo, "bucket_mb")
    outer_lr: float = option(1.0, "alpha: the outer learning rate of the outer SGD, which has "
                             "no momentum (the error feedback takes its place)")
    error_decay: float = option(0.95, "beta: each worker's error-feedback accumulator decays "
                                "by it before the round's pseudo-gradient is added")
    topk: int = option(64, "k: entries sent per chunk (64 of a 64x64 chunk: 1.56%)")
    chunk: int = option(64, "chunk side: each dimension cut in blocks of its largest divisor "
                        "not above it (64x64 = 4096-element chunks)")
    bits: int = option(2, "the sent values' bits: 2, 4, 8 (statistical quantiser), 32 "
                       "(unquantised)")
    range_in_sigmas: float = option(6.0, "the quantiser's range in standard deviations of the "
                                    "kept values")

    def __post_init__(self) -> None:
        check_rounds(self)
        check_decay("error_decay", self.error_decay)
        check_int("topk", self.topk, 1)
        check_int("chunk", self.chunk, 1)
        if self.bits not in BITS:
            raise ValueError(f"bits: must be one of {', '.join(map(str, BITS))}, "
                             f"got {self.bits!r}")
        check_range(self.range_in_sigmas)

    @property
    def schedule(self) -> RoundSchedule:
        """How long each round lasts: DiLoCo's rule."""
        return DiLoCo.schedule.fget(self)  # type: ignore[attr-defined]

    @property
    def outer_step(self) -> OuterStep:
        """The outer SGD of learning rate alpha, without momentum."""
        return OuterStep(outer="sgd", outer_lr=self.outer_lr, outer_momentum=0.0,
                         outer_nesterov=False)

    def symmetric(self) -> bool:
        return True  # the same all-gathers on every worker (and on every replica)

    def validate(self, world_size: int) -> None:
        check_replicas_divide(self.replica_size, world_size)

    def sharding_refusal(self) -> str | None:
        return "SparseLoCo chunks whole tensors; it does not run on sharded models yet"

    def bind(self, comm: Communicator, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> SparseLoCoRuntime:
        self.validate(comm.world_size)
        return SparseLoCoRuntime(self, comm, model, optimizer)


class SparseLoCoRuntime(DiLoCoRuntime):
    """One worker of SparseLoCo: DiLoCo's rounds, its reduction replaced by the chunked
    top-k of the error-feedback accumulators, quantised and all-gathered."""

    def __init__(self, config: SparseLoCo, comm: Communicator, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        super().__init__(config, comm, model, optimizer)  # type: ignore[arg-type]
        self.config: SparseLoCo = config  # type: ignore[assignment]
        self.chunking = [ChunkedTopK(p.shape, config.chunk, config.topk) for p in self.trained]
        largest = max((c.size for c in self.chunking), default=1)
        self.index_dtype = torch.int16 if largest <= 2**15 else torch.int32
        self.quantiser = None if config.bits == 32 else StatisticalQuantiser(
            config.bits, config.range_in_sigmas)
        # internal state: each worker's own error-feedback accumulator e_r, by name
        self.errors = {name: torch.zeros_like(p) for name, p in zip(self.names, self.trained,
                                                                   strict=True)}

    def _value_bytes(self, chunking: ChunkedTopK, dtype: torch.dtype) -> int:
        count = chunking.chunks * chunking.k
        if self.quantiser is None:
            return count * (8 if dtype == torch.float64 else 4)
        return self.quantiser.header_bytes() + self.quantiser.code_bytes(count)

    def payload_bytes(self) -> int:
        """The bytes one worker's payload holds (the same on every worker)."""
        size = self.index_dtype.itemsize
        return sum(c.chunks * c.k * size + self._value_bytes(c, p.dtype)
                   for c, p in zip(self.chunking, self.trained, strict=True))

    @torch.no_grad()
    def compress(self, deltas: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Fold ``deltas`` into the accumulators, take each one's chunked top-k and quantise
        it; subtract what is sent. Returns (the payload, uint8; what was sent, per tensor)."""
        beta = self.config.error_decay
        parts, sent = [], []
        for name, delta, chunking in zip(self.names, deltas, self.chunking, strict=True):
            e = self.errors[name]
            e.mul_(beta).add_(delta.view_as(e))
            index = chunking.select(e)
            values = torch.gather(chunking.split(e), -1, index).reshape(-1)
            parts.append(index.reshape(-1).to(self.index_dtype).view(torch.uint8))
            if self.quantiser is None:
                parts.append(values.contiguous().view(torch.uint8))
            else:
                header, codes = self.quantiser.encode(values)
                values = self.quantiser.decode(header, codes).to(e.dtype)
                parts += [header.view(torch.uint8), self.quantiser.pack(codes)]
            dense = torch.zeros(chunking.chunks, chunking.size, dtype=e.dtype, device=e.device)
            dense.scatter_(-1, index, values.view(chunking.chunks, chunking.k))
            sent_here = chunking.join(dense)
            e.sub_(sent_here)
            sent.append(sent_here)
        return torch.cat(parts), sent

    def decode(self, payloads: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each tensor's positions and values in the payloads ``payloads`` (R, bytes): per
        tensor, (index, values), each (R, chunks, k). Decoded for every payload at once: a
        few operations per tensor whatever the number of workers."""
        out, offset = [], 0
        rows = payloads.shape[0]
        for p, chunking in zip(self.trained, self.chunking, strict=True):
            count = chunking.chunks * chunking.k
            width = count * self.index_dtype.itemsize
            index = field(payloads, offset, width, self.index_dtype).long()
            offset += width
            if self.quantiser is None:
                width = self._value_bytes(chunking, p.dtype)
                values = field(payloads, offset, width, p.dtype)
            else:
                width = self.quantiser.header_bytes()
                header = field(payloads, offset, width, torch.float32)
                offset += width
                width = self.quantiser.code_bytes(count)
                codes = self.quantiser.unpack(payloads[:, offset:offset + width], count)
                values = self.quantiser.decode(header, codes).to(p.dtype)
            offset += width
            shape = (rows, chunking.chunks, chunking.k)
            out.append((index.view(shape), values.view(shape)))
        return out

    def decompress(self, payload: torch.Tensor) -> list[torch.Tensor]:
        """The dense tensors one worker's ``payload`` holds."""
        return [self._scatter(chunking, p, index, values) for (index, values), chunking, p
                in zip(self.decode(payload.view(1, -1)), self.chunking, self.trained,
                       strict=True)]

    @staticmethod
    def _scatter(chunking: ChunkedTopK, p: torch.Tensor, index: torch.Tensor,
                 values: torch.Tensor) -> torch.Tensor:
        """The dense tensor of the sum of the rows of ``values`` at ``index``, added in row
        order: the sum of the rows' dense tensors, bit for bit (a position a row did not
        send adds nothing, where the dense sum adds an exact zero). The k positions of one
        chunk in one row are distinct, so each ``scatter_add_`` is deterministic on every
        device."""
        total = torch.zeros(chunking.chunks, chunking.size, dtype=p.dtype, device=p.device)
        for row in range(index.shape[0]):
            total.scatter_add_(-1, index[row], values[row])
        return chunking.join(total)

    @torch.no_grad()
    def reduce(self, deltas: list[torch.Tensor]) -> None:
        """Replace each pseudo-gradient by the average over the replicas of what each sent,
        in place: one all-gather of every worker's payload, summed in rank order (the same
        sums on every worker and backend)."""
        payload, _ = self.compress(deltas)
        gathered = self.across.all_gather(payload)
        # one worker standing for all (the planner's): the mean of equal parts is the part
        same = isinstance(gathered, Copies)
        decoded = self.decode(gathered.part.view(1, -1) if same else torch.stack(gathered))
        for delta, p, chunking, (index, values) in zip(deltas, self.trained, self.chunking,
                                                      decoded, strict=True):
            total = self._scatter(chunking, p, index, values)
            if not same:
                divide_(total, len(gathered))
            delta.copy_(total.view_as(delta))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),
                "error_feedback": {name: e.clone() for name, e in self.errors.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for name, e in state["error_feedback"].items():
            if name not in self.errors:
                raise ValueError(f"state: SparseLoCo's error feedback has {name!r}, which "
                                 "the model does not train")
            self.errors[name].copy_(e)
