"""Fault injection (--fault), bounded waits with the failed peer named, and non-finite values.

Each kind of fault runs in the simulator (fast, in virtual time); crash and hang of 1 of 4 also
run as real `gossamer train` processes on gloo, and a NaN injected on one rank is followed on
gloo as in the simulator: no other rank may ever send, receive or hold a non-finite value.
"""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gossamer.train.loop as loop
import gossamer.train.run as run
from gossamer.algorithms import create
from gossamer.api import distribute
from gossamer.cli import main
from gossamer.comm import CommError, CommTimeoutError, SimWorld
from gossamer.comm.faults import (
    CRASH_EXIT_CODE,
    Fault,
    FaultInjector,
    InjectedFault,
    check_faults,
    parse_fault,
)
from gossamer.comm.sim import SimulationError
from gossamer.compress import ErrorFeedback
from gossamer.patterns.nonfinite import NonFiniteError, flag_words, ranks_from_flags, set_flag
from gossamer.testing import free_port, spawn_gloo, state_tensors
from gossamer.train.config import TrainConfig, load_recipe
from gossamer.warm import WarmProcess, start_python

SRC = Path(__file__).resolve().parents[1] / "src"

# ----------------------------------------------------------------------------- parsing


def test_parse_fault() -> None:
    assert parse_fault("1:5:crash") == Fault(1, 5, "crash")
    assert parse_fault(" 0:1:NaN ") == Fault(0, 1, "nan")
    assert parse_fault("2:3:slow:2.5") == Fault(2, 3, "slow", 2.5)
    assert str(parse_fault("2:3:slow:3.0")) == "2:3:slow:3"
    assert check_faults(["3:2:hang"], world_size=4, steps=2) == (Fault(3, 2, "hang"),)


@pytest.mark.parametrize("text, message", [
    ("1:5", "expected RANK:STEP:KIND"),
    ("x:5:crash", "RANK must be an integer"),
    ("-1:5:crash", "RANK must be >= 0"),
    ("1:0:crash", "STEP must be >= 1"),
    ("1:5:explode", "unknown kind 'explode'"),
    ("1:5:slow", "slow needs one factor"),
    ("1:5:slow:fast", "factor must be a number >= 1"),
    ("1:5:slow:0.5", "factor must be a number >= 1"),
    ("1:5:crash:2", "crash takes no argument"),
])
def test_bad_fault_is_a_value_error_naming_the_setting(text: str, message: str) -> None:
    with pytest.raises(ValueError, match="--fault") as info:
        parse_fault(text)
    assert message in str(info.value)


