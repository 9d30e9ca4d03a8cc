"""Fan a launch out over the hosts of a hostfile: one partita agent per node, started by ssh.

``partita --hostfile H [flags] script.py`` resolves the hosts and slots first
(`partita.launcher.hostfile`, before anything starts), then builds a `NodeCommand` per host
(`fanout_plan`, a pure function) and runs them (`run_fanout`). Each node runs
``python -u -m partita.launcher --num_nodes N --node_rank K --master_addr M --master_port P
...``: the same per-node agent as a hand-started multi-node job, so workers get partita's
environment, ``--local_rank`` and the bound rendezvous store of `partita.launcher.launch`.
An elastic job (``--nnodes MIN:MAX``) passes that instead of ``--num_nodes``; node 0 hosts
its dynamic rendezvous and the fan-out lets the job outlive any other node (`run_fanout`).
Each ssh's standard input stays open as the node's line: the fan-out closes it to stop the
node, and it closes by itself when the fan-out dies (`partita.launcher.lifeline`).

The environment forwarded to the nodes is the variables of this process whose names start with
an allow-listed prefix (DeepSpeed's ``NCCL``, ``PYTHON``, ``MLFLOW``, ``MV2``, ``UCX``, plus
``GLOO_`` and the user's ``PARTITA_`` settings) and then the ``KEY=VALUE`` lines of
``.deepspeed_env`` (``$DS_ENV_FILE`` names another file) in the home directory and the working
directory, later ones winning, as DeepSpeed reads them. Values are shell-quoted and travel on
ssh's standard input as a script for ``bash -s``, never as arguments, so they do not show in
``ps`` on either side.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from partita.launcher.hostfile import Resources
from partita.launcher.launch import DEFAULT_MASTER_PORT, LaunchError, LaunchOptions
from partita.platform import env as env_vars

__all__ = [
    "EXPORT_PREFIXES",
    "LIFELINE_FD",
    "NodeCommand",
    "agent_flags",
    "deepspeed_env_files",
    "exported_env",
    "fanout_plan",
    "node_script",
    "read_env_file",
    "run_fanout",
]

#: Variables forwarded to every node when their name starts with one of these.
EXPORT_PREFIXES = ("NCCL", "PYTHON", "MLFLOW", "MV2", "UCX", "GLOO_", "PARTITA_")

# Set by the launcher for its own workers; a value from this node would be wrong on another.
_LAUNCHER_SET = frozenset(
    var.name for var in env_vars.VARIABLES if var.set_by.startswith("the `partita` launcher")
)
_SSH_OPTIONS = ("-o", "BatchMode=yes")  # a password prompt would hang the fan-out
#: The descriptor on which each node's agent gets ssh's standard input (`partita.launcher.lifeline`).
LIFELINE_FD = 3
# How long a stopped node's agent gets to end its workers after its line closes (torch's
# agent gives them 30 s between SIGTERM and SIGKILL) before its ssh is terminated.
_STOP_GRACE_S = 60.0


@dataclass(frozen=True)
class NodeCommand:
    """What the fan-out runs for one node: ``argv`` locally, ``script`` on its stdin."""

    host: str
    node_rank: int
    argv: tuple[str, ...]
    script: str


def read_env_file(lines: Iterable[str], path: str) -> dict[str, str]:
    """``KEY=VALUE`` lines of a ``.deepspeed_env`` file (value up to the line's end, stripped).

    Blank lines and ``#`` comments are skipped; any other line without ``=`` or with a key
    that is not a shell variable name is a `LaunchError` naming the file and line.
    """
    result: dict[str, str] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, equals, value = line.partition("=")
        key = key.strip()
        if not equals or not key.isidentifier() or not key.isascii():
            raise LaunchError(f"{path}:{number}: expected KEY=VALUE, got {line!r}")
        result[key] = value.strip()
    return result


def deepspeed_env_files(environ: Mapping[str, str], cwd: str) -> list[Path]:
    """The ``.deepspeed_env`` files that exist, in the order DeepSpeed reads them."""
    name = environ.get("DS_ENV_FILE", ".deepspeed_env")
    home = environ.get("HOME", str(Path.home()))
    return [p for p in (Path(home) / name, Path(cwd) / name) if p.is_file()]


def exported_env(environ: Mapping[str, str], env_files: Sequence[Path] = ()) -> dict[str, str]:
    """The variables every node gets: allow-listed ones of ``environ``, then the files'."""
    result = {
        key: value
        for key, value in sorted(environ.items())
        if key.startswith(EXPORT_PREFIXES) and key not in _LAUNCHER_SET
    }
    for path in env_files:
        with open(path, encoding="utf-8") as handle:
            result.update(read_env_file(handle, str(path)))
    return result


def _membership_args(options: LaunchOptions, num_hosts: int) -> list[str]:
    """How many nodes each agent expects: all of them, or elastic ``--nnodes MIN:MAX`` (with
    the rendezvous settings, which every agent of the job must share)."""
    if options.min_nodes is None:
        args = ["--num_nodes", str(num_hosts)]
    else:
        args = ["--nnodes", f"{options.min_nodes}:{options.num_nodes}"]
    if options.rdzv_conf:
        args += ["--rdzv_conf", ",".join(f"{key}={value}" for key, value in options.rdzv_conf)]
    return args


def _agent_args(options: LaunchOptions, slots: list[int], gpus: bool) -> list[str]:
    """The per-node ``partita`` flags that do not depend on the node."""
    return ["--num_gpus" if gpus else "--num_procs", str(len(slots)), *agent_flags(options)]


def agent_flags(options: LaunchOptions) -> list[str]:
    """The flags of ``options`` that every node's agent takes as given (restarts, the hang
    bound, how to run the script, core binding, per-rank logs)."""
    args = ["--max_restarts", str(options.max_restarts)]
    if options.hang_timeout is not None:
        args += ["--hang_timeout", repr(options.hang_timeout)]
    for flag in ("module", "no_python", "no_local_rank", "bind_cores_to_rank"):
        if getattr(options, flag):
            args.append(f"--{flag}")
    if options.bind_core_list is not None:
        args += ["--bind_core_list", options.bind_core_list]
    if options.rank_log_dir is not None:
        args += ["--enable_each_rank_log", os.path.abspath(options.rank_log_dir)]
    return args


def node_script(exports: Mapping[str, str], cwd: str, command: Sequence[str]) -> str:
    """A bash script that sets ``exports``, enters ``cwd`` and execs ``command``, every value
    shell-quoted (spaces, quotes, ``$``, ``;`` arrive as typed). ``command`` gets ssh's
    standard input, the fan-out's line to the node, as descriptor `LIFELINE_FD`."""
    lines = ["set -e"]
    lines += [f"export {key}={shlex.quote(value)}" for key, value in exports.items()]
    lines.append(f"cd {shlex.quote(cwd)}")
    # stdin is this script and then the open line: a worker reading stdin would block on it,
    # so stdin becomes /dev/null and the line moves to its own descriptor.
    lines.append(f"exec {shlex.join(command)} {LIFELINE_FD}<&0 < /dev/null")
    return "\n".join(lines) + "\n"


def fanout_plan(
    resources: Resources,
    options: LaunchOptions,
    exports: Mapping[str, str],
    cwd: str,
    master_addr: str | None = None,
    ssh: str = "ssh",
    python: str = sys.executable,
    gpus: bool = True,
    ssh_args: Sequence[str] = (),
) -> list[NodeCommand]:
    """One `NodeCommand` per host of ``resources``, node ranks in hostfile order.

    The master is ``master_addr`` when the user named one, else the first host; the port
    ``options.master_port`` or 29500. GPU slots become ``CUDA_VISIBLE_DEVICES`` on their
    node (``gpus``); CPU slots (``--num_procs``) only count processes. An elastic job
    (``options.min_nodes``) gives every agent ``--nnodes MIN:MAX``: node 0 hosts the dynamic
    rendezvous, as in a job started node by node. ``ssh_args`` (``--launcher_args``) go to
    every ssh before the host.
    """
    hosts = list(resources)
    master = hosts[0] if master_addr is None else master_addr
    port = options.master_port or DEFAULT_MASTER_PORT
    plan = []
    for rank, host in enumerate(hosts):
        slots = resources[host]
        node_env = dict(exports)
        if gpus:
            node_env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
        command = [python, "-u", "-m", "partita.launcher", "--lifeline_fd", str(LIFELINE_FD)]
        command += [*_membership_args(options, len(hosts)), "--node_rank", str(rank)]
        command += ["--master_addr", master, "--master_port", str(port)]
        if is_ip(host):  # its workers' sockets go on the interface the hostfile named
            command += ["--node_addr", host]
        command += _agent_args(options, slots, gpus)
        command += [options.script, *options.script_args]
        argv = (ssh, *_SSH_OPTIONS, *ssh_args, host, "bash -s")
        plan.append(NodeCommand(host, rank, argv, node_script(node_env, cwd, command)))
    return plan


def is_ip(host: str) -> bool:
    """Whether `host` is an IP address (not a name)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def find_ssh(environ: Mapping[str, str]) -> str:
    """The ``ssh`` on PATH; `LaunchError` when there is none."""
    found = shutil.which("ssh", path=environ.get("PATH"))
    if found is None:
        raise LaunchError("--hostfile launches over ssh, but no 'ssh' is on PATH")
    return found


def run_fanout(plan: Sequence[NodeCommand], poll: float = 0.1, elastic: bool = False) -> int:
    """Runs every node's command and waits; returns 0 when the job succeeded, else 1.

    A static job succeeds when every node exits 0: the first node to fail is named and the
    others are stopped (`_stop`). In an elastic job (``elastic``) the survivors carry on
    without a failed node (torch's rendezvous restarts them at the new size, as far as
    ``--max_restarts`` allows), so only node 0, which hosts the rendezvous, decides: its
    failure is named and stops the others, its success is the job's once the rest have ended.
    See [Note: the elastic fan-out's exit].
    """
    pending = [(node, _start(node)) for node in plan]
    while pending:
        for node, proc in list(pending):
            code = proc.poll()
            if code is None:
                continue
            pending.remove((node, proc))
            _close_line(proc)
            if code == 0:
                continue
            where = f"partita: node {node.node_rank} ({node.host}) exited with status {code}"
            if elastic and node.node_rank != 0:
                host_done = all(other.node_rank != 0 for other, _ in pending)
                print(f"{where}; {_AFTER_HOST if host_done else _GOES_ON}", file=sys.stderr)
                continue
            print(f"{where}; stopping the other nodes", file=sys.stderr)
            _stop([other for _, other in pending])
            return 1
        time.sleep(poll)
    return 0


def _stop(procs: Sequence[subprocess.Popen[str]], grace_s: float = _STOP_GRACE_S) -> None:
    """Stops nodes: closing a node's line ends its agent, which ends its workers (terminating
    ssh alone would leave them running, `partita.launcher.lifeline`); an ssh still there after
    ``grace_s`` is terminated."""
    for proc in procs:
        _close_line(proc)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait()


def _close_line(proc: subprocess.Popen[str]) -> None:
    if proc.stdin is not None:
        with contextlib.suppress(OSError):  # the ssh may already be gone (a broken pipe)
            proc.stdin.close()


# [Note: the elastic fan-out's exit]
# Node 0's agent hosts the rendezvous store, so the job lives exactly as long as it does: when
# another node ends, node 0's agent either restarts the workers on the nodes left (exiting 0
# when they finish) or gives up and exits non-zero: no restarts left (it names the node that
# is gone, `partita.launcher.peers`), or fewer than MIN nodes until the join timeout. Another
# node's exit status says only how that node left, and its line names it for the user. A node
# that ends after node 0 succeeded was not in the final round (the agents of a round leave
# through torch's exit barrier together), so it cannot undo the result.
_GOES_ON = (
    "the other nodes go on without it (elastic: they restart at the new size if --max_restarts "
    "allows; node 0, the rendezvous host, decides the job's status)"
)
_AFTER_HOST = "node 0, the rendezvous host, had already finished the job"


def _start(node: NodeCommand) -> subprocess.Popen[str]:
    """Starts ``node``'s ssh with its script on stdin, which then stays open as the node's
    line (`partita.launcher.lifeline`) until the node ends or is stopped."""
    proc = subprocess.Popen(node.argv, stdin=subprocess.PIPE, text=True)
    assert proc.stdin is not None
    # An ssh that fails at once (an unreachable host) may be gone before the script is written:
    # its exit status is reported when it is polled.
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.write(node.script)
        proc.stdin.flush()
    return proc
