"""What distribute() returns is a torch.optim.Optimizer: it shares the wrapped optimizer's
groups and state, takes closures, every learning-rate scheduler, and its state dict loads into
a plain optimizer and back."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.optim.lr_scheduler as schedulers

import gossamer
from gossamer.comm import SimWorld

STEPS = 6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 4, generator=g)
    return x, (x[:, 0] > 0).long()


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    x, y = _batch(step)
    return torch.nn.functional.cross_entropy(model(x), y)


# One constructor per scheduler of torch.optim.lr_scheduler (the test fails if torch adds one).
SCHEDULERS = {
    "LambdaLR": lambda o: schedulers.LambdaLR(o, lambda s: 0.9 ** s),
    "MultiplicativeLR": lambda o: schedulers.MultiplicativeLR(o, lambda s: 0.8),
    "StepLR": lambda o: schedulers.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: schedulers.MultiStepLR(o, milestones=[1, 4], gamma=0.3),
    "ConstantLR": lambda o: schedulers.ConstantLR(o, factor=0.5, total_iters=3),
    "LinearLR": lambda o: schedulers.LinearLR(o, start_factor=0.2, total_iters=4),
    "ExponentialLR": lambda o: schedulers.ExponentialLR(o, gamma=0.7),
    "PolynomialLR": lambda o: schedulers.PolynomialLR(o, total_iters=5, power=2.0),
    "CosineAnnealingLR": lambda o: schedulers.CosineAnnealingLR(o, T_max=5, eta_min=0.001),
    "CosineAnnealingWarmRestarts": lambda o: schedulers.CosineAnnealingWarmRestarts(o, T_0=3),
    "CyclicLR": lambda o: schedulers.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2),
    "OneCycleLR": lambda o: schedulers.OneCycleLR(o, max_lr=0.2, total_steps=STEPS),
    "SequentialLR": lambda o: schedulers.SequentialLR(o, [
        schedulers.LinearLR(o, start_factor=0.5, total_iters=2),
        schedulers.ExponentialLR(o, gamma=0.8)], milestones=[2]),
    "ChainedScheduler": lambda o: schedulers.ChainedScheduler([
        schedulers.ExponentialLR(o, gamma=0.9), schedulers.StepLR(o, step_size=2)]),
    "ReduceLROnPlateau": lambda o: schedulers.ReduceLROnPlateau(o, patience=0, factor=0.5),
    "LRScheduler": None,  # the base class
    "_LRScheduler": None,  # its deprecated alias
}


def test_every_scheduler_of_torch_is_covered():
    found = {name for name, cls in inspect.getmembers(schedulers, inspect.isclass)
             if cls.__module__ == schedulers.__name__
             and (issubclass(cls, schedulers.LRScheduler) or cls is schedulers.ReduceLROnPlateau)}
    assert found == set(SCHEDULERS)


def _train(comm, name: str | None, distributed: bool, closure: bool = False):
    """STEPS steps of SGD with momentum under scheduler ``name``; the learning rates seen and the
    final parameters."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer = gossamer.distribute(model, inner, "allreduce", comm) if distributed else inner
    scheduler = SCHEDULERS[name](optimizer) if name else None
    lrs = []
    for step in range(STEPS):
        def compute(step=step):
            optimizer.zero_grad()
            loss = _loss(model, step)
            loss.backward()
            return loss
        if closure:
            loss = optimizer.step(compute)
        else:
            loss = compute()
            optimizer.step()
        lrs.append(optimizer.param_groups[0]["lr"])
        if isinstance(scheduler, schedulers.ReduceLROnPlateau):
            scheduler.step(loss.detach().item() if step % 2 else 10.0)
        elif scheduler is not None:
            scheduler.step()
    return lrs, [p.detach().clone() for p in model.parameters()], optimizer


@pytest.mark.parametrize("name", [n for n, make in SCHEDULERS.items() if make is not None])
def test_every_scheduler_drives_the_distributed_optimizer_as_a_plain_one(name):
    plain_lrs, plain_params, _ = _train(None, name, distributed=False)
    # two workers with the same batches: the average of equal gradients is the gradient
    for lrs, params, optimizer in SimWorld(2).run(_train, name, True):
        assert isinstance(optimizer, torch.optim.Optimizer)
        assert lrs == plain_lrs
        assert len(set(plain_lrs)) > 1  # the schedule did change the learning rate
        for p, q in zip(params, plain_params, strict=True):
            assert torch.equal(p, q)