def test_faults_checked_against_workers_and_steps(tmp_path: Path, capsys) -> None:
    with pytest.raises(ValueError, match=r"faults \(--fault\) '9:5:crash': rank 9 does not"):
        TrainConfig(sim=4, faults=("9:5:crash",))
    with pytest.raises(ValueError, match="step 50 is past the last step"):
        TrainConfig(sim=4, steps=20, faults=("1:50:crash",))
    with pytest.raises(ValueError, match="rank 4 does not exist"):  # real runs: at start
        FaultInjector(["4:1:crash"], rank=0, world_size=4)
    with pytest.raises(ValueError, match="nonfinite 'maybe' is unknown"):
        TrainConfig(nonfinite="maybe")
    assert main(["train", "--sim", "4", "--fault", "9:5:crash", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--fault" in err and "rank 9" in err
    assert main(["train", "--sim", "4", "--fault", "1:5:slow", "--quiet"]) == 2
    assert "slow needs one factor" in capsys.readouterr().err
    recipe = tmp_path / "r.yaml"
    recipe.write_text("sim: 4\nfaults: [1:5:nan, '2:3:slow:2']\nnonfinite: skip\n")
    config = TrainConfig(**load_recipe(recipe))
    assert config.faults == ("1:5:nan", "2:3:slow:2") and config.nonfinite == "skip"
    assert config.as_dict()["faults"] == ["1:5:nan", "2:3:slow:2"]


def test_faults_fire_only_in_the_first_elastic_attempt() -> None:
    first = FaultInjector(["0:1:crash", "1:1:nan"], 0, 2, environ={})
    assert first.faults == [Fault(0, 1, "crash")]  # only this rank's
    again = FaultInjector(["0:1:crash"], 0, 2, environ={"TORCHELASTIC_RESTART_COUNT": "1"})
    assert again.restarted and again.faults == []


def test_slow_sleeps_in_real_processes_and_nan_poisons_one_gradient() -> None:
    injector = FaultInjector(["0:2:slow:3", "0:2:nan"], 0, 1)
    layer = nn.Linear(3, 2)
    injector.begin_step(object(), 1)  # a communicator without virtual time
    injector.before_backward(1, layer.parameters())
    layer(torch.ones(1, 3)).sum().backward()
    start = time.perf_counter()
    injector.after_backward(1, 0.05)
    assert time.perf_counter() - start < 0.05  # not slow yet, nothing poisoned
    assert torch.isfinite(layer.weight.grad).all()
    injector.begin_step(object(), 2)
    layer.zero_grad()
    injector.before_backward(2, layer.parameters())
    layer(torch.ones(1, 3)).sum().backward()  # the gradient arrives poisoned
    start = time.perf_counter()
    injector.after_backward(2, 0.05)
    assert time.perf_counter() - start >= 0.1  # (3 - 1) x 0.05 s
    assert int(torch.isnan(layer.weight.grad).sum()) == 1
    assert torch.isfinite(layer.bias.grad).all()
    layer.zero_grad()
    layer(torch.ones(1, 3)).sum().backward()  # once only
    assert torch.isfinite(layer.weight.grad).all()


def test_rank_flags_sum_to_the_set_of_ranks() -> None:
    n = 60
    total = torch.zeros(flag_words(n))
    for rank in (0, 1, 23, 24, 59):
        flags = torch.zeros(flag_words(n))
        set_flag(flags, rank)
        total += flags
    assert ranks_from_flags(total) == [0, 1, 23, 24, 59]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rank_flags_come_back_from_their_mean(dtype) -> None:
    """The flags' mean over the world (as an all-reduce with op="mean" leaves them: the sum,
    then one division in the flags' dtype) names the same ranks as their sum, whichever
    ranks set their bit, up to every rank of the world."""
    g = torch.Generator().manual_seed(0)
    for n in (2, 3, 7, 22, 23, 255, 256, 1000, 4097):
        for trial in range(20):
            count = n if trial == 0 else int(torch.randint(1, n + 1, (1,), generator=g))
            ranks = sorted(torch.randperm(n, generator=g)[:count].tolist())
            total = torch.zeros(flag_words(n), dtype=dtype)
            for rank in ranks:
                flags = torch.zeros(flag_words(n), dtype=dtype)
                set_flag(flags, rank)
                total += flags
            assert ranks_from_flags(total) == ranks
            assert ranks_from_flags(total / n, mean_of=n) == ranks, (n, ranks)


# ----------------------------------------------------------------------------- simulator


def _run_sim(timeout: float = 10.0, **settings):
    config = TrainConfig(sim=4, steps=12, eval_every=0, quiet=True, timeout=timeout,
                         **settings)
    world = SimWorld(4, seed=0, timeout=timeout)
    try:
        world.run(loop.train_worker, config, run.prepare(config))
    except SimulationError as error:
        return world, error.failures
    return world, {}


@pytest.mark.parametrize("kind", ["crash", "hang"])
@pytest.mark.parametrize("algorithm", ["allreduce", "sgp"])
def test_crash_or_hang_in_simulator_names_the_peer(kind: str, algorithm: str) -> None:
    world, failures = _run_sim(faults=(f"1:5:{kind}",), algorithm=algorithm)
    assert sorted(failures) == [0, 1, 2, 3]
    assert isinstance(failures[1], InjectedFault)
    assert ("crashed" if kind == "crash" else "hung") in str(failures[1])
    stopped = world.report.clocks[1]
    for rank in (0, 2, 3):
        error = failures[rank]
        assert isinstance(error, CommTimeoutError), error
        assert "rank 1" in str(error) and "step 5" in str(error)  # named, even through a peer
        if algorithm == "allreduce":
            assert error.peers == (1,)
        # gave up within the (virtual) timeout of the moment rank 1 stopped, plus a step
        assert world.report.clocks[rank] <= stopped + 10.0 + 0.1


def test_slow_worker_in_simulator_takes_factor_times_as_long() -> None:
    normal, _ = _run_sim()
    slow, _ = _run_sim(faults=("1:3:slow:4",))
    compute = slow.report.compute_time
    assert compute[1] == pytest.approx(normal.report.compute_time[1] * (2 + 10 * 4) / 12)
    assert compute[0] == normal.report.compute_time[0]
    # AllReduce waits for the slowest: everybody's clock shows it
    assert slow.report.wall_clock > normal.report.wall_clock + 10 * 3 * 0.01 * 0.99


def _models_of_every_worker(monkeypatch) -> list[nn.Module]:
    built: list[nn.Module] = []
    real = loop.build_model

    def recording(*args, **kwargs):
        model = real(*args, **kwargs)
        built.append(model)
        return model

    monkeypatch.setattr(loop, "build_model", recording)
    return built


def test_cli_demo_nan_raises_naming_rank_and_step(capsys) -> None:
    code = main(["train", "--sim", "4", "--algorithm", "sgp", "--fault", "1:5:nan"])
    assert code == 1
    err = capsys.readouterr().err
    assert "rank 1: NonFiniteError: rank 1: non-finite values at step 5" in err
    for rank in (0, 2, 3):  # the others time out waiting for it, and name it
        line = next(x for x in err.splitlines() if x.startswith(f"rank {rank}: "))
        assert "CommTimeoutError" in line and "rank 1" in line


@pytest.mark.slow
def test_cli_demo_nan_skip_finishes_with_every_worker_finite(monkeypatch, capsys) -> None:
    models = _models_of_every_worker(monkeypatch)
    code = main(["train", "--sim", "4", "--algorithm", "sgp", "--fault", "1:5:nan",
                 "--nonfinite", "skip"])
    assert code == 0
    out = capsys.readouterr().out
    accuracy = float(out.split("eval accuracy")[1].split("%")[0])
    assert math.isfinite(accuracy) and accuracy > 80
    assert re.search(r"^non-finite updates skipped +1$", out, re.MULTILINE)
    assert len(models) >= 4  # (prepare() builds one more, to check the settings)
    for model in models:
        for p in model.parameters():
            assert torch.isfinite(p).all()


# ----------------------------------------------------------------------------- no NaN escapes


class Watching:
    """A communicator that records every non-finite tensor sent or received through it."""

    def __init__(self, comm, seen: list[str] | None = None) -> None:
        self._comm = comm
        self.seen = [] if seen is None else seen

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def _look(self, what: str, tensors) -> None:
        for t in tensors:
            if t.is_floating_point() and not torch.isfinite(t).all():
                self.seen.append(f"rank {self._comm.rank} {what}")

    def all_reduce(self, tensor, op="sum"):
        self._look("sent (all_reduce)", [tensor])
        out = self._comm.all_reduce(tensor, op)
        self._look("received (all_reduce)", [out])
        return out

    def all_gather(self, tensor):
        self._look("sent (all_gather)", [tensor])
        out = self._comm.all_gather(tensor)
        self._look("received (all_gather)", [t.view(torch.uint8) if t.dtype == torch.uint8
                                             else t for t in out])
        return out

    def broadcast(self, tensor, src=0):
        self._look("sent (broadcast)", [tensor])
        return self._comm.broadcast(tensor, src)

    def exchange(self, sends, recv_from, recv_like=None):
        self._look("sent (exchange)", list(sends.values()))
        handle = self._comm.exchange(sends, recv_from, recv_like)
        watcher = self

        class Handle:
            def ready(self):
                return handle.ready()

            def wait(self):
                got = handle.wait()
                watcher._look("received (exchange)", list(got.values()))
                return got

        return Handle()

    def group(self, ranks):
        return Watching(self._comm.group(ranks), self.seen)



def nan_on_rank_1(comm, algorithm: str, policy: str, reports: dict | None = None) -> dict:
    """Train a small model with a NaN in rank 1's gradient at step 3; report what every
    rank saw: non-finite values sent, received or held (parameters, EF residuals). With
    ``reports``, the report also goes there, and an error is raised again (a failed worker,
    as in training, not one that finished)."""
    watching = Watching(comm)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    name, *options = algorithm.split(":")  # e.g. "dgc:node_size=2"
    optimizer = distribute(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                           create(name, dict(o.split("=") for o in options)), watching,
                           nonfinite=policy)
    runtime = optimizer.runtime
    injector = FaultInjector(["1:3:nan"], comm.rank, comm.world_size)
    gen = torch.Generator().manual_seed(comm.rank)
    held, error = [], None
    try:
        for step in range(1, 7):
            x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)
            optimizer.zero_grad()
            injector.before_backward(step, list(model.parameters()))
            F.cross_entropy(model(x), y).backward()
            injector.after_backward(step, 0.0)
            optimizer.step()
            if not all(torch.isfinite(p).all() for p in model.parameters()):
                held.append(f"rank {comm.rank} parameters at step {step}")
            reducer = getattr(runtime, "reducer", None)
            if reducer is not None and reducer.memory is not None:
                if isinstance(reducer.memory, ErrorFeedback):
                    assert reducer.memory.state_dict()["residuals"]  # there is one to check
                for t in state_tensors(reducer.memory.state_dict()):
                    if not torch.isfinite(t).all():
                        held.append(f"rank {comm.rank} memory at step {step}")
        optimizer.finish()
    except (NonFiniteError, CommError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        if reports is not None:
            reports[comm.rank] = {"seen": watching.seen, "held": held, "error": error}
            raise
    report = {"seen": watching.seen, "held": held, "error": error,
              "skipped": runtime.skipped_steps}
    if reports is not None:
        reports[comm.rank] = report
    return report


def _check_nothing_escaped(results: list[dict], algorithm: str, policy: str) -> None:
    for rank, seen in enumerate(results):
        assert seen["seen"] == [], (rank, seen["seen"])
        if rank != 1 or policy == "skip":
            assert seen["held"] == [], (rank, seen["held"])
    if policy == "skip":
        assert [r["error"] for r in results] == [None] * len(results)
        if algorithm.split(":")[0] in AGREEING:  # every worker skipped step 3
            assert [r["skipped"] for r in results] == [1] * len(results)
        else:  # decided locally: only rank 1 skipped
            assert [r["skipped"] for r in results] == [0, 1] + [0] * (len(results) - 2)
        return
    # local SGD and QSR send (and so check) their parameters only when they average: after
    # steps 4, 8, ... (H = 4) and 2, 4, ... (QSR's H_base = 2)
    step = 4 if algorithm in ("localsgd", "qsr") else 3
    assert f"NonFiniteError: rank 1: non-finite values at step {step}" in results[1]["error"]
    assert "NaN of" in results[1]["error"]  # which tensor, how many values
    for rank, seen in enumerate(results):
        if rank != 1:
            assert seen["error"] is not None and "rank 1" in seen["error"], seen["error"]
            if algorithm.split(":")[0] in AGREEING:  # raised at once
                assert seen["error"].startswith("NonFiniteError"), seen["error"]


AGREEING = ("allreduce", "dgc", "topk", "randomk", "qsgd", "powersgd", "fp16")


@pytest.mark.parametrize("policy", ["raise", "skip"])
@pytest.mark.parametrize("algorithm", [
    "allreduce", "sgp", "osgp", "dpsgd", "adpsgd", "wagma", "localsgd", "qsr", "gossipgrad",
    "topk", "dgc", "dgc:node_size=2", "randomk", "qsgd", "powersgd", "fp16"])
def test_a_nan_on_rank_1_never_reaches_another_rank_in_simulator(algorithm, policy) -> None:
    reports: dict[int, dict] = {}
    try:
        SimWorld(4, seed=0, timeout=5.0).run(nan_on_rank_1, algorithm, policy, reports)
    except SimulationError:
        assert policy == "raise"
    _check_nothing_escaped([reports[r] for r in range(4)], algorithm, policy)


def _nan_cases_on_gloo() -> list[dict]:
    from gossamer.comm.torch_comm import TorchCommunicator

    comm = TorchCommunicator.from_env(timeout=20)
    try:
        # the raising case last: every rank raises there at once (an agreement), the
        # communicator stays usable until then
        return [nan_on_rank_1(comm, algorithm, policy) for algorithm, policy in (
            ("sgp", "skip"), ("topk", "skip"), ("allreduce", "skip"), ("allreduce", "raise"))]
    finally:
        comm.close()


@pytest.mark.slow
@pytest.mark.gloo
def test_a_nan_on_rank_1_never_reaches_another_rank_on_gloo() -> None:
    per_rank = spawn_gloo(_nan_cases_on_gloo, 4, timeout=120)
    for i, (algorithm, policy) in enumerate((("sgp", "skip"), ("topk", "skip"),
                                             ("allreduce", "skip"), ("allreduce", "raise"))):
        _check_nothing_escaped([per_rank[r][i] for r in range(4)], algorithm, policy)


# ----------------------------------------------------------------------------- gloo processes


def _train_processes(tmp_path: Path, n: int, *args: str) -> list[WarmProcess]:
    """``gossamer train ARGS`` as ``n`` processes of a torchrun-like job on 127.0.0.1, each
    forked from a process that has imported torch (:func:`gossamer.warm.start_python`: it
    exits, crashes and is killed as a fresh interpreter is, without seconds of imports)."""
    port = free_port()
    procs = []
    for rank in range(n):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
        for name in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE"):
            env.pop(name, None)
        procs.append(start_python(["-m", "gossamer", "train", "--quiet", *args], cwd=tmp_path,
                                  env=env, stderr=tmp_path / f"rank{rank}.err"))
    return procs


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.timing
@pytest.mark.parametrize("kind", ["crash", "hang"])
def test_crash_or_hang_of_1_of_4_gloo_workers(tmp_path: Path, kind: str) -> None:
    timeout = 5.0
    procs = _train_processes(tmp_path, 4, "--steps", "10", "--eval-every", "0",
                             "--timeout", str(timeout), "--fault", f"1:3:{kind}")
    said = "exiting with code" if kind == "crash" else "stops answering"
    failed_at, exited = None, {}
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and len(exited) < 3:
            time.sleep(0.05)
            if failed_at is None and said in (tmp_path / "rank1.err").read_text():
                failed_at = time.monotonic()
            for rank in (0, 2, 3):
                if rank not in exited and procs[rank].poll() is not None:
                    exited[rank] = time.monotonic()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert failed_at is not None, (tmp_path / "rank1.err").read_text()
    if kind == "crash":
        assert procs[1].returncode == CRASH_EXIT_CODE
    for rank in (0, 2, 3):
        err = (tmp_path / f"rank{rank}.err").read_text()
        assert rank in exited, f"rank {rank} did not exit:\n{err}"
        assert procs[rank].returncode == 1, err
        assert exited[rank] - failed_at < timeout + 10, err
        message = err.strip().splitlines()[-1]
        assert message.startswith(f"gossamer train (rank {rank}): Comm"), err
        assert "all_reduce #" in message and _suspects(message) == "rank 1", err
        assert "frame #" not in err, err  # no C++ stack frames from a store that went away


def _wait_all(procs: list[WarmProcess], timeout: float = 90) -> None:
    """Wait for every process; kill those still running after ``timeout`` seconds."""
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _survivors(tmp_path: Path, procs: list[WarmProcess], dead: int
               ) -> list[tuple[str, str]]:
    """Wait for a run in which rank ``dead`` crashed; every other rank must have exited 1 with
    a communication error as its last line and no C++ stack frames: (stderr, last line) each."""
    _wait_all(procs)
    assert procs[dead].returncode == CRASH_EXIT_CODE
    out = []
    for rank in range(len(procs)):
        if rank == dead:
            continue
        err = (tmp_path / f"rank{rank}.err").read_text()
        assert procs[rank].returncode == 1, err
        message = err.strip().splitlines()[-1]
        assert message.startswith(f"gossamer train (rank {rank}): Comm"), err
        assert "frame #" not in err, err
        out.append((err, message))
    return out


def _suspects(message: str) -> str | None:
    found = re.search(r"; suspects: ([^.]*)\. Original error", message)
    return found.group(1) if found else None


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.timing
def test_the_store_host_dying_first_is_the_only_one_blamed(tmp_path: Path) -> None:
    """Rank 0 hosts the heartbeat store; when it dies, the survivors cannot read anyone's
    heartbeat, and must blame rank 0 alone, without the store client's C++ stack frames."""
    procs = _train_processes(tmp_path, 4, "--algorithm", "sgp", "--steps", "40",
                             "--eval-every", "0", "--timeout", "5", "--fault", "0:20:crash")
    for err, message in _survivors(tmp_path, procs, dead=0):
        assert _suspects(message) == "rank 0", err


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.timing
def test_a_survivor_that_left_first_is_not_blamed(tmp_path: Path) -> None:
    """Rank 1 dies; rank 0 (the store's host) diagnoses first and exits. A survivor that
    diagnoses later (a timeout after rank 0 left) must still blame rank 1 alone, and say how
    long ago rank 1 was last heard from rather than an operation long past."""
    procs = _train_processes(tmp_path, 4, "--steps", "40", "--eval-every", "0",
                             "--timeout", "5", "--fault", "1:20:crash")
    for err, message in _survivors(tmp_path, procs, dead=1):
        assert _suspects(message) == "rank 1", err
        assert re.search(r"rank 1 stopped responding \(its last heartbeat, [0-9.]+ s ago",
                         message), err


@pytest.mark.parametrize("memory", ["error feedback", "dgc"])
def test_reducer_without_agreement_refuses_a_nan_before_any_memory_holds_it(memory) -> None:
    """The DDP hooks call the reducer without the agreeing flags: a non-finite gradient is
    refused there, naming the tensor, before error feedback or DGC's momentum keeps it."""
    from gossamer.compress import TopK
    from gossamer.compress.dgc import DGCCompressor, DGCMemory
    from gossamer.compress.reducer import CompressedReducer

    def worker(comm):
        if memory == "dgc":
            reducer = CompressedReducer(comm, DGCCompressor(ratio=0.5), DGCMemory(momentum=0.9))
        else:
            reducer = CompressedReducer(comm, TopK(ratio=0.5), ErrorFeedback())
        grad = torch.ones(8)
        if comm.rank == 1:
            grad[3] = math.nan
        try:
            reducer.reduce([("net.w", grad)], 0)
        except FloatingPointError as exc:
            state = state_tensors(reducer.memory.state_dict())
            return str(exc), all(torch.isfinite(t).all() for t in state)
        return None

    assert SimWorld(1).run(worker) == [None]  # a finite gradient goes through
    results = {}

    def recording(comm):
        results[comm.rank] = worker(comm)

    with pytest.raises(SimulationError) as info:
        SimWorld(2, timeout=1.0).run(recording)
    assert "rank 1" in str(info.value.failures[0])  # the other one waits for it, names it
    message, clean = results[1]
    assert "'net.w'" in message and "non-finite" in message
    assert clean  # the memory holds nothing non-finite
