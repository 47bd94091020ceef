"""SimWorld: collectives, exchange, virtual time, determinism, failures."""

from __future__ import annotations

import math

import pytest
import torch

from gossamer.comm import CommError, CommTimeoutError, ComputeModel, NetworkModel, SimWorld, cost
from gossamer.comm.sim import SimulationError


def each_rank_holds_its_rank(comm):
    n, r = comm.world_size, comm.rank
    out = {}
    t = torch.full((5,), float(r))
    comm.all_reduce(t)
    out["sum"] = t.tolist()
    t = torch.full((3,), float(r))
    comm.all_reduce(t, op="mean")
    out["mean"] = t.tolist()
    out["gather_equal"] = [x.tolist() for x in comm.all_gather(torch.tensor([float(r)]))]
    out["gather_unequal"] = [x.tolist() for x in comm.all_gather(torch.full((r,), float(r)))]
    if n > 1:
        handle = comm.exchange({(r + 1) % n: torch.tensor([float(r)])}, [(r - 1) % n])
        out["exchange"] = {k: v.tolist() for k, v in handle.wait().items()}
    b = torch.tensor([float(r)])
    comm.broadcast(b, src=n - 1)
    out["broadcast"] = b.item()
    comm.barrier()
    reversed_group = comm.group(list(reversed(range(n))))
    g = torch.tensor([float(reversed_group.rank)])
    reversed_group.all_reduce(g)
    out["group_rank"] = reversed_group.rank
    out["group_sum"] = g.item()
    if n >= 3 and r in (0, 2):
        sub = comm.group([0, 2])
        s = torch.tensor([float(r)])
        sub.all_reduce(s)
        out["subset_sum"] = s.item()
        gathered = sub.all_gather(torch.tensor([float(r)] * (r + 1)))
        out["subset_gather"] = [x.tolist() for x in gathered]
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_each_rank_holds_its_rank(n):
    results = SimWorld(n).run(each_rank_holds_its_rank)
    total = sum(range(n))
    for r, out in enumerate(results):
        assert out["sum"] == [float(total)] * 5
        assert out["mean"] == pytest.approx([total / n] * 3)
        assert out["gather_equal"] == [[float(i)] for i in range(n)]
        assert out["gather_unequal"] == [[float(i)] * i for i in range(n)]
        if n > 1:
            assert out["exchange"] == {(r - 1) % n: [float((r - 1) % n)]}
        assert out["broadcast"] == float(n - 1)
        assert out["group_rank"] == n - 1 - r
        assert out["group_sum"] == float(total)
        if n >= 3 and r in (0, 2):
            assert out["subset_sum"] == 2.0
            assert out["subset_gather"] == [[0.0], [2.0, 2.0, 2.0]]