def test_a_closure_is_evaluated_and_its_loss_returned():
    with_closure = SimWorld(2).run(_train, None, True, True)
    without = SimWorld(2).run(_train, None, True, False)
    for (_, a, opt), (_, b, _) in zip(with_closure, without, strict=True):
        assert opt.runtime.step == STEPS
        for p, q in zip(a, b, strict=True):
            assert torch.equal(p, q)

    def returns_the_loss(comm):
        model = _model()
        optimizer = gossamer.distribute(
            model, torch.optim.SGD(model.parameters(), lr=0.1), "sgp", comm)

        def closure():
            optimizer.zero_grad()
            loss = _loss(model, 0)
            loss.backward()
            return loss
        with torch.no_grad():  # the closure runs with gradients enabled all the same
            loss = optimizer.step(closure)
        return loss.detach().item(), optimizer.runtime.step

    loss, steps = SimWorld(2).run(returns_the_loss)[0]
    assert loss > 0 and steps == 1


def _shares(comm):
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    optimizer = gossamer.distribute(model, inner, "localsgd", comm)
    same = (optimizer.param_groups is inner.param_groups, optimizer.state is inner.state,
            optimizer.defaults == inner.defaults)
    optimizer.param_groups[0]["lr"] = 0.5  # through the wrapper: the inner one sees it
    seen = inner.param_groups[0]["lr"]
    _loss(model, 0).backward()
    optimizer.zero_grad(set_to_none=False)
    zeroed = all(p.grad is not None and not p.grad.any() for p in model.parameters())
    optimizer.zero_grad()
    cleared = all(p.grad is None for p in model.parameters())
    try:
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return same, seen, zeroed, cleared, refused


def test_groups_and_state_are_the_wrapped_optimizers():
    same, seen, zeroed, cleared, refused = SimWorld(2).run(_shares)[0]
    assert same == (True, True, True)
    assert seen == 0.5
    assert zeroed and cleared
    assert "add_param_group" in refused and "before distribute()" in refused


def _round_trip(comm):
    """Train 3 steps, save; a plain AdamW loads the dict; a fresh distributed optimizer loads
    it and continues exactly as the uninterrupted one."""
    def build():
        model = _model()
        return model, gossamer.distribute(
            model, torch.optim.AdamW(model.parameters(), lr=0.01), "localsgd", comm)

    def steps(model, optimizer, start, stop):
        for step in range(start, stop):
            optimizer.zero_grad()
            _loss(model, step + comm.rank).backward()  # the workers' batches differ
            optimizer.step()

    model, optimizer = build()
    steps(model, optimizer, 0, 3)
    saved = copy.deepcopy(optimizer.state_dict())  # as saving it would: a snapshot
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    steps(model, optimizer, 3, STEPS)
    plain = torch.optim.AdamW(_model().parameters(), lr=1.0)
    plain.load_state_dict(saved)  # a plain optimizer of the type takes it as its own
    resumed_model, resumed = build()
    resumed_model.load_state_dict(weights)
    resumed.load_state_dict(saved)
    # load_state_dict gives the wrapped optimizer new groups: the wrapper's are those still
    same_groups = resumed.param_groups is resumed.optimizer.param_groups
    steps(resumed_model, resumed, 3, STEPS)
    old_form = build()[1]
    old_form.load_state_dict({"optimizer": {k: v for k, v in saved.items()
                                            if k != "algorithm"},
                              "algorithm": saved["algorithm"]})
    return (same_groups, plain.param_groups[0]["lr"], sorted(saved),
            resumed.runtime.state_dict() ==
            optimizer.runtime.state_dict(), old_form.runtime.step,
            all(torch.equal(p, q) for p, q in zip(model.parameters(),
                                                  resumed_model.parameters(), strict=True)))


def test_state_dict_loads_into_a_plain_optimizer_and_resumes_exactly():
    for same_groups, lr, keys, same_runtime, old_step, equal in SimWorld(2).run(_round_trip):
        assert same_groups
        assert lr == 0.01
        assert keys == ["algorithm", "param_groups", "state"]
        assert same_runtime and equal
        assert old_step == 3  # the form of earlier versions still loads


