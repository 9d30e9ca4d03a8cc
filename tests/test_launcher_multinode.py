"""Multi-node launch inputs (issue 18): hostfile and host filters, entry-point environments,
the ssh fan-out plan. Pure functions, table-driven; nothing here starts a training process."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from partita.launcher import cli
from partita.launcher.hostfile import (
    HostfileError,
    parse_filter,
    parse_hostfile,
    resolve_resources,
)
from partita.launcher.launch import LaunchError, LaunchOptions
from partita.launcher.multinode import (
    deepspeed_env_files,
    exported_env,
    fanout_plan,
    node_script,
    read_env_file,
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
        # elastic --nnodes MIN:MAX: up to MAX hosts, fewer down to MIN
        ({"num_nodes": 2, "min_nodes": 1}, {"a": [0, 1, 2, 3], "b": [0, 1]}),
        ({"num_nodes": 5, "min_nodes": 3}, {"a": [0, 1, 2, 3], "b": [0, 1], "c": [0]}),
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
        ({"num_nodes": 5, "min_nodes": 4}, r"--nnodes 4:5 asks for more nodes than the 3"),
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
    from partita.platform.cluster_env import locate

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
    from partita.platform.cluster_env import locate

    with pytest.raises(ValueError, match=message):
        locate(environ)


# --- 3. the ssh fan-out plan -----------------------------------------------------------------

TRICKY = {
    "PARTITA_A": "two words",
    "PARTITA_B": 'it\'s "quoted"',
    "PARTITA_C": "$HOME and ${PATH} and `id`",
    "PARTITA_D": "a; echo pwned > /dev/stderr; b",
    "PARTITA_E": "",
}


def test_read_env_file_as_deepspeed_reads_it() -> None:
    lines = ["NCCL_DEBUG=INFO\n", "\n", "# comment\n", "PYTHONPATH=/x:/y=z  \n", "EMPTY=\n"]
    assert read_env_file(lines, "e") == {
        "NCCL_DEBUG": "INFO",
        "PYTHONPATH": "/x:/y=z",
        "EMPTY": "",
    }


@pytest.mark.parametrize(
    ("line", "message"),
    [("JUSTAWORD", r"e:2: expected KEY=VALUE, got 'JUSTAWORD'"), ("1X=2", "e:2:"), ("=v", "e:2:")],
)
def test_bad_env_file_line_names_file_and_line(line: str, message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        read_env_file(["OK=1", line], "e")


def test_exported_env_allow_list_then_files(tmp_path: Path) -> None:
    env_file = tmp_path / ".deepspeed_env"
    env_file.write_text("NCCL_DEBUG=WARN\nMY_VAR=from file\n")
    environ = {
        "NCCL_DEBUG": "INFO",
        "PYTHONPATH": "/a b",
        "GLOO_SOCKET_IFNAME": "eth1",
        "PARTITA_HANG_TIMEOUT": "30",
        "PARTITA_LAUNCHER_PID": "123",  # this node's launcher, wrong anywhere else
        "AWS_SECRET_ACCESS_KEY": "hunter2",  # not on the allow-list
        "HOME": str(tmp_path),
        "DS_ENV_FILE": ".deepspeed_env",
    }
    assert deepspeed_env_files(environ, str(tmp_path / "elsewhere")) == [env_file]
    assert exported_env(environ, [env_file]) == {
        "GLOO_SOCKET_IFNAME": "eth1",
        "NCCL_DEBUG": "WARN",
        "PARTITA_HANG_TIMEOUT": "30",
        "PYTHONPATH": "/a b",
        "MY_VAR": "from file",
    }


def test_node_script_quotes_values_and_arguments_exactly(tmp_path: Path) -> None:
    odd_dir = tmp_path / "dir with 'quote' $x;"
    odd_dir.mkdir()
    args = ["arg with space", "it's", "$HOME", "a;b", "`id`"]
    show = "import json, os, sys; print(json.dumps([os.getcwd(), sys.argv[1:], dict(os.environ)]))"
    script = node_script(TRICKY, str(odd_dir), [sys.executable, "-c", show, *args])
    out = subprocess.run(
        ["bash", "-s"], input=script, capture_output=True, text=True, check=True, timeout=60
    )
    cwd, argv, environ = json.loads(out.stdout)
    assert cwd == str(odd_dir)
    assert argv == args
    assert {k: environ[k] for k in TRICKY} == TRICKY
    assert out.stderr == ""  # nothing was executed from a value


def _options(**kw: object) -> LaunchOptions:
    return LaunchOptions(script="train.py", script_args=("--lr", "1e-3", "a b"), **kw)  # type: ignore[arg-type]


def test_fanout_plan_one_agent_per_node_in_hostfile_order() -> None:
    resources = {"h1": [0, 1], "h2": [1, 3]}
    plan = fanout_plan(
        resources,
        _options(max_restarts=1),
        {"NCCL_DEBUG": "INFO"},
        "/w",
        ssh="/bin/ssh",
        python="/py",
    )
    assert [(n.host, n.node_rank) for n in plan] == [("h1", 0), ("h2", 1)]
    for node in plan:
        assert node.argv == ("/bin/ssh", "-o", "BatchMode=yes", node.host, "bash -s")
        *env_lines, cd, exec_line = node.script.splitlines()[1:]
        assert env_lines == [
            "export NCCL_DEBUG=INFO",
            f"export CUDA_VISIBLE_DEVICES={','.join(map(str, resources[node.host]))}",
        ]
        assert cd == "cd /w"
        assert shlex.split(exec_line) == [
            "exec", "/py", "-u", "-m", "partita.launcher", "--lifeline_fd", "3",
            "--num_nodes", "2", "--node_rank", str(node.node_rank),
            "--master_addr", "h1", "--master_port", "29500",
            "--num_gpus", "2", "--max_restarts", "1",
            "train.py", "--lr", "1e-3", "a b", "3<&0", "<", "/dev/null",
        ]  # fmt: skip


def test_fanout_plan_cpu_slots_and_named_master() -> None:
    plan = fanout_plan(
        {"127.0.0.1": [0, 1], "127.0.0.2": [0, 1]},
        _options(master_port=4321, no_local_rank=True, hang_timeout=30.0),
        {},
        "/w",
        master_addr="10.1.1.1",
        gpus=False,
    )
    exec_line = shlex.split(plan[1].script.splitlines()[-1])
    assert "CUDA_VISIBLE_DEVICES" not in plan[1].script
    for flag, value in [
        ("--master_addr", "10.1.1.1"),
        ("--master_port", "4321"),
        ("--num_procs", "2"),
        ("--hang_timeout", "30.0"),
        ("--node_rank", "1"),
    ]:
        assert exec_line[exec_line.index(flag) + 1] == value
    assert "--no_local_rank" in exec_line


def test_elastic_fanout_plan_starts_the_per_node_elastic_agent(tmp_path: Path) -> None:
    # Each node runs what a scheduler would start by hand (--nnodes MIN:MAX --node_rank K):
    # parsed there, it is the dynamic rendezvous that node 0 hosts, up to MAX nodes.
    from partita.launcher.launch import WorkerPlan, build_launch_config

    conf = (("last_call_timeout", "1"), ("keep_alive_interval", "1"))
    options = LaunchOptions(script=_script(tmp_path), num_nodes=3, min_nodes=1, max_restarts=2,
                            master_port=4321, rdzv_conf=conf)  # fmt: skip
    hosts = {"10.0.0.1": [0], "10.0.0.2": [0]}
    plan = fanout_plan(hosts, options, {}, "/w", gpus=False, python="/py")
    for node in plan:
        exec_line = shlex.split(node.script.splitlines()[-1])
        assert exec_line[:5] == ["exec", "/py", "-u", "-m", "partita.launcher"]
        agent = cli.parse_launch_args(exec_line[5:-3])  # up to "3<&0", "<", "/dev/null"
        assert (agent.min_nodes, agent.num_nodes, agent.node_rank) == (1, 3, node.node_rank)
        assert (agent.master_addr, agent.master_port) == ("10.0.0.1", 4321)
        assert (agent.node_addr, agent.max_restarts, agent.rdzv_conf) == (node.host, 2, conf)
        config = build_launch_config(agent, WorkerPlan("cpu", 1), 4321, str(tmp_path))
        assert (config.rdzv_backend, config.min_nodes, config.max_nodes) == ("partita-c10d", 1, 3)


def test_fanout_secrets_stay_off_command_lines() -> None:
    plan = fanout_plan({"a": [0], "b": [0]}, _options(), TRICKY, "/w")
    for node in plan:
        assert not any(v and v in arg for v in TRICKY.values() for arg in node.argv)


def test_plan_scripts_run_through_bash_reach_the_agent_with_exact_env(tmp_path: Path) -> None:
    # A stand-in for python records what the agent would have been started with.
    fake_python = tmp_path / "python"
    fake_python.write_text(
        '#!/bin/sh\nprintf \'%s\\n\' "$@" > "$REC.$PARTITA_NODE"\n'
        'printf \'%s\' "$PARTITA_D" > "$REC.$PARTITA_NODE.env"\n'
    )
    fake_python.chmod(0o755)
    exports = {**TRICKY, "REC": str(tmp_path / "rec")}
    plan = fanout_plan({"h1": [0], "h2": [0]}, _options(), exports, str(tmp_path),
                       python=str(fake_python))  # fmt: skip
    for node in plan:
        script = node.script.replace("set -e", f"set -e\nexport PARTITA_NODE={node.node_rank}")
        subprocess.run(["bash", "-s"], input=script, text=True, check=True, timeout=60)
        argv = (tmp_path / f"rec.{node.node_rank}").read_text().splitlines()
        assert argv[argv.index("--node_rank") + 1] == str(node.node_rank)
        assert argv[-3:] == ["--lr", "1e-3", "a b"]
        assert (tmp_path / f"rec.{node.node_rank}.env").read_text() == TRICKY["PARTITA_D"]


_FAKE_SSH = """#!/bin/bash
# Records its argv (one per line) and the script on stdin up to its exec line (stdin then stays
# open as the node's line), per host; exits $FAIL_CODE for $FAIL_HOST.
host="$3"  # argv: -o BatchMode=yes HOST COMMAND
printf '%s\\n' "$@" > "$SSH_LOG/$host.argv"
while IFS= read -r line; do
  printf '%s\\n' "$line" >> "$SSH_LOG/$host.stdin"
  case "$line" in exec*) break ;; esac
