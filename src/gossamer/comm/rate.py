"""Data rates: one unit (bytes per second) inside, the units people write outside.

Every rate gossamer takes (the simulator's ``NetworkModel(bandwidth=...)``, an emulated link's
``LinkSpec(bandwidth=...)``, ``--bandwidth``, ``--emulate bandwidth=...``) goes through
:func:`parse_rate` and is kept in bytes per second; :func:`format_rate` writes one back in the
unit networks are sold in.

Example::

    parse_rate("1gbit")      # 125000000.0
    parse_rate("125MB/s")    # 125000000.0
    parse_rate(12.5e6)       # 12500000.0: a bare number is bytes per second
    format_rate(125e6)       # '1 Gbit/s'
"""

from __future__ import annotations

import math
import re

__all__ = ["format_rate", "parse_rate"]

_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BINARY = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_NUMBER = r"([+-]?[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|[+-]?\.[0-9]+(?:[eE][+-]?[0-9]+)?)"
# bits: 1gbit, 100 Mbit/s (tc's spelling, any case); bytes: 125MB/s, 1.5 GiB/s (capital B, /s)
_BITS = re.compile(_NUMBER + r"\s*([kmgtKMGT]?)bit(?:/s)?", re.IGNORECASE)
_BYTES = re.compile(_NUMBER + r"\s*([kmgtKMGT]i?|)B/s")
_EXAMPLES = "1gbit, 100mbit, 125MB/s, 1.5GB/s or 12.5e6 (a bare number is bytes per second)"


def parse_rate(value: str | float, arg: str = "rate") -> float:
    """A rate in bytes per second, from a number or a string with its unit.

    A bare number (``12.5e6``, ``"12.5e6"``) is bytes per second. Bits are written as tc
    writes them, in any case, with or without ``/s``: ``500kbit``, ``100mbit``,
    ``1 Gbit/s``. Bytes are a capital ``B`` with ``/s``: ``125MB/s``, ``1.5GB/s``,
    ``1GiB/s`` (binary prefixes with ``i``). Prefixes are decimal otherwise (``1gbit`` is
    1e9 bits). ``bps`` is refused: tc reads it as bytes, most people as bits.

    Args:
        value: the rate.
        arg: what the rate is, for the error message (default ``"rate"``).

    Raises ValueError naming ``arg`` when ``value`` is not a rate, or not a finite one > 0.
    """
    if isinstance(value, bool):
        raise ValueError(f"{arg} must be a rate such as {_EXAMPLES}, got {value!r}")
    if isinstance(value, (int, float)):
        rate = float(value)
    elif isinstance(value, str):
        rate = _parse_text(value, arg)
    else:
        raise ValueError(f"{arg} must be a rate such as {_EXAMPLES}, got {value!r}")
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"{arg} must be a rate > 0 bytes per second, got {value!r}")
    return rate


def _parse_text(value: str, arg: str) -> float:
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    if re.search(r"bps$", text, re.IGNORECASE):
        raise ValueError(f"{arg}={value!r} is not a rate: 'bps' is ambiguous (tc reads bytes, "
                         "most people bits); write bit or B/s, e.g. 100mbit or 12.5MB/s")
    match = _BITS.fullmatch(text)
    if match is not None:
        return float(match.group(1)) * _PREFIXES[match.group(2).lower()] / 8
    match = _BYTES.fullmatch(text)
    if match is not None:
        prefix = match.group(2).lower()
        return float(match.group(1)) * (_BINARY[prefix] if prefix.endswith("i")
                                        else _PREFIXES[prefix])
    raise ValueError(f"{arg}={value!r} is not a rate such as {_EXAMPLES}")


def format_rate(bytes_per_s: float) -> str:
    """``bytes_per_s`` in bits per second with a decimal prefix: ``125e6`` is ``'1 Gbit/s'``,
    ``12.5e6`` is ``'100 Mbit/s'``; :func:`parse_rate` reads it back."""
    bits = float(bytes_per_s) * 8
    for unit, scale in (("Tbit", 1e12), ("Gbit", 1e9), ("Mbit", 1e6), ("kbit", 1e3)):
        if abs(bits) >= scale:
            return f"{bits / scale:g} {unit}/s"
    return f"{bits:g} bit/s"
