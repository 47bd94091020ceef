"""TorchCommunicator, P2PGroup and the launch environment, over real gloo processes.

Spawning costs about 2 s per process (importing torch), so each world size runs all its checks
in one spawned function that returns what it saw; the assertions are made here.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from gossamer.comm.base import DEFAULT_TIMEOUT, CommError, default_timeout
from gossamer.comm.cost import ring_all_reduce_traffic
from gossamer.comm.environment import LAUNCHER_VARIABLES
from gossamer.comm.torch_comm import (
    LaunchEnv,
    TorchCommunicator,
    expand_nodelist,
    launch_env_from,
)
from gossamer.testing import spawn_gloo

N = 1001  # not a multiple of any world size: the ring's chunks differ by one element


def _values(tensors: list[torch.Tensor]) -> list[list[float]]:
    return [t.flatten().tolist() for t in tensors]


def _each_rank_holds_its_rank() -> dict:
    """Every collective on a world where rank r contributes r; returns what this rank saw."""
    threads_before = _threads()
    comm = TorchCommunicator.from_env(timeout=60)
    n, r = comm.world_size, comm.rank
    seen: dict = {"rank": r}

    t = torch.full((N,), float(r))
    comm.all_reduce(t)
    seen["sum"] = sorted(set(t.tolist()))
    seen["stats_sent"] = dict(comm.stats.bytes_sent)
    seen["stats_messages"] = dict(comm.stats.messages_sent)
    seen["stats_received"] = dict(comm.stats.bytes_received)

    m = torch.full((2, 3), float(r), dtype=torch.float64)
    seen["mean"] = sorted(set(comm.all_reduce(m, op="mean").flatten().tolist()))
    a = torch.full((5,), float(r))
    handle = comm.all_reduce_async(a, op="mean")
    seen["mean_async"] = sorted(set(handle.wait().tolist())) + sorted(set(handle.wait().tolist()))
    try:
        comm.all_reduce_async(a, op="max")
    except ValueError as exc:
        seen["bad_op"] = str(exc)
    nc = torch.full((4, 3), float(r)).t()  # not contiguous: reduced through a copy
    comm.all_reduce(nc)
    seen["noncontig"] = sorted(set(nc.flatten().tolist()))

    seen["gather_equal"] = _values(comm.all_gather(torch.tensor([r])))
    count = r if n == 4 else r + 1  # with n = 4, rank 0 contributes nothing
    pieces = comm.all_gather(torch.full((count, 2), r, dtype=torch.int32))
    seen["gather_unequal"] = [(tuple(p.shape), p.flatten().tolist()) for p in pieces]

    handle = comm.exchange({(r + 1) % n: torch.tensor([float(r)])}, [(r - 1) % n])
    got = handle.wait()
    seen["exchange"] = {peer: v.tolist() for peer, v in got.items()}
    seen["exchange_idempotent"] = handle.wait() is got

    seen["broadcast"] = comm.broadcast(torch.full((3,), float(r)), src=1).tolist()
    comm.barrier()
    seen["operations"] = dict(comm.stats.operations)

    rev = comm.group(list(reversed(range(n))))
    g = rev.rank
    seen["rev_rank"] = g
    rt = torch.full((N,), float(g))
    rev.all_reduce(rt)
    seen["rev_sum"] = sorted(set(rt.tolist()))
    seen["rev_stats_sent"] = dict(rev.stats.bytes_sent)
    seen["rev_mean"] = rev.all_reduce(torch.tensor([float(g), 1.0]), op="mean").tolist()
    seen["rev_gather"] = _values(rev.all_gather(torch.tensor([g])))
    pieces = rev.all_gather(torch.full((g,), g))  # group rank 0 contributes nothing
    seen["rev_gather_unequal"] = [p.tolist() for p in pieces]
    seen["rev_broadcast"] = rev.broadcast(torch.full((2, 2), float(g)), src=1).flatten().tolist()
    rev.barrier()

    if n >= 3:
        if r in (0, 2):
            sub = comm.group([0, 2])
            seen["sub_sum"] = sub.all_reduce(torch.full((5,), float(r))).tolist()
            seen["sub_gather"] = _values(sub.all_gather(torch.full((r + 1,), r)))
            seen["sub_broadcast"] = sub.broadcast(torch.tensor([float(r)]), src=1).tolist()
            sub.barrier()
        else:
            try:
                comm.group([0, 2])
            except ValueError as exc:
                seen["sub_refused"] = str(exc)
    comm.barrier()  # the subset's traffic is done before anyone closes
    comm.close()
    # gloo's threads are gone when close() returns (one left to interpreter shutdown can
    # abort the process while it releases a finished operation's tensors)
    seen["threads"] = (threads_before, _threads())
    try:
        comm.all_reduce(torch.ones(1))
    except ValueError as exc:
        seen["closed"] = str(exc)
    return seen


def _threads() -> int:
    """The OS threads of this process."""
    return len(os.listdir("/proc/self/task"))


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("n", [2, 3, 4])
def test_each_rank_holds_its_rank(n: int) -> None:
    results = spawn_gloo(_each_rank_holds_its_rank, n, timeout=120)
    for seen in results:
        before, after = seen["threads"]
        assert after == before, f"rank {seen['rank']}: {after - before} threads outlive close()"
        assert "all_reduce on a closed communicator" in seen["closed"]
    total = float(sum(range(n)))
    for r, seen in enumerate(results):
        assert seen["rank"] == r
        assert seen["sum"] == [total]
        assert seen["mean"] == [total / n]
        # divided once, however often it is waited for
        assert seen["mean_async"] == [total / n, total / n]
        assert seen["bad_op"] == "op must be 'sum' or 'mean', got 'max'"
        assert seen["noncontig"] == [total]
        expected = ring_all_reduce_traffic(r, n, N, 4)
        assert seen["stats_sent"] == {peer: nbytes for peer, nbytes, _ in expected}
        assert seen["stats_messages"] == {peer: msgs for peer, _, msgs in expected}
        pred = (r - 1) % n
        assert seen["stats_received"] == {pred: ring_all_reduce_traffic(pred, n, N, 4)[0][1]}
        assert seen["gather_equal"] == [[k] for k in range(n)]
        counts = [k if n == 4 else k + 1 for k in range(n)]
        assert seen["gather_unequal"] == [((c, 2), [k] * (2 * c)) for k, c in enumerate(counts)]
        assert seen["exchange"] == {(r - 1) % n: [float((r - 1) % n)]}
        assert seen["exchange_idempotent"]
        assert seen["broadcast"] == [1.0] * 3
        assert seen["operations"] == {"all_reduce": 4, "all_gather": 2, "exchange": 1,
                                      "broadcast": 1, "barrier": 1}

        g = seen["rev_rank"]
        assert g == n - 1 - r
        assert seen["rev_sum"] == [total]
        assert seen["rev_stats_sent"] == {
            peer: nbytes for peer, nbytes, _ in ring_all_reduce_traffic(g, n, N, 4)
        }
        assert seen["rev_mean"] == [total / n, 1.0]
        assert seen["rev_gather"] == [[k] for k in range(n)]
        assert seen["rev_gather_unequal"] == [[k] * k for k in range(n)]
        assert seen["rev_broadcast"] == [1.0] * 4

    if n >= 3:
        for r in (0, 2):
            assert results[r]["sub_sum"] == [2.0] * 5
            assert results[r]["sub_gather"] == [[0], [2, 2, 2]]
            assert results[r]["sub_broadcast"] == [2.0]
        assert "ranks" in results[1]["sub_refused"]


def _dies_before_third_all_reduce() -> dict | None:
    """Rank 1 exits just before its 3rd all-reduce; the others report the error they got."""
    comm = TorchCommunicator.from_env(timeout=10)
    t = torch.ones(100)
    for i in range(1, 4):
        if comm.rank == 1 and i == 3:
            os._exit(1)
        start = time.monotonic()
        try:
            comm.all_reduce(t)
        except CommError as exc:
            elapsed = time.monotonic() - start
            # stay alive (rank 0 hosts the store, and each survivor's heartbeat is read) until
            # the other survivor has diagnosed too: each says so in the store once it has
            other = 2 - comm.rank
            comm._store.set(f"test/diagnosed/{comm.rank}", "1")
            comm._store.wait([f"test/diagnosed/{other}"], timedelta(seconds=30))
            return {"step": i, "message": str(exc), "peers": exc.peers, "elapsed": elapsed}
    return None


@pytest.mark.slow
@pytest.mark.gloo
def test_dead_worker_is_named() -> None:
    results = spawn_gloo(_dies_before_third_all_reduce, 3, timeout=60, allow_exit={1})
    assert results[1] is None
    for r in (0, 2):
        seen = results[r]
        assert seen is not None, f"rank {r} got no error"
        assert seen["step"] == 3
        assert "all_reduce #3" in seen["message"]
        assert "rank 1" in seen["message"], seen["message"]
        assert 1 in seen["peers"]
        assert seen["elapsed"] < 10 + 10


@pytest.mark.gloo
def test_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no launcher variables: a world of one, in this process, every op a no-op."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    comm = TorchCommunicator.from_env(backend="gloo", timeout=30)
    try:
        assert (comm.rank, comm.world_size) == (0, 1)
        t = torch.arange(6.0).reshape(2, 3)
        assert torch.equal(comm.all_reduce(t.clone(), op="mean"), t)
        assert torch.equal(comm.all_gather(t)[0], t)
        assert torch.equal(comm.broadcast(t.clone()), t)
        comm.barrier()
        assert comm.exchange({}, []).wait() == {}
        solo = comm.group([0])
        assert torch.equal(solo.all_reduce(t.clone()), t)
        assert torch.equal(solo.all_gather(t)[0], t)
        assert comm.stats.total_bytes_sent == 0
        with pytest.raises(ValueError, match="ranks"):
            comm.group([0, 0])
    finally:
        comm.close()
    assert not dist.is_initialized()


@pytest.mark.slow
@pytest.mark.gloo
def test_a_tensor_on_a_device_the_backend_does_not_carry_is_a_value_error(monkeypatch) -> None:
    """torch's error for it ("No backend type associated with device type cpu", as NCCL
    gives for a CPU tensor) is the caller's, not a failure of the group: a ValueError that
    names the backend and the device, not a CommError."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    comm = TorchCommunicator.from_env(backend="gloo", timeout=30)
    try:
        assert comm.backend == "gloo"

        def wrong_device():
            raise RuntimeError("No backend type associated with device type cpu")

        with pytest.raises(ValueError, match=r"all_reduce #1: the gloo backend carries no "
                                             r"tensors on the cpu device"):
            comm._run("all_reduce #1", wrong_device)

        def gone():
            raise RuntimeError("Connection closed by peer")

        with pytest.raises(CommError):
            comm._run("all_reduce #2", gone)
    finally:
        comm.close()


