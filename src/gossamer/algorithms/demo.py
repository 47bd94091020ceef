"""DeMo, Decoupled Momentum Optimization: each worker keeps its own momentum and sends only its
fastest-moving components, a few DCT coefficients per chunk; every worker steps with the sign
of their average.

Per step, on each worker and for each parameter (Peng, Quesnelle, Kingma, Algorithm 1, as the
authors' code computes it):

1. ``m = beta m + lr g`` with the worker's own gradient g: nothing is all-reduced. The
   reference code folds the learning rate into the momentum (``delta.add_(grad, alpha=lr)``);
   at a constant learning rate this is the paper's ``m = beta m + g`` scaled by lr, which the
   sign below does not see.
2. The tensor is cut into chunks and each chunk's 2-D orthonormal DCT-II taken: a chunk spans
   ``n1`` rows and ``n2`` columns, ``n`` the largest divisor of the dimension not above
   ``compression_chunk`` (64). A vector is one row of chunks of ``n2``, a tensor of more than
   two dimensions is viewed as ``(shape[0], rest)`` (the reference handles 1-D and 2-D only).
3. ``q``: the ``compression_topk`` (32) coefficients of largest magnitude of each chunk (all of
   them where a chunk has fewer); ``m = m - idct(q)``: what was extracted leaves the momentum,
   the rest stays and keeps accumulating.
4. Every worker's positions and values are all-gathered; at each position the values of the
   workers that chose it are averaged (the reference's ``scatter_reduce(..., "mean",
   include_self=False)``: over those workers, not over all); ``Q = idct`` of the result.
5. ``x = x - lr sign(Q)``: the reference's signum (``p.grad.sign_()`` then ``SGD.step``).

Every worker computes the same Q from the same gathered values, so the replicas stay identical.

How it fits the optimizer: DeMo is an optimizer of its own (the reference is a subclass of
``torch.optim.SGD`` with momentum 0 whose ``step`` replaces the gradients by ``sign(Q)`` and
calls SGD's step). Here the runtime applies that step itself in ``after_backward``, with each
parameter group's ``lr`` and ``weight_decay`` read from the wrapped optimizer when the step is
taken (so learning-rate schedulers act as usual): ``x = x (1 - lr wd) - lr sign(Q)``, the
reference's decoupled decay. It then leaves the gradients None, so that the wrapped optimizer's
step, which still runs, leaves these parameters alone: its own rule (SGD's momentum, Adam's
moments) is not used, whatever optimizer it is. With a ``torch.optim.SGD`` without momentum
this is exactly what SGD would do with the gradient ``sign(Q)`` (its L2 decay is then the
decoupled one); with AdamW it is AdamW's decoupled decay. An optimizer built with
``maximize=True`` is refused (ValueError naming ``optimizer``): DeMo descends; so is a
trainable parameter in none of its groups (ValueError naming it), which would have no lr.

The defaults are the reference's: ``compression_decay`` 0.999 (beta), ``compression_topk`` 32,
``compression_chunk`` 64. Bytes per step and worker: one all-gather of the positions (int16
where a chunk holds at most 32768 coefficients, as with every chunk up to 181 x 181; int32
otherwise; the reference sends int64) and one of the values (the parameters' dtype), two
messages for the whole model (the reference sends two per tensor). One more value rides at the
end of the values: this worker's non-finite flag, so that every worker learns who had a
non-finite gradient and all raise or all skip the step, which leaves every momentum as it was
(see :mod:`gossamer.patterns.nonfinite`).

References: Bowen Peng, Jeffrey Quesnelle, Diederik P. Kingma, "DeMo: Decoupled Momentum
Optimization", arXiv:2411.19870 (2024), Algorithm 1; their code, github.com/bloc97/DeMo
(``demo.py``), also EXO Gym's ``DeMoStrategy``.

Example::

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)  # its lr and weight decay
    optimizer = gossamer.distribute(model, optimizer, DeMo(compression_topk=32), comm)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from gossamer.algorithms.base import Algorithm, Runtime
from gossamer.checks import check_int
from gossamer.comm.base import Communicator
from gossamer.comm.mirror import Copies
from gossamer.options import option
from gossamer.patterns.nonfinite import all_finite, describe_nonfinite
from gossamer.patterns.parts import held


def _joined(parts: list[torch.Tensor], offset: int, count: int, dtype: torch.dtype,
            shape: tuple[int, int]) -> torch.Tensor:
    """Every gathered part's elements ``[offset, offset + count)`` as ``shape``, joined along
    the last dimension in rank order; for :class:`~gossamer.comm.mirror.Copies` (the
    planner's one worker for all), its one part repeated: the same tensor."""
    if isinstance(parts, Copies):
        return parts.part[offset:offset + count].to(dtype).view(shape).repeat(1, parts.times)
    return torch.cat([part[offset:offset + count].to(dtype).view(shape) for part in parts],
                     dim=-1)


@dataclass(frozen=True, kw_only=True)
class DeMo(Algorithm):
    """Decoupled Momentum Optimization: local momenta, their top DCT components exchanged,
    signum steps taken with the wrapped optimizer's learning rate and weight decay.

    The wrapped optimizer's own rule (momentum, Adam's moments) is not used: the runtime
    steps and leaves the gradients None. It must hold every trainable parameter (ValueError
    naming the one missing): each parameter's lr and weight decay are its group's.

    A parameter without a gradient on this worker (an unused layer) still takes every step:
    its weight decay applies and it moves by the sign of what the workers sent, whereas
    ``torch.optim`` skips a parameter whose gradient is None. The workers must stay identical,
    and none can know locally whether another had a gradient for it.

    Args:
        compression_decay: beta, the decay of each worker's momentum (default 0.999, the
            reference's); in [0, 1).
        compression_topk: DCT coefficients sent per chunk (default 32).
        compression_chunk: the target chunk side (default 64): a chunk spans the largest
            divisor of each dimension not above it.
    """

    name: ClassVar[str] = "demo"
    #: nothing in flight between steps; each worker's momentum is its own
    continues_after_failure: ClassVar[bool] = True
    needs: ClassVar[str] = (
        "a learning rate for a sign step (every element moves by lr per step): with the MNIST "
        "CNN recipe's lr 0.05 it reaches 11.65%, with --lr 0.002 98.85% and --lr 0.005 "
        "98.90%, against 98.50% for allreduce at lr 0.05 (8 workers); digits learns at 0.05")

    compression_decay: float = option(0.999, "beta, the momentum's decay; what is not sent "
                                      "stays and decays at this rate")
    compression_topk: int = option(32, "DCT coefficients sent per chunk; higher: more bytes")
    compression_chunk: int = option(64, "target chunk side: the largest divisor of each "
                                    "dimension not above it")

    def __post_init__(self) -> None:
        decay = self.compression_decay
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) \
                or not 0 <= decay < 1:  # NaN fails this too
            raise ValueError(f"compression_decay: must be a number in [0, 1), got {decay!r}")
        check_int("compression_topk", self.compression_topk, 1)
        check_int("compression_chunk", self.compression_chunk, 1)

    def sharding_refusal(self) -> str | None:
        """None: on a sharded model each rank chunks, transforms and selects its local shards
        (a shard's rows in chunks of the largest divisor of its own row count), so the
        components sent differ from the unsharded run's, which chunks whole tensors; the
        learning rate and weight decay are the sharded parameter's group's."""
        return None

    def symmetric(self) -> bool:
        return True  # the same all-gathers on every worker

    def bind(self, comm: Communicator, model: nn.Module,
             optimizer: torch.optim.Optimizer) -> DeMoRuntime:
        return DeMoRuntime(self, comm, model, optimizer)


