"""Gradient compression: compressors with typed payloads, and the memories that keep what was
not sent.

- Compressors (:class:`Compressor`): :class:`NoCompression`, :class:`FP16`, :class:`BF16`,
  :class:`TopK`, :class:`RandomK`, :class:`DGCCompressor`, :class:`QSGD`, :class:`PowerSGD`,
  :class:`Statistical` (MuLoCo's and SparseLoCo's quantiser; not a ``--compressor`` name).
  Each declares how its payloads aggregate (``aggregations``): a sparse payload cannot be
  all-reduced, and asking for it is a ValueError when the combination is built.
- Payloads (:mod:`gossamer.compress.payloads`) know their bytes on the wire.
- Memories (:class:`Memory`): :class:`ErrorFeedback`, and DGC's momentum correction
  :class:`DGCMemory`.
- :class:`CompressedReducer` composes them over a communicator; it is what
  ``AllReduce(compressor=..., memory=...)`` and the DDP hooks of :mod:`gossamer.hooks` use.
- The registry (:mod:`gossamer.compress.registry`): each compressor by name, with its options
  and memory choice, as a :class:`Compression` (``"dgc:ratio=0.001"``).

Example::

    from gossamer.algorithms import AllReduce
    from gossamer.compress import DGCCompressor, DGCMemory, parse_compression

    algorithm = AllReduce(compressor=DGCCompressor(ratio=0.001), memory=DGCMemory())
    algorithm = AllReduce(compression=parse_compression("dgc:ratio=0.001"))  # the same
"""

from gossamer.compress.base import (
    AGGREGATIONS,
    Aggregation,
    Compressor,
    Memory,
    resolve_aggregation,
)
from gossamer.compress.cast import BF16, FP16, NoCompression
from gossamer.compress.dgc import DGCCompressor, DGCMemory, take_over_momentum, warmup_density
from gossamer.compress.memory import ErrorFeedback
from gossamer.compress.payloads import (
    DensePayload,
    LowRankPayload,
    Payload,
    QuantizedPayload,
    SharedIndexPayload,
    SparsePayload,
)
from gossamer.compress.powersgd import PowerSGD
from gossamer.compress.qsgd import QSGD
from gossamer.compress.reducer import CompressedReducer
from gossamer.compress.registry import (
    Compression,
    available_compressors,
    lookup_compression,
    parse_compression,
)
from gossamer.compress.sparse import RandomK, TopK
from gossamer.compress.statistical import Statistical

__all__ = [
    "AGGREGATIONS",
    "BF16",
    "FP16",
    "QSGD",
    "Aggregation",
    "CompressedReducer",
    "Compression",
    "Compressor",
    "DGCCompressor",
    "DGCMemory",
    "DensePayload",
    "ErrorFeedback",
    "LowRankPayload",
    "Memory",
    "NoCompression",
    "Payload",
    "PowerSGD",
    "QuantizedPayload",
    "RandomK",
    "SharedIndexPayload",
    "SparsePayload",
    "Statistical",
    "TopK",
    "available_compressors",
    "lookup_compression",
    "parse_compression",
    "resolve_aggregation",
    "take_over_momentum",
    "warmup_density",
]
