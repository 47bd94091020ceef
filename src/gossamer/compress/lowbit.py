"""Low-precision wire formats for a dense float32 vector: float32, bfloat16, int8 and int4.

``float32`` is the unquantised vector (a float64 one travels as it is).

A :class:`LowBit` codec turns a float32 vector into the tensor that travels and back. The
integer formats are symmetric and uniform: one float32 scale per vector, ``max |x| / q_max``
(``q_max`` = 127 for int8, 7 for int4), and each element rounded to the nearest multiple of it
(round half to even), so that ``|x - decode(encode(x))| <= scale / 2`` elementwise and zero
stays exactly zero. int4 packs two elements per byte. The payload is a uint8 tensor: the
scale's 4 bytes, then the elements. Rounding is deterministic: every worker that encodes the
same vector sends the same bytes.

Streaming DiLoCo (Douillard et al. 2025) sends its pseudo-gradients in 4 bits (an E3M0
floating-point format there); these formats are the uniform integer counterparts, with the
error each worker makes kept by the caller (error feedback), so that nothing is lost for good.

Example::

    codec = LowBit("int4")
    payload = codec.encode(x)  # uint8, 4 + ceil(len(x) / 2) bytes
    y = codec.decode(payload, len(x))  # float32, |x - y| <= max|x| / 14
"""

from __future__ import annotations

import torch

#: the precisions a codec takes, narrowest last
PRECISIONS = ("float32", "bfloat16", "int8", "int4")
_Q_MAX = {"int8": 127, "int4": 7}


class LowBit:
    """Encode and decode a 1-D float32 tensor in ``precision`` (one of :data:`PRECISIONS`)."""

    def __init__(self, precision: str) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, "
                             f"got {precision!r}")
        self.precision = precision

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The payload of the 1-D float32 tensor ``x``."""
        if self.precision == "float32":  # unquantised; a float64 vector stays float64
            return x.detach().clone() if x.dtype == torch.float64 else x.detach().float()
        if self.precision == "bfloat16":
            return x.detach().to(torch.bfloat16)
        q_max = _Q_MAX[self.precision]
        # the scale on x's device, read by nobody: peak / q_max in float64 (as a Python float
        # would be), rounded to float32, or 1 for a zero or empty x
        peak = x.detach().abs().amax().to(torch.float64) if x.numel() else \
            x.new_zeros((), dtype=torch.float64)
        scale = torch.where(peak > 0, peak / q_max, 1.0).to(torch.float32).view(1)
        q = torch.round(x.detach().float() / scale).clamp_(-q_max, q_max).to(torch.int16)
        if self.precision == "int8":
            data = q.to(torch.int8).view(torch.uint8)
        else:  # two elements per byte, each as q + 8 in 1..15
            nibbles = (q + 8).to(torch.uint8)
            if nibbles.numel() % 2:
                nibbles = torch.cat([nibbles, nibbles.new_full((1,), 8)])
            data = nibbles[0::2] | (nibbles[1::2] << 4)
        return torch.cat([scale.view(torch.uint8), data])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """The float32 vector of ``numel`` elements that ``payload`` holds."""
        if self.precision == "float32":
            return payload.clone()
        if self.precision == "bfloat16":
            return payload.float()
        scale = payload[:4].clone().view(torch.float32)
        data = payload[4:]
        if self.precision == "int8":
            q = data.clone().view(torch.int8).float()
        else:
            q = torch.stack([data & 15, data >> 4], dim=1).reshape(-1)[:numel].float() - 8
        return q[:numel] * scale

    def nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of the payload of a vector of ``numel`` elements of ``dtype`` (float32 by
        default; a float64 vector travels as float64 in ``"float32"``)."""
        if self.precision == "float32":
            return (8 if dtype == torch.float64 else 4) * numel
        if self.precision == "bfloat16":
            return 2 * numel
        return 4 + (numel if self.precision == "int8" else (numel + 1) // 2)