def test_ring_all_reduce_time_matches_alpha_beta():
    n, numel, alpha, bandwidth = 8, 8 * 1000, 1e-4, 1e8
    world = SimWorld(n, network=NetworkModel(latency=alpha, bandwidth=bandwidth))

    def fn(comm):
        comm.all_reduce(torch.ones(numel))
        return comm.clock()

    clocks = world.run(fn)
    nbytes = numel * 4
    expected = 2 * (n - 1) * (alpha + nbytes / (n * bandwidth))
    assert all(c == pytest.approx(expected, rel=0.01) for c in clocks)
    # and the bytes each worker sent: 2 (n - 1) / n of the tensor, to its ring successor
    assert world.report.bytes_sent == [2 * (n - 1) * nbytes // n] * n
    assert set(world.report.bytes_per_link) == {(i, (i + 1) % n) for i in range(n)}


def test_one_peer_exchange_time_matches_alpha_beta():
    alpha, bandwidth, numel = 2e-4, 5e7, 10_000
    world = SimWorld(2, network=NetworkModel(latency=alpha, bandwidth=bandwidth))

    def fn(comm):
        peer = 1 - comm.rank
        comm.exchange({peer: torch.ones(numel)}, [peer]).wait()
        return comm.clock()

    expected = alpha + numel * 4 / bandwidth
    assert world.run(fn) == pytest.approx([expected, expected], rel=0.01)


def test_nic_serialises_sends_and_receiver_waits_for_late_sender():
    alpha, bandwidth, numel = 1e-3, 1e6, 1000  # 4 ms per 4 kB message
    world = SimWorld(
        3, network=NetworkModel(latency=alpha, bandwidth=bandwidth),
        compute=ComputeModel(step_time=0.5, stragglers={2: 2.0}),
    )

    def fn(comm):
        if comm.rank == 0:  # two sends queue on one NIC: the second arrives a transfer later
            comm.exchange({1: torch.ones(numel), 2: torch.ones(numel)}, []).wait()
            return comm.clock()
        if comm.rank == 1:
            comm.exchange({}, [0], recv_like=torch.ones(numel)).wait()
            comm.exchange({}, [2], recv_like=torch.ones(1)).wait()
            return comm.clock()
        comm.exchange({}, [0], recv_like=torch.ones(numel)).wait()
        comm.compute_step()  # 1 s: rank 1 must wait for it
        comm.exchange({1: torch.ones(1)}, []).wait()
        return comm.clock()

    clocks = world.run(fn)
    transfer = numel * 4 / bandwidth
    assert clocks[0] == pytest.approx(2 * transfer, rel=1e-6)
    arrival_at_2 = 2 * transfer + alpha
    sent_by_2 = arrival_at_2 + 1.0
    assert clocks[2] == pytest.approx(sent_by_2 + 4 / bandwidth, rel=1e-6)
    assert clocks[1] == pytest.approx(sent_by_2 + 4 / bandwidth + alpha, rel=1e-6)
    assert world.report.idle_time[1] > 0.9


def _train_steps(comm, steps=5):
    xs = torch.randn(steps, 4, 8)  # the worker's own torch generator: differs per rank
    torch.manual_seed(0)  # the same model on every worker
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in xs:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        comm.compute_step()
        for p in model.parameters():
            comm.all_reduce(p.grad, op="mean")
        opt.step()
        if comm.world_size > 1:
            peer = (comm.rank + 1) % comm.world_size
            comm.exchange({peer: model[0].weight.data}, [(comm.rank - 1) % comm.world_size]).wait()
    return torch.cat([p.detach().flatten() for p in model.parameters()]), comm.clock()


def test_determinism_bit_for_bit():
    def make():
        return SimWorld(6, compute=ComputeModel(step_time=0.01, jitter=0.3, stragglers={1: 3.0}),
                        seed=42)

    first = make().run(_train_steps)
    second = make().run(_train_steps)
    for (p1, c1), (p2, c2) in zip(first, second, strict=True):
        assert torch.equal(p1, p2)
        assert c1 == c2
    # different seeds give different random streams
    third = SimWorld(6, seed=43).run(_train_steps)
    assert not torch.equal(first[0][0], third[0][0])


def test_torch_rng_is_per_worker_and_main_state_restored():
    state = torch.get_rng_state()
    draws = SimWorld(3, seed=1).run(lambda comm: torch.rand(2))
    assert not torch.equal(draws[0], draws[1])
    assert torch.equal(torch.get_rng_state(), state)


def test_compute_model_stragglers_and_jitter_are_reproducible():
    world = SimWorld(2, compute=ComputeModel(step_time=0.1, stragglers={1: 4.0}))

    def fn(comm):
        for _ in range(3):
            comm.compute_step()
        return comm.clock()

    assert world.run(fn) == pytest.approx([0.3, 1.2])
    assert world.report.steps == [3, 3]


def test_a_trace_replays_each_ranks_step_times_in_turn_and_from_a_checkpoint():
    model = ComputeModel(step_time=0.1, stragglers={1: 2.0}, jitter=0.5,
                         trace={0: [0.01, 0.02, 0.04], 1: [0.5]})

    def steps(comm, n):
        for _ in range(n):
            comm.compute_step()
        return comm.clock(), comm.simulation_state()

    world = SimWorld(3, compute=model)
    (clock0, state0), (clock1, _), (clock2, _) = world.run(steps, 4)
    assert clock0 == pytest.approx(0.01 + 0.02 + 0.04 + 0.01)  # from the first again
    assert clock1 == pytest.approx(4 * 0.5 * 2.0)  # stragglers apply, jitter does not
    assert clock2 != pytest.approx(0.4)  # an untraced rank: step_time with jitter
    assert world.report.steps == [4, 4, 4]

    def resumed(comm, state, n):  # as a run from a checkpoint of step 4 goes on
        comm.load_simulation_state(state)
        return steps(comm, n)

    states = [state0, state0, state0]
    clock, _ = SimWorld(3, compute=model).run(lambda c: resumed(c, states[c.rank], 2))[0]
    assert clock == pytest.approx(0.02 + 0.04)  # its 5th and 6th steps


def test_a_traced_steps_parts_are_charged_at_its_communicator_calls():
    # rank 0's work before the first collective is short and before the second long, rank 1's
    # the other way round: each collective waits for the slower rank's work before it
    network = NetworkModel(latency=0.001, bandwidth=1e9)
    parts = {0: [[0.1, 0.3, 0.05]], 1: [[0.2, 0.1, 0.0]]}

    def step(comm):
        t = torch.ones(4)
        comm.compute_step()
        comm.all_reduce(t)
        comm.barrier()
        state = comm.simulation_state()
        comm.compute_step()  # the next step starts with what the last call left over
        return comm.clock(), state

    def one_collective(comm):
        comm.all_reduce(torch.ones(4))
        return comm.clock()

    all_reduce = SimWorld(2, network=network).run(one_collective)[0]

    def barrier(comm):
        comm.barrier()
        return comm.clock()

    barrier_time = SimWorld(2, network=network).run(barrier)[0]
    world = SimWorld(2, network=network, compute=ComputeModel(trace=parts))
    (clock0, state0), (clock1, _) = world.run(step)
    # both at max(0.1, 0.2) + all_reduce, + max(0.3, 0.1) + barrier; then rank 0's 0.05
    # and the next step's first part
    end = 0.2 + all_reduce + 0.3 + barrier_time
    assert clock0 == pytest.approx(end + 0.05 + 0.1)
    assert clock1 == pytest.approx(end + 0.0 + 0.2)
    assert state0["compute_parts"] == [pytest.approx(0.05)]
    assert world.report.compute_time == pytest.approx([0.55, 0.5])
    # the same totals as whole steps wait less: the two collectives back to back
    totals = {r: [sum(p[0])] for r, p in parts.items()}
    whole = SimWorld(2, network=network, compute=ComputeModel(trace=totals)).run(step)
    assert whole[0][0] == pytest.approx(0.45 + all_reduce + barrier_time + 0.45)
    # stragglers scale each part; exchanges and their waits take a part each
    scaled = ComputeModel(trace={0: [[0.1, 0.2, 0.3]]}, stragglers={0: 2.0})
    assert scaled.step_parts(0, 0) == pytest.approx((0.2, 0.4, 0.6))
    assert scaled.step_duration(0, None, 0) == pytest.approx(1.2)
    assert scaled.step_parts(1, 0) is None

    def swap(comm):
        comm.compute_step()
        handle = comm.exchange({1 - comm.rank: torch.ones(1)}, [1 - comm.rank])
        handle.wait()
        return comm.clock()

    # the exchange is posted after the first part, the wait comes after the second
    world = SimWorld(2, network=network, compute=ComputeModel(
        trace={0: [[0.1, 0.2, 0.4]], 1: [[0.1, 0.0, 0.4]]}))
    clocks = world.run(swap)
    assert world.report.compute_time == pytest.approx([0.3, 0.1])  # the last part left over
    assert clocks[0] == pytest.approx(0.3)  # rank 1's message arrived long before
    assert 0.1 < clocks[1] < 0.11  # rank 0's left at 0.1, before its second part


@pytest.mark.parametrize("trace, match", [
    ({0: []}, r"trace\[0\] must be a non-empty sequence"),
    ({0: 0.1}, r"trace\[0\] must be a non-empty sequence"),
    ({0: [0.1, -1.0]}, r"trace\[0\]\[1\] must be >= 0"),
    ({0: [float("nan")]}, r"trace\[0\]\[0\] must be a number"),
    ({0: [[]]}, r"trace\[0\]\[0\] must be a number of seconds or a non-empty sequence"),
    ({0: [0.1, [0.2, -0.1]]}, r"trace\[0\]\[1\]\[1\] must be >= 0"),
])
def test_a_bad_trace_is_named(trace, match):
    with pytest.raises(ValueError, match=match):
        ComputeModel(trace=trace)
    with pytest.raises(ValueError, match="compute.trace"):
        SimWorld(2, compute=ComputeModel(trace={2: [0.1]}))
    with pytest.raises(ValueError, match="measured compute model takes no trace"):
        ComputeModel(measured=True, trace={0: [0.1]})


def test_an_all_gather_takes_the_shapes_round_then_the_payloads_as_the_real_ones_do():
    from gossamer.comm.p2p_group import HEADER_BYTES, shape_header

    assert shape_header(torch.zeros(2, 3)).numel() * 8 == HEADER_BYTES

    def fn(comm):
        comm.all_gather(torch.zeros(1000 * (comm.rank + 1)))  # 4000, 8000, 12000 bytes
        after_one = comm.clock()
        comm.all_gather(torch.zeros(0))  # the shapes alone
        return after_one, comm.clock() - after_one

    net = NetworkModel(latency=1e-3, bandwidth=1e6)
    results = SimWorld(3, network=net, compute=ComputeModel(step_time=0.0)).run(fn)
    header = 2 * (1e-3 + HEADER_BYTES / 1e6)  # two steps of the ring
    payload = 2 * (1e-3 + 12000 / 1e6)  # each step as slow as its largest block
    assert results == [pytest.approx((header + payload, header))] * 3


def test_a_ring_all_gather_of_equal_blocks_costs_what_the_step_by_step_sum_gives():
    net = NetworkModel(latency=1e-4, bandwidth=1e6, link_bandwidth={(2, 3): 2e5})
    members = [0, 1, 2, 3, 4]
    for sizes in ([700] * 5, [700, 700, 700, 701, 700]):
        expected = 0.0
        for s in range(4):  # the general rule, written out
            expected += max(net.message_time(members[i], members[(i + 1) % 5], sizes[(i - s) % 5])
                            for i in range(5))
        assert cost.ring_all_gather_time(sizes, net, members) == expected
    assert cost.ring_all_gather_time([700], net, [0]) == 0.0


def test_dead_worker_named_after_timeout():
    world = SimWorld(4, timeout=5.0, compute=ComputeModel(step_time=1.0))

    def fn(comm):
        t = torch.ones(3)
        for step in range(3):
            comm.compute_step()
            if comm.rank == 1 and step == 2:
                raise RuntimeError("worker 1 crashed")
            comm.all_reduce(t)
        return t

    with pytest.raises(SimulationError) as info:
        world.run(fn)
    failures = info.value.failures
    assert set(failures) == {0, 1, 2, 3}
    for r in (0, 2, 3):
        assert isinstance(failures[r], CommTimeoutError)
        assert "rank 1" in str(failures[r]) and "all_reduce" in str(failures[r])
        assert failures[r].peers == (1,)
    # they gave up exactly one timeout after arriving
    assert world.report.clocks[0] == pytest.approx(3.0 + 5.0, rel=1e-3)


def test_mismatched_collectives_raise():
    def fn(comm):
        if comm.rank == 0:
            comm.all_reduce(torch.ones(3))
        else:
            comm.all_reduce(torch.ones(4))

    with pytest.raises(SimulationError) as info:
        SimWorld(2, timeout=1.0).run(fn)
    assert any(isinstance(e, CommError) for e in info.value.failures.values())


def test_exchange_keeps_pairwise_order_and_copies_payload():
    def fn(comm):
        if comm.rank == 0:
            t = torch.zeros(1)
            handles = []
            for i in range(3):
                t.fill_(i)  # payload is copied at send: later writes don't leak
                handles.append(comm.exchange({1: t}, []))
            for h in handles:
                h.wait()
            return None
        like = torch.zeros(1)
        handles = [comm.exchange({}, [0], recv_like=like) for _ in range(3)]
        return [h.wait()[0].item() for h in reversed(handles)]

    assert SimWorld(2).run(fn)[1] == [2.0, 1.0, 0.0]


def test_256_workers():
    world = SimWorld(256, network=NetworkModel(latency=1e-5, bandwidth=1e9))

    def fn(comm):
        t = torch.full((64,), float(comm.rank))
        comm.all_reduce(t, op="mean")
        return t[0].item()

    assert world.run(fn) == [pytest.approx(255 / 2)] * 256


@pytest.mark.parametrize(
    "kwargs, name",
    [({"latency": -1.0}, "latency"), ({"bandwidth": -5.0}, "bandwidth"),
     ({"bandwidth": 0.0}, "bandwidth"), ({"link_bandwidth": {(0, 1): -1.0}}, "link_bandwidth")],
)
def test_bad_network_model(kwargs, name):
    with pytest.raises(ValueError, match=name):
        NetworkModel(**kwargs)


def test_bad_world():
    with pytest.raises(ValueError, match="world_size"):
        SimWorld(0)
    with pytest.raises(ValueError, match="step_time"):
        ComputeModel(step_time=-1.0)
    with pytest.raises(ValueError, match="stragglers"):
        SimWorld(2, compute=ComputeModel(stragglers={5: 2.0}))
    with pytest.raises(ValueError, match="timeout"):
        SimWorld(2, timeout=0)


def test_bad_exchange_arguments():
    def fn(comm):
        with pytest.raises(ValueError, match="sends"):
            comm.exchange({comm.rank: torch.ones(1)}, [])
        with pytest.raises(ValueError, match="recv_from"):
            comm.exchange({}, [7], recv_like=torch.ones(1))
        with pytest.raises(ValueError, match="recv_like"):
            comm.exchange({}, [1 - comm.rank])
        return True

    assert SimWorld(2).run(fn) == [True, True]


def test_integer_mean_rounds_down():
    """An all-reduce mean of integers floor-divides, as TorchCommunicator and P2PGroup do (an
    integer tensor cannot hold the fraction)."""
    def fn(comm):
        world = comm.all_reduce(torch.tensor([3 * comm.rank + 1, -comm.rank]), op="mean")
        group = comm.group([0, 2]) if comm.rank != 1 else None
        pair = group.all_reduce(torch.tensor([comm.rank + 2]), op="mean") if group else None
        return world.tolist(), None if pair is None else pair.tolist()

    results = SimWorld(3).run(fn)
    assert [w for w, _ in results] == [[(1 + 4 + 7) // 3, (0 - 1 - 2) // 3]] * 3
    assert results[0][1] == results[2][1] == [(2 + 4) // 2]


def _counters(stats) -> dict[str, dict]:
    return {name: {k: v for k, v in sorted(getattr(stats, name).items()) if v} for name in
            ("bytes_sent", "bytes_received", "messages_sent", "messages_received", "operations")}


def _subgroup_traffic(comm, make_group) -> dict[str, dict]:
    out = {}
    if comm.rank in (0, 2, 3):
        sub = make_group(comm, [0, 2, 3])
        sub.all_gather(torch.ones(5 + sub.rank))
        sub.all_reduce(torch.ones(7))
        sub.broadcast(torch.ones(3), src=2)
        sub.barrier()
        sub.exchange({(sub.rank + 1) % 3: torch.ones(2)}, [(sub.rank - 1) % 3]).wait()
        if sub.rank in (0, 2):
            inner = sub.group([2, 0])
            inner.all_reduce(torch.ones(4))
            inner.barrier()
            out["inner"] = _counters(inner.stats)
        out["group"] = _counters(sub.stats)
    out["world"] = _counters(comm.stats)
    return out


def test_a_p2p_group_is_counted_as_a_subgroup():
    """A P2PGroup (what a real communicator's group is) over the simulator counts as the
    simulator's own subgroup: each collective under its name with cost.py's traffic, in the
    group and in every enclosing one, not the exchanges that carry it."""
    from gossamer.comm.p2p_group import P2PGroup

    native = SimWorld(4).run(_subgroup_traffic, lambda comm, ranks: comm.group(ranks))
    p2p = SimWorld(4).run(_subgroup_traffic, P2PGroup)
    assert p2p == native
    # rank 0 is rank 0 of the group and rank 1 of the nested one; the nested group's
    # all-reduce and barrier are counted in the group and the world too
    ops = {"all_gather": 1, "all_reduce": 2, "barrier": 2, "broadcast": 1, "exchange": 1}
    assert native[0]["world"]["operations"] == native[0]["group"]["operations"] == ops
    assert native[0]["inner"]["operations"] == {"all_reduce": 1, "barrier": 1}
    assert native[1]["world"] == {name: {} for name in native[1]["world"]}


def test_cost_formulas_sum_to_ring_totals():
    n, numel = 5, 1003
    sent = sum(b for r in range(n) for _, b, _ in cost.ring_all_reduce_traffic(r, n, numel, 4))
    assert sent == 2 * (n - 1) * numel * 4
    sizes = [0, 4, 8, 12, 16]
    gathered = sum(b for r in range(n) for _, b, _ in cost.ring_all_gather_traffic(r, n, sizes))
    assert gathered == (n - 1) * sum(sizes)
    tree = [b for r in range(n) for _, b, _ in cost.broadcast_traffic(r, n, 2, 100)]
    assert sum(tree) == (n - 1) * 100
    assert sorted(r for r in range(n) if cost.broadcast_sources(r, n, 2)) == [0, 1, 3, 4]
    assert math.isclose(cost.barrier_rounds(n), 3)


def test_hung_worker_is_named_after_real_timeout():
    import time

    def fn(comm):
        if comm.rank == 1:
            while True:  # computes forever, never communicates
                time.sleep(0.01)
        comm.all_reduce(torch.ones(1))

    world = SimWorld(3, real_timeout=0.5, timeout=10.0)
    start = time.monotonic()
    with pytest.raises(SimulationError) as info:
        world.run(fn)
    assert time.monotonic() - start < 10
    failures = info.value.failures
    assert "real_timeout" in str(failures[1]) and "rank 1" in str(failures[1])
    assert isinstance(failures[0], CommTimeoutError) and failures[0].peers == (1,)


def test_hung_worker_is_named_with_sigint_ignored():
    """A process started with SIGINT ignored (a background job, nohup) still gets the
    watchdog's interrupt, and its disposition is restored afterwards."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        test_hung_worker_is_named_after_real_timeout()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_grad_mode_is_per_worker():
    def fn(comm):
        if comm.rank == 0:
            with torch.no_grad():
                comm.barrier()  # rank 1 runs meanwhile, with grad enabled
                return torch.is_grad_enabled()
        comm.barrier()
        return torch.is_grad_enabled()

    assert SimWorld(2).run(fn) == [False, True]
