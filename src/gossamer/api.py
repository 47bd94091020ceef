"""The entry point: put an algorithm around any model and optimizer, keep your training loop.

Example::

    import torch, gossamer

    model = torch.nn.Linear(10, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer = gossamer.distribute(model, optimizer, "allreduce")  # under torchrun
    for x, y in loader:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    optimizer.synchronize()  # exact average of the replicas, e.g. before saving

Mixed precision: give the scaler to ``distribute`` and use it as usual::

    scaler = torch.amp.GradScaler("cuda")
    optimizer = gossamer.distribute(model, optimizer, "sgp", scaler=scaler)
    for x, y in loader:
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # every worker skips the same overflowing steps
        scaler.update()  # and every scale stays the same
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from gossamer.algorithms import Algorithm, Runtime, create, model_tensors
from gossamer.comm.base import Communicator, ProcessGroupBacked
from gossamer.comm.buckets import apply_flat
from gossamer.patterns.nonfinite import agree, all_finite
from gossamer.sharding import LocalShards, check_replica_comm, local_shards
from gossamer.torch_internals import (
    global_step_hooks,
    mark_step_hooked,
    profiler_enabled,
    run_step_with_hooks,
    scaler_found_inf,
    takes_amp_scaling,
    unwrapped_step,
)

#: torch's own ``Optimizer.zero_grad`` (DistributedOptimizer.zero_grad does its work directly
#: for an optimizer that keeps it)
_TORCH_ZERO_GRAD = torch.optim.Optimizer.zero_grad


def _with_step_hooks(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` with what ``torch.optim.Optimizer`` wraps every step in: the global and the
    optimizer's own step pre- and post-hooks, run as torch runs them, inside a profiler
    record named as torch names it. The record is entered only while a profiler runs:
    entering one costs about 6 us, which the wrapped optimizer's step pays already, and a
    small model's whole step takes 300 us (the simulator runs hundreds of them a step)."""
    if global_step_hooks() is None:  # a torch without them: its own wrapper
        return torch.optim.Optimizer.profile_hook_step(step)

    @functools.wraps(step)
    def wrapper(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if profiler_enabled():
            name = f"Optimizer.step#{type(self).__name__}.step"
            with torch.autograd.profiler.record_function(name):
                return run_step_with_hooks(self, (self, *args), kwargs, step)
        return run_step_with_hooks(self, (self, *args), kwargs, step)

    return mark_step_hooked(wrapper)  # torch's own wrapper then stays off


def _step_wrapped(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()``. Where that is torch's wrapper around its class's step, the same
    without the wrapper's profiler record unless a profiler runs: its hooks run as torch runs
    them. The wrapper costs about 12 us, half of it the record, of a small model's 300 us step,
    which every simulated worker pays.
    A step set on the object (an LR scheduler's counter), another wrapper, ``torch.compile``
    or a torch without the global hooks: ``optimizer.step()`` itself."""
    body = unwrapped_step(type(optimizer).step)
    if (body is not None and "step" not in vars(optimizer)
            and not profiler_enabled()
            and not torch.compiler.is_compiling()):
        run_step_with_hooks(optimizer, (optimizer,), {}, body)
    else:
        optimizer.step()


# GradScaler.step() hands the unscaling and the decision to skip to step() (the scale and its
# own found-inf as attributes ``grad_scale`` and ``found_inf``), instead of not calling step()
# where it found an overflow, which would leave the other workers waiting in the collective
@takes_amp_scaling
class DistributedOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` with a distributed algorithm around the wrapped one's step.

    ``step()`` marks the step's compute for the simulator, runs the algorithm's after-backward
    hook (e.g. gradient averaging), the wrapped optimizer's step (skipped for a non-finite
    gradient under ``nonfinite="skip"``), the after-step hook (e.g. gossip of parameters) and
    the before-forward hook of the next step. ``step(closure)`` evaluates the closure first
    (forward and backward, as Lightning passes it) and returns its loss.

    It is an optimizer in its own right, so that learning-rate schedulers, GradScaler,
    Lightning and Accelerate take it: :attr:`param_groups` and :attr:`state` are the wrapped
    optimizer's own (the same objects), ``zero_grad`` and ``add_param_group`` act on it, and
    :meth:`state_dict` is the wrapped optimizer's with the algorithm's state under
    ``"algorithm"``, which a plain optimizer of the same type loads as its own.

    With a ``torch.amp.GradScaler`` (:attr:`scaler`, given to :func:`distribute`),
    ``scaler.step(optimizer)`` calls ``step()`` on every worker, also on one whose scaled
    gradients overflowed: ``step()`` unscales the gradients, the workers agree whether any
    overflowed (see :mod:`gossamer.patterns.nonfinite`), and if one did, every worker skips
    the step as a whole and reports the overflow to its scaler, so that ``scaler.update()``
    lowers every worker's scale alike.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, runtime: Runtime,
                 scaler: torch.amp.GradScaler | None = None,
                 shards: LocalShards | None = None) -> None:
        # Optimizer's own set-up (its hooks), over no parameters; from then on param_groups,
        # state and defaults are the wrapped optimizer's (properties below), so that a change
        # made through either is seen by both, also after its load_state_dict() replaced them
        super().__init__([{"params": []}], dict(optimizer.defaults))
        self.optimizer = optimizer
        self.runtime = runtime
        self.scaler = scaler  # the GradScaler that steps this optimizer, if any
        #: a sharded model's local shards, which the runtime works on (None: not sharded)
        self.shards = shards
        runtime.use_scaler(scaler is not None)

    def _wrapped(self, name: str, default: Any) -> Any:
        inner = self.__dict__.get("optimizer")
        return getattr(inner, name) if inner is not None else self.__dict__.get(name, default)

    def _set_wrapped(self, name: str, value: Any) -> None:
        inner = self.__dict__.get("optimizer")
        if inner is not None:
            setattr(inner, name, value)
        else:  # Optimizer.__init__, before the wrapped optimizer is set
            self.__dict__[name] = value

    param_groups = property(lambda self: self._wrapped("param_groups", []),
                            lambda self, v: self._set_wrapped("param_groups", v),
                            doc="The wrapped optimizer's parameter groups (the same list).")
    state = property(lambda self: self._wrapped("state", {}),
                     lambda self, v: self._set_wrapped("state", v),
                     doc="The wrapped optimizer's per-parameter state (the same mapping).")
    defaults = property(lambda self: self._wrapped("defaults", {}),
                        lambda self, v: self._set_wrapped("defaults", v),
                        doc="The wrapped optimizer's defaults.")

    @property
    def comm(self) -> Communicator:
        return self.runtime.comm

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``. With ``set_to_none`` (the default), for an
        optimizer that keeps torch's own, done here as torch does it (every gradient set to
        None), without the dynamo guard and the profiler record around it, which cost about
        7 us a call where setting the gradients costs 0.3 us: a small model's whole step takes
        300 us, and the simulator runs hundreds of them a step. Under a profiler or
        ``torch.compile``, torch's own runs; an optimizer's own ``zero_grad`` (its class's or
        one set on it) is always called."""
        inner = self.optimizer
        if (set_to_none and type(inner).zero_grad is _TORCH_ZERO_GRAD
                and "zero_grad" not in vars(inner)  # nor one set on the object
                and not profiler_enabled()
                and not torch.compiler.is_compiling()):
            for group in inner.param_groups:
                for p in group["params"]:
                    p.grad = None
            return
        inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # during Optimizer.__init__ (the empty group), before the wrapped optimizer is set
        if "optimizer" not in self.__dict__:
            return
        raise ValueError("add_param_group: the algorithm was bound to the model's parameters "
                         "when distribute() was called; build the optimizer with every group "
                         "before distribute()")

    @_with_step_hooks
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One distributed optimizer step; ``closure`` (forward and backward) is evaluated
        first, with gradients enabled, and its loss returned.

        Called by ``scaler.step(optimizer)``, it unscales the gradients first and skips the
        whole step on every worker if any worker's overflowed (see the class docs).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.shards is None:
            return self._step(loss)
        # a sharded model: the method's gradient hooks see the local shards of the gradients
        # that FSDP2 reduce-scattered in backward (the hooks on the local views never fire)
        self.shards.pull_gradients()
        try:
            return self._step(loss)
        finally:
            self.shards.drop_gradients()

    def _step(self, loss: Any) -> Any:
        runtime = self.runtime
        overflow = self._unscale_gradients()  # None unless a GradScaler called
        runtime.comm.compute_step()
        runtime.overflow = overflow
        if overflow is not None and not runtime.agrees_on_gradients:
            # no collective of this method's carries the agreement here: one of its own
            found = overflow or not all_finite(self._gradients())
            runtime.skip_update = bool(agree(runtime.comm, found, self._device()))
            if not runtime.skip_update:
                runtime.after_backward()
        else:
            runtime.check_gradients()
            runtime.after_backward()  # the all-reduce methods agree in their reduction
        if self.shards is not None:
            self.shards.push_gradients()
        if runtime.skip_update:  # a non-finite gradient under nonfinite="skip", or overflow
            runtime.skipped_steps += 1
            if overflow is not None:  # the scaler skips the step as a whole, every worker alike
                self._report_overflow()
                return loss
        else:
            _step_wrapped(self.optimizer)
        runtime.after_step()
        runtime.step += 1
        runtime.before_forward()
        return loss

    def _gradients(self) -> list[torch.Tensor]:
        return [p.grad for group in self.param_groups for p in group["params"]
                if p.grad is not None]

    def _device(self) -> torch.device:
        return next((p.device for group in self.param_groups for p in group["params"]),
                    torch.device("cpu"))

    def _unscale_gradients(self) -> bool | None:
        """Under ``GradScaler.step(self)``: unscale the gradients (unless ``scaler.unscale_``
        did already) and return whether the scaler found them non-finite on this worker;
        None when no scaler called."""
        found_inf = getattr(self, "found_inf", None)  # set by GradScaler.step for this call
        if found_inf is None:
            return None
        with torch.no_grad():
            return self._unscale(found_inf)

    def _unscale(self, found_inf: torch.Tensor) -> bool:
        # the scaler given to distribute() has recorded its check of this optimizer's
        # gradients, unless another one (or one not given) calls; a torch that no longer shows
        # the record (None) cannot tell
        if self.scaler is None or scaler_found_inf(self.scaler, self) == {}:
            raise ValueError("scaler: a GradScaler that distribute() was not given "
                             "(scaler=...) steps this optimizer; the workers could not keep "
                             "its scale the same")
        scale = getattr(self, "grad_scale", None)  # None: scaler.unscale_(optimizer) did it
        if scale is not None:
            inverse = scale.double().reciprocal().float()  # as GradScaler.unscale_ has it
            for grad in self._gradients():
                grad.mul_(inverse.to(grad.device))
        return bool(found_inf.item())

    def _report_overflow(self) -> None:
        """Make ``scaler.update()`` see the agreed overflow on this worker too. It updates the
        scale from the found-inf it recorded for this optimizer, which it checked here alone;
        GradScaler offers no public way to set it (see :mod:`gossamer.torch_internals`)."""
        for found_inf in (scaler_found_inf(self.scaler, self) or {}).values():
            found_inf.fill_(1.0)

    def synchronize(self) -> None:
        """Average the replicas exactly (collective: every worker must call it)."""
        self.runtime.average_parameters()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without communicating, as DDP's
        ``no_sync``: for gradient accumulation, wrap every micro-batch's backward but the
        last. Needed only where the algorithm communicates during backward (AllReduce's
        overlapped all-reduce); without it each backward averages (correct, since averaging is
        linear, but one all-reduce per micro-batch)."""
        self.runtime.pause_gradient_sync(True)
        try:
            yield
        finally:
            self.runtime.pause_gradient_sync(False)

    def before_eval(self) -> None:
        """Before evaluating: what the algorithm does there (local SGD re-estimates BatchNorm
        statistics, WAGMA stops its rounds, an exact average under ``average_before_eval``).
        Collective: every worker must call it at the same step."""
        self.runtime.before_eval()
        self.runtime.prepare_eval()

    def finish(self) -> None:
        """After the last step: settle messages in flight (and, where the algorithm is set to,
        average exactly). Collective: every worker must call it."""
        self.runtime.finish()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict (``state``, ``param_groups``: a plain optimizer of
        its type loads it) with the algorithm's state under ``"algorithm"``."""
        return {**self.optimizer.state_dict(), "algorithm": self.runtime.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load what :meth:`state_dict` gave, or a plain optimizer's state dict (the
        algorithm's state is then kept as it is), or the ``{"optimizer", "algorithm"}`` form of
        earlier versions of gossamer."""
        state = dict(state)
        algorithm = state.pop("algorithm", None)
        self.optimizer.load_state_dict(state.get("optimizer", state))
        if algorithm is not None:
            self.runtime.load_state_dict(dict(algorithm))

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({type(self.runtime).__name__}, rank {self.comm.rank} "
                f"of {self.comm.world_size}, {self.optimizer.__class__.__name__})")


def distribute(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    algorithm: Algorithm | str = "allreduce",
    comm: Communicator | None = None,
    *,
    broadcast: bool = True,
    nonfinite: str = "raise",
    scaler: torch.amp.GradScaler | None = None,
    total_steps: int | None = None,
    training_inputs: Callable[[int], Iterable[torch.Tensor]] | None = None,
) -> DistributedOptimizer:
    """Wire ``algorithm`` into ``model`` and ``optimizer`` on this worker.

    Args:
        model: the replica of this worker, or this rank's part of it: a model sharded with
            FSDP2 (``fully_shard(..., mesh=layout.shard_mesh)``, see
            :mod:`gossamer.sharding`), whose parameters are DTensors. The method then runs on
            the local shards, with ``comm``, the replica dimension, before the optimizer
            steps (after backward and FSDP's reduce-scatter); a method that does not run on
            shards (:meth:`~gossamer.algorithms.Algorithm.sharding_refusal`), ``nonfinite=
            "skip"`` and a ``scaler`` are ValueErrors there.
        optimizer: a ``torch.optim`` optimizer over ``model``'s parameters: every trainable
            one (``requires_grad``) must be in its parameter groups (a frozen one may stay
            out), and it must not be one that :func:`distribute` returned; either is a
            ValueError.
        algorithm: an :class:`~gossamer.algorithms.Algorithm` configuration, or a registered
            name (default ``"allreduce"``) built with default options.
        comm: the communicator; ``None`` (default) initialises torch.distributed from the
            environment (torchrun, SLURM or Open MPI; a single process when none is set),
            on gloo for a model on the CPU and on ``from_env``'s default for one on a GPU
            (``GOSSAMER_BACKEND`` if set, else NCCL). A model on the CPU with an NCCL
            communicator is a ValueError. For a sharded model, the communicator of the
            replica dimension (``ShardLayout.from_env(shards=S).comm``); None, or one that
            spans ranks of the same replica, is a ValueError naming it.
        broadcast: copy rank 0's parameters and buffers to every worker first, so that all
            replicas start equal (default True, as DDP does).
        nonfinite: what a NaN or infinite gradient or parameter does, found before it is sent:
            ``"raise"`` (default: a :class:`~gossamer.patterns.nonfinite.NonFiniteError`
            naming the rank and step) or ``"skip"`` (the update is skipped); see
            :mod:`gossamer.patterns.nonfinite` for which algorithms agree on it.
        scaler: the ``torch.amp.GradScaler`` whose ``step()`` and ``update()`` the training
            loop calls with this optimizer (default None: none). The workers then agree on
            every overflow of the scaled gradients and skip the same steps, and their scales
            stay equal; methods that make no global collective in every step (gossip,
            asynchronous, local SGD, GossipGraD) make one small all-reduce per step for it.
            Overflows are skipped whatever ``nonfinite`` says.
        total_steps: the number of optimizer steps the loop will take (default None: not
            known). QSR's schedule needs it, and local SGD ends its last round there.
        training_inputs: ``training_inputs(k)`` yields k minibatches of this worker's training
            inputs, drawn apart from the loop's own (default None). Local SGD re-estimates
            BatchNorm statistics with them before an evaluation.

    Returns:
        A :class:`DistributedOptimizer` to use in place of ``optimizer``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    _check_optimizer(model, optimizer)
    if isinstance(algorithm, str):
        algorithm = create(algorithm)
    if not isinstance(algorithm, Algorithm):
        raise ValueError(f"algorithm must be an Algorithm or a name, got {algorithm!r}")
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise ValueError(f"scaler must be a torch.amp.GradScaler or None, got {scaler!r}")
    shards = local_shards(model)  # None: a model not sharded
    if shards is not None:
        _check_sharded(algorithm, comm, shards, nonfinite, scaler)
    devices = {t.device.type for t in model_tensors(model)}
    if comm is None:
        from gossamer.comm.torch_comm import TorchCommunicator

        # a model on the CPU goes over gloo, also where CUDA would make NCCL the default
        comm = TorchCommunicator.from_env(backend="gloo" if devices == {"cpu"} else None)

    if isinstance(comm, ProcessGroupBacked) and comm.backend == "nccl" and devices - {"cuda"}:
        raise ValueError(
            f"model: its tensors are on {', '.join(sorted(devices))}, and the communicator's "
            "backend, NCCL, carries CUDA tensors only: move the model to the GPU "
            "(model.cuda()), or pass a gloo communicator "
            "(TorchCommunicator.from_env(backend='gloo'))")
    algorithm = algorithm.resolve(comm.world_size)  # validated, topology built: once
    # a sharded model: the method works on the local shards, across the replicas
    local = model if shards is None else shards.view
    if broadcast and comm.world_size > 1:
        broadcast_model(comm, local)
    runtime = algorithm.bind(comm, local, optimizer)
    runtime.start(total_steps=total_steps, training_inputs=training_inputs, nonfinite=nonfinite)
    runtime.before_forward()
    return DistributedOptimizer(optimizer, runtime, scaler, shards)


def _check_sharded(algorithm: Algorithm, comm: Communicator | None, shards: LocalShards,
                   nonfinite: str, scaler: torch.amp.GradScaler | None) -> None:
    """Refuse what does not run on a model sharded with FSDP2 (ValueError naming it): a
    method not proven there, a communicator that is not the replica dimension, and the
    decisions that a replica's shards would each take alone (skipping a non-finite step, a
    GradScaler's overflow)."""
    why = algorithm.sharding_refusal()
    if why is not None:
        raise ValueError(f"algorithm: {algorithm.label} does not run on a model sharded with "
                         f"FSDP2: {why}")
    for name, value, default in (("nonfinite", nonfinite, "raise"), ("scaler", scaler, None)):
        if value != default:
            raise ValueError(
                f"{name}={value!r} on a sharded model: each shard's ranks would decide alone "
                "whether to skip a step, and a replica's shards could then differ; not "
                f"supported yet (leave {name}={default!r})")
    check_replica_comm(comm, shards)


def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that is distributed already (wrapping it again would run the method
    twice a step, and send everything twice) or that leaves out a trainable parameter of
    ``model`` (the method would send it while nothing updates it: built over another model,
    the model would never change). Parameters are compared by identity; a frozen one
    (``requires_grad=False``) may stay out, and the optimizer may hold others besides."""
    inner: Any = optimizer
    for _ in range(8):  # through wrappers that keep the optimizer they wrap as .optimizer
        if isinstance(inner, DistributedOptimizer):
            where = "" if inner is optimizer else f" (inside a {type(optimizer).__name__})"
            raise ValueError(
                f"optimizer: already distributed{where}, by an earlier distribute(): "
                "distributing it again would run the method twice a step and send everything "
                "twice; use that optimizer as it is, or pass the one it wraps "
                "(its .optimizer) to distribute a new one")
        inner = getattr(inner, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    missing = [name for name, p in trainable if id(p) not in held]
    if not missing:
        return
    if len(missing) == len(trainable):
        raise ValueError(
            "optimizer: it holds none of the model's trainable parameters (built over another "
            "model?): the model would never change while the method sends its parameters; "
            "build it over model.parameters()")
    names = ", ".join(repr(name) for name in missing[:3])
    if len(missing) > 3:
        names += f" and {len(missing) - 3} more"
    which = "parameter" if len(missing) == 1 else "parameters"
    verb = "is" if len(missing) == 1 else "are"
    raise ValueError(
        f"optimizer: the model's trainable {which} {names} {verb} in none of its parameter "
        "groups: the method would send them while nothing updates them; build the optimizer "
        "over every trainable parameter, or set requires_grad=False on those it does not train")


@torch.no_grad()
def broadcast_model(comm: Communicator, model: nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and floating-point buffers to every worker."""
    apply_flat(model_tensors(model), lambda buffer: comm.broadcast(buffer, src=src))
