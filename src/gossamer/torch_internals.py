"""Every private name of torch that gossamer uses, each behind one function that says why and
what runs where torch no longer has it.

Each is kept for a measured reason: torch's step wrapper costs about 12 us a call (half of it
a profiler record) and its ``zero_grad`` about 7 us, against a small model's whole step of
about 300 us, which the simulator runs hundreds of times a training step; and GradScaler
offers no public way to hand an optimizer the overflow decision or to set the found-inf it
recorded. Where a name is gone, the function falls back to torch's public behaviour (slower,
never wrong) and :func:`check` says so, one message a name (tests/test_torch_internals.py
fails with them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.optim import optimizer as _torch_optim

T = TypeVar("T", bound=type)


def global_step_hooks() -> tuple[dict, dict] | None:
    """torch's own dictionaries of global step pre- and post-hooks (hooks registered later are
    in them), or None where torch no longer keeps them: then every step goes through torch's
    public step wrapper, about 12 us slower."""
    pre = getattr(_torch_optim, "_global_optimizer_pre_hooks", None)
    post = getattr(_torch_optim, "_global_optimizer_post_hooks", None)
    return (pre, post) if isinstance(pre, dict) and isinstance(post, dict) else None


_GLOBAL_HOOKS = global_step_hooks()
_PROFILER_ENABLED = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)


def _torch_step_code() -> Any:
    """The code of the wrapper torch puts around every optimizer class's step, if any."""
    wrap = getattr(torch.optim.Optimizer, "profile_hook_step", None)
    return getattr(wrap and wrap(lambda *a, **k: None), "__code__", None)


_TORCH_STEP_CODE = _torch_step_code()


def profiler_enabled() -> bool:
    """Whether a torch profiler runs, so that gossamer enters torch's records (about 6 us each)
    only then. torch has no public call for it; where its private one is gone, True: torch's
    own step wrapper and ``zero_grad`` then run, records and all."""
    return True if _PROFILER_ENABLED is None else _PROFILER_ENABLED()


def is_torch_step_wrapper(step: Any) -> bool:
    """Whether ``step`` is the wrapper torch puts around every optimizer class's step."""
    return _TORCH_STEP_CODE is not None and getattr(step, "__code__", None) is _TORCH_STEP_CODE


def unwrapped_step(step: Any) -> Callable[..., Any] | None:
    """The step function inside torch's wrapper ``step``, for :func:`run_step_with_hooks` to
    run without the wrapper's profiler record; None where ``step`` is no such wrapper or torch
    no longer keeps its global hooks (then call the optimizer's step itself)."""
    if _GLOBAL_HOOKS is None or not is_torch_step_wrapper(step):
        return None
    return getattr(step, "__wrapped__", None)


def run_step_with_hooks(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict,
                        call: Callable[..., Any]) -> Any:
    """``call(*args, **kwargs)``, ``optimizer``'s step, between the global and the optimizer's
    own step hooks, as torch's wrapper runs them: in its order, each hook with ``(optimizer,
    args, kwargs)`` where ``args`` holds the optimizer first, and a pre-hook may replace
    ``args`` and ``kwargs``; without the wrapper's profiler record (about 6 us). Where torch
    no longer keeps the hooks where this looks: torch's public wrapper around ``call``."""
    if _GLOBAL_HOOKS is None:
        return torch.optim.Optimizer.profile_hook_step(call)(*args, **kwargs)
    try:
        own_pre = optimizer._optimizer_step_pre_hooks
        own_post = optimizer._optimizer_step_post_hooks
        count_step = optimizer._optimizer_step_code
    except AttributeError:
        return torch.optim.Optimizer.profile_hook_step(call)(*args, **kwargs)
    pre, post = _GLOBAL_HOOKS
    for pre_hook in [*pre.values(), *own_pre.values()]:
        result = pre_hook(optimizer, args, kwargs)
        if result is not None:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(f"{call} must return None or a tuple of (new_args, "
                                   f"new_kwargs), but got {result}.")
            args, kwargs = result
    out = call(*args, **kwargs)
    count_step()
    for post_hook in [*own_post.values(), *post.values()]:
        post_hook(optimizer, args, kwargs)
    return out