def test_an_optimizer_without_the_models_parameters_is_refused():
    """The optimizer must hold every trainable parameter of the model, by identity: one built
    over another model (which would leave the model unchanged while the method sends its
    parameters) and one that leaves a trainable parameter out are refused naming the argument,
    before anything is sent; a frozen parameter may stay out, and the model then trains."""

    def worker(comm):
        model, other = _model(), _model()  # equal values, other tensors
        with pytest.raises(ValueError, match="^optimizer: it holds none of the model's"):
            gossamer.distribute(model, torch.optim.SGD(other.parameters(), lr=0.1),
                                "allreduce", comm)
        with pytest.raises(ValueError, match=r"^optimizer: the model's trainable parameters "
                                             r"'2\.weight', '2\.bias' are in none"):
            gossamer.distribute(model, torch.optim.SGD(model[0].parameters(), lr=0.1),
                                "sgp", comm)
        sent = comm.stats.total_bytes_sent
        model[2].requires_grad_(False)  # frozen: it may stay out of the optimizer
        frozen = [p.detach().clone() for p in model[2].parameters()]
        first = model[0].weight.detach().clone()
        optimizer = gossamer.distribute(
            model, torch.optim.SGD(model[0].parameters(), lr=0.1), "allreduce", comm)
        optimizer.zero_grad()
        _loss(model, comm.rank).backward()
        optimizer.step()
        return (sent, all(torch.equal(p, q) for p, q in zip(model[2].parameters(), frozen,
                                                              strict=True)),
                torch.equal(model[0].weight, first))

    for sent, frozen_kept, first_kept in SimWorld(2).run(worker):
        assert sent == 0  # refused before the broadcast
        assert frozen_kept and not first_kept


def test_an_optimizer_distributed_already_is_refused():
    """Wrapping what distribute() returned again would run the method twice a step (twice the
    traffic): refused naming the argument, also inside a wrapper that keeps it as
    ``.optimizer`` (as Accelerate's does). The optimizer it wraps may be distributed anew."""

    class Wrapper(torch.optim.Optimizer):
        def __init__(self, optimizer):
            self.optimizer = optimizer
            self.param_groups = optimizer.param_groups

    def one_step(optimizer, comm, model):
        before = comm.stats.total_bytes_sent
        optimizer.zero_grad()
        _loss(model, comm.rank).backward()
        optimizer.step()
        return comm.stats.total_bytes_sent - before

    def worker(comm):
        model = _model()
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        optimizer = gossamer.distribute(model, inner, "allreduce", comm)
        first = one_step(optimizer, comm, model)
        with pytest.raises(ValueError, match="^optimizer: already distributed"):
            gossamer.distribute(model, optimizer, "allreduce", comm)
        with pytest.raises(ValueError, match=r"^optimizer: already distributed \(inside a "
                                             r"Wrapper\)"):
            gossamer.distribute(model, Wrapper(optimizer), "allreduce", comm)
        again = gossamer.distribute(model, inner, "allreduce", comm)
        return first, one_step(again, comm, model)

    params = sum(p.numel() for p in _model().parameters())
    for first, again in SimWorld(2).run(worker):
        assert first >= 4 * params  # the float32 gradients, all-reduced
        assert again == first  # the method once a step, not twice


def test_every_method_and_compressor_is_importable_from_gossamer():
    from gossamer.algorithms import lookup

    for name in gossamer.available():
        cls = lookup(name)  # a configuration class, or a preset (DGC: AllReduce with dgc's)
        assert any(getattr(gossamer, attr) is cls for attr in gossamer.__all__), name
    assert "topk" in gossamer.available_compressors()
    assert str(gossamer.parse_compression("topk:ratio=0.5")) == "topk:ratio=0.5"
    assert gossamer.AllReduce(compression="topk:ratio=0.5") == gossamer.with_compression(
        gossamer.AllReduce(), "topk:ratio=0.5")


def test_before_eval_is_the_runtimes():
    from gossamer.algorithms import DPSGD

    def worker(comm):
        model = torch.nn.Linear(3, 1)
        opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  DPSGD(average_before_eval=True), comm)
        before = opt.runtime.synchronizations
        opt.before_eval()
        return opt.runtime.synchronizations - before

    assert SimWorld(2).run(worker) == [1, 1]


def test_zero_grad_is_torchs():
    """zero_grad() sets every gradient to None, zero_grad(set_to_none=False) zeroes them, a
    profiler sees torch's record of it, and an optimizer's own zero_grad (its class's, or one
    set on the object) is the one called."""

    class Counting(torch.optim.SGD):
        calls = 0

        def zero_grad(self, set_to_none: bool = True) -> None:
            Counting.calls += 1
            super().zero_grad(set_to_none)

    def run(comm):
        model = _model()
        optimizer = gossamer.distribute(
            model, torch.optim.SGD(model.parameters(), lr=0.1), "allreduce", comm)
        _loss(model, 0).backward()
        optimizer.zero_grad()
        cleared = [p.grad is None for p in model.parameters()]
        _loss(model, 1).backward()
        optimizer.zero_grad(set_to_none=False)
        zeroed = [p.grad is not None and not p.grad.any() for p in model.parameters()]
        _loss(model, 2).backward()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            optimizer.zero_grad()
        profiled = [p.grad is None for p in model.parameters()]
        names = {event.name for event in prof.events()}
        counted = gossamer.distribute(
            model, Counting(model.parameters(), lr=0.1), "allreduce", comm)
        _loss(model, 3).backward()
        counted.zero_grad()
        own = [p.grad is None for p in model.parameters()]
        patched = torch.optim.SGD(model.parameters(), lr=0.1)
        patched_calls = []
        patched.zero_grad = lambda set_to_none=True: patched_calls.append(set_to_none)
        gossamer.distribute(model, patched, "allreduce", comm).zero_grad()
        return cleared, zeroed, profiled, names, own, patched_calls

    cleared, zeroed, profiled, names, own, patched_calls = SimWorld(1).run(run)[0]
    assert all(cleared) and all(zeroed) and all(profiled) and all(own)
    assert "Optimizer.zero_grad#SGD.zero_grad" in names
    assert Counting.calls == 1
    assert patched_calls == [True]


