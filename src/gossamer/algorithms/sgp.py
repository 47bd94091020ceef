"""Stochastic Gradient Push (SGP) and Overlap SGP: push-sum gossip of the parameters.

Each worker holds a push-sum numerator ``x`` and weight ``w``. Forward and backward use the
de-biased parameters ``z = x / w``; the optimizer then steps the numerator with that gradient,
``x_{k+1/2} = x_k - lr * grad F(z_k)`` (the parameters are turned back into the numerator before
the optimizer steps, as the reference code does), and the worker pushes shares of
``[x_{k+1/2}, w_k]`` to this step's out-peers (by default the directed exponential graph, one
peer per step: peer ``rank + 2^(k mod m)`` with ``m = ceil(log2 n)``), keeps its own share
and adds what it received.

Overlap SGP (``tau >= 1``) mixes at step ``k`` the messages sent at step ``k - tau`` — first
mixing them in, then sending shares of the result, as the reference code does — so
communication overlaps the next ``tau`` steps' computation and no step waits for the messages
of the same step. Mass in flight is kept and mixed later, so nothing is lost: the sum of the
numerators moves by exactly the sum of the updates.

Reference: Assran, Loizou, Ballas, Rabbat, "Stochastic Gradient Push for Distributed Deep
Learning" (ICML 2019), Algorithm 1 (SGP) and Algorithm 2 (Overlap SGP).

Example::

    optimizer = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1,
                                    momentum=0.9), SGP(peers_per_step=1), comm)
    # the loop is unchanged; optimizer.finish() after the last step averages exactly
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from gossamer.algorithms.base import Algorithm
from gossamer.algorithms.gossip import GossipAlgorithm, GossipRuntime
from gossamer.algorithms.pushsum import push_message, push_sum_send
from gossamer.checks import check_int
from gossamer.comm.base import Communicator, Handle
from gossamer.options import option
from gossamer.topology import Topology


@dataclass(frozen=True, kw_only=True)
class SGP(GossipAlgorithm):
    """Stochastic Gradient Push: push-sum gossip of the parameters after every step.

    Args:
        topology: a column-stochastic topology, strongly connected over its period (default
            ``"exponential"``), by name or as a Topology.
        peers_per_step: out-peers per step of the exponential topology (default 1).
        tau: steps between sending a message and mixing it (default 0; Overlap SGP: 1).
        allreduce_every: an exact average every K steps (default 0: never).
        average_before_eval: exact average before each evaluation (default False).
        average_at_end: exact average after the last step (default True).
    """

    name: ClassVar[str] = "sgp"
    default_topology: ClassVar[str] = "exponential"
    continues_after_failure: ClassVar[bool] = True

    peers_per_step: int = option(1, "higher: faster mixing, proportionally more bytes per step")
    tau: int = option(0, "Overlap SGP's tau: steps between sending and mixing; higher: "
                      "more overlap of communication with computation, staler mixing")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("peers_per_step", self.peers_per_step, 1)
        check_int("tau", self.tau, 0)

    def topology_options(self) -> dict[str, object]:
        if self.topology == "exponential":
            return {"peers_per_step": self.peers_per_step}
        if self.peers_per_step != 1:
            raise ValueError("peers_per_step applies to the exponential topology only; "
                             f"topology is {self.topology!r}")
        return {}

    def check_topology(self, topology: Topology) -> None:
        topology.require_column_stochastic(arg="topology")
        topology.require_strongly_connected(arg="topology")

    def sharding_refusal(self) -> str | None:
        return None  # push-sum is element-wise: each shard mixes with its own in the others

    def bind(self, comm: Communicator, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> SGPRuntime:
        return SGPRuntime(self, comm, model, optimizer)


@dataclass(frozen=True, kw_only=True)
class OSGP(SGP):
    """Overlap SGP: SGP whose messages are mixed ``tau`` steps after they were sent (default 1).
    """

    name: ClassVar[str] = "osgp"

    tau: int = option(1, "Overlap SGP's tau: steps between sending and mixing; higher: "
                      "more overlap of communication with computation, staler mixing")


class SGPRuntime(GossipRuntime):
    """One worker of SGP: its push-sum weight and the messages in flight."""

    def __init__(self, config: SGP, comm: Communicator, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        super().__init__(config, comm, model, optimizer)
        self.config: SGP = config
        # internal state
        self.holds_numerator = False  # between after_backward and the mixing: numerator x
        # Sent, not yet mixed: the handle of each step's exchange, or what it delivered.
        self.in_flight: deque[Handle | dict[int, torch.Tensor]] = deque()
        flat = self.flat.buffers[0]  # [numerator..., weight] of the step being mixed
        self._message = torch.empty(flat.numel() + 1, dtype=flat.dtype, device=flat.device)
        #: push-sum weight (the parameters hold numerator / weight): a tensor on the model's
        #: device, of the messages' dtype, so that no step reads it back to the host
        self.weight = torch.ones((), dtype=flat.dtype, device=flat.device)
        self._unit_weight = True  # known on the host: the weight is exactly 1 (no mixing yet)

    @staticmethod
    def _received(entry: Handle | dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        return entry if isinstance(entry, dict) else entry.wait()

    def _add_received(self, message: torch.Tensor, entry) -> torch.Tensor:
        """``message`` plus the shares ``entry`` delivered (in place: ``message`` is this
        runtime's own buffer)."""
        received = self._received(entry)
        for peer in sorted(received):
            message.add_(received[peer])
        return message

    @torch.no_grad()
    def after_backward(self) -> None:
        # The gradient was taken at z = x / w; the optimizer steps the numerator x
        # (Algorithms 1 and 2: x_{k+1/2} = x_k - lr grad F(z_k)). With w == 1 they are equal.
        if not self._unit_weight:
            torch._foreach_mul_([p.data for p in self.params], self.weight)
        self.holds_numerator = True

    @torch.no_grad()
    def after_step(self) -> None:
        # The step's arithmetic is that of push_message, push_sum_send and push_sum_collect,
        # in one buffer of this runtime: only the shares sent (in flight) are new tensors.
        self.check_parameters()  # gathers the numerator x_{k+1/2} into the flat buffer
        message = self._message
        message[:-1].copy_(self.flat.buffers[0])
        message[-1] = self.weight
        if self.config.tau:  # Overlap SGP: mix what step k - tau sent, then send the result
            while len(self.in_flight) >= self.config.tau:
                message = self._add_received(message, self.in_flight.popleft())
        kept, handle = push_sum_send(self.comm, self.topology, self.step, message,
                                     in_place=True)
        self.in_flight.append(handle)
        if not self.config.tau:  # SGP: this step's messages, at once
            kept = self._add_received(kept, self.in_flight.popleft())
        self._set(kept)
        self.periodic_average()

    def _set(self, message: torch.Tensor) -> None:
        self.holds_numerator = False
        self.weight = message[-1].clone()
        self._unit_weight = False
        torch.div(message[:-1], self.weight, out=self.flat.buffers[0])
        self.flat.scatter(self.params)

    @torch.no_grad()
    def settle(self) -> None:
        """Mix every message still in flight into the numerator (conserving the mass)."""
        message = push_message(self.read_parameters() * self.weight, self.weight)  # a copy
        while self.in_flight:
            message = self._add_received(message, self.in_flight.popleft())
        self._set(message)

    @torch.no_grad()
    def average_parameters(self) -> None:
        """The exact average: sum of numerators over sum of weights, in-flight mass included."""
        self.settle()
        message = push_message(self.read_parameters() * self.weight, self.weight)
        self.comm.all_reduce(message, op="mean")
        self.weight = torch.ones_like(self.weight)
        self._unit_weight = True
        self.write_parameters(message[:-1] / message[-1])
        self.average_buffers()
        self.synchronizations += 1

    @torch.no_grad()
    def change_membership(self, comm: Communicator, algorithm: Algorithm) -> None:
        """The messages in flight among the old members are dropped (their mass with them);
        a step that failed before its mixing has its parameters de-biased again."""
        self.in_flight.clear()
        if self.holds_numerator:
            for p in self.params:
                p.data.div_(self.weight)
            self.holds_numerator = False
        super().change_membership(comm, algorithm)

    def state_dict(self) -> dict[str, Any]:
        in_flight = [self._received(entry) for entry in self.in_flight]
        self.in_flight = deque(in_flight)  # delivered now; mixed at the same steps as before
        return {**super().state_dict(), "weight": float(self.weight), "in_flight": in_flight}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        weight = float(state["weight"])
        self.weight = torch.tensor(weight, dtype=self.weight.dtype, device=self.weight.device)
        self._unit_weight = weight == 1.0
        self.in_flight = deque({int(k): v for k, v in d.items()} for d in state["in_flight"])
