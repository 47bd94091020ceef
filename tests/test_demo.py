"""DeMo against its oracle, its invariants, the gloo backend, checkpoints and bad options.

The library runs in SimWorld (4 workers, float64) on a per-worker least-squares problem: a
``Linear(12, 6)`` whose data depend on the worker and the step, under a decaying learning rate.
After every step each worker's parameters and momentum must match the oracle's
(``tests/oracles/demo.py``, a plain sequential program from the paper's Algorithm 1 as the
authors' code computes it, DCT from its definition, gradients written out by hand) to 1e-9.
"""

from __future__ import annotations

import pytest
import torch
from oracles import demo as oracle
from oracles.least_squares import LeastSquares
from torch import nn

import gossamer
from gossamer.algorithms import DeMo, create
from gossamer.algorithms.demo import ChunkedDCT
from gossamer.comm import SimWorld
from gossamer.comm.cost import ring_all_gather_traffic
from gossamer.patterns.nonfinite import NonFiniteError

N, IN, OUT, ROWS, STEPS = 4, 12, 6, 5, 12
LRS = [0.02 * 0.9**k for k in range(STEPS)]
ATOL = 1e-9
NAMES = ["bias", "weight"]  # the runtime's order: by name


PROBLEM = LeastSquares(IN, OUT, ROWS)
_data, _grad, _model = PROBLEM.data, PROBLEM.grad, PROBLEM.model
X0 = PROBLEM.x0()


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    a, y = _data(rank, step)
    return 0.5 * (model(a) - y).pow(2).sum(1).mean()