def test_step_hooks_and_the_profilers_record_are_torchs():
    """The step runs the global and the optimizer's own pre- and post-hooks in torch's order,
    a pre-hook may replace the arguments, and a profiler sees the step under torch's name."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    def steps(comm):
        model = _model()
        optimizer = gossamer.distribute(
            model, torch.optim.SGD(model.parameters(), lr=0.1), "allreduce", comm)
        calls = []
        closure_calls = []

        def closure():
            closure_calls.append(1)
            optimizer.zero_grad()
            loss = _loss(model, 0)
            loss.backward()
            return loss

        def own_pre(opt, args, kwargs):
            calls.append(("own pre", opt is optimizer and args == (optimizer,)))
            return (opt,), {"closure": closure}  # the step then evaluates this closure

        handles = [
            register_optimizer_step_pre_hook(lambda opt, a, k: calls.append(("global pre", 0))),
            optimizer.register_step_pre_hook(own_pre),
            optimizer.register_step_post_hook(
                lambda opt, a, k: calls.append(("own post", a == (opt,), tuple(k)))),
            register_optimizer_step_post_hook(lambda opt, a, k: calls.append(("global post", 0))),
        ]
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                optimizer.step()
        finally:
            for handle in handles:
                handle.remove()
        names = {event.name for event in prof.events()}
        return calls, len(closure_calls), names

    calls, closures, names = SimWorld(1).run(steps)[0]
    # torch runs the inner SGD's own hooks too: only the global ones twice
    own = [c for c in calls if c[0].startswith("own")]
    # as torch passes them: the arguments hold the optimizer first, and the post-hooks see
    # what the pre-hook made of them
    assert own == [("own pre", True), ("own post", True, ("closure",))]
    assert [c[0] for c in calls if c[0].startswith("global")] == [
        "global pre", "global pre", "global post", "global post"]
    assert calls.index(("own pre", True)) < calls.index(("own post", True, ("closure",)))
    assert closures == 1
    assert "Optimizer.step#DistributedOptimizer.step" in names
    assert "Optimizer.step#SGD.step" in names


def test_the_wrapped_optimizers_step_runs_its_hooks_without_a_profiler():
    """Without a profiler the wrapped optimizer's step runs outside torch's wrapper (no
    profiler record), with its own and the global hooks in torch's order and with torch's
    arguments (the optimizer first, as torch's wrapper passes them); a step set on the
    object (here a counter) is called as it is; the parameters move as a plain SGD's."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def steps(comm, patched):
        model = _model()
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        optimizer = gossamer.distribute(model, inner, "allreduce", comm)
        calls = []
        if patched:
            step = inner.step
            inner.step = lambda *a, **k: (calls.append("patched"), step(*a, **k))[1]
        handles = [
            register_optimizer_step_pre_hook(
                lambda opt, a, k: calls.append(("global pre", type(opt).__name__))),
            inner.register_step_pre_hook(
                lambda opt, a, k: calls.append(("inner pre", a == (opt,), k))),
            inner.register_step_post_hook(lambda opt, a, k: calls.append("inner post")),
        ]
        try:
            for step_index in range(2):
                optimizer.zero_grad()
                _loss(model, step_index).backward()
                optimizer.step()
        finally:
            for handle in handles:
                handle.remove()
        return calls, [p.detach().clone() for p in model.parameters()]

    model = _model()
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step_index in range(2):
        plain.zero_grad()
        _loss(model, step_index).backward()
        plain.step()
    for patched in (False, True):
        calls, params = SimWorld(1).run(steps, patched)[0]
        one_step = [("global pre", "DistributedOptimizer"), ("global pre", "SGD"),
                    ("inner pre", True, {}), "inner post"]
        if patched:
            one_step.insert(1, "patched")
        assert calls == one_step * 2
        for p, q in zip(params, model.parameters(), strict=True):
            assert torch.equal(p, q.detach())