@pytest.mark.gloo
def test_gossamer_backend_chooses_from_envs_default(monkeypatch) -> None:
    """GOSSAMER_BACKEND=gloo: gloo where CUDA would make NCCL the default; spawn_gloo sets
    it for its children, so that multi-process tests run on gloo on a machine with GPUs."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("GOSSAMER_BACKEND", "gloo")
    comm = TorchCommunicator.from_env(timeout=30)
    try:
        assert comm.backend == "gloo" and comm.device == torch.device("cpu")
    finally:
        comm.close()
    monkeypatch.delenv("GOSSAMER_BACKEND")
    assert spawn_gloo(_backend_of_a_child, 2, timeout=60) == [("gloo", "gloo")] * 2


def _backend_of_a_child() -> tuple[str, str]:
    comm = TorchCommunicator.from_env(timeout=30)
    try:
        return os.environ["GOSSAMER_BACKEND"], comm.backend
    finally:
        comm.close()


_NEVER_CLOSED = """
import atexit
import torch
import torch.distributed as dist
from gossamer.comm import TorchCommunicator

# registered first, so it runs last (atexit is last in, first out): after gossamer's hook
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
comm = TorchCommunicator.from_env(backend="gloo", timeout=30)
comm.all_reduce(torch.ones(3))
"""


@pytest.mark.slow
@pytest.mark.gloo
def test_a_communicator_never_closed_closes_at_exit(tmp_path) -> None:
    """A program that never calls close() (as most examples) must not leave gloo's threads to
    the interpreter's finalisation, where they can abort the process."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    done = subprocess.run([sys.executable, "-c", _NEVER_CLOSED], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "initialized at exit: False" in done.stdout, done.stdout + done.stderr[-2000:]