def chunk_side(size: int, target: int) -> int:
    """The largest divisor of ``size`` not above ``target`` (the reference's
    ``_get_smaller_split``); 1 for an empty side (a sharded model's empty shard: no chunks)."""
    return max((d for d in range(1, min(size, target) + 1) if size % d == 0), default=1)


@functools.lru_cache(maxsize=64)
def dct_matrix(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix C (float64): ``X = C x``, ``x = C^T X``;
    ``C[k, j] = sqrt(2 / n) cos(pi (2 j + 1) k / (2 n))``, row 0 divided by sqrt(2). Made
    once per size (a model's tensors share a few sizes): read-only."""
    k = torch.arange(n, dtype=torch.float64).view(n, 1)
    j = torch.arange(n, dtype=torch.float64).view(1, n)
    c = math.sqrt(2 / n) * torch.cos(math.pi * (2 * j + 1) * k / (2 * n))
    c[0] /= math.sqrt(2)
    return c


def matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """The 2-D view DeMo chunks a tensor of ``shape`` in: a scalar (1, 1), a vector one row,
    more than two dimensions (shape[0], the rest)."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


class ChunkedDCT:
    """The chunked 2-D DCT of one tensor's shape: ``encode`` gives (chunks, n1 * n2)
    coefficients, ``decode`` takes them back to the tensor."""

    def __init__(self, shape: torch.Size, chunk: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.shape = shape
        self.rows, self.cols = matrix_shape(shape)
        self.n1, self.n2 = chunk_side(self.rows, chunk), chunk_side(self.cols, chunk)
        self.c1 = dct_matrix(self.n1).to(dtype=dtype, device=device)
        self.c2 = dct_matrix(self.n2).to(dtype=dtype, device=device)
        self.chunks = (self.rows // self.n1) * (self.cols // self.n2)
        self.size = self.n1 * self.n2  # coefficients per chunk

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        blocks = x.reshape(self.rows // self.n1, self.n1, self.cols // self.n2, self.n2)
        coefficients = torch.einsum("yhxw,bh,dw->yxbd", blocks, self.c1, self.c2)
        return coefficients.reshape(self.chunks, self.size)

    def decode(self, coefficients: torch.Tensor) -> torch.Tensor:
        blocks = coefficients.reshape(self.rows // self.n1, self.cols // self.n2, self.n1,
                                      self.n2)
        x = torch.einsum("yxbd,bh,dw->yhxw", blocks, self.c1, self.c2)
        return x.reshape(self.shape)


class DeMoRuntime(Runtime):
    """One worker of DeMo: its momentum per parameter, and the DCT of each shape."""

    replicas_identical: ClassVar[bool] = True  # every worker steps with the same sign(Q)
    agrees_on_gradients: ClassVar[bool] = True  # the flags ride on the values' all-gather

    def __init__(self, config: DeMo, comm: Communicator, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        super().__init__(comm, model, optimizer)
        self.config = config
        for group in optimizer.param_groups:
            if group.get("maximize"):
                raise ValueError("optimizer: DeMo descends; build it with maximize=False")
        # each step reads a parameter's lr and weight decay from its group: a trainable one
        # left out of the optimizer has none
        grouped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for name, p in self.named_parameters:
            if id(held(p)) not in grouped:
                raise ValueError(
                    f"optimizer: the model's trainable parameter {name!r} is in none of its "
                    "parameter groups, and DeMo takes each parameter's learning rate and weight "
                    "decay from its group; build the optimizer over every trainable parameter, "
                    f"or set requires_grad=False on {name!r}")
        # by name: the same order on every worker, whatever order the model registers them in
        self.named = sorted(self.named_parameters, key=lambda item: item[0])
        self.transforms = [ChunkedDCT(p.shape, config.compression_chunk, p.dtype, p.device)
                           for _, p in self.named]
        # internal state: each worker's own momentum, lr-scaled as in the reference
        self.momentum = {name: torch.zeros_like(p) for name, p in self.named}
        self.topk = [min(config.compression_topk, t.size) for t in self.transforms]
        largest = max((t.size for t in self.transforms), default=1)
        self.index_dtype = torch.int16 if largest <= 2**15 else torch.int32
        dtypes = [p.dtype for _, p in self.named]
        self.value_dtype = dtypes[0] if dtypes else torch.float32
        for dtype in dtypes[1:]:
            self.value_dtype = torch.promote_types(self.value_dtype, dtype)
        self._found: str | None = None

    def payload_sizes(self) -> tuple[int, int]:
        """(positions, values) one worker sends per step: the values include the flag."""
        positions = sum(k * t.chunks for k, t in zip(self.topk, self.transforms, strict=True))
        return positions, positions + 1

    def check_gradients(self) -> None:
        """Nothing here: the workers agree on non-finite gradients in after_backward."""
        self.skip_update = False

    def _groups(self) -> dict[int, tuple[float, float]]:
        """(lr, weight_decay) of each parameter's group, by the id of the tensor the optimizer
        holds for it (a sharded model's parameter, see :func:`held`), as they are now."""
        return {id(p): (float(group["lr"]), float(group.get("weight_decay", 0.0)))
                for group in self.optimizer.param_groups for p in group["params"]}

    @torch.no_grad()
    def after_backward(self) -> None:
        if not self.named:
            return
        grads = [p.grad for _, p in self.named]
        found = bool(self.overflow) or not all_finite([g for g in grads if g is not None])
        if found:
            self._found = describe_nonfinite([(n, p.grad) for n, p in self.named], "gradient")
        groups = self._groups()
        decay = self.config.compression_decay
        updated, indices, values = [], [], []
        for (name, p), transform, k in zip(self.named, self.transforms, self.topk, strict=True):
            m = self.momentum[name] * decay
            if p.grad is not None and not found:
                m.add_(p.grad, alpha=groups[id(held(p))][0])
            coefficients = transform.encode(m)
            index = torch.topk(coefficients.abs(), k, dim=-1, sorted=False).indices
            value = torch.gather(coefficients, -1, index)
            if found:  # nothing non-finite leaves this worker: zeros at valid positions
                value = torch.zeros_like(value)
            extracted = torch.zeros_like(coefficients).scatter_(-1, index, value)
            updated.append(m - transform.decode(extracted))
            indices.append(index.flatten())
            values.append(value.flatten().to(self.value_dtype))
        flag = torch.ones(1, dtype=self.value_dtype, device=values[0].device) * float(found)
        sent_index = torch.cat(indices).to(self.index_dtype)
        sent_values = torch.cat([*values, flag])
        gathered_index = self.comm.all_gather(sent_index)
        gathered_values = self.comm.all_gather(sent_values)
        if isinstance(gathered_values, Copies):  # one worker for all (the planner's)
            ranks = list(range(gathered_values.times)) if float(sent_values[-1]) != 0 else []
        else:
            ranks = [r for r, v in enumerate(gathered_values) if float(v[-1]) != 0]
        if ranks:
            if self.nonfinite == "raise" and self.overflow is None:
                raise self.nonfinite_error("gradient", ranks, self._found)
            self.skip_update = True  # every worker skips: every momentum stays as it was
            return
        for (name, _), m in zip(self.named, updated, strict=True):
            self.momentum[name] = m
        offset = 0
        for (_, p), transform, k in zip(self.named, self.transforms, self.topk, strict=True):
            count = k * transform.chunks
            shape = (transform.chunks, k)
            index = _joined(gathered_index, offset, count, torch.int64, shape)
            value = _joined(gathered_values, offset, count, p.dtype, shape)
            offset += count
            averaged = torch.zeros(transform.chunks, transform.size, dtype=p.dtype,
                                   device=p.device)
            averaged.scatter_reduce_(-1, index, value, reduce="mean", include_self=False)
            lr, weight_decay = groups[id(held(p))]
            if weight_decay:
                p.mul_(1 - lr * weight_decay)
            p.add_(transform.decode(averaged).sign(), alpha=-lr)
            p.grad = None  # the wrapped optimizer's step leaves this parameter alone
        self.synchronizations += 1

    @torch.no_grad()
    def change_membership(self, comm: Communicator, algorithm: Algorithm) -> None:
        """The members go on from their exact average (equal to each one's parameters unless
        the failure came between two members' updates of a step), each with its own momentum:
        a step's momentum is kept only once the step's all-gather succeeded, so a failed step
        leaves it as it was; the dead worker's momentum is lost, as its residual would be in
        any error-feedback method. Nothing else depends on the workers."""
        assert isinstance(algorithm, DeMo)
        self.comm, self.config = comm, algorithm
        self.average_parameters()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),
                "momentum": {name: m.clone() for name, m in self.momentum.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for name, m in state["momentum"].items():
            if name not in self.momentum:
                raise ValueError(f"state: DeMo's momentum has {name!r}, which the model "
                                 "does not train")
            self.momentum[name].copy_(m)
