"""The benchmarks' stand-in models: seeded MLPs, the same initial weights on every worker."""

from __future__ import annotations

from gossamer.plan.models import DIGITS_MLP, mlp

__all__ = ["DDP_MLP", "DIGITS_MLP", "NETBENCH_MLP", "STAND_IN_MLP", "WAGMA_MLP", "mlp"]

# Widths of the MLPs the benchmarks time; the comment is each one's parameter count (and
# DIGITS_MLP, 9,610: the digits task's MLP, from the planner's models, with mlp()).
DDP_MLP = (784, 1024, 256, 10)  # 1,068,810: AllReduce against DDP
STAND_IN_MLP = (256, 384, 10)  # 102,538: scaled to ResNet-50 by NetworkModel.size_scale
WAGMA_MLP = (64, 256, 10)  # 19,210: WAGMA with a straggler
NETBENCH_MLP = (784, 2048, 2048, 10)  # 5,824,522 (23.3 MB of float32): the network suite
