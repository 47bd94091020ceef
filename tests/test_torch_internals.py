"""The private names of torch that gossamer uses (gossamer.torch_internals): this torch still
has each as gossamer expects (a torch that changes one fails here, with the fallback said),
each function does what torch does, and where a name is gone the public fallback still runs
the hooks, the step and the scaler."""

from __future__ import annotations

import pytest
import torch
from torch.optim import optimizer as torch_optimizer
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

import gossamer
from gossamer import torch_internals
from gossamer.api import DistributedOptimizer, _step_wrapped
from gossamer.comm import SimWorld
from gossamer.torch_internals import (
    check,
    global_step_hooks,
    is_torch_step_wrapper,
    mark_step_hooked,
    profiler_enabled,
    run_step_with_hooks,
    scaler_found_inf,
    unwrapped_step,
)

ORDER = ["global pre", "own pre", "step", "own post", "global post"]


class Recording(torch.optim.Optimizer):
    """An optimizer whose step records that it ran, and with which closure."""

    def __init__(self, calls: list) -> None:
        super().__init__([torch.nn.Parameter(torch.zeros(1))], {})
        self.calls = calls

    def step(self, closure=None):  # torch puts its wrapper around it
        self.calls.append("step" if closure is None else ("step", closure))
        return "stepped"


def recording(calls: list, pre=None) -> tuple[Recording, list]:
    """A Recording optimizer with a global and its own pre- and post-hook that record their
    calls (``pre`` in place of its own pre-hook), and the hooks' handles."""
    optimizer = Recording(calls)
    handles = [
        register_optimizer_step_pre_hook(lambda opt, a, k: calls.append("global pre")),
        optimizer.register_step_pre_hook(pre or (lambda opt, a, k: calls.append("own pre"))),
        optimizer.register_step_post_hook(lambda opt, a, k: calls.append("own post")),
        register_optimizer_step_post_hook(lambda opt, a, k: calls.append("global post")),
    ]
    return optimizer, handles


def hooked_step(pre=None) -> tuple[list, object]:
    """The calls and the result of run_step_with_hooks on a Recording optimizer."""
    calls: list = []
    optimizer, handles = recording(calls, pre)
    try:
        out = run_step_with_hooks(optimizer, (optimizer,), {}, Recording.step.__wrapped__)
    finally:
        for handle in handles:
            handle.remove()
    return calls, out


def test_torch_still_has_every_private_name_gossamer_uses():
    problems = check()
    if problems:
        pytest.fail("torch changed what gossamer.torch_internals uses:\n" + "\n".join(problems))


def test_the_hooks_run_in_torchs_order_as_torchs_own_wrapper_runs_them():
    calls: list = []
    optimizer, handles = recording(calls)
    try:
        assert optimizer.step() == "stepped"  # torch's own wrapper
    finally:
        for handle in handles:
            handle.remove()
    assert calls == ORDER
    assert hooked_step() == (ORDER, "stepped")
    assert unwrapped_step(Recording.step) is Recording.step.__wrapped__


def test_a_pre_hook_may_replace_the_arguments_as_in_torch():
    seen = []

    def pre(opt, args, kwargs):
        seen.append(args == (opt,) and kwargs == {})
        return args, {"closure": "given"}

    calls, _ = hooked_step(pre)
    assert seen == [True]
    assert calls == ["global pre", ("step", "given"), "own post", "global post"]
    with pytest.raises(RuntimeError, match="must return None or a tuple"):
        hooked_step(lambda opt, a, k: "not a pair")


def test_torchs_step_wrapper_is_recognised():
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # torch wraps SGD.step

    def plain(self):
        return None

    assert is_torch_step_wrapper(torch.optim.SGD.step)
    assert unwrapped_step(torch.optim.SGD.step) is torch.optim.SGD.step.__wrapped__
    assert not is_torch_step_wrapper(plain) and unwrapped_step(plain) is None
    assert not is_torch_step_wrapper(DistributedOptimizer.step)  # gossamer's own


