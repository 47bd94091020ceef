"""The compression protocol: a :class:`Compressor` makes typed payloads, a :class:`Memory`
keeps what was not sent, and the two are composed in one place
(:class:`~gossamer.compress.reducer.CompressedReducer`): compensate, compress, send, update.

A compressor declares how its payloads aggregate, ``"allreduce"`` (dense or low-rank payloads,
whose sum is the payload of the sum), ``"allgather"`` (sparse or quantized payloads, which
every worker decompresses and adds) or ``"sparse_allreduce"`` (top-k and DGC's payloads,
reduced by regions and re-selected: :mod:`gossamer.compress.sparse_allreduce`), and the
combination is checked when it is built (:func:`resolve_aggregation`), not left to prose.

Compressors and memories are frozen keyword-only dataclasses: the fields are the
configuration, checked on construction; the per-tensor state (residuals, PowerSGD's factors)
lives in private containers, keyed by the tensor's name, and is saved by ``state_dict()``.
:meth:`Compressor.for_worker` and :meth:`Memory.fresh` give each worker its own empty copy,
so that one configuration can be shared by every simulated worker.

Values are computed, kept and sent in :func:`value_dtype` of the gradient: float32, or float64
for a float64 model, so that a float64 model keeps its precision (float16 values and the fp16
and bf16 compressors narrow them on purpose).

Randomness (random-k's indices, QSGD's rounding, PowerSGD's start, DGC's sample) is drawn from
``(seed, tensor name, step)`` (:meth:`Compressor.seed_parts`): it does not depend on the order
in which tensors are compressed, so DDP's buckets and gossamer's give the same result. On the
CPU it comes from a ``torch.Generator`` of that seed, on other devices from counter-based draws
made there, the same on every device (:mod:`gossamer.compress.draws`).
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Literal

import torch

from gossamer.compress.draws import seed_value
from gossamer.compress.payloads import Payload

Aggregation = Literal["allreduce", "allgather", "sparse_allreduce"]
AGGREGATIONS: tuple[Aggregation, ...] = ("allreduce", "allgather", "sparse_allreduce")


def value_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which a gradient of ``dtype`` is compressed, remembered and sent: float32
    for float32, float16 and bfloat16 gradients, float64 for float64 ones."""
    return torch.promote_types(dtype, torch.float32)