_WRAPPED_NEVER_CLOSED = """
import atexit
import torch
import torch.distributed as dist
from gossamer.comm import TorchCommunicator

atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
# the program's own group (as Lightning and Accelerate make it), wrapped and left open
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
comm = TorchCommunicator(timeout=30)
comm.all_reduce(torch.ones(3))
"""


@pytest.mark.slow
@pytest.mark.gloo
def test_a_group_the_program_made_and_left_is_destroyed_at_exit(tmp_path) -> None:
    """A group made by the program (or a framework) that wraps it and never destroys it is
    released at exit too, before the interpreter's finalisation."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    done = subprocess.run([sys.executable, "-c", _WRAPPED_NEVER_CLOSED], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "initialized at exit: False" in done.stdout, done.stdout + done.stderr[-2000:]


def _polls_a_receive() -> list[bool]:
    """Rank 0 posts a receive and polls it; rank 1 sends after a while."""
    import time

    from gossamer.comm import TorchCommunicator

    comm = TorchCommunicator.from_env(timeout=30)
    try:
        polls = []
        if comm.rank == 0:
            handle = comm.exchange({}, [1], recv_like=torch.zeros(1000))
            polls.append(handle.ready())  # nothing sent yet: rank 1 waits for the go
            comm._store.set("test/go", "1")
            deadline = time.monotonic() + 20
            while not handle.ready() and time.monotonic() < deadline:
                time.sleep(0.01)  # polling: ready() never blocks
            polls.append(handle.ready())
            polls.append(bool(torch.equal(handle.wait()[1], torch.arange(1000.0))))
        else:
            comm._store.wait(["test/go"], timedelta(seconds=20))
            comm.exchange({0: torch.arange(1000.0)}, []).wait()
        comm.barrier()
        return polls
    finally:
        comm.close()


@pytest.mark.slow
@pytest.mark.gloo
def test_ready_reports_an_arrived_message_without_waiting() -> None:
    """gloo itself says a receive is complete only once waited for; ready() must not."""
    from gossamer.testing import spawn_gloo

    polls = spawn_gloo(_polls_a_receive, 2, timeout=60)[0]
    assert polls == [False, True, True]


def _fails_on_rank_1() -> int:
    if int(os.environ["RANK"]) == 1:
        raise ValueError("boom on purpose")
    return 7


def _never_returns() -> None:
    time.sleep(600)


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("fresh", [False, True])
def test_spawn_reports_failures_and_timeouts(fresh) -> None:
    """In the pool and in fresh processes alike; the pool then starts anew."""
    with pytest.raises(RuntimeError, match="(?s)rank 1 raised.*ValueError: boom on purpose"):
        spawn_gloo(_fails_on_rank_1, 2, timeout=60, fresh=fresh)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0\] did not report"):
        spawn_gloo(_never_returns, 1, timeout=5, fresh=fresh)
    assert time.monotonic() - start < 5 + 10  # the child was killed, not waited for
    assert spawn_gloo(_fails_on_rank_1, 1, fresh=fresh) == [7]


def _what_a_call_sees() -> tuple[int, str | None, str, int, bool]:
    comm = TorchCommunicator.from_env(timeout=30)
    total = int(comm.all_reduce(torch.ones(1)).item())
    return (os.getpid(), os.environ.get("GOSSAMER_TEST_MARK"), os.environ["MASTER_PORT"],
            total, dist.is_initialized())


@pytest.mark.slow
@pytest.mark.gloo
def test_spawn_reuses_its_processes_with_each_call_fresh(monkeypatch) -> None:
    """A call runs in the pool's resident processes, with a process group of its own, the
    caller's environment of the moment and a new port; fresh=True starts new ones."""
    first = spawn_gloo(_what_a_call_sees, 2)
    monkeypatch.setenv("GOSSAMER_TEST_MARK", "second")
    second = spawn_gloo(_what_a_call_sees, 2)
    assert [r[0] for r in second] == [r[0] for r in first]  # the same processes
    assert [r[1] for r in first] == [None, None] and [r[1] for r in second] == ["second"] * 2
    assert first[0][2] != second[0][2]  # a fresh rendezvous
    assert [r[3:] for r in first + second] == [(2, True)] * 4
    fresh = spawn_gloo(_what_a_call_sees, 2, fresh=True)
    assert not {r[0] for r in fresh} & {r[0] for r in first}


