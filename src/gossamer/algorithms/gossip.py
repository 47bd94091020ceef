"""What the gossip methods (SGP, Overlap SGP, D-PSGD, AD-PSGD) share: the topology option,
the flat view of the parameters, periodic exact averages, and the hooks around evaluation
and the end of training."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from gossamer.algorithms.base import Algorithm, ExactAverages, Runtime, average_tensors
from gossamer.checks import check_int
from gossamer.comm.base import Communicator
from gossamer.comm.buckets import Buckets
from gossamer.options import option
from gossamer.patterns.nonfinite import all_finite
from gossamer.topology import Topology, build


@dataclass(frozen=True, kw_only=True)
class GossipAlgorithm(Algorithm):
    """Options every gossip method has (see the subclasses for their defaults)."""

    name: ClassVar[str]
    default_topology: ClassVar[str]

    topology: str | Topology = option("", "a registered topology name, or a Topology object")
    allreduce_every: int = option(0,
                                  "an exact average of all every K steps (0: never); lower: closer")
    average_before_eval: bool = option(False,
                                       "exact average before each evaluation (changes training)")
    average_at_end: bool = option(True, "exact average after the last step, so all end equal")
    # the world size ``topology`` was built and checked for by resolve() (0: not resolved)
    _resolved_for: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.topology == "":
            object.__setattr__(self, "topology", self.default_topology)
        if not isinstance(self.topology, (str, Topology)):
            raise ValueError(f"topology must be a name or a Topology, got {self.topology!r}")
        check_int("allreduce_every", self.allreduce_every, 0)

    def topology_options(self) -> dict[str, object]:
        """Options passed to the topology builder (by name)."""
        return {}

    def resolve(self, world_size: int) -> GossipAlgorithm:
        """This configuration with its topology built and checked for ``world_size``, once."""
        if self._resolved_for == world_size:
            return self
        self.check_world_size(world_size)
        resolved = dataclasses.replace(self, topology=self.make_topology(world_size))
        object.__setattr__(resolved, "_resolved_for", world_size)
        return resolved

    def symmetric(self) -> bool:
        # exchanges along the topology, resolved for the world size (resolve())
        return isinstance(self.topology, Topology) and self.topology.mirrored()

    def check_world_size(self, world_size: int) -> None:
        """Checks of the options against the world size, before the topology is built."""

    def make_topology(self, world_size: int) -> Topology:
        if isinstance(self.topology, Topology) and self._resolved_for == world_size:
            return self.topology  # built and checked once, by resolve()
        if isinstance(self.topology, Topology):
            topology = self.topology
        else:
            topology = build(self.topology, world_size, **self.topology_options())
        topology.require_world_size(world_size, arg="topology")
        self.check_topology(topology)
        return topology

    def check_topology(self, topology: Topology) -> None:
        """The conditions this method's convergence needs (ValueError naming ``topology``)."""
        topology.require_strongly_connected(arg="topology")

    def validate(self, world_size: int) -> None:
        self.resolve(world_size)


class GossipRuntime(ExactAverages, Runtime):
    """A worker of a gossip method: its topology and a flat copy of its parameters."""

    def __init__(self, config: GossipAlgorithm, comm: Communicator, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        super().__init__(comm, model, optimizer)
        self.config = config
        self.topology = config.make_topology(comm.world_size)
        self.params = [p for p in model.parameters()]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise ValueError(f"model: {config.name} needs parameters of one floating dtype, got "
                             f"{sorted(map(str, dtypes))}")
        self.flat = Buckets(self.params, bucket_bytes=None)

    @torch.no_grad()
    def read_parameters(self) -> torch.Tensor:
        """The parameters as one flat tensor (a copy)."""
        self.flat.gather(self.params)
        return self.flat.buffers[0].clone()

    @torch.no_grad()
    def check_parameters(self) -> None:
        """Raise a NonFiniteError if a parameter is non-finite: one sum over the flat copy
        (see :mod:`gossamer.patterns.nonfinite`)."""
        self.flat.gather(self.params)
        if not all_finite(self.flat.buffers):
            raise self.nonfinite_error("parameters")

    @torch.no_grad()
    def checked_parameters(self) -> torch.Tensor:
        """:meth:`read_parameters`, checked before they are sent."""
        self.check_parameters()
        return self.flat.buffers[0].clone()

    @torch.no_grad()
    def write_parameters(self, flat: torch.Tensor) -> None:
        self.flat.buffers[0].copy_(flat)
        self.flat.scatter(self.params)

    def change_membership(self, comm: Communicator, algorithm: Algorithm) -> None:
        """The topology rebuilt and re-validated for the new members, then their exact
        average."""
        assert isinstance(algorithm, GossipAlgorithm)
        self.comm, self.config = comm, algorithm
        self.topology = algorithm.make_topology(comm.world_size)
        self.average_parameters()

    @torch.no_grad()
    def average_buffers(self) -> None:
        buffers = [b for b in self.model.buffers() if torch.is_floating_point(b)]
        if buffers:
            average_tensors(self.comm, buffers)
