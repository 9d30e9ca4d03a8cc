"""The ``partita`` command: launch a training script on this node, or run a subcommand.

``partita [launcher flags] script.py [script args...]`` starts one worker per GPU (or
``--num_procs`` CPU workers) through torchrun's elastic agent; the flags follow DeepSpeed's
``deepspeed`` launcher, so existing command lines keep working. Multi-node jobs either run
``partita`` once on every node with ``--node_rank`` and ``--master_addr`` and either
``--num_nodes`` or DeepSpeed's ``--hostfile H --no_ssh`` (the hostfile gives the world, node K
runs host K's slots), or name the nodes in a ``--hostfile`` and let partita start that
per-node command on each over ssh (`partita.launcher.multinode`), or through ``--launcher
pdsh|openmpi|mpich|slurm``, the scheduler's own tool (`partita.launcher.backends`); a hostfile
of one host runs here unless ``--force_multi``, as DeepSpeed's does. ``--nnodes MIN:MAX``
(torchrun's spelling) makes the job elastic: torch's dynamic c10d rendezvous admits MIN to MAX
nodes and, with ``--max_restarts``, restarts the workers at the new size when a node dies or
joins; every agent still gets a distinct ``--node_rank`` (0 hosts the rendezvous store). With a
``--hostfile`` the fan-out starts up to MAX hosts, keeps the others running when a node other
than 0 ends, and returns node 0's status.

If the first argument names a subcommand in ``SUBCOMMANDS`` it runs that instead. Nothing here
imports torch at module level, so ``partita --help`` answers quickly.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import importlib
import os
import shlex
import shutil
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from partita.launcher import lifeline
from partita.launcher.launch import (
    DEFAULT_MASTER_PORT,
    LaunchError,
    LaunchOptions,
    launch,
)

# launch.py imports torch only inside its functions, so this import keeps --help fast.
from partita.platform import env

if TYPE_CHECKING:
    from partita.launcher import backends

__all__ = ["SUBCOMMANDS", "build_parser", "main", "parse_launch_args"]

#: Subcommand name -> ``"module:function"``; the function takes the remaining argv and returns
#: an exit status. Loaded only when used. A script whose name equals a subcommand is launched
#: by giving its path (``partita ./export``).
SUBCOMMANDS: dict[str, str] = {
    "estimate": "partita.estimate.cli:estimate_main",
    "export": "partita.checkpoint.export:main",
    "generate": "partita.inference.cli:main",
    "plan": "partita.estimate.cli:plan_main",
}

# DeepSpeed launcher flags partita recognises but does not implement, with what to do instead;
# a clear refusal beats argparse's "unrecognized arguments" or a silently ignored flag.
_ELASTIC = "use torchrun's spelling --nnodes MIN:MAX (and --max_restarts)"
_SLURM = "Slurm launcher option; pass srun's own flag in --launcher_args"
_UNSUPPORTED: dict[tuple[str, ...], str] = {
    ("--autotuning",): "partita has no autotuner",
    ("--elastic_training",): _ELASTIC,
    ("--min_elastic_nodes",): _ELASTIC,
    ("--max_elastic_nodes",): _ELASTIC,
    ("--comment",): _SLURM,
    ("--account",): _SLURM,
}

#: Where ``--save_pid`` writes ``<pid>.deepspeed``: DeepSpeed's fixed place, where programs
#: written for DeepSpeed look.
PID_FILE_DIR = "/tmp"

#: ``--launcher`` values: partita's own ssh fan-out, and the schedulers' tools
#: (`partita.launcher.backends`). DeepSpeed's others are refused with a reason.
LAUNCHERS = ("ssh", "pdsh", "openmpi", "mpich", "slurm")
_REFUSED_LAUNCHERS = {
    "mvapich": "use --launcher mpich (MVAPICH's mpirun takes MPICH's flags) or openmpi",
    "impi": "use --launcher mpich (Intel MPI's mpirun takes MPICH's flags)",
}


class _Unsupported(argparse.Action):
    """Fails the parse with the reason a DeepSpeed flag is not supported."""

    def __init__(self, *args: Any, reason: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reason = reason

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        parser.error(f"{option_string} is not supported by partita: {self.reason}")


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in some messages
    return parse


def _port(text: str) -> int:
    value = _int_at_least(1)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [1, 65535], got {value}")
    return value


def _node_range(text: str) -> tuple[int, int]:
    low, colon, high = text.partition(":")
    try:
        bounds = (int(low), int(high)) if colon else (int(low), int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K or MIN:MAX, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"needs 1 <= MIN <= MAX, got {text!r}")
    return bounds


_RDZV_KEYS = (
    "last_call_timeout",
    "join_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "read_timeout",
    "timeout",
)


def _rdzv_conf(text: str) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in filter(None, text.split(",")):
        key, equals, value = item.partition("=")
        if not equals or key not in _RDZV_KEYS or not value.isdigit():
            raise argparse.ArgumentTypeError(
                f"expected KEY=SECONDS with KEY one of {', '.join(_RDZV_KEYS)}, got {item!r}"
            )
        pairs.append((key, value))
    return tuple(pairs)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds (0 disables it), got {text}")
    return value


def _epilog() -> str:
    lines = [
        "Workers get --local_rank=<N> as their first argument (unless --no_local_rank) and the",
        "env vars RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and",
        f"{env.ACCELERATOR.name}=cpu|cuda (the device this launch is for).",
        "",
        *textwrap.wrap(
            "DeepSpeed flags refused with a reason: "
            + ", ".join(names[-1] for names in _UNSUPPORTED),
            width=88,
        ),
    ]
    if SUBCOMMANDS:
        lines += ["", "subcommands (partita <name> --help): " + ", ".join(sorted(SUBCOMMANDS))]
    return "\n".join(lines)


def _add_node_flags(parser: argparse.ArgumentParser) -> None:
    nodes = parser.add_argument_group("multi-node (run partita on every node)")
    nodes.add_argument(
        "--num_nodes",
        type=_int_at_least(1),
        metavar="K",
        help="number of nodes in the job (default: 1; with --hostfile: its first K hosts, "
        "default all)",
    )
    nodes.add_argument(
        "--nnodes",
        type=_node_range,
        metavar="K|MIN:MAX",
        help="torchrun's spelling: K as --num_nodes K; MIN:MAX runs elastic (torch's c10d "
        "rendezvous) on MIN to MAX nodes, restarting at the new size after a node fails or "
        "joins (with --max_restarts); --node_rank 0 hosts the rendezvous (with --hostfile: "
        "the first of up to MAX hosts, whose exit is the job's)",
    )
    nodes.add_argument(
        "--node_rank",
        type=_int_at_least(0),
        metavar="R",
        help="this node's index in [0, K); required when K > 1",
    )
    nodes.add_argument(
        "--master_addr",
        metavar="ADDR",
        help="address of node 0; required when K > 1 (default: 127.0.0.1)",
    )
    nodes.add_argument(
        "--master_port",
        type=_port,
        metavar="PORT",
        help=f"rendezvous port on node 0 (default: a free port; {DEFAULT_MASTER_PORT} when K > 1)",
    )
    nodes.add_argument(
        "--node_addr",
        metavar="ADDR",
        help="this node's address: its workers' gloo/NCCL sockets listen on the interface "
        "carrying it (default on node 0: the store's address)",
    )
    nodes.add_argument(
        "--rdzv_conf",
        type=_rdzv_conf,
        default=(),
        metavar="K=V,...",
        help="rendezvous settings as torchrun's --rdzv-conf (last_call_timeout, "
        "keep_alive_interval, keep_alive_max_attempt, join_timeout)",
    )
    nodes.add_argument(
        "--bind_addr",
        metavar="ADDR",
        help="address node 0's rendezvous store listens on (default: the address --master_addr "
        "resolves to; 0.0.0.0 or :: for every interface)",
    )


def _add_hostfile_flags(parser: argparse.ArgumentParser) -> None:
    hosts = parser.add_argument_group("multi-node from a hostfile")
    hosts.add_argument(
        "-H",
        "--hostfile",
        metavar="FILE",
        help="hosts to run on, one 'HOST slots=N' line each (DeepSpeed's format), node ranks "
        "in file order; partita starts each (--launcher), or with --no_ssh runs host "
        "--node_rank's slots here",
    )
    filters = hosts.add_mutually_exclusive_group()
    filters.add_argument(
        "-i",
        "--include",
        metavar="SPEC",
        help="use only these hosts/slots of the hostfile: HOST[:SLOT,...][@HOST...]",
    )
    filters.add_argument(
        "-e", "--exclude", metavar="SPEC", help="use all but these hosts/slots (same syntax)"
    )
    hosts.add_argument(
        "--launcher",
        type=str.lower,
        metavar="NAME",
        help="how the hosts are started: ssh (default: partita's own fan-out), pdsh, openmpi "
        "(mpirun), mpich (mpirun), slurm (srun)",
    )
    hosts.add_argument(
        "--launcher_args",
        default="",
        metavar="'ARGS'",
        help="extra arguments for the launcher's command (ssh, pdsh, mpirun, srun), one quoted "
        "string split as a shell would",
    )
    hosts.add_argument(
        "--force_multi",
        action="store_true",
        help="start a hostfile job through the launcher even when it selects one host (which "
        "otherwise runs here, as DeepSpeed's does)",
    )
    hosts.add_argument(
        "--ssh_port",
        type=_port,
        metavar="PORT",
        help="port of the hosts' sshd (ssh fan-out and pdsh)",
    )
    hosts.add_argument(
        "--no_ssh_check",
        action="store_true",
        help="accepted: partita does not probe ssh first (ssh runs with BatchMode=yes)",
    )


def _add_worker_flags(parser: argparse.ArgumentParser) -> None:
    workers = parser.add_argument_group("workers")
    workers.add_argument(
        "--bind_cores_to_rank",
        action="store_true",
        help="run each worker on its own share of the node's cores (one per physical core, "
        "split evenly in local-rank order), OMP_NUM_THREADS that share's size",
    )
    workers.add_argument(
        "--bind_core_list",
        metavar="LIST",
        help="the cores --bind_cores_to_rank shares out, e.g. 0-3,8,10-11",
    )
    workers.add_argument(
        "--enable_each_rank_log",
        metavar="DIR",
        help="write each worker's stdout and stderr to DIR/<YYYYmmddHHMMSS>_rank<R>.log",
    )
    workers.add_argument(
        "--save_pid",
        action="store_true",
        help="write this process's pid to /tmp/<pid>.deepspeed while the job runs (what a "
        "program that started partita signals to stop the job)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The launcher's argument parser (flags named as in DeepSpeed's ``deepspeed`` command)."""
    parser = argparse.ArgumentParser(
        prog="partita",
        description="Launch a partita/DeepSpeed training script on this node.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # No prefix matching: a typo must not silently select a different flag.
        allow_abbrev=False,
    )
    procs = parser.add_mutually_exclusive_group()
    procs.add_argument(
        "--num_gpus",
        "--num_accelerators",
        type=_int_at_least(1),
        metavar="N",
        help="GPU workers per node, on GPUs 0..N-1 (default: all visible GPUs, else 1 CPU worker)",
    )
    procs.add_argument(
        "--num_procs",
        type=_int_at_least(1),
        metavar="N",
        help=f"CPU workers per node (gloo); sets {env.ACCELERATOR.name}=cpu even if GPUs are present",
    )
    _add_node_flags(parser)
    _add_hostfile_flags(parser)
    _add_job_flags(parser)
    _add_worker_flags(parser)
    parser.add_argument(
        "--module", action="store_true", help="run the script as a module, like 'python -m'"
    )
    parser.add_argument(
        "--no_python",
        action="store_true",
        help="execute the script directly instead of with python",
    )
    parser.add_argument(
        "--no_local_rank", action="store_true", help="do not pass --local_rank=<N> to the script"
    )
    # Set by the --hostfile fan-out on each node's agent: ssh's standard input, whose end
    # stops the node (`partita.launcher.lifeline`). Not for users.
    parser.add_argument("--lifeline_fd", type=_int_at_least(0), help=argparse.SUPPRESS)
    parser.add_argument(
        "--no_ssh",
        action="store_true",
        help="DeepSpeed's per-node mode: run only this node's part of the job (--node_rank K), "
        "a scheduler or you starting partita on every node; with --hostfile the file gives "
        "the world (hosts in node-rank order, their slots as workers)",
    )
    for names, reason in _UNSUPPORTED.items():
        # Listed once in the epilog: a help line each would bury the flags that work.
        # nargs="?" so the refusal fires whether or not the user gave the flag a value.
        parser.add_argument(
            *names, nargs="?", action=_Unsupported, reason=reason, help=argparse.SUPPRESS
        )
    parser.add_argument("script", help="training script (a module with --module)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def _add_job_flags(parser: argparse.ArgumentParser) -> None:
    """Flags of the job as a whole: restarts and the hang bound."""
    parser.add_argument(
        "--max_restarts",
        type=_int_at_least(0),
        default=0,
        metavar="M",
        help="restart all workers up to M times after a failure (default: 0)",
    )
    parser.add_argument(
        "--hang_timeout",
        type=_seconds,
        metavar="S",
        help="end the job when a rank makes no progress for S seconds: its heartbeat stops, or "
        f"it leaves the others waiting in a collective (default: ${env.HANG_TIMEOUT.name}, else "
        f"{env.DEFAULT_HANG_TIMEOUT:g}; 0 disables)",
    )


def _check_script(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    if ns.module and ns.no_python:
        parser.error("--module and --no_python cannot be used together")
    if ns.no_python:
        if shutil.which(ns.script) is None:
            parser.error(f"executable {ns.script!r} not found (--no_python runs it directly)")
    elif not ns.module and not os.path.isfile(ns.script):
        parser.error(f"script {ns.script!r} not found (working directory: {os.getcwd()})")


def _check_nodes(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    ns.min_nodes = None
    if ns.nnodes is not None:
        if ns.num_nodes is not None:
            parser.error("--nnodes and --num_nodes cannot be used together (one node count)")
        low, ns.num_nodes = ns.nnodes
        if low != ns.num_nodes:
            ns.min_nodes = low
    _check_launcher(parser, ns)
    if ns.hostfile is not None:
        _check_hostfile_job(parser, ns)
        return
    if ns.include is not None or ns.exclude is not None:
        parser.error("--include/--exclude select hosts of a --hostfile; give one")
    ns.num_nodes = 1 if ns.num_nodes is None else ns.num_nodes
    if ns.num_nodes > 1:
        missing = [flag for flag in ("node_rank", "master_addr") if getattr(ns, flag) is None]
        if missing:
            flags = " and ".join(f"--{flag}" for flag in missing)
            parser.error(f"--num_nodes {ns.num_nodes} needs {flags} (run partita on each node)")
    node_rank = 0 if ns.node_rank is None else ns.node_rank
    if node_rank >= ns.num_nodes:
        parser.error(
            f"--node_rank must be in [0, {ns.num_nodes}) for --num_nodes {ns.num_nodes}, got {node_rank}"
        )


def _check_launcher(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """``--launcher`` and the flags that only mean something with a hostfile job."""
    if ns.launcher is not None:
        if ns.launcher in _REFUSED_LAUNCHERS:
            parser.error(
                f"--launcher {ns.launcher} is not supported by partita: "
                f"{_REFUSED_LAUNCHERS[ns.launcher]}"
            )
        if ns.launcher not in LAUNCHERS:
            parser.error(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {ns.launcher!r}")
    try:
        ns.launcher_argv = tuple(shlex.split(ns.launcher_args))
    except ValueError as err:
        parser.error(f"--launcher_args {ns.launcher_args!r}: {err}")
    if ns.bind_core_list is not None and not ns.bind_cores_to_rank:
        parser.error("--bind_core_list lists the cores for --bind_cores_to_rank; give that too")
    started_here = ns.hostfile is None or ns.no_ssh
    given = [
        flag
        for flag, value in (
            ("--launcher", ns.launcher),
            ("--launcher_args", ns.launcher_argv),
            ("--force_multi", ns.force_multi),
            ("--ssh_port", ns.ssh_port),
        )
        if value
    ]
    if given and started_here:
        why = "--no_ssh runs this node only" if ns.hostfile else "no --hostfile"
        parser.error(f"{given[0]} chooses how the hosts of a --hostfile are started ({why})")


def _check_hostfile_job(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    if ns.no_ssh:
        if ns.node_rank is None:
            parser.error(
                "--hostfile with --no_ssh starts this node's part of the job: give its "
                "--node_rank (its host's index in the hostfile, after any filters)"
            )
        if ns.min_nodes is not None:
            parser.error(
                "--nnodes MIN:MAX cannot be used with --hostfile --no_ssh (the hostfile fixes "
                "the nodes); start each node with --nnodes and no --hostfile"
            )
        return
    given = [f"--{f}" for f in ("node_rank", "node_addr", "bind_addr") if getattr(ns, f)]
    if given:
        parser.error(
            f"{given[0]} cannot be used with --hostfile unless --no_ssh (the fan-out sets it "
            "per node)"
        )
    launcher = ns.launcher or "ssh"
    if ns.min_nodes is not None and launcher != "ssh":
        parser.error(f"--nnodes MIN:MAX (elastic) runs through the ssh fan-out, not {launcher}")
    if launcher in ("openmpi", "mpich", "slurm"):
        if ns.ssh_port is not None:
            parser.error(
                f"--ssh_port is for ssh and pdsh; --launcher {launcher} reaches the hosts its "
                "own way (its flags go in --launcher_args)"
            )
        for flag in ("bind_cores_to_rank", "enable_each_rank_log"):
            if getattr(ns, flag):
                parser.error(
                    f"--{flag} cannot be used with --launcher {launcher}: its ranks are the "
                    f"tool's (pass its own binding or output flags in --launcher_args)"
                )


def parse_launch_args(argv: Sequence[str]) -> LaunchOptions:
    """Parse and validate launcher arguments; exits with status 2 and a message when invalid."""
    return _options(_parse(argv))


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = build_parser()
    ns = parser.parse_args(list(argv))
    _check_script(parser, ns)
    _check_nodes(parser, ns)
    return ns


def _options(ns: argparse.Namespace) -> LaunchOptions:
    return LaunchOptions(
        script=ns.script,
        script_args=tuple(ns.script_args),
        num_gpus=ns.num_gpus,
        num_procs=ns.num_procs,
        num_nodes=ns.num_nodes or 1,
        node_rank=0 if ns.node_rank is None else ns.node_rank,
        master_addr="127.0.0.1" if ns.master_addr is None else ns.master_addr,
        master_port=ns.master_port,
        bind_addr=ns.bind_addr,
        hang_timeout=ns.hang_timeout,
        max_restarts=ns.max_restarts,
        module=ns.module,
        no_python=ns.no_python,
        no_local_rank=ns.no_local_rank,
        node_addr=ns.node_addr,
        min_nodes=ns.min_nodes,
        rdzv_conf=ns.rdzv_conf,
        bind_cores_to_rank=ns.bind_cores_to_rank,
        bind_core_list=ns.bind_core_list,
        rank_log_dir=ns.enable_each_rank_log,
    )


def _run_subcommand(name: str, argv: list[str]) -> int:
    module_name, _, func_name = SUBCOMMANDS[name].partition(":")
    func = getattr(importlib.import_module(module_name), func_name)
    status = func(argv)
    return 0 if status is None else int(status)


def _launch_hostfile(ns: argparse.Namespace) -> int:
    """Resolves the hosts (every refusal before anything starts), then runs this node's part
    (``--no_ssh``, or a job of one host), or starts every host: ssh fan-out or ``--launcher``."""
    from partita.launcher import hostfile, multinode

    try:
        with open(ns.hostfile, encoding="utf-8") as handle:
            pool = hostfile.parse_hostfile(handle, ns.hostfile)
    except OSError as err:
        raise LaunchError(f"cannot read hostfile {ns.hostfile!r}: {err.strerror}") from None
    per_node = ns.num_procs if ns.num_procs is not None else ns.num_gpus
    flag = "--num_procs" if ns.num_procs is not None else "--num_gpus"
    resources = hostfile.resolve_resources(
        pool, ns.include, ns.exclude, ns.num_nodes, per_node, flag, ns.min_nodes
    )
    cwd = os.getcwd()
    job = None
    if ns.launcher not in (None, "ssh"):
        # Asked before choosing to run here: a filter the tool cannot express is refused even
        # when it leaves one host (DeepSpeed's runner asks its backend at the same point).
        job = _backend_job(ns, pool, resources, cwd)
    if ns.no_ssh:
        return _launch_node_of(ns, resources, ns.node_rank)
    if len(resources) == 1 and not ns.force_multi and ns.min_nodes is None:
        return _launch_node_of(ns, resources, 0)  # as DeepSpeed: one host runs here
    if job is not None:
        from partita.launcher import backends

        backends.find_tools(job.launcher, os.environ)
        argv, extra_env = backends.build_command(job, os.environ)
        return backends.run(argv, extra_env)
    exports = multinode.exported_env(os.environ, multinode.deepspeed_env_files(os.environ, cwd))
    ssh = multinode.find_ssh(os.environ)
    plan = multinode.fanout_plan(
        resources,
        _options(ns),
        exports,
        cwd,
        master_addr=ns.master_addr,
        ssh=ssh,
        gpus=ns.num_procs is None,
        ssh_args=_ssh_port_args(ns) + ns.launcher_argv,
    )
    return multinode.run_fanout(plan, elastic=ns.min_nodes is not None)


def _ssh_port_args(ns: argparse.Namespace) -> tuple[str, ...]:
    return () if ns.ssh_port is None else ("-p", str(ns.ssh_port))


def _launch_node_of(ns: argparse.Namespace, resources: dict[str, list[int]], rank: int) -> int:
    """Node ``rank`` of the hostfile job, here: its slots as workers (GPUs: those ids, in
    ``CUDA_VISIBLE_DEVICES``; CPU processes under ``--num_procs``, without a GPU, or with
    ``PARTITA_ACCELERATOR``/``DS_ACCELERATOR`` ``cpu``), node 0
    (or ``--master_addr``) hosting the rendezvous, as DeepSpeed's per-node launch does."""
    from partita.launcher import launch as launch_module
    from partita.launcher.multinode import is_ip

    hosts = list(resources)
    if not 0 <= rank < len(hosts):
        raise LaunchError(
            f"--node_rank {rank} is not a node of this job: the hostfile selects {len(hosts)} "
            f"host(s) ({', '.join(hosts)}), node ranks 0..{len(hosts) - 1}"
        )
    host, slots = hosts[rank], resources[hosts[rank]]
    num_gpus: int | None = None
    num_procs: int | None = len(slots)
    cpu = env.forced_accelerator() == "cpu"  # PARTITA_ACCELERATOR or DS_ACCELERATOR
    if ns.num_procs is None and (
        ns.num_gpus is not None or (not cpu and launch_module.visible_gpu_count() > 0)
    ):
        num_gpus, num_procs = len(slots), None
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
    node_addr = ns.node_addr
    if node_addr is None and len(hosts) > 1 and is_ip(host):
        node_addr = host  # its workers' sockets go on the interface the hostfile named
    master_addr = ns.master_addr or (hosts[0] if len(hosts) > 1 else "127.0.0.1")
    options = dataclasses.replace(
        _options(ns),
        num_gpus=num_gpus,
        num_procs=num_procs,
        num_nodes=len(hosts),
        node_rank=rank,
        master_addr=master_addr,
        node_addr=node_addr,
    )
    return launch(options)


def _backend_job(
    ns: argparse.Namespace, pool: dict[str, int], resources: dict[str, list[int]], cwd: str
) -> backends.Job:
    """The ``--launcher`` job, checked (`backends.check_request`)."""
    from partita.launcher import backends, multinode

    exports = multinode.exported_env(os.environ, multinode.deepspeed_env_files(os.environ, cwd))
    job = backends.Job(
        launcher=ns.launcher,
        hostfile=ns.hostfile,
        pool=pool,
        resources=resources,
        options=_options(ns),
        master_addr=ns.master_addr or next(iter(resources)),
        master_port=ns.master_port or DEFAULT_MASTER_PORT,
        launcher_args=ns.launcher_argv,
        ssh_port=ns.ssh_port,
        exports=exports,
        cwd=cwd,
        filtered=ns.include is not None or ns.exclude is not None,
        num_nodes=ns.num_nodes,
        per_node=ns.num_procs if ns.num_procs is not None else ns.num_gpus,
        gpus=ns.num_procs is None,
    )
    backends.check_request(job)
    return job


@contextlib.contextmanager
def _pid_file(save: bool) -> Iterator[None]:
    """``--save_pid``: ``/tmp/<pid>.deepspeed`` holds this process's pid while the job runs
    (DeepSpeed's file, named by the pid of the process its caller started: this one)."""
    if not save:
        yield
        return
    path = Path(PID_FILE_DIR) / f"{os.getpid()}.deepspeed"
    part = path.with_suffix(".deepspeed.part")
    part.write_text(str(os.getpid()))
    part.replace(path)  # a reader never sees half a pid
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``partita`` command; returns the process exit status."""
    # A crash of the agent itself (a signal in native code: torch's store, the elastic agent)
    # prints every thread's stack instead of ending the job with a bare status (-11 seen in CI).
    if not faulthandler.is_enabled():
        faulthandler.enable()
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        return _run_subcommand(args[0], args[1:])
    ns = _parse(args)
    try:
        with _pid_file(ns.save_pid):
            if ns.hostfile is not None:
                return _launch_hostfile(ns)
            if ns.lifeline_fd is not None:
                lifeline.watch(ns.lifeline_fd)
            return launch(_options(ns))
    except LaunchError as err:
        print(f"partita: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