def test_launch_env_torchrun() -> None:
    env = launch_env_from({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                           "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234"})
    assert env == LaunchEnv(rank=3, world_size=8, local_rank=1, master_addr="10.0.0.5",
                            master_port=1234, source="torchrun")


def test_launch_env_slurm() -> None:
    env = launch_env_from({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                           "SLURM_JOB_NODELIST": "gpu-[03-05],cpu7"})
    assert env == LaunchEnv(rank=5, world_size=8, local_rank=1, master_addr="gpu-03",
                            master_port=29500, source="slurm")
    explicit = launch_env_from({"SLURM_PROCID": "0", "SLURM_NTASKS": "2",
                                "SLURM_NODELIST": "a1", "MASTER_ADDR": "head"})
    assert explicit.master_addr == "head"
    assert expand_nodelist("node[01-04,07],gpu2") == [
        "node01", "node02", "node03", "node04", "node07", "gpu2"
    ]
    assert expand_nodelist("r[1-2]n[8-10]") == [
        "r1n8", "r1n9", "r1n10", "r2n8", "r2n9", "r2n10"
    ]
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST"):
        launch_env_from({"SLURM_PROCID": "0", "SLURM_NTASKS": "2",
                         "SLURM_JOB_NODELIST": "node[01-"})


def test_launch_env_mpi() -> None:
    env = launch_env_from({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "MASTER_ADDR": "host0"})
    assert env == LaunchEnv(rank=2, world_size=4, local_rank=0, master_addr="host0",
                            master_port=29500, source="mpi")