def test_a_step_marked_hooked_is_left_as_it_is():
    def step(self, closure=None):
        return None

    marked = type("Marked", (torch.optim.SGD,), {"step": mark_step_hooked(step)})
    unmarked = type("Unmarked", (torch.optim.SGD,), {"step": lambda self, closure=None: None})
    for cls in (marked, unmarked):
        cls([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert marked.step is step
    assert is_torch_step_wrapper(unmarked.step)


def test_the_profiler_is_seen_while_it_runs():
    assert not profiler_enabled()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert profiler_enabled()
    assert not profiler_enabled()


def test_the_scalers_found_inf_is_its_own():
    """It is the scaler's record for the optimizer it unscaled: setting it makes update()
    lower the scale. An optimizer it never unscaled has none."""
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(param.sum()).backward()
    scaler.unscale_(optimizer)
    found = scaler_found_inf(scaler, optimizer)
    assert list(found) == [torch.device("cpu")] and found[torch.device("cpu")].item() == 0.0
    scaler.step(optimizer)
    for found_inf in scaler_found_inf(scaler, optimizer).values():
        found_inf.fill_(1.0)
    scaler.update()
    assert scaler.get_scale() == 2.0
    other = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    assert scaler_found_inf(scaler, other) == {}


# -- where torch no longer has a name: the public fallback ----------------------------------


def test_without_the_global_hooks_torchs_wrapper_runs_them(monkeypatch):
    with monkeypatch.context() as gone:  # what a torch without them would show
        gone.delattr(torch_optimizer, "_global_optimizer_pre_hooks")
        assert global_step_hooks() is None
        assert any("_global_optimizer_pre_hooks is gone" in m and "12 us" in m
                   for m in check())
    # what gossamer found at import on such a torch (torch's own wrapper still needs them)
    monkeypatch.setattr(torch_internals, "_GLOBAL_HOOKS", None)
    assert hooked_step() == (ORDER, "stepped")
    assert unwrapped_step(Recording.step) is None  # gossamer calls optimizer.step() itself
    assert wrapped_step_calls() == ORDER


def wrapped_step_calls() -> list:
    """What gossamer's step of a recording optimizer called, in order (hooks and step)."""
    calls: list = []
    optimizer, handles = recording(calls)
    try:
        _step_wrapped(optimizer)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def test_without_an_optimizers_own_hooks_torchs_wrapper_runs_the_step(monkeypatch):
    calls: list = []
    optimizer = Recording(calls)  # torch's wrapper is around Recording.step from here
    body = Recording.step.__wrapped__
    monkeypatch.delattr(torch.optim.Optimizer, "_optimizer_step_code")
    assert any("_optimizer_step_code is gone" in m for m in check())
    wrapped = []

    def newer_wrapper(func):  # a torch whose wrapper no longer uses the name
        def wrapper(*args, **kwargs):
            wrapped.append(func)
            return func(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(torch.optim.Optimizer, "profile_hook_step", staticmethod(newer_wrapper))
    assert run_step_with_hooks(optimizer, (optimizer,), {}, body) == "stepped"
    assert calls == ["step"] and wrapped == [body]


def test_without_the_profilers_flag_torchs_records_are_kept(monkeypatch):
    with monkeypatch.context() as gone:
        gone.delattr(torch._C._autograd, "_profiler_enabled")
        assert any("_profiler_enabled is gone" in m for m in check())
    monkeypatch.setattr(torch_internals, "_PROFILER_ENABLED", None)
    assert profiler_enabled()  # so torch's own step wrapper and zero_grad run
    assert wrapped_step_calls() == ORDER


def test_without_the_scalers_found_inf_an_overflow_is_still_skipped(monkeypatch):
    monkeypatch.delattr(torch.amp.GradScaler, "_found_inf_per_device")
    assert any("_found_inf_per_device is gone" in m for m in check())

    def steps(comm):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        assert scaler_found_inf(scaler, torch.optim.SGD(model.parameters())) is None
        optimizer = gossamer.distribute(
            model, torch.optim.SGD(model.parameters(), lr=0.1), "allreduce", comm,
            scaler=scaler)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        scaler.scale(model(torch.full((2, 3), float("inf"))).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        moved = any(not torch.equal(p, q) for p, q in zip(before, model.parameters(), strict=True))
        return moved, optimizer.runtime.skipped_steps, scaler.get_scale()

    assert SimWorld(2).run(steps) == [(False, 1, 2.0)] * 2
