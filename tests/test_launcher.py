"""Tests of the ``partita`` launcher: torch-free --help, real 2-process launches (loopback-only
sockets), failures, bad flags."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from launch_helpers import finish, is_loopback, listening_sockets, start_launcher, wait_for_files
from partita.launcher import cli
from partita.launcher.launch import (
    LaunchError,
    LaunchOptions,
    WorkerPlan,
    find_free_port,
    listen_socket,
    loopback_env,
    plan_workers,
    store_bind_address,
    with_parent_death_signal,
    worker_command,
    worker_env,
)

CLI = [sys.executable, "-m", "partita.launcher.cli"]

# Checks what the launcher promised, then proves the ranks can talk over gloo.
GOOD_SCRIPT = """
import argparse, json, os, sys
from pathlib import Path

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, required=True)
parser.add_argument("--foo", type=int, required=True)
parser.add_argument("--literal", required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
dist.destroy_process_group()
record = {
    "rank": rank,
    "local_rank_arg": args.local_rank,
    "local_rank_env": int(os.environ["LOCAL_RANK"]),
    "world_size": int(os.environ["WORLD_SIZE"]),
    "master_addr": os.environ["MASTER_ADDR"],
    "accelerator": os.environ["PARTITA_ACCELERATOR"],
    "foo": args.foo,
    "literal": args.literal,
    "sum": total.item(),
}
Path(args.out, f"rank{rank}.json").write_text(json.dumps(record))
"""

# Rank 1 raises once rank 0 is up; rank 0 would sleep for minutes unless the launcher kills it.
FAILING_SCRIPT = """
import os, sys, time
from pathlib import Path

out = Path(sys.argv[-1])
rank = int(os.environ["RANK"])
(out / f"pid{rank}").write_text(str(os.getpid()))
if rank == 1:
    while not (out / "pid0").exists():
        time.sleep(0.05)
    raise RuntimeError("deliberate failure on rank 1")
time.sleep(600)
"""


def _write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def test_help_does_not_import_torch() -> None:
    result = subprocess.run([*CLI, "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "--num_gpus" in result.stdout and "--num_procs" in result.stdout
    probe = (
        "import sys, partita.launcher.cli as c\n"
        "try:\n    c.main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        "assert 'torch' not in sys.modules, 'torch imported by the launcher CLI'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr


def test_two_cpu_processes_get_rank_env_and_all_reduce(tmp_path: Path) -> None:
    script = _write(tmp_path / "train.py", GOOD_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    # '$' must reach the script untouched although the agent substitutes ${local_rank}.
    literal = "a$b${local_rank}$$c"
    cmd = [*CLI, "--num_procs", "2", str(script), "--foo", "1", "--literal", literal]
    result = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, record in enumerate(records):
        assert record == {
            "rank": rank,
            "local_rank_arg": rank,
            "local_rank_env": rank,
            "world_size": 2,
            "master_addr": "127.0.0.1",
            "accelerator": "cpu",
            "foo": 1,
            "literal": literal,
            "sum": 3.0,
        }


def test_failing_rank_stops_job_names_rank_and_leaves_no_process(tmp_path: Path) -> None:
    script = _write(tmp_path / "fail.py", FAILING_SCRIPT)
    # The timeout is a hang guard: rank 0 sleeps for 600 s unless the launcher stops it.
    result = subprocess.run(
        [*CLI, "--num_procs", "2", str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert output.count("Traceback (most recent call last)") == 1, output  # rank 1's own
    assert output.endswith(
        "\npartita: rank 1 failed (exit 1): RuntimeError: deliberate failure on rank 1\n"
    ), output
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in range(2)]
    survivors = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        matches = proc.info["pid"] in pids or str(script) in cmdline
        # A zombie has finished running; only its exit status waits to be collected.
        if matches and proc.info["status"] != psutil.STATUS_ZOMBIE:
            survivors.append((proc.info["pid"], cmdline))
    assert not survivors, f"worker processes left behind: {survivors}"


# Joins the process group, proves it works, reports ready, and holds its sockets open until the
# test has listed them (the release file), so the test sees every listener of a running job.
HOLD_SCRIPT = """
import os, sys, time
from pathlib import Path

import torch
import torch.distributed as dist

out = Path(sys.argv[-1])
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
total = torch.tensor([1.0])
dist.all_reduce(total)
(out / f"ready{rank}").write_text(str(total.item()))
while not (out / "release").exists():
    time.sleep(0.05)
dist.barrier()
dist.destroy_process_group()
"""


def _job_listeners(launcher_pid: int) -> dict[tuple[int, str], list[tuple[str, int]]]:
    """Listening sockets of the launcher (which runs torchrun's agent) and of every worker."""
    procs = [psutil.Process(launcher_pid), *psutil.Process(launcher_pid).children(recursive=True)]
    return {(p.pid, " ".join(p.cmdline()[:4])): listening_sockets(p.pid) for p in procs}


def test_single_node_launch_listens_on_loopback_only(tmp_path: Path) -> None:
    script = _write(tmp_path / "hold.py", HOLD_SCRIPT)
    proc = start_launcher(["--num_procs", "2", str(script), str(tmp_path)])
    try:
        wait_for_files([tmp_path / "ready0", tmp_path / "ready1"], proc, guard_s=120)
        listeners = _job_listeners(proc.pid)
    finally:
        (tmp_path / "release").write_text("")
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    # The rendezvous store listens in the launcher; without it this test would check nothing.
    assert listeners[next(k for k in listeners if k[0] == proc.pid)], listeners
    exposed = {k: [a for a in v if not is_loopback(a[0])] for k, v in listeners.items()}
    assert not any(exposed.values()), f"sockets listening beyond loopback: {exposed}"


def test_two_node_job_binds_the_master_addr_it_is_given(tmp_path: Path) -> None:
    # Two "nodes" on this machine: node 0's store must listen where --master_addr says.
    script = _write(tmp_path / "hold.py", HOLD_SCRIPT)
    port = str(find_free_port())
    common = ["--num_nodes", "2", "--master_addr", "127.0.0.1", "--master_port", port]
    node0 = start_launcher([*common, "--node_rank", "0", str(script), str(tmp_path)])
    node1 = start_launcher([*common, "--node_rank", "1", str(script), str(tmp_path)])
    try:
        wait_for_files([tmp_path / "ready0", tmp_path / "ready1"], node0, guard_s=120)
        store = listening_sockets(node0.pid)
    finally:
        (tmp_path / "release").write_text("")
        outputs = [finish(node, guard_s=120) for node in (node0, node1)]
    for node, (out, err) in zip((node0, node1), outputs, strict=True):
        assert node.returncode == 0, out + err
    assert ("127.0.0.1", int(port)) in store, store
    assert all(ip == "127.0.0.1" for ip, _ in store), store


@pytest.fixture
def script(tmp_path: Path) -> str:
    """An existing (empty) script path for argument-parsing tests."""
    return str(_write(tmp_path / "s.py", "\n"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num_procs", "0", "{s}"], "--num_procs: must be >= 1, got 0"),
        (
            ["--num_gpus", "x", "{s}"],
            "argument --num_gpus/--num_accelerators: expected an integer, got 'x'",
        ),
        ([], "the following arguments are required: script"),
        (["--num_procs", "2"], "the following arguments are required: script"),
        (["--num_procs", "2", "no_such_script.py"], "script 'no_such_script.py' not found"),
        (["--num_gpus", "1", "--num_procs", "2", "{s}"], "not allowed with argument"),
        (
            ["--hostfile", "hosts", "--node_rank", "1", "{s}"],
            "--node_rank cannot be used with --hostfile",
        ),
        (["--include", "localhost:0", "{s}"], "--include/--exclude select hosts of a --hostfile"),
        (["--force_multi", "{s}"], "--force_multi chooses how the hosts of a --hostfile are"),
        (["--num_nodes", "2", "{s}"], "--num_nodes 2 needs --node_rank and --master_addr"),
        (
            ["--num_nodes", "2", "--node_rank", "2", "--master_addr", "h", "{s}"],
            "--node_rank must be in [0, 2) for --num_nodes 2, got 2",
        ),
        (["--node_rank", "1", "{s}"], "--node_rank must be in [0, 1)"),
        (["--master_port", "70000", "{s}"], "must be a TCP port in [1, 65535], got 70000"),
        (["--module", "--no_python", "pkg.train"], "--module and --no_python cannot be used"),
        (["--no_python", "no-such-binary-xyz"], "executable 'no-such-binary-xyz' not found"),
        (["--num_proc", "2", "{s}"], "unrecognized arguments"),  # no prefix matching
        (["--hang_timeout", "-1", "{s}"], "--hang_timeout: must be >= 0 seconds"),
        (["--hang_timeout", "x", "{s}"], "expected a number of seconds, got 'x'"),
    ],
)
def test_bad_flags_exit_2_with_clear_message(
    argv: list[str], message: str, script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([arg.replace("{s}", script) for arg in argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_parse_multi_node_and_script_args(script: str) -> None:
    argv = ["--num_nodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1"]
    options = cli.parse_launch_args([*argv, "--master_port", "1234", script, "--num_procs", "5"])
    assert options == LaunchOptions(
        script=script,
        script_args=("--num_procs", "5"),  # flags after the script belong to the script
        num_nodes=2,
        node_rank=1,
        master_addr="10.0.0.1",
        master_port=1234,
    )


def test_subcommand_dispatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path / "fake_sub.py", "def run(argv):\n    return 7 if argv == ['-x'] else 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.SUBCOMMANDS, "fake", "fake_sub:run")
    assert cli.main(["fake", "-x"]) == 7


@pytest.mark.parametrize(
    ("num_gpus", "num_procs", "visible", "expected"),
    [
        (None, None, 0, WorkerPlan("cpu", 1)),
        (None, None, 4, WorkerPlan("cuda", 4)),
        (2, None, 4, WorkerPlan("cuda", 2)),
        (None, 3, 4, WorkerPlan("cpu", 3)),
        (None, 3, 0, WorkerPlan("cpu", 3)),
    ],
)
def test_plan_workers(
    num_gpus: int | None, num_procs: int | None, visible: int, expected: WorkerPlan
) -> None:
    assert plan_workers(num_gpus, num_procs, visible) == expected


def test_plan_workers_rejects_unavailable_gpus() -> None:
    with pytest.raises(LaunchError, match="use --num_procs 2 to run 2 CPU processes"):
        plan_workers(2, None, 0)
    with pytest.raises(LaunchError, match="--num_gpus 8 is more than the 2 CUDA device"):
        plan_workers(8, None, 2)


def test_worker_command_variants() -> None:
    python = sys.executable
    plain = worker_command(LaunchOptions(script="t.py", script_args=("--a", "1")))
    assert plain == (python, ["-u", "t.py", "--local_rank=${local_rank}", "--a", "1"])
    module = worker_command(LaunchOptions(script="pkg.t", module=True, no_local_rank=True))
    assert module == (python, ["-u", "-m", "pkg.t"])
    binary = worker_command(LaunchOptions(script="run.sh", script_args=("$x",), no_python=True))
    assert binary == ("run.sh", ["--local_rank=${local_rank}", "$$x"])


def test_worker_env_sets_accelerator_and_keeps_user_threads() -> None:
    env = worker_env(WorkerPlan("cpu", 2), {})
    assert env["PARTITA_ACCELERATOR"] == "cpu" and int(env["OMP_NUM_THREADS"]) >= 1
    assert worker_env(WorkerPlan("cuda", 2), {"OMP_NUM_THREADS": "8"}) == {
        "PARTITA_ACCELERATOR": "cuda",
        "PARTITA_AS_DEEPSPEED": "1",  # `import deepspeed` is partita under the launcher
    }


def test_store_bind_address_follows_the_launch() -> None:
    assert store_bind_address(LaunchOptions(script="t.py")) == "127.0.0.1"
    two = {"script": "t.py", "num_nodes": 2}
    # An address the user typed is bound as typed, loopback included (two "nodes" on one host).
    assert store_bind_address(LaunchOptions(**two, master_addr="127.0.0.1")) == "127.0.0.1"
    assert store_bind_address(LaunchOptions(**two, master_addr="10.1.2.3")) == "10.1.2.3"
    assert store_bind_address(LaunchOptions(**two, master_addr="h", bind_addr="0.0.0.0")) == (
        "0.0.0.0"
    )
    # A host name that resolves to loopback here would leave the other nodes unable to join.
    with pytest.raises(LaunchError, match=r"--master_addr 'localhost' resolves to .* cannot reach"):
        store_bind_address(LaunchOptions(**two, master_addr="localhost"))
    with pytest.raises(
        LaunchError, match=r"--master_addr 'no-such-host\.invalid' does not resolve"
    ):
        store_bind_address(LaunchOptions(**two, master_addr="no-such-host.invalid"))


def test_listen_socket_names_address_and_port_when_taken() -> None:
    taken = listen_socket("127.0.0.1", 0)
    port = taken.getsockname()[1]
    try:
        with pytest.raises(
            LaunchError, match=f"cannot listen on 127.0.0.1:{port} .* --master_port"
        ):
            listen_socket("127.0.0.1", port)
    finally:
        taken.close()


def test_loopback_env_pins_gloo_and_nccl_to_loopback_unless_set() -> None:
    env = loopback_env({})
    assert set(env) == {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"}
    addrs = psutil.net_if_addrs()[env["GLOO_SOCKET_IFNAME"]]
    assert any(is_loopback(a.address) for a in addrs if a.family.name == "AF_INET")
    assert loopback_env({"GLOO_SOCKET_IFNAME": "eth9"}) == {
        "NCCL_SOCKET_IFNAME": env["NCCL_SOCKET_IFNAME"]
    }


# Prints the parent-death signal the kernel holds for this process (PR_GET_PDEATHSIG = 2).
PDEATHSIG_PROBE = (
    "import ctypes; v = ctypes.c_int(); "
    "ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0); print(v.value)"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_worker_exec_arms_parent_death_signal_and_refuses_orphans() -> None:
    entry, args = with_parent_death_signal(sys.executable, ["-c", PDEATHSIG_PROBE])
    assert (entry, args[:2]) == (sys.executable, ["-m", "partita.launcher.worker_exec"])
    env = {**os.environ, "PARTITA_LAUNCHER_PID": str(os.getpid())}
    result = subprocess.run([entry, *args], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == signal.SIGKILL  # survives exec into the worker program
    # A shim whose launcher is already gone (its parent is not the named pid) starts nothing.
    env["PARTITA_LAUNCHER_PID"] = str(os.getpid() + 1_000_000)
    result = subprocess.run([entry, *args], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 1 and result.stdout == ""
    assert "is gone; not starting" in result.stderr


def test_bad_hang_timeout_variable_fails_before_any_worker_starts(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PARTITA_HANG_TIMEOUT", "soon")
    assert cli.main(["--num_procs", "2", script]) == 2
    err = capsys.readouterr().err
    assert "environment variable PARTITA_HANG_TIMEOUT='soon' must be a number of seconds" in err