def test_launch_env_single() -> None:
    assert launch_env_from({}) == LaunchEnv(rank=0, world_size=1, local_rank=0,
                                            master_addr="127.0.0.1", master_port=29500,
                                            source="single")


@pytest.mark.parametrize(
    ("environ", "variable"),
    [
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE"),
        ({"RANK": "5", "WORLD_SIZE": "4"}, "RANK"),
        ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK"),
        ({"RANK": "0"}, "WORLD_SIZE"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT"),
        ({"SLURM_PROCID": "2", "SLURM_NTASKS": "2"}, "SLURM_PROCID"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "-1"}, "OMPI_COMM_WORLD_SIZE"),
    ],
)
def test_launch_env_malformed(environ: dict[str, str], variable: str) -> None:
    with pytest.raises(ValueError, match=variable):
        launch_env_from(environ)


def _nccl_all_reduce() -> list[float]:
    comm = TorchCommunicator.from_env(backend="nccl", timeout=60)
    t = torch.full((N,), 2.0, device=torch.device("cuda", torch.cuda.current_device()))
    comm.all_reduce(t, op="mean")
    values = sorted(set(t.cpu().tolist()))
    comm.close()
    return values


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_all_reduce() -> None:
    assert spawn_gloo(_nccl_all_reduce, 1, timeout=120) == [[2.0]]


@pytest.mark.gloo
def test_timeout_defaults_to_the_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert default_timeout("gloo") == default_timeout("sim") == 300.0
    assert default_timeout("NCCL") == 600.0  # torch's own NCCL default: slower start-up
    assert default_timeout("mpi") == DEFAULT_TIMEOUT
    comm = TorchCommunicator.from_env(backend="gloo")
    try:
        assert comm.timeout == 300.0
        assert TorchCommunicator(timeout=7).timeout == 7.0  # configured wins
        with pytest.raises(ValueError, match="timeout"):
            TorchCommunicator(timeout=0)
    finally:
        comm.close()


_COUNTERS = ("bytes_sent", "bytes_received", "messages_sent", "messages_received", "operations")


def _counters(stats) -> dict[str, dict]:
    """Every counter of ``stats``, without the zeros."""
    return {name: {k: v for k, v in sorted(getattr(stats, name).items()) if v}
            for name in _COUNTERS}