def mark_step_hooked(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step``, marked so that torch does not put its own wrapper around it (a class's step
    that runs the hooks itself, as :func:`run_step_with_hooks` does)."""
    step.hooked = True  # type: ignore[attr-defined]
    return step


def takes_amp_scaling(cls: T) -> T:
    """``cls``, an optimizer class that ``GradScaler.step`` then calls on every worker, with
    the scale and its found-inf as attributes ``grad_scale`` and ``found_inf``, instead of
    skipping its step where it found an overflow (which would leave the other workers waiting
    in the step's collective). torch offers no public way to ask for it, and no fallback
    keeps the workers together without it: :func:`check` says so where it is gone."""
    cls._step_supports_amp_scaling = True
    return cls


def scaler_found_inf(scaler: torch.amp.GradScaler,
                     optimizer: torch.optim.Optimizer) -> dict[Any, torch.Tensor] | None:
    """The found-inf tensors, per device, that ``scaler`` recorded for ``optimizer`` (empty if
    it recorded none): ``scaler.update()`` lowers the scale where one is 1, and GradScaler
    offers no public way to set them. None where torch no longer has them: overflows are then
    still skipped on every worker alike, but the scales may drift apart."""
    found = getattr(scaler, "_found_inf_per_device", None)
    return None if found is None else found(optimizer)


def check() -> list[str]:
    """One message for each private name above that this torch no longer has, or has in
    another shape; empty where all are as gossamer expects."""
    version, problems = torch.__version__, []

    def expect(ok: Callable[[], object], name: str, fallback: str) -> None:
        try:
            good = bool(ok())
        except Exception:  # whatever torch changed: a message, not a crash
            good = False
        if not good:
            problems.append(f"{name} is gone or changed in torch {version}: {fallback}")

    slower_step = "gossamer falls back to torch's own step wrapper (about 12 us slower a step)"
    for hooks in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
        expect(lambda h=hooks: isinstance(getattr(_torch_optim, h), dict),
               f"torch.optim.optimizer.{hooks}", slower_step)
    param = torch.nn.Parameter(torch.ones(1))
    sgd = torch.optim.SGD([param], lr=0.0)
    for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
        expect(lambda h=hooks: isinstance(getattr(sgd, h), dict),
               f"torch.optim.Optimizer.{hooks}", slower_step)
    expect(lambda: callable(sgd._optimizer_step_code),
           "torch.optim.Optimizer._optimizer_step_code", slower_step)
    expect(lambda: type(sgd).step.__code__ is _torch_step_code() and type(sgd).step.__wrapped__,
           "torch.optim.Optimizer.profile_hook_step (its code and __wrapped__)",
           slower_step)
    expect(lambda: isinstance(torch._C._autograd._profiler_enabled(), bool),
           "torch._C._autograd._profiler_enabled",
           "gossamer assumes a profiler runs: torch's step wrapper and zero_grad always run "
           "(about 12 us and 7 us slower a step)")
    plain = type("Plain", (torch.optim.SGD,), {"step": mark_step_hooked(lambda self: None)})
    expect(lambda: type(plain([param], lr=0.0)).step.__code__ is not _torch_step_code(),
           "the 'hooked' mark of an optimizer's step",
           "torch wraps DistributedOptimizer.step again (hooks run twice)")
    seen: dict[str, Any] = {}
    amp = takes_amp_scaling(type("Amp", (torch.optim.SGD,), {
        "step": mark_step_hooked(lambda self: seen.update(vars(self)))}))
    scaler = torch.amp.GradScaler("cpu")
    optimizer = amp([param], lr=0.0)
    scaler.scale(param.sum()).backward()
    expect(lambda: scaler.step(optimizer) is None and "found_inf" in seen,
           "GradScaler.step's reading of _step_supports_amp_scaling",
           "GradScaler skips step() on a worker whose gradients overflow, and the others "
           "wait for it in the step's collective")
    expect(lambda: list(scaler._found_inf_per_device(optimizer).values())[0].numel() == 1,
           "torch.amp.GradScaler._found_inf_per_device",
           "an overflow is still skipped on every worker, but their scales may drift apart")
    return problems
