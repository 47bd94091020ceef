"""The benchmarks' stand-in models: seeded MLPs, the same initial weights on every worker."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["DDP_MLP", "DIGITS_MLP", "NETBENCH_MLP", "STAND_IN_MLP", "WAGMA_MLP", "mlp"]

# Widths of the MLPs the benchmarks time; the comment is each one's parameter count.
DDP_MLP = (784, 1024, 256, 10)  # 1,068,810: AllReduce against DDP
DIGITS_MLP = (64, 128, 10)  # 9,610: the digits task's MLP (SimWorld overhead)
STAND_IN_MLP = (256, 384, 10)  # 102,538: scaled to ResNet-50 by NetworkModel.size_scale
WAGMA_MLP = (64, 256, 10)  # 19,210: WAGMA with a straggler
NETBENCH_MLP = (784, 2048, 2048, 10)  # 5,824,522 (23.3 MB of float32): the network suite


def mlp(*widths: int) -> nn.Sequential:
    """An MLP of ``widths`` (Linear layers with a ReLU between them), initialised from
    ``torch.manual_seed(0)``.

    Every worker that builds it starts from the same model, as a broadcast would give. The
    global generator is seeded on purpose: some benchmarks then draw their fixed batch from it,
    and their published figures were measured that way.

    Example::

        model = mlp(*DDP_MLP)  # 784-1024-256-10
    """
    if len(widths) < 2:
        raise ValueError(f"widths must name at least an input and an output, got {widths}")
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)