def _group_traffic(comm) -> dict[str, dict]:
    """A subgroup's collectives (an all-gather of sizes differing per rank, an integer mean,
    a broadcast, a barrier) and an exchange, then a group nested in it; what the process's,
    the group's and the nested group's counters say, and the integer mean."""
    out: dict[str, dict] = {}
    if comm.rank in (0, 2, 3):
        sub = comm.group([0, 2, 3])
        sub.all_gather(torch.ones(5 + sub.rank))
        mean = sub.all_reduce(torch.full((7,), 3 * comm.rank + 1), op="mean")
        out["mean"] = {"values": mean.tolist()}
        sub.broadcast(torch.ones(3), src=2)
        sub.barrier()
        sub.exchange({(sub.rank + 1) % 3: torch.ones(2)}, [(sub.rank - 1) % 3]).wait()
        if sub.rank in (0, 2):
            inner = sub.group([2, 0])
            inner.all_reduce(torch.ones(4))
            inner.all_gather(torch.ones(inner.rank + 2))
            inner.barrier()
            out["inner"] = _counters(inner.stats)
        out["group"] = _counters(sub.stats)
    comm.barrier()
    out["world"] = _counters(comm.stats)
    return out


def _group_traffic_on_gloo() -> dict[str, dict]:
    from gossamer.comm import TorchCommunicator

    with TorchCommunicator.from_env(timeout=30) as comm:
        return _group_traffic(comm)


@pytest.mark.gloo
def test_a_subgroups_traffic_is_counted_as_the_simulator_counts_it() -> None:
    """Backend parity: a P2PGroup's collectives are counted in its parent's stats under their
    names with cost.py's bytes and messages (the barrier's zero-byte signals included, the
    all-gather's shape headers not), not as the exchanges that carry them, as the simulator
    counts a subgroup's; a nested group's count in every enclosing group. Every counter
    agrees, and an integer mean rounds down in both."""
    from gossamer.comm import SimWorld

    real = spawn_gloo(_group_traffic_on_gloo, 4, timeout=120)
    sim = SimWorld(4).run(_group_traffic)
    assert real == sim
    assert real[0]["mean"]["values"] == [(1 + 7 + 10) // 3] * 7
    assert real[1]["world"]["operations"] == {"barrier": 1}
    # rank 0: the group's 4 collectives and exchange, the nested group's 3, the world barrier
    assert real[0]["world"]["operations"] == {
        "all_gather": 2, "all_reduce": 2, "barrier": 3, "broadcast": 1, "exchange": 1}
    assert real[0]["group"]["operations"] == {
        "all_gather": 2, "all_reduce": 2, "barrier": 2, "broadcast": 1, "exchange": 1}
    assert real[0]["world"]["bytes_sent"] and real[0]["inner"]["bytes_sent"]


def _posting_fails_as_gloo_fails() -> list[str]:
    """Each posting call of a collective or an exchange raises what gloo raises when the peer's
    connection closed: a RuntimeError that is not a DistError."""
    from unittest import mock

    from gossamer.comm import TorchCommunicator

    comm = TorchCommunicator.from_env(timeout=30)
    closed = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                          "[127.0.0.1]:4492")
    caught = []
    try:
        # an exchange posts its receives and sends in one batch_isend_irecv
        for what, target, call in (
                ("irecv", "batch_isend_irecv",
                 lambda: comm.exchange({}, [1 - comm.rank], recv_like=torch.zeros(4))),
                ("isend", "batch_isend_irecv",
                 lambda: comm.exchange({1 - comm.rank: torch.zeros(4)}, [])),
                ("all_reduce", "all_reduce", lambda: comm.all_reduce(torch.zeros(4))),
                ("all_reduce", "all_reduce", lambda: comm.all_reduce_async(torch.zeros(4)))):
            with mock.patch.object(dist, target, side_effect=closed):
                try:
                    call()
                except CommError as exc:
                    named = "Connection closed" in str(exc)
                    caught.append(f"{what}: {type(exc).__name__}: {named}")
        comm.barrier()
        return caught
    finally:
        comm.close()


@pytest.mark.slow
@pytest.mark.gloo
def test_a_peer_gone_when_posting_is_a_comm_error() -> None:
    """gloo raises a plain RuntimeError, not a DistError, when a send or receive is posted to a
    peer whose connection closed: it is a CommError naming the operation, as a failed wait is,
    so that the survivors under on_failure="continue" go on."""
    for caught in spawn_gloo(_posting_fails_as_gloo_fails, 2, timeout=60):
        assert caught == ["irecv: CommError: True", "isend: CommError: True",
                          "all_reduce: CommError: True", "all_reduce: CommError: True"]