def check_ratio(name: str, value: object) -> None:
    """``value`` must be a number in (0, 1] (a fraction of the elements)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
            or not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")


def seeded_generator(seed: int, *parts: object, device: torch.device | str = "cpu"
                     ) -> torch.Generator:
    """A generator seeded from ``seed`` and ``parts`` (a tensor's name, a step...): the same
    draws wherever and in whatever order it is made."""
    return torch.Generator(device=device).manual_seed(seed_value(seed, *parts))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Compressor(ABC):
    """Turns a tensor into a :class:`~gossamer.compress.payloads.Payload` and back.

    Subclasses set :attr:`aggregations` (those their payloads support, the first is the
    default) and :attr:`rounds` (PowerSGD's two all-reduces).
    """

    #: How payloads may be combined across workers, the default first.
    aggregations: ClassVar[tuple[Aggregation, ...]] = ("allreduce", "allgather")
    #: Collectives per step: round r > 0 is made by :meth:`next_round` from round r - 1's sum.
    rounds: ClassVar[int] = 1

    # internal state: the current step (for seeds and warm-up), the run's length (where the
    # training loop tells it: warm-up schedules fitted to the run) and the worker's index
    _step: list[int] = dataclasses.field(default_factory=lambda: [0], init=False, repr=False,
                                         compare=False)
    _total_steps: list[int | None] = dataclasses.field(default_factory=lambda: [None],
                                                       init=False, repr=False, compare=False)
    _worker: list[int] = dataclasses.field(default_factory=lambda: [0], init=False, repr=False,
                                           compare=False)

    def compresses(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is compressed; the others are all-reduced dense (default: all)."""
        return True

    @abstractmethod
    def compress(self, tensor: torch.Tensor, key: str) -> Payload:
        """This worker's payload for ``tensor`` (named ``key``); ``tensor`` is not modified."""

    @abstractmethod
    def decompress(self, payload: Payload, key: str) -> torch.Tensor:
        """The dense tensor that ``payload`` stands for (a new tensor, shaped as the input)."""

    def next_round(self, summed: Payload, key: str) -> Payload:
        """The next round's payload, from the sum over workers of this round's."""
        raise NotImplementedError(f"{type(self).__name__} has a single round")

    def decompress_sum(self, summed: Payload, key: str) -> torch.Tensor:
        """The sum of the workers' tensors from the sum of their (all-reduced) payloads."""
        return self.decompress(summed, key)

    def share(self, tensor: torch.Tensor, key: str, world_size: int) -> Payload:
        """This worker's payload of ``tensor`` for an all-reduce over ``world_size`` workers:
        its :meth:`compress` (a compressor whose narrow sum could overflow where the average
        fits sends its share of the average instead, :class:`~gossamer.compress.FP16`)."""
        return self.compress(tensor, key)

    def decompress_average(self, summed: Payload, key: str, world_size: int) -> torch.Tensor:
        """The average over ``world_size`` workers from the all-reduced sum of their
        :meth:`share` payloads."""
        return self.decompress_sum(summed, key).div_(world_size)

    def decompress_add(self, payload: Payload, key: str, out: torch.Tensor) -> None:
        """``out += decompress(payload)``, for gathered payloads (sparse ones override it)."""
        out.add_(self.decompress(payload, key).view_as(out))

    # -- per worker and per step ---------------------------------------------------------------

    def for_worker(self, index: int) -> Compressor:
        """An empty copy of this compressor for worker ``index`` (workers that must draw the
        same random numbers, such as the members of a node, share an index)."""
        fresh = dataclasses.replace(self)
        fresh._worker[0] = index
        fresh._total_steps[0] = self.total_steps  # the run's, not the worker's
        return fresh

    def set_step(self, step: int) -> None:
        """The optimizer step about to be compressed (seeds, warm-up schedules)."""
        self._step[0] = step

    @property
    def step(self) -> int:
        return self._step[0]

    def set_total_steps(self, total_steps: int | None) -> None:
        """The run's length in optimizer steps, where the training loop knows it (None: not
        known): DGC fits its default density warm-up to it."""
        self._total_steps[0] = total_steps

    @property
    def total_steps(self) -> int | None:
        return self._total_steps[0]

    def generator(self, key: str, device: torch.device, *, per_worker: bool = False
                  ) -> torch.Generator:
        """The generator of ``key`` at this step (of this worker, with ``per_worker``)."""
        return seeded_generator(*self.seed_parts(key, per_worker=per_worker), device=device)

    def seed_parts(self, key: str, *, per_worker: bool = False) -> tuple[object, ...]:
        """What seeds the draws of ``key`` at this step: the option ``seed``, the key, the
        step (and this worker's index, with ``per_worker``); the generator's seed and the
        counter-based draws' (:mod:`gossamer.compress.draws`) are made from it."""
        parts: tuple[object, ...] = (getattr(self, "seed", 0), key, self.step)
        if per_worker:
            parts += (self._worker[0],)
        return parts

    def draw_seed(self, key: str, *, per_worker: bool = False) -> int:
        """The seed of :mod:`gossamer.compress.draws`' counter-based draws of ``key``."""
        return seed_value(*self.seed_parts(key, per_worker=per_worker))

    def state_dict(self) -> dict[str, Any]:
        """Per-tensor state to checkpoint (default: none)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Memory(ABC):
    """What a worker keeps between steps: error feedback's residual, DGC's velocities.

    ``compensate`` returns the tensor to compress (it may be the memory's own buffer), and
    ``update`` is told what was sent, once the step's collectives are done.
    """

    @abstractmethod
    def compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """The gradient plus what was kept back; ``grad`` itself is not modified."""

    @abstractmethod
    def update(self, key: str, compensated: torch.Tensor, payload: Payload,
               compressor: Compressor) -> None:
        """Keep what ``payload`` (made by ``compressor`` from ``compensated``) did not send."""

    def fresh(self) -> Memory:
        """An empty copy, for one worker."""
        return dataclasses.replace(self)

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def resolve_aggregation(compressor: Compressor, aggregation: str | None) -> Aggregation:
    """The aggregation to use: ``aggregation`` if ``compressor`` supports it, else a ValueError
    naming it (a sparse payload cannot be all-reduced); None: the compressor's default."""
    if aggregation is None:
        return compressor.aggregations[0]
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)} or None, "
                         f"got {aggregation!r}")
    if aggregation == "sparse_allreduce" and aggregation not in compressor.aggregations:
        raise ValueError(
            f"aggregation='sparse_allreduce' needs a compressor that selects entries by "
            f"magnitude (TopK, DGCCompressor), got {type(compressor).__name__}; it supports: "
            f"{', '.join(compressor.aggregations)}")
    if aggregation not in compressor.aggregations:
        kind = "sparse or quantized" if "allgather" in compressor.aggregations else "low-rank"
        raise ValueError(
            f"aggregation={aggregation!r} cannot carry {type(compressor).__name__}'s {kind} "
            f"payloads; it supports: {', '.join(compressor.aggregations)}"
        )
    return aggregation  # type: ignore[return-value]
