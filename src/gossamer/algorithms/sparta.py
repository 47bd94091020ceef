"""SPARTA: sparse parameter averaging. After every optimizer step each worker averages a small
random fraction of its parameters with the other workers.

Every worker steps its own optimizer on its own data, as in local SGD; but instead of averaging
the whole model every H steps, each step averages a fraction ``p`` of the parameters (default
0.005, EXO Gym's ``p_sparta``): the same positions on every worker, all-reduced (mean) and
written back. Only the selected values travel: an all-reduce of the k values chosen this step,
all tensors of one dtype packed into one message, so a step sends about ``p`` of what a dense
average would. After the last step an exact average of everything (``average_at_end``) gives
one model.

Which positions: EXO Gym's ``RandomIndexSelector`` draws a Bernoulli(``p``) mask per tensor
from each process's global random state and broadcasts rank 0's mask before every tensor's
all-reduce. Here the mask is drawn from a generator that every worker seeds alike, so the
workers agree without the broadcast (no bytes, no extra message): at step ``s`` (0-based,
optimizer steps taken) a CPU ``torch.Generator`` seeded with :func:`selection_seed` of
``(seed, s)`` draws, for each trainable parameter in ``model.named_parameters()`` order,
``torch.rand(numel)`` (float32) and selects the positions where it is below ``fraction``.
A position is a flat index in the tensor's logical (row-major) order, whatever its memory
layout: a ``channels_last`` weight has the same positions selected as a contiguous one.
``selector="partitioned"`` is EXO Gym's ``PartitionedIndexSelector``: each tensor's positions
are split at random into ``P = max(1, min(ceil(1 / fraction), numel))`` disjoint parts, and step
``s`` averages part ``s mod P`` of the partition of cycle ``s // P`` (its labels are
``argsort(rand(numel)) mod P``, drawn from the generator seeded with the
:func:`selection_seed` of ``(seed, cycle, i)`` for the i-th tensor): every position is
averaged exactly once per cycle.

On a sharded model (:mod:`gossamer.sharding`) each rank draws over the whole tensors, as
above, and averages the positions that fall in its local shards
(:mod:`gossamer.patterns.parts`): the positions the unsharded run averages.

Every trainable parameter takes part, also one without a gradient on this worker (EXO Gym skips
those, which would let the workers' messages differ). Buffers (BatchNorm statistics) stay local
until the final average. A worker whose gradient is non-finite under ``nonfinite="skip"`` skips
its own optimizer step but still averages (the others wait for it); non-finite parameters are
never sent (NonFiniteError).

Reference: EXO Gym's ``SPARTAStrategy`` (github.com/exo-explore/gym,
``exogym/strategy/sparta.py``), from "SPARTA: Sparse Parameter Averaging for Distributed
Training" (EXO Labs, 2025).

Example::

    optimizer = gossamer.distribute(model, torch.optim.AdamW(model.parameters()),
                                    SPARTA(fraction=0.005), comm)
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from gossamer.algorithms.base import Algorithm, Runtime
from gossamer.checks import check_int
from gossamer.comm.base import Communicator, control_device
from gossamer.compress import draws
from gossamer.options import option
from gossamer.patterns.nonfinite import all_finite
from gossamer.patterns.parts import keep_part, part_of

#: the ways of choosing the positions of a step (see the module docstring)
SELECTORS = ("random", "partitioned")


@dataclass(frozen=True, kw_only=True)
class SPARTA(Algorithm):
    """Sparse parameter averaging: after each step, average a random ``fraction`` of the
    parameters (the same positions on every worker) over all workers.

    Args:
        fraction: p, the expected fraction of each tensor's elements averaged per step
            (default 0.005, EXO Gym's). 1 averages everything after every step; 0 never
            averages (independent workers until ``average_at_end``).
        seed: seeds the positions' generator, the same on every worker (default 0).
        selector: ``"random"`` (default): a fresh Bernoulli(p) mask each step;
            ``"partitioned"``: disjoint random parts of about p of each tensor, one per step,
            so that every element is averaged once every ``ceil(1 / p)`` steps.
        average_at_end: exact average of all parameters and buffers after the last step
            (default True).
    """

    name: ClassVar[str] = "sparta"
    #: the positions follow from the seed and the step alone, whatever the world size
    continues_after_failure: ClassVar[bool] = True

    fraction: float = option(0.005, "p, the share of the parameters averaged after each step; "
                             "higher: more bytes, less drift between replicas")
    seed: int = option(0, "seeds the positions drawn, the same on every worker")
    selector: str = option("random", "random: a Bernoulli(p) mask per step; partitioned: "
                           "disjoint parts, each element once per ceil(1/p) steps")
    average_at_end: bool = option(True, "all replicas equal after the last step")

    def __post_init__(self) -> None:
        fraction = self.fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
                or not 0 <= fraction <= 1:  # NaN fails this too
            raise ValueError(f"fraction: must be a number in [0, 1], got {fraction!r}")
        check_int("seed", self.seed, 0)
        if self.selector not in SELECTORS:
            raise ValueError(f"selector: must be one of {', '.join(SELECTORS)}, "
                             f"got {self.selector!r}")
        if self.selector == "partitioned" and fraction == 0:
            raise ValueError("fraction: the partitioned selector needs fraction > 0, got 0")

    def sharding_refusal(self) -> str | None:
        """None: on a sharded model each rank draws the positions over the whole tensors, as
        the unsharded run does, and averages those that fall in its shards."""
        return None

    def symmetric(self) -> bool:
        return True  # the same all-reduce of the same seeded positions on every worker

    def bind(self, comm: Communicator, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> SPARTARuntime:
        return SPARTARuntime(self, comm, model, optimizer)


def selection_seed(*numbers: int) -> int:
    """The seed of the positions' generator for ``numbers`` (the option ``seed``, then the
    step, or the cycle and the tensor's index): the first 8 bytes of the BLAKE2b hash of
    their decimal forms joined by "/", little-endian, so that distinct tuples give unrelated
    streams on every platform."""
    text = "/".join(str(int(n)) for n in numbers).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def select(config: SPARTA, step: int, sizes: list[int],
           device: torch.device | None = None) -> list[torch.Tensor]:
    """The flat positions (int64, on ``device``: default the CPU) averaged at ``step`` in
    tensors of ``sizes`` elements, the same on every worker (see the module docstring)."""
    device = torch.device("cpu") if device is None else device
    if not draws.on_host(device):
        return counter_select(config, step, sizes, device)
    if config.selector == "random":
        generator = torch.Generator(device).manual_seed(selection_seed(config.seed, step))
        return [torch.nonzero(torch.rand(n, generator=generator, device=device)
                              < config.fraction).flatten() for n in sizes]
    out = []
    for index, n in enumerate(sizes):
        parts = max(1, min(math.ceil(1 / config.fraction), n))
        cycle, part = divmod(step, parts)  # a tensor with fewer parts has shorter cycles
        generator = torch.Generator(device).manual_seed(
            selection_seed(config.seed, cycle, index))
        labels = torch.argsort(torch.rand(n, generator=generator, device=device)) % parts
        out.append(torch.nonzero(labels == part).flatten())
    return out


def counter_select(config: SPARTA, step: int, sizes: list[int], device: torch.device
                   ) -> list[torch.Tensor]:
    """:func:`select` from counter-based draws made on ``device``, the same on every device
    (:mod:`gossamer.compress.draws`, seeded with the same :func:`selection_seed`): the
    uniform draws are :func:`~gossamer.compress.draws.uniform`, the argsort of ``rand(n)`` is
    :func:`~gossamer.compress.draws.permutation`. A partition's part is known in size
    (``ceil((n - part) / P)`` places of the permutation), so it is read off the inverse
    permutation without a look at the data; a random selection's size is the data's."""
    if config.selector == "random":
        seed = selection_seed(config.seed, step)
        return [torch.nonzero(draws.uniform(seed, n, device) < config.fraction).flatten()
                for n in sizes]
    out = []
    for index, n in enumerate(sizes):
        parts = max(1, min(math.ceil(1 / config.fraction), n))
        cycle, part = divmod(step, parts)
        order = draws.permutation(selection_seed(config.seed, cycle, index), n, device)
        # labels[i] = order[i] % parts: the places i with order[i] = part, part + P, ...
        out.append(torch.argsort(order)[part::parts].sort().values)
    return out


@functools.lru_cache(maxsize=16)
def shapes_only_selection(config: SPARTA, step: int, sizes: tuple[int, ...]
                          ) -> tuple[torch.Tensor, ...]:
    """:func:`select` on the CPU, kept for the timing-only simulator's workers: each of them
    (and each worker count the planner predicts) draws the same positions at a step, a few
    hundred milliseconds of draws for a 25M-parameter model. Read-only tensors."""
    return tuple(select(config, step, list(sizes), torch.device("cpu")))


#: what indexes a tensor's selected elements: flat positions, or one coordinate per dimension
Where = torch.Tensor | tuple[torch.Tensor, ...]


def elements(p: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, Where]:
    """``(target, where)`` such that ``target[where]`` are the elements of ``p`` at the flat
    positions ``index``, reading and writing ``p`` itself. The positions count in ``p``'s
    logical (row-major) order whatever its memory layout, so that the elements selected do
    not depend on it: a contiguous ``p`` is indexed through ``p.view(-1)``; any other
    (a ``channels_last`` convolution's weight) through the positions unravelled into
    coordinates, since its ``reshape(-1)`` is a copy and what is written there would be lost."""
    if p.is_contiguous():
        return p.view(-1), index
    return p, torch.unravel_index(index, p.shape)


class SPARTARuntime(Runtime):
    """One worker of SPARTA: its step counter (the positions follow from it and the seed)."""

    def __init__(self, config: SPARTA, comm: Communicator, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        super().__init__(comm, model, optimizer)
        self.config = config
        # statistics
        self.sparse_averages = 0  # steps whose selection held at least one element
        self.values_averaged = 0  # elements averaged over all steps

    @torch.no_grad()
    def after_step(self) -> None:
        params = [p for _, p in self.named_parameters]
        # (the timing-only simulator's parameters are shapes only: positions drawn on the CPU)
        device = control_device(params[0].device) if params else None
        # drawn over the whole tensors: a part (a sharded model's local shard) keeps the
        # positions that fall in it, those the unsharded run averages there
        sizes = [part_of(p).numel for p in params]
        if params and params[0].is_meta:  # every simulated worker draws the same: once
            positions = shapes_only_selection(self.config, self.step, tuple(sizes))
        else:
            positions = select(self.config, self.step, sizes, device)
        # one all-reduce per dtype and device: the selected values of every tensor, packed
        kinds: dict[tuple[torch.dtype, torch.device], list[tuple[torch.Tensor, Where, int]]] = {}
        for p, index in zip(params, positions, strict=True):
            index = keep_part(p, index)
            if index.numel():
                target, where = elements(p, index.to(p.device))
                kinds.setdefault((p.dtype, p.device), []).append((target, where, index.numel()))
        if not kinds:
            return  # every worker drew the same empty selection: nothing to send
        for selected in kinds.values():
            buffer = torch.cat([target[where] for target, where, _ in selected])
            if not all_finite([buffer]):  # checked before it is sent
                raise self.nonfinite_error("parameters")
            self.comm.all_reduce(buffer, op="mean")
            offset = 0
            for target, where, count in selected:
                target[where] = buffer[offset:offset + count]  # into the parameter itself
                offset += count
            self.values_averaged += offset
        self.sparse_averages += 1

    @torch.no_grad()
    def change_membership(self, comm: Communicator, algorithm: Algorithm) -> None:
        """The members go on from their exact average. Nothing is in flight (every averaging
        is a blocking all-reduce) and the positions depend on the seed and the step only, so
        the selections go on unchanged over the new members."""
        assert isinstance(algorithm, SPARTA)
        self.comm, self.config = comm, algorithm
        self.average_parameters()

    def finish(self) -> None:
        self.settle()  # nothing is in flight: every averaging is a blocking all-reduce
        if self.config.average_at_end:
            self.average_parameters()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "sparse_averages": self.sparse_averages,
                "values_averaged": self.values_averaged}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.sparse_averages = int(state.get("sparse_averages", 0))
        self.values_averaged = int(state.get("values_averaged", 0))
