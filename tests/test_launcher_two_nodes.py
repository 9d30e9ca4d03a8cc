"""Two "nodes" on this machine (issue 18): two partita agents with distinct node ranks on
127.0.0.1 and 127.0.0.2, started by hand (``--no_ssh --node_rank K``), by the hostfile fan-out
through a stand-in for ssh, or DeepSpeed's per-node way (``--hostfile H --no_ssh --node_rank K``,
the hostfile giving the world), train ZeRO stages 0-3 as one node of the same world size does;
a node killed with SIGKILL ends the job naming it, or, under ``--nnodes 1:2
--max_restarts 1`` through the fan-out, the other node resumes from ``latest`` at world size 1
(the per-node elastic command the fan-out runs is checked in test_launcher_multinode.py).

Every job runs tests/multinode_train.py, one process per node (world size 2)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import torch

from launch_helpers import (
    finish,
    kill_all,
    listening_sockets,
    start_launcher,
    wait_for_files,
    wait_gone,
)
from partita.launcher.launch import find_free_port

SCRIPT = Path(__file__).resolve().parent / "multinode_train.py"
NODES = ("127.0.0.1", "127.0.0.2")
GUARD_S = 300  # hang guard for a whole job on 2 busy cores, never a timing assertion
# pytest's own timeout past the guard, so a hung job fails through the guard, which prints the
# launchers' output (pytest's timeout at 300 s fired first and showed nothing, 2026-12-04).
pytestmark = pytest.mark.timeout(GUARD_S + 120)
# One thread per worker in every run: the launcher's default divides the cores among a node's
# workers, so one node of 2 workers and 2 nodes of 1 would sum in different orders.
THREADS = {"OMP_NUM_THREADS": "1"}


def _node(rank: int, port: int) -> list[str]:
    """Launcher flags of node ``rank`` of a 2-node job on the loopback "nodes"."""
    return [
        "--no_ssh",
        *("--node_rank", str(rank), "--master_addr", NODES[0], "--master_port", str(port)),
        *("--node_addr", NODES[rank], "--num_procs", "1", "--num_nodes", "2"),
    ]


def _start_nodes(
    out: Path, script_args: list[str]
) -> tuple[subprocess.Popen[str], subprocess.Popen[str]]:
    """Node 1's agent first (it waits for node 0's store), then node 0's."""
    port = find_free_port()
    args = [str(SCRIPT), str(out), *script_args]
    node1 = start_launcher([*_node(1, port), *args], env=THREADS)
    node0 = start_launcher([*_node(0, port), *args], env=THREADS)
    return node0, node1


