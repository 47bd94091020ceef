"""Compressors by name: ``"dgc:ratio=0.001"`` -> a :class:`Compression`, for the command line,
recipes and DDP hooks.

Each registered compressor has one entry: a frozen keyword-only dataclass whose fields are its
options, the memory choice included (error feedback; DGC's momentum correction, masking and
clipping). A compressor's own options take their default and help from the
:class:`~gossamer.compress.Compressor` class that implements them (:func:`option_of`), so that
each is written once; the registry aliases of :mod:`gossamer.algorithms.compressed`, the DDP
hook states of :mod:`gossamer.hooks.compression` and the help texts all derive from the entry.

A spec is ``NAME`` or ``NAME:KEY=VALUE:KEY=VALUE`` (values converted to the options' types,
as ``--option`` does), or a mapping ``{"name": NAME, **options}`` (YAML). Example::

    available_compressors()                  # ['dgc', 'fp16', 'powersgd', 'qsgd', ...]
    c = parse_compression("dgc:ratio=0.001:warmup_steps=60")
    str(c)                                    # 'dgc:warmup_steps=60' (ratio is the default)
    c.as_dict()                               # {'name': 'dgc', 'ratio': 0.001, ...}
    compressor, memory = c.build(world_size=8)

    algorithm = AllReduce(compression=c)  # gossamer.algorithms.with_compression does it by name
    # command line: gossamer train --algorithm allreduce --compressor dgc:ratio=0.001
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from gossamer.compress.base import Compressor, Memory
from gossamer.compress.cast import BF16, FP16
from gossamer.compress.dgc import DGCCompressor, DGCMemory
from gossamer.compress.memory import ErrorFeedback
from gossamer.compress.powersgd import PowerSGD
from gossamer.compress.qsgd import QSGD
from gossamer.compress.sparse import RandomK, TopK
from gossamer.options import converted, option, option_of

__all__ = [
    "Compression",
    "DGCCompression",
    "FP16Compression",
    "PowerSGDCompression",
    "QSGDCompression",
    "RandomKCompression",
    "TopKCompression",
    "available_compressors",
    "lookup_compression",
    "option_of",
    "parse_compression",
    "register_compression",
]

_REGISTRY: dict[str, type[Compression]] = {}

C = TypeVar("C", bound=type["Compression"])


@dataclass(frozen=True, kw_only=True)
class Compression(ABC):
    """A registered compressor with its options: what ``--compressor NAME:KEY=VALUE`` names.

    Subclasses are frozen keyword-only dataclasses, registered with
    :func:`register_compression` under :attr:`name`. Bad options are a ValueError naming the
    option when the object is built (the compressor's and memory's own checks).
    """

    #: The registry name, used by the command line, recipes and hooks.
    name: ClassVar[str]

    def __post_init__(self) -> None:
        self.build(1)  # the compressor's and the memory's checks name the option

    @abstractmethod
    def build(self, world_size: int) -> tuple[Compressor, Memory | None]:
        """A new compressor and memory (None: none) for a world of ``world_size`` workers:
        the number of gradients the compressed exchange averages (with a hierarchy of nodes,
        the number of nodes)."""

    def options(self) -> dict[str, Any]:
        """Every option by name, defaults included."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    def as_dict(self) -> dict[str, Any]:
        """``{"name": ..., **options}``, every option included: for YAML; parses back to an
        equal object (:func:`parse_compression`)."""
        return {"name": self.name, **self.options()}

    def __str__(self) -> str:
        """The spec ``NAME[:KEY=VALUE...]`` of the options that differ from the defaults."""
        default = type(self)()
        parts = [self.name] + [f"{key}={_spec_value(value)}" for key, value in
                               self.options().items() if value != getattr(default, key)]
        return ":".join(parts)


def _spec_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    return repr(value) if isinstance(value, float) else str(value)


def register_compression(cls: C) -> C:
    """Class decorator: make the :class:`Compression` ``cls`` available under ``cls.name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"compressor name {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def available_compressors() -> list[str]:
    """The registered compressor names, sorted."""
    return sorted(_REGISTRY)


def lookup_compression(name: str) -> type[Compression]:
    """The entry class of ``name``; ValueError listing the known names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"compressor {name!r} is unknown; known compressors: "
                         f"{', '.join(available_compressors())}") from None


