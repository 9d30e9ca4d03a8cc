"""DeepSpeed's launcher flags on ``partita``: the per-node hostfile form (``--hostfile H --no_ssh
--node_rank N``), ``--launcher openmpi|mpich|slurm|pdsh`` with ``--launcher_args``,
``--force_multi``, ``--save_pid``, ``--enable_each_rank_log`` and ``--bind_cores_to_rank``
(``--bind_core_list``), as DeepSpeed's runner.py, multinode_runner.py and launch.py mean them.

Parsing, host selection and the commands built are checked without starting anything. The
launches: one job of 2 CPU workers for core binding, per-rank logs and the pid file together;
each scheduler's command run by a stand-in for its tool (tests/fake_scheduler.py) that starts
the ranks here as the tool would, the OpenMPI one through a real all-reduce. Two nodes trained
the per-node way with the one-node losses: tests/test_launcher_two_nodes.py."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from launch_helpers import finish, start_launcher
from partita.launcher import backends, cli, launch, multinode, rank_setup
from partita.launcher.launch import LaunchError, LaunchOptions, find_free_port

PROBE = Path(__file__).resolve().parent / "launcher_probe.py"
FAKE = Path(__file__).resolve().parent / "fake_scheduler.py"
GUARD_S = 300  # hang guard for a launch on 2 busy cores, never a timing assertion
TWO_HOSTS = "127.0.0.1 slots=1\n127.0.0.2 slots=1\n"


def _script(tmp_path: Path) -> str:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit(0)\n")
    return str(script)


def _hostfile(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """What would have been started: launches, fan-outs and tool processes, recorded instead."""
    calls: list[object] = []
    monkeypatch.setattr(cli, "launch", lambda options: calls.append(options) or 0)
    monkeypatch.setattr(multinode, "run_fanout", lambda plan, **kw: calls.append(plan) or 0)
    monkeypatch.setattr(backends, "run", lambda argv, env: calls.append((argv, env)) or 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # restored after the test
    return calls


@pytest.mark.parametrize(
    ("hosts", "flags", "gpus", "expected", "visible"),
    [
        # DeepSpeed's per-node form on two loopback "nodes": node 1 is the second host.
        (
            "localhost slots=1\n127.0.0.1 slots=1\n",
            ["--no_ssh", "--node_rank", "1", "--master_addr", "127.0.0.1"],
            0,
            dict(num_nodes=2, node_rank=1, num_procs=1, num_gpus=None, node_addr="127.0.0.1"),
            None,
        ),
        # --include picks hosts and slots; node 1 is the second selected host; GPU ids kept.
        (
            "a slots=4\nb slots=4\nc slots=4\n",
            ["--no_ssh", "--node_rank", "1", "--include", "a@c:1,3"],
            4,
            dict(num_nodes=2, node_rank=1, num_gpus=2, num_procs=None, master_addr="a"),
            "1,3",
        ),
        (
            "a slots=4\nb slots=4\nc slots=4\n",
            ["--no_ssh", "--node_rank", "1", "--exclude", "b:0", "--num_nodes", "2"],
            4,
            dict(num_nodes=2, node_rank=1, num_gpus=3, master_addr="a", master_port=None),
            "1,2,3",
        ),
        (
            "a slots=4\nb slots=4\n",
            ["--no_ssh", "--node_rank", "0", "--num_gpus", "2", "--master_port", "29600"],
            4,
            dict(num_nodes=2, node_rank=0, num_gpus=2, master_port=29600),
            "0,1",
        ),
        # --num_procs: CPU workers, the first N slots, even with GPUs present.
        (
            "a slots=4\nb slots=4\n",
            ["--no_ssh", "--node_rank", "1", "--num_procs", "3"],
            4,
            dict(num_nodes=2, node_rank=1, num_procs=3, num_gpus=None),
            None,
        ),
        # One host selected, no --force_multi: it runs here, as DeepSpeed's runner does
        # (--no_ssh_check is accepted: partita never probes ssh).
        (
            "solo slots=2\n",
            ["--no_ssh_check"],
            0,
            dict(num_nodes=1, node_rank=0, num_procs=2, master_addr="127.0.0.1"),
            None,
        ),
        ("a slots=2\nb slots=2\n", ["--include", "b:1"], 2, dict(num_nodes=1, num_gpus=1), "1"),
        # DeepSpeed's CPU accelerator asked for: the slots are CPU processes, GPUs or not.
        ("a slots=2\n", ["DS_ACCELERATOR=cpu"], 4, dict(num_procs=2, num_gpus=None), None),
        ("a slots=2\n", ["PARTITA_ACCELERATOR=cpu"], 4, dict(num_procs=2, num_gpus=None), None),
    ],
)
def test_hostfile_node_runs_its_slots_here(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    started: list[object],
    hosts: str,
    flags: list[str],
    gpus: int,
    expected: dict[str, object],
    visible: str | None,
) -> None:
    monkeypatch.setattr(launch, "visible_gpu_count", lambda: gpus)
    for name in ("PARTITA_ACCELERATOR", "DS_ACCELERATOR"):  # conftest sets the first to cpu
        monkeypatch.delenv(name, raising=False)
    for setting in [flag for flag in flags if "=" in flag]:
        monkeypatch.setenv(*setting.split("="))
    flags = [flag for flag in flags if "=" not in flag]
    assert cli.main(["--hostfile", _hostfile(tmp_path, hosts), *flags, _script(tmp_path)]) == 0
    [options] = started
    assert isinstance(options, LaunchOptions)
    assert {key: getattr(options, key) for key in expected} == expected
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == visible


@pytest.mark.parametrize(
    ("hosts", "flags", "message"),
    [
        (TWO_HOSTS, ["--no_ssh"], "--no_ssh starts this node's part of the job: give its"),
        (TWO_HOSTS, ["--no_ssh", "--node_rank", "2"], "--node_rank 2 is not a node of this job"),
        (TWO_HOSTS, ["--node_rank", "1"], "--node_rank cannot be used with --hostfile unless"),
        (TWO_HOSTS, ["--no_ssh", "--node_rank", "0", "--launcher", "pdsh"], "(--no_ssh runs"),
        (TWO_HOSTS, ["--no_ssh", "--node_rank", "0", "--nnodes", "1:2"], "--nnodes MIN:MAX"),
        (None, ["--launcher", "openmpi"], "--launcher chooses how the hosts of a --hostfile"),
        (None, ["--force_multi"], "--force_multi chooses how the hosts"),
        (None, ["--launcher_args=-v"], "--launcher_args chooses how the hosts"),
        (TWO_HOSTS, ["--launcher", "mvapich"], "--launcher mvapich is not supported by partita"),
        (TWO_HOSTS, ["--launcher", "nope"], "--launcher must be one of ssh, pdsh, openmpi"),
        (TWO_HOSTS, ["--launcher_args", "'open"], '--launcher_args "\'open": No closing'),
        (TWO_HOSTS, ["--launcher", "openmpi", "--include", "127.0.0.1"], "--include/--exclude"),
        (TWO_HOSTS, ["--launcher", "mpich", "--num_nodes", "2"], "--num_nodes/--num_gpus"),
        ("a slots=2\nb slots=1\n", ["--launcher", "mpich"], "same slots on every host (-ppn)"),
        ("a slots=2\nb slots=2\n", ["--launcher", "slurm", "-i", "a:1@b"], "select slots 1 of"),
        ("a slots=2\nb slots=1\n", ["--launcher", "pdsh"], "same slots on every host"),
        (TWO_HOSTS, ["--launcher", "slurm", "--bind_cores_to_rank"], "its ranks are the tool's"),
        (TWO_HOSTS, ["--launcher", "mpich", "--ssh_port", "22"], "--ssh_port is for ssh and"),
        (None, ["--ssh_port", "22"], "--ssh_port chooses how the hosts"),
        (TWO_HOSTS, ["--launcher", "openmpi", "--nnodes", "1:2"], "runs through the ssh fan"),
        (None, ["--bind_core_list", "0"], "--bind_core_list lists the cores for --bind_cores_to"),
    ],
)
def test_refused_before_anything_starts(
    tmp_path: Path,
    started: list[object],
    capsys: pytest.CaptureFixture[str],
    hosts: str | None,
    flags: list[str],
    message: str,
) -> None:
    argv = ["--hostfile", _hostfile(tmp_path, hosts), *flags] if hosts else flags
    try:
        status = cli.main([*argv, _script(tmp_path)])
    except SystemExit as exc:  # an argparse error
        status = exc.code  # type: ignore[assignment]
    assert status == 2
    assert started == []
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "ranks", "message"),
    [
        (dict(bind_core_list="0"), 2, "1 core(s) (0) cannot be split over 2 ranks"),
        (dict(bind_core_list="3-1"), 1, "--bind_core_list: core range '3-1' in '3-1' ends before"),
        (dict(bind_core_list="99999"), 1, "names core(s) 99999 this process may not run on"),
        (dict(bind_cores_to_rank=False, rank_log_dir="{file}"), 1, "cannot make the directory"),
    ],
)
def test_worker_set_up_refusals(
    tmp_path: Path, options: dict[str, object], ranks: int, message: str
) -> None:
    (tmp_path / "a_file").write_text("")
    fields = {"bind_cores_to_rank": True, **options}
    if fields.get("rank_log_dir") == "{file}":
        fields["rank_log_dir"] = str(tmp_path / "a_file")
    with pytest.raises(LaunchError) as err:
        launch.rank_setup_args(LaunchOptions("t.py", **fields), ranks)  # type: ignore[arg-type]
    assert message in str(err.value)


def test_missing_tool_is_named_before_anything_starts(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    started: list[object],
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    hostfile = _hostfile(tmp_path, TWO_HOSTS)
    for name, missing in [
        ("openmpi", "mpirun and ompi_info are"),
        ("mpich", "mpirun is"),
        ("slurm", "srun is"),
        ("pdsh", "pdsh is"),
    ]:
        assert cli.main(["--hostfile", hostfile, "--launcher", name, _script(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert f"partita: error: --launcher {name} runs " in err
        assert f"but {missing} not on PATH" in err
    assert started == []


def test_force_multi_and_launcher_args_go_to_the_ssh_fan_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started: list[object]
) -> None:
    monkeypatch.setattr(multinode, "find_ssh", lambda environ: "/usr/bin/ssh")
    hostfile = _hostfile(tmp_path, "solo slots=2\n")
    flags = ["--force_multi", "--ssh_port", "2222", "--launcher_args", "-o 'ConnectTimeout=5'"]
    assert cli.main(["--hostfile", hostfile, "--num_procs", "2", *flags, _script(tmp_path)]) == 0
    [[node]] = started  # one host, yet fanned out over ssh
    assert isinstance(node, multinode.NodeCommand)
    assert node.argv == (
        "/usr/bin/ssh", "-o", "BatchMode=yes", "-p", "2222", "-o", "ConnectTimeout=5", "solo",
        "bash -s",
    )  # fmt: skip


def _job(launcher: str, **kw: object) -> backends.Job:
    fields: dict[str, object] = dict(
        launcher=launcher,
        hostfile="/h/hosts",
        pool={"n1": 2, "n2": 2},
        resources={"n1": [0, 1], "n2": [0, 1]},
        options=LaunchOptions("train.py", ("--lr", "a b")),
        master_addr="10.0.0.1",
        master_port=29500,
        launcher_args=("--oversubscribe",),
        exports={"NCCL_DEBUG": "INFO"},
        cwd="/w",
    )
    fields.update(kw)
    return backends.Job(**fields)  # type: ignore[arg-type]


RANK = ["/py", "-u", "-m", "partita.launcher.rank_setup", "--local_rank", "--"]
RANK_ARGS = ["--run-path", "train.py", "--lr", "a b"]
ENV = ["PYTHONPATH=/w", "PARTITA_AS_DEEPSPEED=1", "MASTER_ADDR=10.0.0.1", "MASTER_PORT=29500"]


@pytest.mark.parametrize(
    ("job", "tool"),
    [
        (
            _job("openmpi"),
            ["mpirun", "-n", "4", "-hostfile", "/h/hosts", "--mca", "btl", "^openib"]
            + ["--mca", "btl_tcp_if_include", "eth0", "--oversubscribe", "-x", "NCCL_DEBUG=INFO"]
            + [arg for pair in ["UCX_TLS=tcp", *ENV] for arg in ("-x", pair)],
        ),
        (  # --launcher_args naming btl_tcp_if_include drops the eth0 default
            _job("openmpi", launcher_args=("-mca", "btl_tcp_if_include", "ib0")),
            ["mpirun", "-n", "4", "-hostfile", "/h/hosts", "--mca", "btl", "^openib"]
            + ["-mca", "btl_tcp_if_include", "ib0", "-x", "NCCL_DEBUG=INFO"]
            + [arg for pair in ["UCX_TLS=tcp", *ENV] for arg in ("-x", pair)],
        ),
        (
            _job("mpich"),
            ["mpirun", "-n", "4", "-ppn", "2", "--oversubscribe", "-genv", "NCCL_DEBUG", "INFO"]
            + [a for pair in ENV for a in ("-genv", *pair.split("="))]
            + ["-hosts", "n1,n2"],
        ),
        (
            _job("slurm", num_nodes=2, per_node=2),
            ["srun", "-n", "4", "--oversubscribe", "--nodes", "2", "--gpus-per-node", "2"]
            + ["--export=ALL,NCCL_DEBUG=INFO," + ",".join(ENV)],
        ),
        (  # a filter: srun gets the hosts left and their count; CPU slots
            _job("slurm", resources={"n2": [0]}, filtered=True, per_node=1, gpus=False),
            ["srun", "-n", "1", "--oversubscribe", "--nodelist", "n2", "--nodes", "1"]
            + [
                "--export=ALL,NCCL_DEBUG=INFO,"
                + ",".join([*ENV[:2], "PARTITA_ACCELERATOR=cpu", *ENV[2:]])
            ],
        ),
    ],
)
def test_scheduler_command_as_deepspeed_builds_it(job: backends.Job, tool: list[str]) -> None:
    backends.check_request(job)
    argv, extra = backends.build_command(job, {}, python="/py")
    assert argv == [*tool, *RANK, *RANK_ARGS]
    assert extra == {}


def test_rank_command_modes() -> None:
    module = backends.rank_command(LaunchOptions("pkg.train", module=True), python="/py")
    assert module == [*RANK, "--run-module", "pkg.train"]
    exe = backends.rank_command(LaunchOptions("./t", no_python=True, no_local_rank=True), "/py")
    assert exe == ["/py", "-u", "-m", "partita.launcher.rank_setup", "--", "./t"]


def test_pdsh_command_runs_the_per_node_agent_with_pdsh_node_rank() -> None:
    options = LaunchOptions("train.py", ("a b",), bind_cores_to_rank=True, bind_core_list="0-3")
    job = _job("pdsh", options=options, exports={"NCCL_DEBUG": "a b"}, launcher_args=("-u", "9"))
    job = dataclasses.replace(job, ssh_port=2200)
    environ = {"PYTHONPATH": "/lib", "PDSH_SSH_ARGS_APPEND": "-q"}
    argv, extra = backends.build_command(job, environ, python="/py")
    assert argv[:9] == ["pdsh", "-S", "-f", "1024", "-w", "n1,n2", "-u", "9", argv[8]]
    assert len(argv) == 9
    assert extra == {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": "-q -p 2200"}
    remote = argv[8]
    assert remote.startswith("export NCCL_DEBUG='a b'; export PYTHONPATH=/w:/lib; cd /w; exec ")
    agent = shlex.split(remote.split("; exec ", 1)[1].replace("%n", "1"))
    assert agent[:4] == ["/py", "-u", "-m", "partita.launcher"]
    parsed = cli.parse_launch_args(agent[4:-2] + [__file__, "a b"])
    assert (parsed.num_nodes, parsed.node_rank, parsed.master_addr) == (2, 1, "10.0.0.1")
    assert (parsed.num_gpus, parsed.bind_cores_to_rank, parsed.bind_core_list) == (2, True, "0-3")
    assert agent[-2:] == ["train.py", "a b"]


def test_core_lists_as_deepspeed_splits_them() -> None:
    assert rank_setup.parse_core_list("1,3-5,7") == [1, 3, 4, 5, 7]
    assert rank_setup.format_core_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    for bad, message in [("1,1", "ascend"), ("a", "bad core range"), ("3-", "bad core range")]:
        with pytest.raises(ValueError, match=message):
            rank_setup.parse_core_list(bad)
    cores = [0, 1, 2, 3, 4]  # 2 ranks: 2 cores each, core 4 idle
    assert [rank_setup.cores_for_rank(cores, 2, r) for r in (0, 1)] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="cannot be split over 3 ranks"):
        rank_setup.cores_for_rank([0, 1], 3, 0)
    physical = rank_setup.physical_cores()
    assert physical and set(physical) <= os.sched_getaffinity(0)


def test_bound_cores_refuses_kmp_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KMP_AFFINITY", "compact")
    with pytest.raises(LaunchError, match="unset KMP_AFFINITY"):
        launch.bound_cores(None, 1)


def _fake_tools(tmp_path: Path) -> dict[str, str]:
    """A PATH with the stand-ins first, and where they log."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    for tool in ("mpirun", "ompi_info", "srun", "pdsh"):
        (bin_dir / tool).write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} {tool} "$@"\n')
        (bin_dir / tool).chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(log)}


