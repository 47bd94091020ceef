"""Mixed precision: a ``torch.amp.GradScaler`` with ``distribute()`` and with the DDP hooks.

One worker's scaled loss overflows (it is multiplied by inf) at one step. Every worker must
skip that same step and no other (the wrapped optimizer does not step, the algorithm does
nothing more: its step counter stays), nobody waits for anybody (the communicators time out
after 30 s), and every scaler backs off at that step, so that the scales stay equal.

A skipped step is a step not taken: for the methods whose runs are deterministic, the run
with the overflow ends with exactly the parameters of a run without a scaler in which no
worker calls ``step()`` at that step. The compressed methods differ from that reference by
design (the step's reduction, which carried the agreement, updated the memories of the
workers that sent), and so do the asynchronous ones (the agreement's all-reduce changes
when their messages arrive); they are checked for the rest.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gossamer
from gossamer.algorithms import ADPSGD, GossipGraD, LocalSGD, TopKAllReduce, available, create
from gossamer.comm import SimWorld
from gossamer.testing import state_tensors

WORLD = 4
STEPS = 6
OVERFLOW_RANK, OVERFLOW_STEP = 1, 3
# init_scale 2^10, doubled after every 2 clean steps, halved by the overflow at step 3
SCALES = [2.0**10, 2.0**11, 2.0**11, 2.0**10, 2.0**10, 2.0**11]
STEPPED = [s for s in range(STEPS) if s != OVERFLOW_STEP]
COMPRESSED = {"dgc", "topk", "randomk", "qsgd", "powersgd", "fp16"}
ASYNCHRONOUS = {"adpsgd", "wagma"}  # (WAGMA's default tau=1 is wait-avoiding)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(STEPS, 8, 4, generator=g, dtype=torch.float64),
            torch.randn(STEPS, 8, 2, generator=g, dtype=torch.float64))


def _scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    xs, ys = _data(rank)
    loss = F.mse_loss(model(xs[step]), ys[step])
    if (rank, step) == (OVERFLOW_RANK, OVERFLOW_STEP):
        loss = loss * math.inf  # the scaled gradients overflow on this worker only
    return loss


def _scaled_steps(model: nn.Module, optimizer, scaler: torch.amp.GradScaler, rank: int,
                  clock: list[int], unscale: bool = False) -> list[float]:
    """STEPS steps through ``scaler``, with the overflow; the scale after each. ``unscale``:
    call ``scaler.unscale_`` before ``scaler.step`` (as one does to clip)."""
    scales = []
    for step in range(STEPS):
        clock[0] = step
        optimizer.zero_grad()
        scaler.scale(_loss(model, rank, step)).backward()
        if unscale:
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def _record_steps(optimizer: torch.optim.Optimizer, clock: list[int]) -> list[int]:
    """The loop steps at which ``optimizer`` (the wrapped one) really stepped."""
    stepped: list[int] = []
    optimizer.register_step_post_hook(lambda *_: stepped.append(clock[0]))
    return stepped



def _finite(state) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in state_tensors(state) if t.is_floating_point())


def train(comm, algorithm, scaled: bool = True, unscale: bool = False) -> dict[str, object]:
    """STEPS steps through ``distribute``. ``scaled``: with a GradScaler, and the overflow
    (``unscale``: through ``scaler.unscale_`` first); otherwise the reference: no scaler, and
    no worker calls step() at OVERFLOW_STEP."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    clock = [0]
    stepped = _record_steps(inner, clock)
    scaler = _scaler() if scaled else None
    optimizer = gossamer.distribute(model, inner, algorithm, comm, scaler=scaler)
    optimizer.runtime.total_steps = STEPS
    scales: list[float] = []
    if scaler is not None:
        scales = _scaled_steps(model, optimizer, scaler, comm.rank, clock, unscale)
    else:
        for step in STEPPED:
            clock[0] = step
            optimizer.zero_grad()
            _loss(model, comm.rank, step).backward()
            optimizer.step()
    optimizer.finish()
    runtime = optimizer.runtime
    return {"scales": scales, "stepped": stepped, "step": runtime.step,
            "skipped": runtime.skipped_steps, "state": runtime.state_dict(),
            "params": [p.detach().clone() for p in model.parameters()]}


def _check_skipped_alike(results: list[dict[str, object]], what: str) -> None:
    for rank, result in enumerate(results):
        assert result["scales"] == SCALES, (what, rank)
        assert result["stepped"] == STEPPED, (what, rank)
        assert all(torch.isfinite(p).all() for p in result["params"]), (what, rank)


