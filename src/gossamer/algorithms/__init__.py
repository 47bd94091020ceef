"""Distributed training methods, one module each, all written against a Communicator."""

from gossamer.algorithms.allreduce import AllReduce, AllReduceRuntime
from gossamer.algorithms.base import Algorithm, Runtime, average_tensors, model_tensors
from gossamer.algorithms.registry import available, create, describe, lookup, register

register(AllReduce)

__all__ = [
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
    "register",
]
