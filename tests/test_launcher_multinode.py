"""Multi-node launch inputs (issue 18): hostfile and host filters, entry-point environments,
the ssh fan-out plan. Pure functions, table-driven; nothing here starts a training process."""

from __future__ import annotations

from pathlib import Path

import pytest

from partita.launcher import cli
from partita.launcher.hostfile import (
    HostfileError,
    parse_filter,
    parse_hostfile,
    resolve_resources,
)

POOL = {"a": 4, "b": 2, "c": 1}


# --- 1. hostfile, --include/--exclude, --num_nodes/--num_gpus/--num_procs -------------------


def test_hostfile_comments_blank_lines_and_order() -> None:
    text = "# cluster\n\nworker-1 slots=4\n  worker-0   slots=2  \n# end\n"
    assert list(parse_hostfile(text.splitlines(), "hf").items()) == [
        ("worker-1", 4),
        ("worker-0", 2),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a slots=2\nb slots = 2\n", r"hf:2: expected 'HOST slots=N', got 'b slots = 2'"),
        ("a slots=2\n\nb\n", r"hf:3: expected 'HOST slots=N', got 'b'"),
        ("a slots=two\n", r"hf:1: expected"),
        ("a slots=2 extra\n", r"hf:1: expected"),
        ("a slots=0\n", r"hf:1: host 'a' has slots=0"),
        (
            "a slots=2\n#\nb slots=1\na slots=4\n",
            r"hf:4: host 'a' is listed again \(first on line 1\)",
        ),
        ("# nothing\n\n", r"hf: lists no host"),
    ],
)
def test_bad_hostfile_names_file_and_line(text: str, message: str) -> None:
    with pytest.raises(HostfileError, match=message):
        parse_hostfile(text.splitlines(), "hf")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("a", {"a": []}),
        ("a@b:0,1", {"a": [], "b": [0, 1]}),
        ("b:1@b:0,1", {"b": [0, 1]}),
        ("b:1@b", {"b": []}),
    ],
)
def test_parse_filter(spec: str, expected: dict[str, list[int]]) -> None:
    assert parse_filter(spec, "--include") == expected


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, {"a": [0, 1, 2, 3], "b": [0, 1], "c": [0]}),
        ({"include": "b@a:1,3"}, {"a": [1, 3], "b": [0, 1]}),  # hostfile order, not flag order
        ({"exclude": "a:0,1@c"}, {"a": [2, 3], "b": [0, 1]}),
        ({"exclude": "a"}, {"b": [0, 1], "c": [0]}),
        ({"num_nodes": 2}, {"a": [0, 1, 2, 3], "b": [0, 1]}),
        ({"num_nodes": 2, "slots_per_node": 2}, {"a": [0, 1], "b": [0, 1]}),
        ({"include": "a:1,2,3", "slots_per_node": 2}, {"a": [1, 2]}),
    ],
)
def test_resolve_resources(kwargs: dict[str, object], expected: dict[str, list[int]]) -> None:
    assert resolve_resources(POOL, **kwargs) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"include": "a@zz"}, r"--include: host 'zz' is not in the hostfile"),
        ({"exclude": "zz:0"}, r"--exclude: host 'zz' is not in the hostfile"),
        ({"include": "b:2"}, r"--include: host 'b' has no slot 2 \(the hostfile lists slots=2"),
        ({"include": "b:x"}, r"--include 'b:x': bad slot index 'x' for host 'b'"),
        ({"include": "a@@b"}, r"--include 'a@@b': bad host entry ''"),
        ({"include": "a", "exclude": "b"}, "--include and --exclude cannot be used together"),
        ({"exclude": "a@b@c"}, "leaves no slot on any host"),
        ({"num_nodes": 4}, r"--num_nodes 4 asks for more nodes than the 3 selected"),
        ({"slots_per_node": 2}, r"--num_gpus 2 asks for more slots than host 'c' has"),
        (
            {"include": "a:0", "slots_per_node": 2, "slots_flag": "--num_procs"},
            r"--num_procs 2 asks for more slots than host 'a' has selected \(1: 0\)",
        ),
    ],
)
def test_resolve_resources_refusals_name_the_host(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(HostfileError, match=message):
        resolve_resources(POOL, **kwargs)  # type: ignore[arg-type]


def _script(tmp_path: Path) -> str:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit(0)\n")
    return str(script)


@pytest.mark.parametrize(
    ("hostfile", "flags", "message"),
    [
        ("a slots=2\nb slots==2\n", [], ":2: expected 'HOST slots=N'"),
        ("a slots=2\nb slots=2\n", ["--include", "a@c"], "host 'c' is not in the hostfile"),
        ("a slots=2\nb slots=1\n", ["--num_procs", "2"], "more slots than host 'b'"),
        ("a slots=2\n", ["--num_nodes", "2"], "--num_nodes 2 asks for more nodes"),
    ],
)
def test_cli_refuses_before_anything_starts(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hostfile: str,
    flags: list[str],
    message: str,
) -> None:
    path = tmp_path / "hostfile"
    path.write_text(hostfile)
    started: list[object] = []
    monkeypatch.setattr(cli, "launch", lambda *a: started.append(a) or 0)
    monkeypatch.setattr("subprocess.Popen", lambda *a, **k: started.append(a))
    status = cli.main(["--hostfile", str(path), *flags, _script(tmp_path)])
    err = capsys.readouterr().err
    assert status == 2
    assert started == []
    assert message in err
    assert err.count("\n") == 1, err  # one line


def test_cli_names_a_missing_hostfile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    assert cli.main(["--hostfile", str(missing), _script(tmp_path)]) == 2
    assert f"hostfile {str(missing)!r}" in capsys.readouterr().err


# --- 2. entry-point environments -> ranks, nodes, master ------------------------------------

_SLURM_TASK = {  # srun --ntasks-per-node=4 on 4 nodes: the task with global rank 9
    "SLURM_PROCID": "9",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "16",
    "SLURM_NODEID": "2",
    "SLURM_NNODES": "4",
    "SLURM_TASKS_PER_NODE": "4(x4)",
    "SLURM_JOB_NODELIST": "node[01-03,07]",
}
_OMPI = {
    "OMPI_COMM_WORLD_RANK": "6",
    "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
}
_PMI = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
_PET = {
    "PET_NNODES": "3",
    "PET_NPROC_PER_NODE": "1",
    "PET_NODE_RANK": "2",
    "PET_MASTER_ADDR": "job-node-0-0.job",
    "PET_MASTER_PORT": "29400",
}

# (rank, local_rank, world_size, local_world_size, node_rank, num_nodes, master, port, source)
_CASES = [
    (_SLURM_TASK, (9, 1, 16, 4, 2, 4, "node01", 29500, "slurm")),
    # the step's node list, not the allocation's, holds the step's first host
    (
        {
            **_SLURM_TASK,
            "SLURM_STEP_NODELIST": "node[03,07]",
            "SLURM_STEP_NUM_NODES": "2",
            "SLURM_NODEID": "1",
            "SLURM_NTASKS": "8",
            "SLURM_PROCID": "5",
            "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        },
        (5, 1, 8, 4, 1, 2, "node03", 29500, "slurm"),
    ),
    ({**_SLURM_TASK, "MASTER_ADDR": "10.0.0.9"}, (9, 1, 16, 4, 2, 4, "10.0.0.9", 29500, "slurm")),
    ({**_OMPI, "MASTER_ADDR": "head"}, (6, 2, 8, 4, 1, 2, "head", 29500, "openmpi")),
    (
        {**_OMPI, "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2"},
        (2, 2, 4, 4, 0, 1, "127.0.0.1", 29500, "openmpi"),
    ),
    ({**_PMI, "MASTER_ADDR": "h0", "MASTER_PORT": "1234"}, (3, 1, 4, 2, 1, 2, "h0", 1234, "pmi")),
    (
        {"PMI_RANK": "2", "PMI_SIZE": "4", "PMI_LOCAL_RANK": "2", "PMI_LOCAL_SIZE": "4"},
        (2, 2, 4, 4, 0, 1, "127.0.0.1", 29500, "pmi"),
    ),
    (_PET, (2, 0, 3, 1, 2, 3, "job-node-0-0.job", 29400, "kubeflow")),
    (
        {**_PET, "MASTER_ADDR": "job-node-0-0.job", "MASTER_PORT": "29400"},
        (2, 0, 3, 1, 2, 3, "job-node-0-0.job", 29400, "kubeflow"),
    ),
    # torchrun started by Kubeflow's torch policy: torchrun's own variables win
    (
        {
            **_PET,
            "PET_NPROC_PER_NODE": "4",
            "RANK": "9",
            "WORLD_SIZE": "12",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "2",
            "GROUP_WORLD_SIZE": "3",
            "MASTER_ADDR": "job-node-0-0.job",
            "MASTER_PORT": "29400",
        },
        (9, 1, 12, 4, 2, 3, "job-node-0-0.job", 29400, "torchrun"),
    ),
    ({}, (0, 0, 1, 1, 0, 1, "127.0.0.1", 29500, "none")),
]


@pytest.mark.parametrize(("environ", "expected"), _CASES)
def test_entry_point_environments(environ: dict[str, str], expected: tuple[object, ...]) -> None:
    from partita.cluster_env import locate

    got = locate(environ)
    assert (
        got.rank,
        got.local_rank,
        got.world_size,
        got.local_world_size,
        got.node_rank,
        got.num_nodes,
        got.master_addr,
        got.master_port,
        got.source,
    ) == expected


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (_OMPI, "MASTER_ADDR"),  # 2 nodes and nobody said where rank 0 is
        (_PMI, "MASTER_ADDR"),
        ({"PMI_RANK": "0"}, "PMI_SIZE is required"),
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "MPI_LOCALRANKID"),
        ({**_SLURM_TASK, "SLURM_NODEID": "4"}, r"SLURM_NODEID=4 is outside \[0, 4\)"),
        ({**_PET, "PET_NPROC_PER_NODE": "4"}, "PET_NPROC_PER_NODE=4"),
        ({**_PET, "MASTER_ADDR": "other"}, "MASTER_ADDR='other' contradicts PET_MASTER_ADDR"),
        ({**_PET, "MASTER_PORT": "1"}, "MASTER_PORT='1' contradicts PET_MASTER_PORT"),
        ({**_PET, "PET_NODE_RANK": "3"}, r"PET_NODE_RANK=3 is outside \[0, 3\)"),
        ({k: v for k, v in _PET.items() if k != "PET_MASTER_ADDR"}, "PET_MASTER_ADDR"),
        ({**_PET, "PET_NNODES": "1:3"}, "PET_NNODES='1:3' is not an integer"),
        ({"PET_NODE_RANK": "0"}, "PET_NNODES is required"),
    ],
)
def test_bad_entry_point_environments_name_the_variable(
    environ: dict[str, str], message: str
) -> None:
    from partita.cluster_env import locate

    with pytest.raises(ValueError, match=message):
        locate(environ)
