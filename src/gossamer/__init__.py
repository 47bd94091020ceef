"""gossamer: communication-efficient data-parallel training for PyTorch.

One code base for gossip averaging (SGP, D-PSGD, AD-PSGD), local SGD, group averaging,
gradient compression and the AllReduce baseline, running on real ``torch.distributed`` or on
an in-process deterministic simulator of hundreds of workers.

Every method, compressor and communicator is importable from here. Example::

    import gossamer
    optimizer = gossamer.distribute(model, optimizer, gossamer.SGP(tau=1), total_steps=1000)
    optimizer = gossamer.distribute(model, optimizer,
                                    gossamer.AllReduce(compression="topk:ratio=0.01"))
"""

from gossamer import loggers, metrics
from gossamer.algorithms import (
    ADPSGD,
    DESLOC,
    DGC,
    DPSGD,
    OSGP,
    QSR,
    SGP,
    SPARTA,
    WAGMA,
    Algorithm,
    AllReduce,
    DeMo,
    DiLoCo,
    FP16AllReduce,
    GossipGraD,
    LocalSGD,
    MuLoCo,
    NoLoCo,
    PowerSGDAllReduce,
    QSGDAllReduce,
    RandomKAllReduce,
    Runtime,
    SparseLoCo,
    StreamingDiLoCo,
    TopKAllReduce,
    available,
    push_sum_average,
    with_compression,
)
from gossamer.api import DistributedOptimizer, distribute
from gossamer.comm import ComputeModel, NetworkModel, SimWorld, TorchCommunicator
from gossamer.compress import available_compressors, parse_compression
from gossamer.loggers import Logger
from gossamer.metrics import consensus_distance, snapshot
from gossamer.optim import MuonWithAdamW, muon
from gossamer.sharding import ShardLayout

__version__ = "0.1.0"

__all__ = [
    "ADPSGD",
    "DESLOC",
    "DGC",
    "DeMo",
    "DiLoCo",
    "DPSGD",
    "OSGP",
    "QSR",
    "SGP",
    "SPARTA",
    "WAGMA",
    "Algorithm",
    "AllReduce",
    "ComputeModel",
    "DistributedOptimizer",
    "FP16AllReduce",
    "Logger",
    "GossipGraD",
    "LocalSGD",
    "MuLoCo",
    "MuonWithAdamW",
    "NoLoCo",
    "NetworkModel",
    "PowerSGDAllReduce",
    "QSGDAllReduce",
    "RandomKAllReduce",
    "Runtime",
    "ShardLayout",
    "SimWorld",
    "SparseLoCo",
    "StreamingDiLoCo",
    "TopKAllReduce",
    "TorchCommunicator",
    "__version__",
    "available",
    "available_compressors",
    "consensus_distance",
    "distribute",
    "loggers",
    "metrics",
    "muon",
    "parse_compression",
    "push_sum_average",
    "snapshot",
    "with_compression",
]