def _train(comm, algorithm, steps: int = STEPS, momentum: float = 0.9,
           weight_decay: float = 0.0, record: bool = False):
    """``steps`` steps of ``algorithm``; per step the parameters and the runtime's momentum
    ([weight, bias] both), and the bytes sent after distribute()."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=LRS[0], momentum=momentum,
                            weight_decay=weight_decay)
    opt = gossamer.distribute(model, inner, algorithm, comm)
    comm.stats.reset()
    params, momenta, grads = [], [], []
    for k in range(steps):
        for group in opt.param_groups:
            group["lr"] = LRS[k]
        opt.zero_grad()
        _loss(model, comm.rank, k).backward()
        if record:
            grads.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
        state = opt.runtime.state_dict()["momentum"]
        momenta.append([state["weight"].clone(), state["bias"].clone()])
    return {"params": params, "momenta": momenta, "grads": grads,
            "sent": comm.stats.total_bytes_sent, "runtime": opt.runtime}


def _assert_close(got, want, what: str, atol: float = ATOL) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for j, (a, b) in enumerate(zip(g, w, strict=True)):
            err = float((a - b).abs().max())
            assert err <= atol, f"{what}: worker {i}, tensor {j}: off by {err:g}"


CASES = {
    "small chunks": (DeMo(compression_decay=0.9, compression_topk=5, compression_chunk=4),
                     {"beta": 0.9, "topk": 5, "chunk": 4}, 0.0),
    "defaults, weight decay": (DeMo(), {}, 0.05),
    "one coefficient per chunk": (DeMo(compression_topk=1, compression_chunk=6),
                                  {"topk": 1, "chunk": 6}, 0.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_oracle_step_by_step(case):
    algorithm, options, weight_decay = CASES[case]
    results = SimWorld(N).run(lambda comm: _train(comm, algorithm, weight_decay=weight_decay))
    want = oracle.demo(X0, N, _grad, LRS, weight_decay=weight_decay, **options)
    for k in range(STEPS):
        _assert_close([r["params"][k] for r in results], want.params[k], f"{case}, step {k}")
        _assert_close([r["momenta"][k] for r in results], want.momenta[k],
                      f"{case}, momentum after step {k}")
        for r in results[1:]:  # every worker steps with the same sign(Q)
            assert all(torch.equal(a, b) for a, b in zip(r["params"][k], results[0]["params"][k],
                                                         strict=True))
    # the momenta differ per worker (only their fast components were exchanged)
    assert not torch.allclose(results[0]["momenta"][-1][0], results[1]["momenta"][-1][0])


def test_every_coefficient_sent_is_sign_sgd_on_the_averaged_gradient():
    """With top-k = every coefficient the momentum is extracted whole each step (beta has
    nothing left to decay), so Q is the average of lr g over the workers: sign SGD on the
    all-reduced gradient, whatever beta."""
    expected = [t.clone() for t in X0]
    for k in range(STEPS):
        grads = [_grad(i, k, expected) for i in range(N)]
        for j in range(len(expected)):
            mean = sum(g[j] for g in grads) / N
            expected[j] = expected[j] - LRS[k] * torch.sign(mean)
    for beta in (0.0, 0.999):
        algorithm = DeMo(compression_decay=beta, compression_topk=10**6)
        results = SimWorld(N).run(lambda comm, a=algorithm: _train(comm, a))
        for r in results:
            for a, b in zip(r["params"][-1], expected, strict=True):
                assert torch.allclose(a, b, rtol=0, atol=1e-12), beta
            assert all(float(m.abs().max()) < 1e-15 for m in r["momenta"][-1])


def test_one_worker_with_every_coefficient_is_sign_sgd():
    expected = [t.clone() for t in X0]
    for k in range(STEPS):
        expected = [x - LRS[k] * torch.sign(g) for x, g in zip(expected, _grad(0, k, expected),
                                                               strict=True)]
    result = SimWorld(1).run(lambda comm: _train(comm, DeMo(compression_topk=10**6)))[0]
    for a, b in zip(result["params"][-1], expected, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def _largest(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def test_what_stays_in_the_momentum_is_all_but_the_top_components():
    """Each step: ``beta m + lr g - m_new`` (what left) has at most top-k DCT coefficients per
    chunk, at the positions of the k largest of ``beta m + lr g``, and ``m_new`` has none
    there."""
    beta, topk, chunk = 0.9, 3, 4
    algorithm = DeMo(compression_decay=beta, compression_topk=topk, compression_chunk=chunk)
    results = SimWorld(N).run(lambda comm: _train(comm, algorithm, record=True))
    for r in results:
        previous = [torch.zeros_like(t) for t in X0]
        for k in range(STEPS):
            for j, x in enumerate(X0):
                dct = ChunkedDCT(x.shape, chunk, torch.float64, torch.device("cpu"))
                accumulated = beta * previous[j] + LRS[k] * r["grads"][k][j]
                left = dct.encode(accumulated - r["momenta"][k][j])
                stays = dct.encode(r["momenta"][k][j])
                top = torch.topk(dct.encode(accumulated).abs(), min(topk, dct.size), -1).indices
                mask = torch.zeros_like(left, dtype=torch.bool).scatter_(-1, top, True)
                assert _largest(left[~mask]) < 1e-14, (k, j)
                assert _largest(stays[mask]) < 1e-14, (k, j)
                assert torch.allclose(left[mask], dct.encode(accumulated)[mask], atol=1e-14)
            previous = r["momenta"][k]


def test_bytes_are_what_the_payload_says():
    """Per step and worker: an all-gather of the positions (int16) and one of the values
    (float64) with the non-finite flag, counted as the ring moves them."""
    algorithm = DeMo(compression_topk=5, compression_chunk=4)
    results = SimWorld(N).run(lambda comm: _train(comm, algorithm))
    # weight 6 x 12 in chunks of 3 x 4: 6 chunks of 12, 5 sent; bias 6: 2 chunks of 3, all 3
    positions = 6 * 5 + 2 * 3
    assert results[0]["runtime"].payload_sizes() == (positions, positions + 1)
    for rank, r in enumerate(results):
        per_step = sum(b for _, b, _ in ring_all_gather_traffic(rank, N, [2 * positions] * N))
        per_step += sum(b for _, b, _ in ring_all_gather_traffic(rank, N,
                                                                 [8 * (positions + 1)] * N))
        assert r["sent"] == STEPS * per_step, rank
        assert r["runtime"].synchronizations == STEPS


def test_the_wrapped_optimizer_gives_only_its_lr_and_weight_decay():
    """SGD with momentum, without, and AdamW (its decay decoupled, as DeMo's) give the same
    run: the runtime steps, and the wrapped optimizer's own rule never sees a gradient."""

    def run(comm, make):
        model = _model()
        opt = gossamer.distribute(model, make(model.parameters()), DeMo(), comm)
        for k in range(STEPS):
            for group in opt.param_groups:
                group["lr"] = LRS[k]
            opt.zero_grad()
            _loss(model, comm.rank, k).backward()
            opt.step()
            assert all(p.grad is None for p in model.parameters())
        return [p.detach().clone() for p in model.parameters()], opt.optimizer.state

    makes = [lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.05),
             lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.05),
             lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.05)]
    runs = [SimWorld(N).run(run, make) for make in makes]
    for other in runs[1:]:
        for (a, state), (b, _) in zip(other, runs[0], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
            assert not state  # no momentum buffer, no moments
    want = oracle.demo(X0, N, _grad, LRS, weight_decay=0.05)
    _assert_close([r[0] for r in runs[0]], want.params[-1], "with weight decay")


def test_checkpoint_round_trip_continues_the_same_run():
    algorithm = DeMo(compression_topk=4, compression_chunk=4)
    split = STEPS // 2

    def run(comm, resume: bool):
        model = _model()
        opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=LRS[0]),
                                  algorithm, comm)
        for k in range(STEPS):
            if resume and k == split:
                saved = (model.state_dict(), opt.optimizer.state_dict(),
                         opt.runtime.state_dict())
                model = _model()
                opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=1.0),
                                          algorithm, comm, broadcast=False)
                model.load_state_dict(saved[0])
                opt.optimizer.load_state_dict(saved[1])
                opt.runtime.load_state_dict(saved[2])
            for group in opt.param_groups:
                group["lr"] = LRS[k]
            opt.zero_grad()
            _loss(model, comm.rank, k).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    whole = SimWorld(N).run(run, False)
    resumed = SimWorld(N).run(run, True)
    for a, b in zip(whole, resumed, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_non_finite_gradient_is_skipped_by_every_worker():
    """Under nonfinite="skip", one worker's infinite gradient makes every worker skip the
    step: parameters and momenta as before it; under "raise" every worker raises."""

    def run(comm, policy: str):
        model = _model()
        opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.01), DeMo(),
                                  comm, nonfinite=policy)
        states = []
        for k in range(3):
            opt.zero_grad()
            loss = _loss(model, comm.rank, k)
            if k == 1 and comm.rank == 2:
                loss = loss * float("inf")
            loss.backward()
            opt.step()
            states.append(([p.detach().clone() for p in model.parameters()],
                           {n: m.clone() for n, m in opt.runtime.momentum.items()}))
        return states, opt.runtime.skipped_steps

    for states, skipped in SimWorld(N).run(run, "skip"):
        assert skipped == 1
        before, after = states[0], states[1]
        assert all(torch.equal(a, b) for a, b in zip(before[0], after[0], strict=True))
        assert all(torch.equal(before[1][n], after[1][n]) for n in NAMES)
        assert all(torch.isfinite(m).all() for m in states[2][1].values())
    with pytest.raises(Exception) as raised:
        SimWorld(N).run(run, "raise")
    assert all(isinstance(e, NonFiniteError) for e in raised.value.failures.values())