def _job_pids(*launchers: subprocess.Popen[str]) -> list[int]:
    pids = []
    for proc in launchers:
        pids.append(proc.pid)
        pids += [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    return pids


def _run(args: list[str], out: Path) -> None:
    proc = start_launcher([*args, str(SCRIPT), str(out), *_rest(out)], env=THREADS)
    stdout, stderr = finish(proc, guard_s=GUARD_S)
    assert proc.returncode == 0, stdout + stderr


def _rest(out: Path) -> list[str]:
    return json.loads((out / "args.json").read_text())


@pytest.fixture(scope="module")
def one_node_losses(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    """Stages 0-3 on one node, world size 2: the reference."""
    out = tmp_path_factory.mktemp("one_node")
    (out / "args.json").write_text(json.dumps(["stages"]))
    _run(["--num_procs", "2"], out)
    return json.loads((out / "losses.json").read_text())


def _ip(addr: str) -> str:
    return addr.removeprefix("::ffff:")  # an IPv4-mapped IPv6 listener


def test_two_agents_train_like_one_node_and_listen_only_where_named(
    tmp_path: Path, one_node_losses: dict[str, list[float]]
) -> None:
    node0, node1 = _start_nodes(tmp_path, ["stages", "--hold"])
    try:
        wait_for_files([tmp_path / "held0", tmp_path / "held1"], [node0, node1], guard_s=GUARD_S)
        listeners = {pid: listening_sockets(pid) for pid in _job_pids(node0, node1)}
    finally:
        (tmp_path / "release").write_text("")
        outputs = [finish(node, guard_s=120) for node in (node0, node1)]
    for node, (out, err) in zip((node0, node1), outputs, strict=True):
        assert node.returncode == 0, out + err
    records = [json.loads((tmp_path / f"rank{r}_restart0.json").read_text()) for r in (0, 1)]
    assert sorted((r["node_rank"], r["world"]) for r in records) == [(0, 2), (1, 2)]
    assert json.loads((tmp_path / "losses.json").read_text()) == one_node_losses
    # The store (node 0's agent) and gloo (every worker) listen; each on a named address.
    sockets = [addr for found in listeners.values() for addr in found]
    assert len([pid for pid, found in listeners.items() if found]) >= 3, listeners
    assert all(_ip(ip) in NODES for ip, _ in sockets), listeners


def test_deepspeed_per_node_form_with_a_hostfile_trains_like_one_node(
    tmp_path: Path, one_node_losses: dict[str, list[float]]
) -> None:
    # DeepSpeed's per-node command line, unchanged: the hostfile gives the world (two hosts
    # that are this machine, a slot each), each command starts its node's slots as ranks.
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    out = tmp_path / "out"
    out.mkdir()
    port = str(find_free_port())
    per_node = ["--hostfile", str(hostfile), "--no_ssh", "--master_addr", "127.0.0.1"]
    script = ["--master_port", port, str(SCRIPT), str(out), "stages"]
    node1 = start_launcher([*per_node, "--node_rank", "1", *script], env=THREADS)
    node0 = start_launcher([*per_node, "--node_rank", "0", *script], env=THREADS)
    try:
        # Node 1 ends with node 0, whose store it needs: a short guard after node 0's keeps
        # both within pytest's timeout, so a hang fails through a guard that prints output.
        for node, guard_s in ((node0, GUARD_S), (node1, 60)):
            stdout, stderr = finish(node, guard_s=guard_s)
            assert node.returncode == 0, stdout + stderr
    finally:
        kill_all([node0.pid, node1.pid])
    records = [json.loads((out / f"rank{r}_restart0.json").read_text()) for r in (0, 1)]
    assert sorted((r["node_rank"], r["world"]) for r in records) == [(0, 2), (1, 2)]
    losses = json.loads((out / "losses.json").read_text())
    assert losses.keys() == one_node_losses.keys()
    for stage, want in one_node_losses.items():
        assert losses[stage] == pytest.approx(want, rel=1e-6, abs=0), stage


_SSH_STAND_IN = """#!/bin/bash
# Stand-in for ssh: records argv and the script on stdin per host, then runs the remote
# command here, as ssh would run it on HOST, and ends when the command does (ssh does not wait
# for its stdin to close).  $SSH_FAIL_HOST: fails as an unreachable host does, running nothing.
# argv: -o BatchMode=yes HOST COMMAND
printf '%s\\n' "$@" > "$SSH_LOG/$3.argv"
if [ "$3" = "${SSH_FAIL_HOST:-}" ]; then
  echo "ssh: connect to host $3 port 22: Connection refused" >&2
  exit 255
fi
bash -c "$4" < <(tee "$SSH_LOG/$3.stdin")
"""


def _start_fanout(
    tmp_path: Path, args: list[str], env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], Path]:
    """``partita --hostfile`` over the two loopback nodes, 1 process each, through the ssh
    stand-in; returns the launcher and the folder where the stand-in logs each host."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    for folder in (bin_dir, log):
        folder.mkdir()
    (bin_dir / "ssh").write_text(_SSH_STAND_IN)
    (bin_dir / "ssh").chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{host} slots=1\n" for host in NODES))
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    env = {"PATH": path, "SSH_LOG": str(log), **THREADS, **(env or {})}
    port = str(find_free_port())
    flags = ["--hostfile", str(hostfile), "--num_procs", "1", "--master_port", port]
    return start_launcher([*flags, *args], env=env), log


def _agent_pid(launcher: subprocess.Popen[str], node_rank: int) -> int:
    """The pid of node ``node_rank``'s partita agent under the fan-out ``launcher``."""
    for child in psutil.Process(launcher.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmd = child.cmdline()
            agent = cmd[1:4] == ["-u", "-m", "partita.launcher"]
            if agent and cmd[cmd.index("--node_rank") + 1] == str(node_rank):
                return child.pid
    raise AssertionError(f"no agent of node {node_rank} under the fan-out")


def test_hostfile_fanout_over_ssh_trains_like_one_node(
    tmp_path: Path, one_node_losses: dict[str, list[float]]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    secretish = {"PARTITA_SECRETISH": "a b; $HOME"}  # forwarded on stdin, quoted, never in argv
    proc, log = _start_fanout(tmp_path, [str(SCRIPT), str(out), "stages"], env=secretish)
    stdout, stderr = finish(proc, guard_s=GUARD_S)
    assert proc.returncode == 0, stdout + stderr
    assert json.loads((out / "losses.json").read_text()) == one_node_losses
    for rank, host in enumerate(NODES):
        assert (log / f"{host}.argv").read_text().splitlines() == [
            "-o", "BatchMode=yes", host, "bash -s",
        ]  # fmt: skip
        script = (log / f"{host}.stdin").read_text()
        assert "export PARTITA_SECRETISH='a b; $HOME'" in script
        assert f"--node_rank {rank} " in script and f"--node_addr {host} " in script


def test_fanout_stops_every_node_when_one_cannot_start(tmp_path: Path) -> None:
    # Node 1's ssh fails before its agent starts, so node 0's agent would wait in the
    # rendezvous for it (torch's static timeout: 600 s); the fan-out stops it instead.
    out = tmp_path / "out"
    out.mkdir()
    refused = {"SSH_FAIL_HOST": NODES[1]}
    proc, _ = _start_fanout(tmp_path, [str(SCRIPT), str(out), "stages"], env=refused)
    try:
        _, stderr = finish(proc, guard_s=GUARD_S)
    finally:
        left = wait_gone(_processes_naming(tmp_path), bound_s=30)
        kill_all(left)
    assert proc.returncode == 1, stderr
    assert f"partita: node 1 ({NODES[1]}) exited with status 255; stopping the other" in stderr
    assert left == [], "a node's agent or worker outlived the fan-out"


def _processes_naming(folder: Path) -> list[int]:
    """Processes (agents, workers) whose command line names ``folder``: this test's job."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(str(folder) in arg for arg in proc.info["cmdline"] or ()):
            found.append(proc.pid)
    return found


@pytest.mark.parametrize("dead", [1, 0])
def test_killed_node_ends_the_job_naming_it(tmp_path: Path, dead: int) -> None:
    nodes = _start_nodes(tmp_path, ["elastic", str(tmp_path / "ckpt"), "4", "--gate", "1"])
    killed, survivor = nodes[dead], nodes[1 - dead]
    pids = [node.pid for node in nodes]  # the agents, until their workers are known
    try:
        # Either node failing to start fails here at once (a node that dies before the gates
        # would leave the other waiting out the whole guard).
        wait_for_files([tmp_path / "gate0", tmp_path / "gate1"], nodes, guard_s=GUARD_S)
        pids = _job_pids(*nodes)
        os.kill(killed.pid, signal.SIGKILL)
        _, err = finish(survivor, guard_s=30)  # the bound, as a hang guard
    finally:
        kill_all(pids)
    assert survivor.returncode == 1, err
    if dead == 1:
        assert f"partita: node 1 ({NODES[1]}, agent pid {killed.pid}) is gone" in err, err
    else:  # node 0's agent hosted the store: its silence is the news
        assert (
            f"partita: node 0 is gone: the rendezvous store its agent hosts at {NODES[0]}:" in err
        )
    assert wait_gone(pids, bound_s=30) == [], "a worker outlived the job"


def test_elastic_job_resumes_on_the_surviving_node_like_a_save_and_load(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "args.json").write_text(
        json.dumps(["elastic", str(ref / "ckpt"), "4", "--stop_at", "2"])
    )
    _run(["--num_procs", "2"], ref)  # steps 1-2 at world size 2, saved
    (ref / "args.json").write_text(json.dumps(["elastic", str(ref / "ckpt"), "4"]))
    _run(["--num_procs", "1"], ref)  # steps 3-4 at world size 1 from latest

    # The hostfile fan-out starts each node's elastic agent (--nnodes 1:2 --node_rank K, as a
    # scheduler would by hand); node 0 hosts the rendezvous and outlives node 1.
    out = tmp_path / "job"
    out.mkdir()
    elastic = ["--nnodes", "1:2", "--max_restarts", "1"]
    elastic += ["--rdzv_conf", "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2"]
    script = [str(SCRIPT), str(out), "elastic", str(out / "ckpt"), "4", "--gate", "2"]
    job, _ = _start_fanout(tmp_path, [*elastic, *script])
    pids: list[int] = []
    try:
        wait_for_files([out / "gate0", out / "gate1"], job, guard_s=GUARD_S)
        pids = _job_pids(job)
        os.kill(_agent_pid(job, node_rank=1), signal.SIGKILL)
        stdout, stderr = finish(job, guard_s=GUARD_S)
    finally:
        kill_all(pids)
    assert job.returncode == 0, stdout + stderr
    killed = 128 + signal.SIGKILL  # bash's status for the agent the stand-in ran
    assert f"partita: node 1 ({NODES[1]}) exited with status {killed}; the other" in stderr
    assert (out / "rank0_restart1.json").exists(), "no restart at the new world size"
    assert json.loads((out / "rank0_restart1.json").read_text())["world"] == 1
    assert (out / "losses_from2_world1.json").exists(), stderr
    got = torch.load(out / "final.pt")
    want = torch.load(ref / "final.pt")
    assert got.keys() == want.keys()
    differ = [name for name in want if not torch.equal(got[name], want[name])]
    assert differ == [], differ
