"""gossamer.comm.environment: one reading of every launcher's variables.

(:func:`launch_env_from`'s parsing of each launcher is tested in test_comm_torch.py.)
"""

from __future__ import annotations

import pytest

from gossamer.comm import torch_comm
from gossamer.comm.environment import (
    LAUNCHER_VARIABLES,
    LaunchEnv,
    launch_env_from,
    launched,
    launched_rank,
    torchrun_variables,
    without_launcher,
)

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "0", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
         "SLURM_JOB_NODELIST": "gpu-[03-05]"}
SLURM_NPROCS = {"SLURM_PROCID": "1", "SLURM_NPROCS": "2"}
MPI = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
       "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
UNRELATED = {"HOME": "/home/someone", "PATH": "/usr/bin", "OMP_NUM_THREADS": "4",
             "SLURM_JOB_ID": "77", "CUDA_VISIBLE_DEVICES": "0"}


@pytest.mark.parametrize(("environ", "source", "rank"), [
    (TORCHRUN, "torchrun", 3),
    (SLURM, "slurm", 5),
    (SLURM_NPROCS, "slurm", 1),
    (MPI, "mpi", 2),
])
def test_launched_by_each_launcher(environ: dict[str, str], source: str, rank: int) -> None:
    environ = {**UNRELATED, **environ}
    assert launched(environ)
    assert launch_env_from(environ).source == source
    assert launched_rank(environ) == rank


def test_not_launched_without_a_launchers_rank() -> None:
    assert not launched({})
    assert not launched(UNRELATED)  # a SLURM allocation's job id alone places nothing
    assert launched_rank(UNRELATED) is None
    # the rendezvous address alone is not a launcher: a user may export it for later
    assert not launched({"MASTER_ADDR": "node0", "MASTER_PORT": "29500"})


def test_launched_agrees_with_launch_env_from() -> None:
    """A torchrun world size without a rank counts as launched, so that the malformed
    environment is reported instead of silently running something else."""
    assert launched({"WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="RANK"):
        launch_env_from({"WORLD_SIZE": "4"})
    assert launched_rank({"WORLD_SIZE": "4"}) is None  # malformed: no rank to name


def test_torchrun_wins_over_the_launcher_that_started_the_launcher() -> None:
    """gossamer launch inside an srun task gives its workers torchrun's variables."""
    environ = {**SLURM, **torchrun_variables(1, 2, "127.0.0.1", 4000)}
    assert launch_env_from(environ) == LaunchEnv(rank=1, world_size=2, local_rank=1,
                                                 master_addr="127.0.0.1", master_port=4000,
                                                 source="torchrun")


@pytest.mark.parametrize("outer", [TORCHRUN, SLURM, SLURM_NPROCS, MPI])
def test_without_launcher_removes_every_launchers_variables(outer: dict[str, str]) -> None:
    environ = {**UNRELATED, **outer}
    clean = without_launcher(environ)
    # the allocation's node list says nothing of where a process sits: it stays
    kept = {k: v for k, v in outer.items() if k == "SLURM_JOB_NODELIST"}
    assert clean == {**UNRELATED, **kept}
    assert not launched(clean)
    assert environ == {**UNRELATED, **outer}  # a copy: the mapping given is untouched


def test_without_launcher_defaults_to_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("GOSSAMER_TEST_KEPT", "yes")
    clean = without_launcher()
    assert "OMPI_COMM_WORLD_RANK" not in clean
    assert clean["GOSSAMER_TEST_KEPT"] == "yes"


def test_launcher_variables_name_each_launchers_place() -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_LOCALID",
                 "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"):
        assert name in LAUNCHER_VARIABLES
    assert len(set(LAUNCHER_VARIABLES)) == len(LAUNCHER_VARIABLES)


def test_torchrun_variables_read_back() -> None:
    assert launch_env_from(torchrun_variables(2, 4, "10.77.0.1", 29500)) == LaunchEnv(
        rank=2, world_size=4, local_rank=2, master_addr="10.77.0.1", master_port=29500,
        source="torchrun")
    node = torchrun_variables(3, 4, "10.77.0.1", 29500, local_rank=0, local_world_size=1)
    assert (node["LOCAL_RANK"], node["LOCAL_WORLD_SIZE"]) == ("0", "1")
    assert launch_env_from(node).local_rank == 0
    with pytest.raises(ValueError, match="rank"):
        torchrun_variables(4, 4, "127.0.0.1", 29500)


def test_torch_comm_reexports_the_environment() -> None:
    from gossamer.comm import environment

    for name in ("LaunchEnv", "launch_env_from", "expand_nodelist"):
        assert getattr(torch_comm, name) is getattr(environment, name)
