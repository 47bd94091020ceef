"""gossamer: communication-efficient data-parallel training for PyTorch.

One code base for gossip averaging (SGP, D-PSGD, AD-PSGD), local SGD, group averaging,
gradient compression and the AllReduce baseline, running on real ``torch.distributed`` or on
an in-process deterministic simulator of hundreds of workers.

Example::

    import gossamer
    optimizer = gossamer.distribute(model, optimizer, "allreduce")
"""

from gossamer.algorithms import Algorithm, AllReduce, Runtime
from gossamer.api import DistributedOptimizer, distribute

__version__ = "0.1.0"

__all__ = [
    "Algorithm",
    "AllReduce",
    "DistributedOptimizer",
    "Runtime",
    "__version__",
    "distribute",
]
