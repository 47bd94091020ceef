"""Names of algorithms for the command line and recipes: ``"allreduce"`` -> :class:`AllReduce`.

Python users construct the configuration classes directly; the registry exists so that a
name and a few ``key=value`` options from a command line or YAML file build the same thing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gossamer.algorithms.base import Algorithm
from gossamer.algorithms.compressed import CompressionPreset
from gossamer.options import converted, describe_options

if TYPE_CHECKING:
    from gossamer.compress.registry import Compression

#: a method's configuration class, or a preset of another method's (``dgc``: allreduce with
#: DGC's compressor)
Entry = type[Algorithm] | CompressionPreset

_REGISTRY: dict[str, Entry] = {}


def register(cls: Entry) -> Entry:
    """Class decorator: make ``cls`` (or a preset) available under ``cls.name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"algorithm name {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> list[str]:
    """The registered algorithm names, sorted."""
    return sorted(_REGISTRY)


def lookup(name: str) -> Entry:
    """The configuration class (or preset) of ``name``; ValueError listing the known names
    otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"algorithm {name!r} is unknown; known algorithms: {', '.join(available())}"
        ) from None


def create(name: str, options: Mapping[str, Any] | None = None) -> Algorithm:
    """Build the algorithm ``name`` with ``options`` (strings are converted to field types).

    Example::

        create("allreduce", {"bucket_mb": "10"})  # AllReduce(bucket_mb=10.0)
    """
    cls = lookup(name)
    if isinstance(cls, CompressionPreset):
        return cls.create(options or {})
    return cls(**converted(cls, options or {}, owner=f"algorithm {name!r}",
                           renamed=cls.renamed_options, retired=cls.retired_options))


def describe(name: str) -> list[tuple[str, str, Any]]:
    """(option, type, default) for each option of ``name``, for help texts."""
    return [(option, tp, default) for option, tp, default, _ in describe_help(name)]


def describe_help(name: str) -> list[tuple[str, str, Any, str]]:
    """(option, type, default, help) for each option of ``name``."""
    cls = lookup(name)
    return cls.describe() if isinstance(cls, CompressionPreset) else describe_options(cls)


def summary(name: str) -> str:
    """The first paragraph of the description of ``name``, on one line."""
    cls = lookup(name)
    text = cls.doc if isinstance(cls, CompressionPreset) else (cls.__doc__ or "")
    paragraph = text.strip().split("\n\n")[0]
    return " ".join(line.strip() for line in paragraph.splitlines())


def with_compression(algorithm: Algorithm,
                     compression: str | Mapping[str, Any] | Compression) -> Algorithm:
    """``algorithm``, a gradient-level method, sending its gradients through ``compression``.

    The methods that take a compressor have a ``compression`` option (``allreduce``,
    ``gossipgrad``, ``diloco`` for its pseudo-gradients); any other is a ValueError naming
    the ``compressor`` argument and them.
    A compression the algorithm already holds is replaced.

    Example::

        with_compression(AllReduce(bucket_mb=10), "dgc:ratio=0.001")
        # AllReduce(bucket_mb=10, compression=DGCCompression(ratio=0.001, ...))
    """
    from gossamer.compress.registry import parse_compression

    compression = parse_compression(compression)
    if _takes_compression(type(algorithm)):
        return dataclasses.replace(algorithm, compression=compression)  # type: ignore[type-var]
    takers = [name for name in available() if _takes_compression(lookup(name))]
    raise ValueError(f"compressor: algorithm {algorithm.name!r} does not take a compressor; "
                     f"the methods that do: {', '.join(takers)}")


def _takes_compression(cls: Entry) -> bool:
    """Whether ``cls`` has a ``compression`` option (a preset has its compressor already)."""
    return isinstance(cls, type) and dataclasses.is_dataclass(cls) and any(
        f.name == "compression" and f.init for f in dataclasses.fields(cls))
