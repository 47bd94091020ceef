"""The statistical quantiser of SparseLoCo's and MuLoCo's authors, element by element.

Sarfi et al., "SparseLoCo" (arXiv 2508.15706), Section 3; the authors' code of MuLoCo
(github.com/facebookresearch/MuLoCo at 15ee278b6018c5fbdb6f779b71d22fabf6984b67,
``torchtitan/torchtitan/components/quantized_outer_sgd.py``, ``QuantizationCompressor``).
"""

from __future__ import annotations

import torch


def quantise(v: torch.Tensor, bits: int, sigmas: float) -> torch.Tensor:
    """``B = 2^bits`` bins of ``sigmas * std / B`` around the mean (std unbiased; 1 where it
    is 0), each value decoded to the mean of the centred values of its bin, plus the mean."""
    flat = v.reshape(-1)
    bins = 2 ** bits
    shift = flat.mean()
    c = flat - shift
    scale = float(sigmas * c.std() / bins) if flat.numel() > 1 else 0.0
    if not scale > 0:
        scale = 1.0
    codes = [min(max(int(torch.round(x / scale + bins // 2)), 0), bins - 1) for x in c]
    table = {b: c[[i for i, q in enumerate(codes) if q == b]].mean() for b in set(codes)}
    return (torch.stack([table[q] for q in codes]) + shift).view_as(v)