done
[ "$host" = "$FAIL_HOST" ] && exit "$FAIL_CODE"
exit 0
"""


def _fake_ssh_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    (bin_dir / "ssh").write_text(_FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SSH_LOG", str(log))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("FAIL_HOST", "none")
    monkeypatch.setenv("FAIL_CODE", "3")
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".deepspeed_env").write_text("PARTITA_D=a; echo pwned; b\n")
    (tmp_path / "hostfile").write_text("# two nodes\n127.0.0.1 slots=2\n127.0.0.2 slots=2\n")
    return log


def test_cli_hostfile_fans_out_over_ssh_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = _fake_ssh_env(tmp_path, monkeypatch)
    script = _script(tmp_path)
    status = cli.main(["--hostfile", "hostfile", "--num_procs", "2", script, "x y"])
    assert status == 0
    for rank, host in enumerate(["127.0.0.1", "127.0.0.2"]):
        argv = (log / f"{host}.argv").read_text().splitlines()
        assert argv == ["-o", "BatchMode=yes", host, "bash -s"]
        lines = (log / f"{host}.stdin").read_text().splitlines()
        assert "export NCCL_DEBUG=INFO" in lines
        assert "export PARTITA_D='a; echo pwned; b'" in lines
        assert lines[-2] == f"cd {shlex.quote(str(tmp_path))}"
        exec_line = shlex.split(lines[-1])
        assert exec_line[1:5] == [sys.executable, "-u", "-m", "partita.launcher"]
        for flag, value in [
            ("--num_nodes", "2"),
            ("--node_rank", str(rank)),
            ("--master_addr", "127.0.0.1"),
            ("--num_procs", "2"),
        ]:
            assert exec_line[exec_line.index(flag) + 1] == value
        assert exec_line[-5:] == [script, "x y", "3<&0", "<", "/dev/null"]


def test_cli_hostfile_failed_node_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_ssh_env(tmp_path, monkeypatch)
    monkeypatch.setenv("FAIL_HOST", "127.0.0.2")
    status = cli.main(["--hostfile", "hostfile", "--num_procs", "1", _script(tmp_path)])
    assert status == 1
    assert "node 1 (127.0.0.2) exited with status 3" in capsys.readouterr().err


@pytest.mark.parametrize(("failed", "status"), [(1, 0), (0, 1)])
def test_cli_elastic_hostfile_outlives_a_node_but_not_the_rendezvous_host(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    failed: int,
    status: int,
) -> None:
    log = _fake_ssh_env(tmp_path, monkeypatch)
    host = ["127.0.0.1", "127.0.0.2"][failed]
    monkeypatch.setenv("FAIL_HOST", host)
    elastic = ["--nnodes", "1:2", "--max_restarts", "1", "--rdzv_conf", "last_call_timeout=1"]
    args = ["--hostfile", "hostfile", *elastic, "--num_procs", "1", _script(tmp_path)]
    assert cli.main(args) == status
    err = capsys.readouterr().err
    assert f"partita: node {failed} ({host}) exited with status 3; " in err
    assert ("stopping the other nodes" in err) == (failed == 0), err
    for rank, name in enumerate(["127.0.0.1", "127.0.0.2"]):
        exec_line = shlex.split((log / f"{name}.stdin").read_text().splitlines()[-1])
        assert "--num_nodes" not in exec_line
        for flag, value in [
            ("--nnodes", "1:2"),
            ("--node_rank", str(rank)),
            ("--rdzv_conf", "last_call_timeout=1"),
            ("--max_restarts", "1"),
        ]:
            assert exec_line[exec_line.index(flag) + 1] == value


def test_cli_hostfile_without_ssh_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_ssh_env(tmp_path, monkeypatch)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert cli.main(["--hostfile", "hostfile", "--num_procs", "1", _script(tmp_path)]) == 2
    assert "no 'ssh' is on PATH" in capsys.readouterr().err


# --- 4. elastic membership, node addresses --------------------------------------------------


def test_nnodes_static_and_elastic(tmp_path: Path) -> None:
    script = _script(tmp_path)
    node = ["--node_rank", "1", "--master_addr", "10.0.0.1"]
    fixed = cli.parse_launch_args(["--nnodes", "3", *node, script])
    assert (fixed.num_nodes, fixed.min_nodes) == (3, None)
    elastic = cli.parse_launch_args(
        ["--nnodes", "1:2", *node, "--rdzv_conf", "last_call_timeout=5,keep_alive_interval=1",
         "--node_addr", "10.0.0.2", script]
    )  # fmt: skip
    assert (elastic.num_nodes, elastic.min_nodes, elastic.node_addr) == (2, 1, "10.0.0.2")
    assert elastic.rdzv_conf == (("last_call_timeout", "5"), ("keep_alive_interval", "1"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "2:1"], "--nnodes: needs 1 <= MIN <= MAX, got '2:1'"),
        (["--nnodes", "one"], "--nnodes: expected K or MIN:MAX, got 'one'"),
        (["--nnodes", "2", "--num_nodes", "2"], "--nnodes and --num_nodes cannot be used"),
        (["--nnodes", "1:2"], "--num_nodes 2 needs --node_rank and --master_addr"),
        (["--hostfile", "h", "--node_addr", "10.0.0.2"], "--node_addr cannot be used with"),
        (["--rdzv_conf", "last_call=5"], "KEY one of last_call_timeout"),
        (["--rdzv_conf", "join_timeout=soon"], "got 'join_timeout=soon'"),
        (["--min_elastic_nodes", "1"], "use torchrun's spelling --nnodes MIN:MAX"),
    ],
)
def test_elastic_flag_refusals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, _script(tmp_path)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_interface_of_names_the_interface_carrying_an_address() -> None:
    import socket

    import psutil

    from partita.launcher.launch import interface_of

    ipv4 = [
        (name, a.address)
        for name, addrs in psutil.net_if_addrs().items()
        for a in addrs
        if a.family == socket.AF_INET
    ]
    assert ipv4
    for name, address in ipv4:
        assert interface_of(address) == name
    loopback = next(name for name, address in ipv4 if address.startswith("127."))
    assert interface_of("127.0.0.2") == loopback  # local, though only 127.0.0.1 is listed
    assert interface_of("203.0.113.77") is None  # documentation range: no interface here
    assert interface_of("no-such-host.invalid") is None


def test_node_interface_env_pins_gloo_and_nccl_or_names_a_foreign_address() -> None:
    from partita.launcher.launch import interface_of, node_interface_env

    lo = interface_of("127.0.0.1")
    assert node_interface_env("127.0.0.2", {}) == {
        "GLOO_SOCKET_IFNAME": lo,
        "NCCL_SOCKET_IFNAME": lo,
    }
    assert node_interface_env("127.0.0.2", {"GLOO_SOCKET_IFNAME": "eth9"}) == {
        "NCCL_SOCKET_IFNAME": lo
    }
    assert node_interface_env(None, {}) == {}
    with pytest.raises(
        LaunchError, match=r"no network interface of this node carries '203\.0\.113\.77'"
    ):
        node_interface_env("203.0.113.77", {})


def test_elastic_launch_config_uses_the_bound_c10d_backend(tmp_path: Path) -> None:
    from partita.launcher.launch import WorkerPlan, build_launch_config

    options = LaunchOptions(
        script="t.py",
        num_nodes=4,
        min_nodes=2,
        node_rank=1,
        master_addr="10.0.0.1",
        node_addr="10.0.0.2",
        rdzv_conf=(("last_call_timeout", "5"),),
    )
    config = build_launch_config(options, WorkerPlan("cpu", 1), 29400, str(tmp_path))
    assert (config.min_nodes, config.max_nodes) == (2, 4)
    assert config.rdzv_backend == "partita-c10d"
    assert config.rdzv_endpoint == "10.0.0.1:29400"
    assert config.local_addr == "10.0.0.2"
    assert config.rdzv_configs["last_call_timeout"] == "5"
    assert "rank" not in config.rdzv_configs  # no static rank: the rendezvous assigns


def test_fanout_plan_gives_ip_hosts_their_node_addr() -> None:
    plan = fanout_plan({"10.0.0.5": [0], "worker-2": [0]}, _options(), {}, "/w", gpus=False)
    first, second = (shlex.split(node.script.splitlines()[-1]) for node in plan)
    assert first[first.index("--node_addr") + 1] == "10.0.0.5"
    assert "--node_addr" not in second  # a name is resolved on its node, not here


def test_gone_nodes_names_the_agent_that_stopped_beating() -> None:
    import datetime

    from torch.distributed import TCPStore

    from partita.launcher.launch import find_free_port
    from partita.launcher.peers import AgentBeat, gone_nodes

    port = find_free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=10))  # fmt: skip
    beats = [AgentBeat("127.0.0.1", port, rank, f"10.0.0.{rank + 1}") for rank in range(3)]
    for beat in beats:
        beat.start()
    try:
        while not all(store.check([f"partita_agents/info/{r}"]) for r in range(3)):
            time.sleep(0.01)  # the beats connect in their own threads
        assert gone_nodes("127.0.0.1", port, num_nodes=3, self_rank=1) == []
        beats[2].stop()
        assert gone_nodes("127.0.0.1", port, num_nodes=3, self_rank=1) == [
            f"node 2 (10.0.0.3, agent pid {os.getpid()}) is gone: its agent stopped beating in "
            "the rendezvous store"
        ]
    finally:
        for beat in beats:
            beat.stop()
    del store  # the store's host is gone
    assert gone_nodes("127.0.0.1", port, num_nodes=3, self_rank=1) == [
        f"node 0 is gone: the rendezvous store its agent hosts at 127.0.0.1:{port} does not answer"
    ]
