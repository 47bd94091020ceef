"""Distributed training methods, one module each, all written against a Communicator."""

from gossamer.algorithms.adpsgd import ADPSGD
from gossamer.algorithms.allreduce import AllReduce, AllReduceRuntime
from gossamer.algorithms.base import Algorithm, Runtime, average_tensors, model_tensors
from gossamer.algorithms.dpsgd import DPSGD
from gossamer.algorithms.local_sgd import QSR, LocalSGD
from gossamer.algorithms.pushsum import push_sum_average, push_sum_round
from gossamer.algorithms.registry import available, create, describe, lookup, register
from gossamer.algorithms.sgp import OSGP, SGP

for _cls in (AllReduce, SGP, OSGP, DPSGD, ADPSGD, LocalSGD, QSR):
    register(_cls)

__all__ = [
    "ADPSGD",
    "DPSGD",
    "QSR",
    "LocalSGD",
    "OSGP",
    "SGP",
    "Algorithm",
    "AllReduce",
    "AllReduceRuntime",
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
]