def _records(out: Path, count: int) -> list[dict[str, object]]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(count)]


def test_bound_cores_rank_logs_and_pid_file_in_one_launch(tmp_path: Path) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs 2 CPUs to bind 2 ranks to one each")
    cores = allowed[-2:]
    out, logs = tmp_path / "out", tmp_path / "logs" / "deeper"
    out.mkdir()
    flags = ["--num_procs", "2", "--bind_cores_to_rank", "--bind_core_list"]
    flags += [rank_setup.format_core_list(cores), "--enable_each_rank_log", str(logs)]
    proc = start_launcher([*flags, "--save_pid", str(PROBE), str(out)])
    stdout, stderr = finish(proc, guard_s=GUARD_S)
    assert proc.returncode == 0, stdout + stderr
    for rank, record in enumerate(_records(out, 2)):
        assert record["affinity"] == [cores[rank]]
        assert record["env"]["OMP_NUM_THREADS"] == "1"  # type: ignore[index]
        assert record["argv"] == [f"--local_rank={rank}", str(out)]
        # While the job ran, /tmp/<partita's pid>.deepspeed held partita's pid.
        assert record["pid_file"] == record["launcher_pid"] == str(proc.pid)
    assert not Path(f"/tmp/{proc.pid}.deepspeed").exists()  # removed at exit
    names = sorted(p.name for p in logs.iterdir())
    assert len(names) == 2 and all(re.fullmatch(r"\d{14}_rank[01]\.log", n) for n in names)
    for rank, name in enumerate(names):
        text = (logs / name).read_text()
        assert f"stdout of rank {rank}\n" in text and f"stderr of rank {rank}\n" in text
    assert "of rank" not in stdout + stderr