def _assert_params_equal(got: list[torch.Tensor], want: list[torch.Tensor], what) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", available())
def test_every_worker_skips_the_overflowing_step(name: str) -> None:
    """4 simulated workers, every registered algorithm: the same step skipped everywhere,
    the same scales; where the run is deterministic, exactly the step not taken."""
    algorithm = create(name)
    scaled = SimWorld(WORLD, timeout=30.0).run(train, algorithm)
    _check_skipped_alike(scaled, name)
    for result in scaled:
        assert result["step"] == STEPS - 1 and result["skipped"] == 1, name
        assert _finite(result["state"]), name  # no memory or momentum kept the inf
    if name in COMPRESSED or name in ASYNCHRONOUS:
        return
    reference = SimWorld(WORLD, timeout=30.0).run(train, algorithm, False)
    for rank in range(WORLD):
        _assert_params_equal(scaled[rank]["params"], reference[rank]["params"], (name, rank))
    initial = list(_model().parameters())
    assert any(not torch.allclose(a, b) for a, b in zip(scaled[0]["params"], initial,
                                                         strict=True))


@pytest.mark.parametrize("name", ["allreduce", "sgp"])
def test_unscaled_before_the_step(name: str) -> None:
    """``scaler.unscale_(optimizer)`` before ``scaler.step`` (to clip, say): the same run."""
    unscaled = SimWorld(WORLD, timeout=30.0).run(train, create(name), True, True)
    _check_skipped_alike(unscaled, name)
    reference = SimWorld(WORLD, timeout=30.0).run(train, create(name), False)
    for rank in range(WORLD):
        _assert_params_equal(unscaled[rank]["params"], reference[rank]["params"], (name, rank))


def test_the_compressed_replicas_stay_identical() -> None:
    """top-k with error feedback: the skipped step's reduction still leaves every replica
    equal (every worker dropped the same average)."""
    results = SimWorld(WORLD, timeout=30.0).run(train, TopKAllReduce(ratio=0.5))
    for result in results[1:]:
        _assert_params_equal(result["params"], results[0]["params"], "topk")


def test_a_scaler_that_distribute_was_not_given_is_refused() -> None:
    """Stepped by a GradScaler it was not given, the optimizer refuses, rather than let the
    workers' scales drift apart; and a scaler must be a GradScaler."""

    def worker(comm):
        model = _model()
        optimizer = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                        "allreduce", comm)
        scaler = _scaler()
        scaler.scale(_loss(model, 0, 0)).backward()
        with pytest.raises(ValueError, match="^scaler: a GradScaler that distribute"):
            scaler.step(optimizer)
        given = gossamer.distribute(model, optimizer.optimizer, "allreduce", comm,
                                    scaler=_scaler())
        with pytest.raises(ValueError, match="^scaler: a GradScaler that distribute"):
            scaler.step(given)  # another scaler than the one given
        with pytest.raises(ValueError, match="^scaler must be a torch.amp.GradScaler"):
            gossamer.distribute(model, optimizer.optimizer, "allreduce", comm, scaler="yes")

    SimWorld(1).run(worker)


# -- real processes: distribute() and DDP with the hooks, on gloo --------------------------

GLOO_METHODS = {"allreduce": "allreduce", "sgp": "sgp", "adpsgd": ADPSGD(),
                "localsgd": LocalSGD(period=2), "topk": TopKAllReduce(ratio=0.5)}


def ddp_train(comm, hook_name: str, scaled: bool = True) -> dict[str, object]:
    """STEPS steps of DDP with one of gossamer's hooks (one bucket per layer)."""
    from torch.nn.parallel import DistributedDataParallel

    from gossamer.hooks import GossipGraDState, TopKState, compression_hook, gossipgrad_hook

    ddp = DistributedDataParallel(_model(), bucket_cap_mb_list=[1e-5] * 4)
    inner = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    clock = [0]
    stepped = _record_steps(inner, clock)
    scaler = _scaler() if scaled else None
    if hook_name == "topk":
        state = TopKState(ddp, ratio=0.5, comm=comm, scaler=scaler)
        ddp.register_comm_hook(state, compression_hook)
    else:
        state = GossipGraDState(comm=comm, scaler=scaler)
        ddp.register_comm_hook(state, gossipgrad_hook)
    if scaler is None:
        for step in range(STEPS):
            inner.zero_grad()
            try:
                _loss(ddp, comm.rank, step).backward()
            except Exception as exc:  # noqa: BLE001 - reported for the test to check
                return {"error": str(exc), "step": step}
            inner.step()
        return {"error": None}
    scales = _scaled_steps(ddp, inner, scaler, comm.rank, clock)
    return {"scales": scales, "stepped": stepped, "step": state.step,
            "skipped": state.skipped_steps, "buckets": state.buckets,
            "state": state.state_dict(),
            "params": [p.detach().clone() for p in ddp.module.parameters()]}


