"""Seeded random draws made on the model's device, the same on every device.

The compressors' and SPARTA's draws follow from a seed and a few parts (a tensor's name, a
step): :func:`seed_value` turns them into one 63-bit number, the first 8 bytes of the BLAKE2b
hash of their decimal forms joined by "/".

On the CPU (:func:`on_host`) they come from a CPU ``torch.Generator`` seeded with that number,
as they always have: a CPU run draws what it drew before. On any other device a
``torch.Generator`` would not do: CUDA's draws differ from the CPU's, and for a tensor of more
than a few hundred thousand elements they depend on the GPU's number of multiprocessors (the
kernel's grid), so that two GPU models would draw different random-k positions. There the
draws are counter-based: element ``i`` of stream ``s`` is a keyed bijection of ``i`` on
``[0, 2^32)`` (:func:`keys`: two rounds of a key XOR and the ``lowbias32`` integer mix,
multiplications split so that no product overflows int64), computed with integer tensor
operations on the device. Integer arithmetic is exact on every device, so the same seed gives
the same draws on every GPU, of any model, and on the CPU when :func:`on_host` is told so (the
tests do). Nothing is read back to the host: the sizes are known beforehand.

- :func:`subset`: a uniform random ``k``-subset, the ``k`` smallest keys (distinct: a
  bijection), ascending;
- :func:`uniform`: ``key / 2^32``, float64 in [0, 1), exact;
- :func:`permutation`: the argsort of the keys;
- :func:`normal`: ``(u1 + u2 + u3 + u4 - 2) sqrt(3)`` of four streams, mean 0 and variance 1
  (Irwin-Hall: additions and one product, exact or correctly rounded on every device).
"""

from __future__ import annotations

import hashlib
import math

import torch

MASK = 0xFFFFFFFF
ROUNDS = 2


def on_host(device: torch.device) -> bool:
    """Whether draws for ``device`` come from a CPU ``torch.Generator`` (the CPU's: what a CPU
    run drew before these draws existed) rather than from :func:`keys`."""
    return device.type == "cpu"


def seed_value(seed: int, *parts: object) -> int:
    """A 63-bit seed from ``seed`` and ``parts``: the same wherever and in whatever order it
    is computed."""
    text = "/".join(str(p) for p in (seed, *parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2^32`` for ``x < 2^32``, with products below 2^49."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & MASK


def _mix(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` (C. Wellons): a bijection of [0, 2^32) with good avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def keys(seed: int, n: int, device: torch.device, stream: int = 0) -> torch.Tensor:
    """Distinct int64 keys in [0, 2^32) of ``0..n-1`` (``n <= 2^32``), a keyed bijection:
    the same on every device."""
    if torch.device(device).type == "meta":  # the timing-only simulator: a shape, no values
        return torch.empty(n, dtype=torch.int64, device=device)
    x = torch.arange(n, dtype=torch.int64, device=device)
    for r in range(ROUNDS):
        x = _mix(x ^ (seed_value(seed, stream, r) & MASK))
    return x


def subset(seed: int, numel: int, k: int, device: torch.device) -> torch.Tensor:
    """A uniform random ``k``-subset of ``range(numel)``, ascending (int64)."""
    if k == numel:
        return torch.arange(numel, device=device)
    chosen = torch.topk(keys(seed, numel, device), k, largest=False, sorted=False).indices
    return chosen.sort().values


def uniform(seed: int, n: int, device: torch.device, stream: int = 0) -> torch.Tensor:
    """``n`` uniform draws in [0, 1), float64 (multiples of 2^-32)."""
    return keys(seed, n, device, stream).to(torch.float64).mul_(2.0**-32)


def permutation(seed: int, n: int, device: torch.device) -> torch.Tensor:
    """A uniform random permutation of ``0..n-1`` (int64)."""
    return torch.argsort(keys(seed, n, device))


def normal(seed: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Approximately standard normal draws, float64: a centred, scaled sum of four uniforms
    of streams 0 to 3."""
    n = math.prod(shape)
    total = uniform(seed, n, device, 0)
    for stream in (1, 2, 3):
        total.add_(uniform(seed, n, device, stream))
    return total.sub_(2.0).mul_(math.sqrt(3.0)).view(shape)
