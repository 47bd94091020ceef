"""Compressed AllReduce-SGD under the compressors' names: ``dgc``, ``topk``, ``randomk``,
``qsgd``, ``powersgd``, ``fp16`` as ``--algorithm``.

Each is a registry preset, not a method of its own: ``allreduce`` with the registered
compressor of the same name (:mod:`gossamer.compress.registry`). Its options are that
compressor's and a few of AllReduce's (``bucket_mb`` and ``overlap``; ``node_size`` for
``dgc``; ``aggregation`` for ``dgc`` and ``topk``). ``--algorithm dgc --option ratio=0.001``,
``--algorithm allreduce --compressor dgc:ratio=0.001`` and, in Python,
``AllReduce(compression="dgc:ratio=0.001")`` or ``DGC(ratio=0.001)`` build the same
:class:`~gossamer.algorithms.AllReduce`, whose :attr:`~gossamer.algorithms.AllReduce.label`
is ``dgc``.

Example::

    gossamer train --sim 4 --algorithm dgc      # warm-up: the first quarter of the run
    gossamer train --sim 4 --algorithm dgc --option ratio=0.001 --option warmup_steps=60

    optimizer = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1,
                                                           momentum=0.9), DGC(ratio=0.001),
                                    total_steps=1000)  # density warm-up: its first 250 steps
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from gossamer.algorithms.allreduce import AllReduce
from gossamer.compress.registry import Compression, lookup_compression
from gossamer.options import converted, describe_options

__all__ = ["DGC", "PRESETS", "CompressionPreset", "FP16AllReduce", "PowerSGDAllReduce",
           "QSGDAllReduce", "RandomKAllReduce", "TopKAllReduce"]


@dataclass(frozen=True)
class CompressionPreset:
    """The registry name ``name`` for ``AllReduce(compression=<the compressor name>)``, with
    the compressor's options and AllReduce's ``allreduce_options``. Called with options (as
    Python keywords) or :meth:`create` (from a command line or a file), it builds the
    :class:`~gossamer.algorithms.AllReduce`."""

    name: str
    doc: str
    allreduce_options: tuple[str, ...] = ("bucket_mb", "overlap")
    needs: str = ""
    renamed_options: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    retired_options: Mapping[str, tuple[Any, str]] = field(
        default_factory=lambda: MappingProxyType({}))
    continues_after_failure: bool = AllReduce.continues_after_failure

    @property
    def compression(self) -> type[Compression]:
        """The registered compressor's entry."""
        return lookup_compression(self.name)

    def option_names(self) -> list[str]:
        """The compressor's options, then AllReduce's that the preset offers."""
        return [f.name for f in dataclasses.fields(self.compression) if f.init] + list(
            self.allreduce_options)

    def describe(self) -> list[tuple[str, str, Any, str]]:
        """(option, type, default, help) of each option."""
        rows = {row[0]: row for row in describe_options(AllReduce)}
        return describe_options(self.compression) + [rows[n] for n in self.allreduce_options]

    def create(self, options: Mapping[str, Any]) -> AllReduce:
        """The AllReduce for ``options`` by name (strings converted to the options' types);
        ValueError naming an unknown option and listing the preset's."""
        owner = f"algorithm {self.name!r}"
        known = self.option_names()
        for key in options:
            if key not in known:
                raise ValueError(f"{owner} has no option {key!r}; its options: "
                                 f"{', '.join(sorted(known))}")
        mine = {k: v for k, v in options.items() if k in self.allreduce_options}
        theirs = {k: v for k, v in options.items() if k not in self.allreduce_options}
        compression = self.compression(**converted(self.compression, theirs, owner))
        return AllReduce(compression=compression, **converted(AllReduce, mine, owner))

    def __call__(self, **options: Any) -> AllReduce:
        return self.create(options)


DGC = CompressionPreset(
    "dgc", "Deep Gradient Compression (Lin et al., ICLR 2018): sparse, momentum-corrected "
    "gradients.\n\nThreshold sparsification of about ratio of each gradient, momentum "
    "correction, local accumulation, momentum factor masking, optional local clipping and "
    "density warm-up (by default the paper's schedule over the first quarter of the run); "
    "fp16 values and int32 positions, all-gathered (see gossamer.compress.dgc).",
    allreduce_options=("bucket_mb", "overlap", "node_size", "aggregation"))
TopKAllReduce = CompressionPreset(
    "topk", "Exact top-k sparsification with error feedback, all-gathered.",
    allreduce_options=("bucket_mb", "overlap", "aggregation"))
RandomKAllReduce = CompressionPreset(
    "randomk", "Random-k sparsification with error feedback, at positions every worker draws "
    "alike; only the values travel, all-reduced.",
    needs="its defaults (ratio 0.01, error feedback) diverge with momentum SGD on digits (24.5% "
    "after 300 steps); ratio=0.1 with error_feedback=false reaches 90.5%, ratio=0.25 89.4%, "
    "against 96.9% for allreduce")
QSGDAllReduce = CompressionPreset(
    "qsgd", "QSGD stochastic quantization (Alistarh et al., NeurIPS 2017), all-gathered.")
PowerSGDAllReduce = CompressionPreset(
    "powersgd", "PowerSGD low-rank compression (Vogels et al., NeurIPS 2019), in two "
    "all-reduces.")
FP16AllReduce = CompressionPreset(
    "fp16", "Gradients all-reduced in float16 or bfloat16: half the bytes.")

#: the presets, in the order ``gossamer algorithms`` lists them
PRESETS = (DGC, TopKAllReduce, RandomKAllReduce, QSGDAllReduce, PowerSGDAllReduce,
           FP16AllReduce)