def gloo_worker() -> dict[str, object]:
    from gossamer.comm.torch_comm import TorchCommunicator

    comm = TorchCommunicator.from_env(timeout=30)
    out: dict[str, object] = {}
    for name, algorithm in GLOO_METHODS.items():
        out[name] = train(comm, algorithm)
    out["ddp topk"] = ddp_train(comm, "topk")
    out["ddp gossipgrad"] = ddp_train(comm, "gossipgrad")
    out["ddp topk without a scaler"] = ddp_train(comm, "topk", scaled=False)
    return out


@pytest.fixture(scope="module")
def gloo_results() -> list[dict[str, object]]:
    from gossamer.testing import spawn_gloo

    return spawn_gloo(gloo_worker, WORLD, timeout=120)


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("name", list(GLOO_METHODS))
def test_gloo_workers_skip_the_same_step(gloo_results, name: str) -> None:
    """4 gloo processes through distribute(): none hangs, all skip step 3 alone, the scales
    stay equal; the deterministic ones end where the simulator's step-not-taken reference
    does, top-k where the simulator's own run with the overflow does."""
    results = [r[name] for r in gloo_results]
    _check_skipped_alike(results, name)
    for result in results:
        assert result["step"] == STEPS - 1 and result["skipped"] == 1
        assert _finite(result["state"])
    if name == "adpsgd":
        return
    algorithm = GLOO_METHODS[name]
    sim = SimWorld(WORLD).run(train, algorithm, name == "topk")
    for rank in range(WORLD):
        _assert_params_equal(results[rank]["params"], sim[rank]["params"], (name, rank))


@pytest.mark.gloo
def test_ddp_compression_hook_under_a_scaler(gloo_results) -> None:
    """DDP with the top-k hook: the overflowing bucket is NaN on every worker, so every
    scaler skips step 3 and backs off; the error-feedback memories hold nothing non-finite,
    the hook's step skips it too, and the run ends where gossamer's own top-k does."""
    results = [r["ddp topk"] for r in gloo_results]
    _check_skipped_alike(results, "ddp topk")
    sim = SimWorld(WORLD).run(train, GLOO_METHODS["topk"])
    for rank, result in enumerate(results):
        assert result["step"] == STEPS - 1 and result["skipped"] == 1
        assert result["buckets"] > STEPS  # several buckets per step
        assert _finite(result["state"])
        _assert_params_equal(result["params"], sim[rank]["params"], ("ddp topk", rank))


@pytest.mark.gloo
def test_ddp_gossipgrad_hook_under_a_scaler(gloo_results) -> None:
    """DDP with the GossipGraD hook: every worker skips step 3 (nothing is exchanged), the
    scales stay equal, and the run ends where GossipGraD with step 3 not taken does."""
    results = [r["ddp gossipgrad"] for r in gloo_results]
    _check_skipped_alike(results, "ddp gossipgrad")
    sim = SimWorld(WORLD).run(train, GossipGraD(average_at_end=False), False)
    for rank, result in enumerate(results):
        assert result["step"] == STEPS - 1 and result["skipped"] == 1
        _assert_params_equal(result["params"], sim[rank]["params"], ("ddp gossipgrad", rank))
    assert not torch.equal(results[0]["params"][0], results[1]["params"][0])  # gossip: apart


@pytest.mark.gloo
def test_ddp_compression_hook_without_a_scaler_raises_everywhere(gloo_results) -> None:
    """Without a scaler the non-finite gradient is an error on every worker, at the step it
    happened, naming the worker that had it: none waits for the others."""
    for result in (r["ddp topk without a scaler"] for r in gloo_results):
        assert result["step"] == OVERFLOW_STEP
        assert "non-finite" in result["error"] and f"rank(s) {OVERFLOW_RANK}" in result["error"]