@pytest.mark.parametrize("options, named", [
    ({"compression_decay": 1.0}, "compression_decay"),
    ({"compression_decay": -0.1}, "compression_decay"),
    ({"compression_decay": float("nan")}, "compression_decay"),
    ({"compression_topk": 0}, "compression_topk"),
    ({"compression_topk": 2.5}, "compression_topk"),
    ({"compression_chunk": 0}, "compression_chunk")])
def test_bad_options_are_refused_naming_them(options, named):
    with pytest.raises(ValueError, match=f"^{named}"):
        DeMo(**options)


def test_a_maximizing_optimizer_is_refused_naming_it():
    def worker(comm):
        model = _model()
        with pytest.raises(ValueError, match="^optimizer"):
            gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1,
                                                       maximize=True), DeMo(), comm)

    SimWorld(1).run(worker)


def test_a_trainable_parameter_outside_the_optimizer_is_refused_naming_it():
    """DeMo takes each parameter's lr and weight decay from its group in the optimizer: a
    trainable parameter in none is refused when bound; a frozen one may stay out."""

    def worker(comm):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        inner = torch.optim.SGD(model[0].parameters(), lr=0.1)
        with pytest.raises(ValueError, match=r"^optimizer: .*'1\.weight'.*requires_grad=False"):
            gossamer.distribute(model, inner, DeMo(), comm)
        model[1].requires_grad_(False)
        opt = gossamer.distribute(model, torch.optim.SGD(model[0].parameters(), lr=0.1),
                                  DeMo(), comm)
        frozen = [p.detach().clone() for p in model[1].parameters()]  # rank 0's, broadcast
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        assert all(torch.equal(p, q) for p, q in zip(model[1].parameters(), frozen,
                                                       strict=True))

    SimWorld(2).run(worker)


