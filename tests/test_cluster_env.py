"""Tests of partita.platform.cluster_env: torchrun, OpenMPI and SLURM variables, node lists, bad
values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from partita.platform.cluster_env import DEFAULT_MASTER_PORT, ClusterEnv, _first_slurm_host, detect


def test_no_launcher_is_a_single_process() -> None:
    assert detect({}) == ClusterEnv(0, 1, 0, 1, "127.0.0.1", DEFAULT_MASTER_PORT, "none")
    assert detect({"MASTER_ADDR": "10.0.0.9"}).master_addr == "10.0.0.9"


def test_torchrun() -> None:
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "node7",
        "MASTER_PORT": "31000",
    }
    assert detect(env) == ClusterEnv(5, 8, 1, 4, "node7", 31000, "torchrun")


def test_torchrun_defaults_local_values_to_a_single_node() -> None:
    assert detect({"RANK": "2", "WORLD_SIZE": "3"}) == ClusterEnv(
        2, 3, 0, 3, "127.0.0.1", DEFAULT_MASTER_PORT, "torchrun"
    )


def test_torchrun_wins_over_mpi_and_slurm() -> None:
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
    }
    assert detect(env).source == "torchrun"
    assert detect(env).rank == 1


def test_openmpi() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "6",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        "MASTER_ADDR": "head",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
    }
    assert detect(env) == ClusterEnv(6, 8, 2, 4, "head", DEFAULT_MASTER_PORT, "openmpi")


def test_openmpi_without_size_names_the_variable() -> None:
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_SIZE is required"):
        detect({"OMPI_COMM_WORLD_RANK": "0"})


def test_slurm_even_layout() -> None:
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "gpu[003-004]",
        "MASTER_PORT": "12345",
    }
    assert detect(env) == ClusterEnv(5, 8, 1, 4, "gpu003", 12345, "slurm")


def test_slurm_uneven_layout_uses_tasks_per_node() -> None:
    # 5 tasks on 2 nodes: 3 on node 0, 2 on node 1 (an even split would say 2 and 2).
    base = {"SLURM_NTASKS": "5", "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "3,2"}
    node0 = detect({**base, "SLURM_PROCID": "2", "SLURM_LOCALID": "2", "SLURM_NODEID": "0"})
    node1 = detect({**base, "SLURM_PROCID": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1"})
    assert (node0.local_rank, node0.local_world_size) == (2, 3)
    assert (node1.local_rank, node1.local_world_size) == (1, 2)
    repeated = {"SLURM_TASKS_PER_NODE": "4(x2),1", "SLURM_NODEID": "1"}
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "9", "SLURM_LOCALID": "1", **repeated}
    assert detect(env).local_world_size == 4
    env["SLURM_NODEID"] = "2"
    env["SLURM_LOCALID"] = "0"
    assert detect(env).local_world_size == 1


def test_slurm_uneven_layout_without_tasks_per_node_is_not_rejected() -> None:
    # 5 tasks on 2 nodes, no SLURM_TASKS_PER_NODE: the even-split guess (2) must not reject
    # the third task of node 0.
    env = {"SLURM_PROCID": "2", "SLURM_NTASKS": "5", "SLURM_NNODES": "2", "SLURM_LOCALID": "2"}
    assert (detect(env).local_rank, detect(env).local_world_size) == (2, 3)


def test_slurm_master_addr_falls_back_to_nodelist_and_defaults() -> None:
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_NODELIST": "login1"}
    assert detect(env).master_addr == "login1"
    assert detect({**env, "MASTER_ADDR": "explicit"}).master_addr == "explicit"
    minimal = detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    assert (minimal.local_rank, minimal.local_world_size, minimal.master_addr) == (
        0,
        2,
        "127.0.0.1",
    )


def test_slurm_needs_ntasks() -> None:
    assert detect({"SLURM_PROCID": "0"}).source == "none"


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node1", "node1"),
        ("node1,node2", "node1"),
        ("node[003-005,010],other", "node003"),
        ("node[010,003-005]", "node010"),
        ("a[7],b[1-2]", "a7"),
        ("node[1-2]-ib", "node1-ib"),
        ("rack[1-2]-gpu[01-04]", "rack1-gpu01"),
        ("  head ", "head"),
        ("", "127.0.0.1"),
    ],
)
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert _first_slurm_host(nodelist) == first


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": ""}, "WORLD_SIZE='' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "LOCAL_RANK='x'"),
        ({"MASTER_PORT": "29500a"}, "MASTER_PORT='29500a' is not an integer"),
        ({"OMPI_COMM_WORLD_RANK": "1.0", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NNODES": "two"}, "SLURM_NNODES"),
        (
            {
                "SLURM_PROCID": "0",
                "SLURM_NTASKS": "2",
                "SLURM_NODEID": "0",
                "SLURM_TASKS_PER_NODE": "2(3)",
            },
            "SLURM_TASKS_PER_NODE='2(3)' is malformed",
        ),
    ],
)
def test_bad_integer_values_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        detect(env)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "0"}, "WORLD_SIZE is required"),
        ({"WORLD_SIZE": "2"}, "RANK is required"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, r"RANK=2 is outside \[0, 2\) given WORLD_SIZE=2"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1 is outside"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
        (
            {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
            r"LOCAL_RANK=2 is outside \[0, 2\) given LOCAL_WORLD_SIZE=2",
        ),
        (
            {"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"},
            "OMPI_COMM_WORLD_RANK=4 is outside",
        ),
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "2"}, "SLURM_PROCID=3 is outside"),
    ],
)
def test_inconsistent_layouts_are_rejected(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        detect(env)


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    for key in (*names, "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "4242")
    assert detect() == ClusterEnv(1, 2, 0, 2, "127.0.0.1", 4242, "torchrun")


def test_initialize_uses_an_existing_process_group_as_is(tmp_path: Path) -> None:
    """Ray Train's entry point: the group exists, no launcher variables say anything."""
    script = Path(__file__).resolve().parent / "multinode_existing_group.py"
    launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                     "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars}
    env["OMP_NUM_THREADS"] = "1"
    store = str(tmp_path / "store")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), "2", store, str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["same_group"], r["world"], r["rank"]) for r in records] == [
        (True, 2, 0),
        (True, 2, 1),
    ]
    assert records[0]["grad_bytes"] > 0  # gradients were reduced over that group
