"""Safe defaults: the rendezvous listens on loopback unless told otherwise, nothing pickled
crosses the wire or is unpickled from untrusted files, checkpoints load tensors only."""

from __future__ import annotations

import ast
import socket
import warnings
from pathlib import Path

import pytest
import torch.distributed as dist

import gossamer
from gossamer.comm.torch_comm import TorchCommunicator
from gossamer.testing import free_port

SRC = Path(gossamer.__file__).resolve().parent

# torch.distributed calls that pickle Python objects onto the wire
OBJECT_COLLECTIVES = {"all_gather_object", "gather_object", "broadcast_object_list",
                      "scatter_object_list", "send_object_list", "recv_object_list"}
# the modules allowed to unpickle: the restricted unpickler, and the test helper that gets
# results back from the processes it spawned itself (a local pipe, not the training's wire)
UNPICKLERS = {SRC / "train" / "safe_pickle.py", SRC / "testing.py"}


def _calls(tree: ast.AST) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            owner = getattr(func.value, "id", "") if isinstance(func, ast.Attribute) else ""
            found.append((f"{owner}.{name}" if owner else name, node.lineno))
    return found


def test_no_pickled_objects_on_the_wire_and_no_unrestricted_unpickling():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        for name, line in _calls(ast.parse(path.read_text(), filename=str(path))):
            short = name.rsplit(".", 1)[-1]
            if short in OBJECT_COLLECTIVES:
                offenders.append(f"{path.relative_to(SRC)}:{line}: {name} pickles objects")
            unpickles = name in ("pickle.load", "pickle.loads", "pickle.Unpickler")
            if unpickles and path not in UNPICKLERS:
                offenders.append(f"{path.relative_to(SRC)}:{line}: {name} unpickles anything")
            if short == "load" and name.startswith("torch."):
                offenders.append(f"{path.relative_to(SRC)}:{line}: check torch.load")
    # torch.load is allowed only through checkpoint.safe_load (weights_only=True)
    allowed = [o for o in offenders if o.startswith("train/checkpoint.py")
               and o.endswith("check torch.load")]
    assert [o for o in offenders if o not in allowed] == []
    source = (SRC / "train" / "checkpoint.py").read_text()
    assert source.count("torch.load(") == source.count("weights_only=True")


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of the TCP sockets listening on ``port`` (from /proc/net/tcp*)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, port_hex = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def _single_worker_env(monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    for name in ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))


@pytest.mark.gloo
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_rendezvous_listens_on_loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    _single_worker_env(monkeypatch, port)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the safe default warns about nothing
        comm = TorchCommunicator.from_env(backend="gloo", timeout=20)
    try:
        addresses = _listening_addresses(port)
        assert addresses == {"0100007F"}, addresses  # 127.0.0.1, little-endian hex
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        comm.close()
    assert not dist.is_initialized()


@pytest.mark.gloo
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_all_interfaces_only_when_asked_and_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = free_port()
    _single_worker_env(monkeypatch, port)
    with pytest.warns(UserWarning, match="no authentication"):
        comm = TorchCommunicator.from_env(backend="gloo", timeout=20, bind_all=True)
    try:
        addresses = _listening_addresses(port)
        assert addresses & {"00000000", "00000000000000000000000000000000"}, addresses
    finally:
        comm.close()


@pytest.mark.slow
@pytest.mark.gloo
def test_train_bind_all_flag_warns() -> None:
    import os

    from gossamer.warm import run_python

    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    args = ["-m", "gossamer", "train", "--steps", "2", "--quiet", "--eval-every", "0"]
    quiet = run_python(args, cwd=os.getcwd(), env=env, timeout=120)
    assert quiet.returncode == 0, quiet.stderr
    assert "no authentication" not in quiet.stderr
    env["MASTER_PORT"] = str(free_port())
    loud = run_python([*args, "--bind-all"], cwd=os.getcwd(), env=env, timeout=120)
    assert loud.returncode == 0, loud.stderr
    assert "no authentication" in loud.stderr