def test_a_parameter_without_a_gradient_is_decayed_alike_on_every_worker():
    """A layer no worker uses has no gradient anywhere, yet takes every step: its weight decay
    applies (torch.optim would skip it), and it stays the same on every worker."""
    steps, lr, weight_decay = 3, 0.1, 0.5

    def worker(comm):
        torch.manual_seed(0)
        model = nn.ModuleDict({"used": nn.Linear(4, 4), "unused": nn.Linear(4, 4)}).double()
        before = model["unused"].weight.detach().clone()
        opt = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=lr,
                                                         weight_decay=weight_decay), DeMo(), comm)
        for k in range(steps):
            torch.manual_seed(100 * comm.rank + k)
            opt.zero_grad()
            model["used"](torch.randn(2, 4, dtype=torch.float64)).sum().backward()
            assert model["unused"].weight.grad is None
            opt.step()
        return before, model["unused"].weight.detach().clone()

    results = SimWorld(2).run(worker)
    for before, after in results:
        assert torch.allclose(after, before * (1 - lr * weight_decay) ** steps, rtol=1e-12,
                              atol=0)
        assert torch.equal(after, results[0][1])


def test_the_registry_builds_it_from_strings():
    assert create("demo", {"compression_topk": "8", "compression_decay": "0.99"}) == DeMo(
        compression_topk=8, compression_decay=0.99)


# ---------------------------------------------------------------------------- gloo

GLOO_CASES = {"defaults": DeMo(), "small chunks": DeMo(compression_topk=3, compression_chunk=4)}


def gloo_run(comm, name: str):
    result = _train(comm, GLOO_CASES[name])
    return result["params"][-1], result["momenta"][-1], result["sent"]


@pytest.mark.slow
@pytest.mark.gloo
def test_gloo_sends_the_same_bytes_and_computes_the_same_parameters():
    from gossamer.testing import collect, run_in_turn, spawn_gloo

    runs = [(name, (name,)) for name in GLOO_CASES]
    results = spawn_gloo(run_in_turn, N, args=(gloo_run, runs), timeout=240)
    for name in GLOO_CASES:
        gloo = collect(results, name)
        sim = SimWorld(N).run(gloo_run, name)
        for rank in range(N):
            assert gloo[rank][2] == sim[rank][2], (name, rank)
            for when in (0, 1):
                for a, b in zip(gloo[rank][when], sim[rank][when], strict=True):
                    assert torch.allclose(a, b, rtol=0, atol=1e-12), (name, rank, when)