def parse_compression(spec: str | Mapping[str, Any] | Compression) -> Compression:
    """The :class:`Compression` that ``spec`` names.

    Args:
        spec: ``"NAME"`` or ``"NAME:KEY=VALUE:KEY=VALUE"`` (values converted to the options'
            types: ``true``/``false``, ``none``, numbers); a mapping ``{"name": NAME,
            **options}`` (values as they are, or strings); or a :class:`Compression`, returned
            as it is.

    Unknown names and options are a ValueError naming them and listing the known ones.

    Example::

        parse_compression("topk:ratio=0.05:error_feedback=false")
        parse_compression({"name": "qsgd", "levels": 7})
    """
    if isinstance(spec, Compression):
        if type(spec) is not _REGISTRY.get(spec.name):
            raise ValueError(f"compressor: {type(spec).__name__} is not the registered "
                             f"compressor {spec.name!r}; give its spec, e.g. {spec.name!r}")
        return spec
    if isinstance(spec, str):
        name, *pairs = (part.strip() for part in spec.split(":"))
        options: dict[str, Any] = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"compressor {spec!r}: {pair!r} is not KEY=VALUE (a spec is "
                                 "NAME[:KEY=VALUE...], e.g. 'dgc:ratio=0.001')")
            options[key.strip()] = value.strip()
    elif isinstance(spec, Mapping):
        options = dict(spec)
        if "name" not in options:
            raise ValueError(f"compressor: a mapping needs a 'name', got {spec!r}")
        name = options.pop("name")
    else:
        raise ValueError(f"compressor must be a spec 'NAME[:KEY=VALUE...]', a mapping with a "
                         f"'name' or a Compression, got {spec!r}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"compressor: no name in {spec!r}; known compressors: "
                         f"{', '.join(available_compressors())}")
    cls = lookup_compression(name)
    kwargs = converted(cls, options, owner=f"compressor {name!r}")
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ValueError(f"compressor {name!r}: {e}") from None


def _error_feedback(on: bool) -> Memory | None:
    return ErrorFeedback() if on else None


# -- the entries ------------------------------------------------------------------------------


@register_compression
@dataclass(frozen=True, kw_only=True)
class DGCCompression(Compression):
    """Deep Gradient Compression (Lin et al., ICLR 2018): sparse, momentum-corrected gradients.

    :class:`~gossamer.compress.DGCCompressor` with :class:`~gossamer.compress.DGCMemory`
    (momentum correction, local accumulation, momentum factor masking, local clipping). The
    memory takes the momentum, Nesterov and weight decay of a ``torch.optim.SGD`` over when
    bound. See :mod:`gossamer.compress.dgc`.
    """

    name: ClassVar[str] = "dgc"

    ratio: float = option_of(DGCCompressor, "ratio")
    sample_ratio: float = option_of(DGCCompressor, "sample_ratio")
    warmup_steps: int | None = option_of(DGCCompressor, "warmup_steps")
    warmup_stages: int = option_of(DGCCompressor, "warmup_stages")
    momentum_masking: bool = option_of(DGCMemory, "masking")
    # the paper's global threshold (Section 3.2): node k clips its share g_k / n of the
    # average at clip_norm / sqrt(n), that is its own mean gradient g_k at clip_norm * sqrt(n)
    clip_norm: float | None = option(None, "local gradient clipping, the threshold of the "
                                     "averaged gradient: each worker clips each tensor of its "
                                     "gradient to clip_norm * sqrt(workers) (nodes, with "
                                     "node_size); none: no clipping")
    fp16_values: bool = option_of(DGCCompressor, "fp16_values")
    weight_decay_in_gradient: bool = option_of(DGCMemory, "weight_decay_in_gradient")
    seed: int = option_of(DGCCompressor, "seed")

    def build(self, world_size: int) -> tuple[DGCCompressor, DGCMemory]:
        compressor = DGCCompressor(ratio=self.ratio, sample_ratio=self.sample_ratio,
                                   warmup_steps=self.warmup_steps,
                                   warmup_stages=self.warmup_stages,
                                   fp16_values=self.fp16_values, seed=self.seed)
        clip = None if self.clip_norm is None else self.clip_norm * math.sqrt(world_size)
        memory = DGCMemory(momentum=None, masking=self.momentum_masking, clip_norm=clip,
                           weight_decay_in_gradient=self.weight_decay_in_gradient)
        return compressor, memory


