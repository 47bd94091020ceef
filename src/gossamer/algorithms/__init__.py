"""Distributed training methods, one module each, all written against a Communicator."""

from gossamer.algorithms.adpsgd import ADPSGD
from gossamer.algorithms.allreduce import AllReduce, AllReduceRuntime
from gossamer.algorithms.base import Algorithm, Runtime, average_tensors, model_tensors
from gossamer.algorithms.compressed import (
    DGC,
    PRESETS,
    CompressionPreset,
    FP16AllReduce,
    PowerSGDAllReduce,
    QSGDAllReduce,
    RandomKAllReduce,
    TopKAllReduce,
)
from gossamer.algorithms.demo import DeMo
from gossamer.algorithms.desloc import DESLOC
from gossamer.algorithms.diloco import DiLoCo
from gossamer.algorithms.dpsgd import DPSGD
from gossamer.algorithms.gossipgrad import GossipGraD
from gossamer.algorithms.local_sgd import QSR, LocalSGD
from gossamer.algorithms.muloco import MuLoCo
from gossamer.algorithms.noloco import NoLoCo
from gossamer.algorithms.pushsum import push_sum_average, push_sum_round
from gossamer.algorithms.registry import (
    available,
    create,
    describe,
    lookup,
    register,
    with_compression,
)
from gossamer.algorithms.sgp import OSGP, SGP
from gossamer.algorithms.sparseloco import SparseLoCo
from gossamer.algorithms.sparta import SPARTA
from gossamer.algorithms.streaming_diloco import StreamingDiLoCo
from gossamer.algorithms.wagma import WAGMA

for _cls in (AllReduce, SGP, OSGP, DPSGD, ADPSGD, LocalSGD, QSR, WAGMA, GossipGraD, *PRESETS,
             DiLoCo, StreamingDiLoCo, SPARTA, DeMo, SparseLoCo, DESLOC, MuLoCo, NoLoCo):
    register(_cls)

__all__ = [
    "ADPSGD",
    "CompressionPreset",
    "DESLOC",
    "DGC",
    "DiLoCo",
    "StreamingDiLoCo",
    "DeMo",
    "FP16AllReduce",
    "PowerSGDAllReduce",
    "QSGDAllReduce",
    "RandomKAllReduce",
    "TopKAllReduce",
    "DPSGD",
    "QSR",
    "LocalSGD",
    "MuLoCo",
    "NoLoCo",
    "OSGP",
    "SGP",
    "SPARTA",
    "SparseLoCo",
    "WAGMA",
    "Algorithm",
    "AllReduce",
    "AllReduceRuntime",
    "GossipGraD",
    "Runtime",
    "available",
    "average_tensors",
    "create",
    "describe",
    "lookup",
    "model_tensors",
    "push_sum_average",
    "push_sum_round",
    "register",
    "with_compression",
]