def test_openmpi_ranks_form_one_world(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    env = _fake_tools(tmp_path)
    port = str(find_free_port())
    hostfile = _hostfile(tmp_path, TWO_HOSTS)
    args = ["--hostfile", hostfile, "--launcher", "openmpi", "--master_port", port]
    proc = start_launcher([*args, str(PROBE), str(out), "allreduce"], env=env)
    stdout, stderr = finish(proc, guard_s=GUARD_S)
    assert proc.returncode == 0, stdout + stderr
    seen = json.loads((tmp_path / "log" / "mpirun.json").read_text())
    assert seen["argv"][:4] == ["-n", "2", "-hostfile", hostfile]
    exported = [seen["argv"][i + 1] for i, arg in enumerate(seen["argv"]) if arg == "-x"]
    assert {"MASTER_ADDR=127.0.0.1", f"MASTER_PORT={port}", "PARTITA_AS_DEEPSPEED=1"} <= set(
        exported
    )
    for rank, record in enumerate(_records(out, 2)):
        assert record["all_reduce"] == 3.0  # 1 + 2: both ranks in one world
        assert record["deepspeed"] == "partita.compat.deepspeed"
        assert record["argv"] == [f"--local_rank={rank}", str(out), "allreduce"]
        assert record["env"]["MASTER_ADDR"] == "127.0.0.1"  # type: ignore[index]


@pytest.mark.parametrize("tool", ["mpich", "slurm"])
def test_scheduler_ranks_get_torch_variables_and_local_rank(tmp_path: Path, tool: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    env = {**_fake_tools(tmp_path), "FAKE_MPI_FLAVOUR": tool}
    hostfile = _hostfile(tmp_path, TWO_HOSTS)
    proc = start_launcher(["--hostfile", hostfile, "--launcher", tool, str(PROBE), str(out)], env)
    stdout, stderr = finish(proc, guard_s=GUARD_S)
    assert proc.returncode == 0, stdout + stderr
    for rank, record in enumerate(_records(out, 2)):
        got = record["env"]
        assert isinstance(got, dict)
        # mpich: -ppn 1 puts a rank on each host; the stand-in srun (no --nodes) both on one
        local, local_world = ("0", "1") if tool == "mpich" else (str(rank), "2")
        assert (got["RANK"], got["WORLD_SIZE"]) == (str(rank), "2")
        assert (got["LOCAL_RANK"], got["LOCAL_WORLD_SIZE"]) == (local, local_world)
        assert (got["MASTER_ADDR"], got["MASTER_PORT"]) == ("127.0.0.1", "29500")
        assert got["PARTITA_AS_DEEPSPEED"] == "1"
        assert record["argv"] == [f"--local_rank={local}", str(out)]


def test_pdsh_starts_a_partita_agent_per_host(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    env = _fake_tools(tmp_path)
    port = str(find_free_port())
    hostfile = _hostfile(tmp_path, TWO_HOSTS)
    args = ["--hostfile", hostfile, "--launcher", "pdsh", "--num_procs", "1"]
    proc = start_launcher([*args, "--master_port", port, str(PROBE), str(out)], env=env)
    stdout, stderr = finish(proc, guard_s=GUARD_S)
    assert proc.returncode == 0, stdout + stderr
    assert json.loads((tmp_path / "log" / "pdsh.json").read_text())["PDSH_RCMD_TYPE"] == "ssh"
    for rank, record in enumerate(_records(out, 2)):
        got = record["env"]
        assert isinstance(got, dict)
        assert (got["RANK"], got["WORLD_SIZE"], got["LOCAL_RANK"]) == (str(rank), "2", "0")
        assert record["argv"] == ["--local_rank=0", str(out)]