@register_compression
@dataclass(frozen=True, kw_only=True)
class TopKCompression(Compression):
    """Exact top-k sparsification with error feedback.

    :class:`~gossamer.compress.TopK`, all-gathered."""

    name: ClassVar[str] = "topk"

    ratio: float = option_of(TopK, "ratio")
    # without it top-k drops most of the gradient for good
    error_feedback: bool = option(True, "keep what was not sent for later steps")
    fp16_values: bool = option_of(TopK, "fp16_values")

    def build(self, world_size: int) -> tuple[TopK, Memory | None]:
        return (TopK(ratio=self.ratio, fp16_values=self.fp16_values),
                _error_feedback(self.error_feedback))


@register_compression
@dataclass(frozen=True, kw_only=True)
class RandomKCompression(Compression):
    """Random-k sparsification with error feedback, at positions every worker draws alike.

    Only the values travel (:class:`~gossamer.compress.RandomK`)."""

    name: ClassVar[str] = "randomk"

    ratio: float = option_of(RandomK, "ratio")
    error_feedback: bool = option(True, "keep what was not sent for later steps")
    seed: int = option_of(RandomK, "seed")

    def build(self, world_size: int) -> tuple[RandomK, Memory | None]:
        return RandomK(ratio=self.ratio, seed=self.seed), _error_feedback(self.error_feedback)


@register_compression
@dataclass(frozen=True, kw_only=True)
class QSGDCompression(Compression):
    """QSGD stochastic quantization (Alistarh et al., NeurIPS 2017), unbiased.

    :class:`~gossamer.compress.QSGD`; without error feedback by default."""

    name: ClassVar[str] = "qsgd"

    levels: int = option_of(QSGD, "levels")
    bucket_size: int = option_of(QSGD, "bucket_size")
    error_feedback: bool = option(False, "keep the quantization error for later steps (QSGD "
                                  "is unbiased without it)")
    seed: int = option_of(QSGD, "seed")

    def build(self, world_size: int) -> tuple[QSGD, Memory | None]:
        return (QSGD(levels=self.levels, bucket_size=self.bucket_size, seed=self.seed),
                _error_feedback(self.error_feedback))


@register_compression
@dataclass(frozen=True, kw_only=True)
class PowerSGDCompression(Compression):
    """PowerSGD low-rank compression (Vogels et al., NeurIPS 2019), with error feedback.

    :class:`~gossamer.compress.PowerSGD`, in two all-reduces."""

    name: ClassVar[str] = "powersgd"

    rank: int = option_of(PowerSGD, "rank")
    warm_start: bool = option_of(PowerSGD, "warm_start")
    error_feedback: bool = option(True, "keep what the approximation missed for later steps")
    seed: int = option_of(PowerSGD, "seed")

    def build(self, world_size: int) -> tuple[PowerSGD, Memory | None]:
        return (PowerSGD(rank=self.rank, warm_start=self.warm_start, seed=self.seed),
                _error_feedback(self.error_feedback))


@register_compression
@dataclass(frozen=True, kw_only=True)
class FP16Compression(Compression):
    """Values in float16 or bfloat16: half the bytes, no memory.

    :class:`~gossamer.compress.FP16` or :class:`~gossamer.compress.BF16`."""

    name: ClassVar[str] = "fp16"

    dtype: str = option("float16", "float16, or bfloat16: float32's range, fewer mantissa bits")

    def build(self, world_size: int) -> tuple[FP16, None]:
        if self.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"dtype must be 'float16' or 'bfloat16', got {self.dtype!r}")
        return (FP16() if self.dtype == "float16" else BF16()), None
