"""Turn validated launcher options into a torchelastic launch and run it.

partita does not manage processes itself: ``torch.distributed.launcher.api.elastic_launch``
(the engine behind ``torchrun``) starts the workers, watches them, restarts them up to
``max_restarts`` times and, when one fails, stops the others and raises ``ChildFailedError``
with a per-rank summary. This module only decides *what* to launch:

- how many workers per node and on which device (``plan_workers``);
- the command line of each worker (``worker_command``), DeepSpeed style: ``python -u script.py
  --local_rank=<N> <script args>``;
- the environment the workers inherit (``worker_env``): ``PARTITA_ACCELERATOR`` is ``cpu`` or
  ``cuda`` so the engine knows which device (and so which process-group backend, gloo or NCCL)
  this launch meant; torchrun's agent adds ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``.

It also keeps the job to itself (issue 13):

- network: node 0 binds the rendezvous store's socket on the address the launch names (a
  single-node job: 127.0.0.1; see `partita.launcher.rendezvous`), a single-node job's
  gloo/NCCL sockets use the loopback interface (``loopback_env``), and a multi-node job's the
  interface carrying the node's own address (``node_interface_env``: ``--node_addr``, or node
  0's store address);
- nodes: each agent of a multi-node job beats in the rendezvous store, so when a worker fails
  because a peer vanished the survivors name the node that is gone (`partita.launcher.peers`);
  ``--nnodes MIN:MAX`` selects torch's dynamic rendezvous, whose restarts resume at the new
  world size;
- processes: every worker starts through `partita.launcher.worker_exec`, so it dies with the
  launcher even when the launcher is SIGKILLed; SIGTERM/SIGINT stop the job through the agent;
- failures: a Python worker runs its script inside that shim, which records the exception that
  ended it, so a failed job prints a user error's message once (exit 2) or the first failing
  rank's traceback once (exit 1), not every rank's and torch's summary block
  (`partita.launcher.failures`; ``PARTITA_DEBUG=1`` prints everything);
- hangs: `partita.launcher.watchdog` ends a job whose ranks stopped making progress for
  ``--hang_timeout`` seconds, naming the rank and each rank's last collective.

torch is imported only inside functions so that ``partita --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from partita.launcher import failures
from partita.launcher.worker_exec import RUN_MODULE, RUN_PATH
from partita.platform import env as env_vars

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig

    from partita.launcher.peers import AgentBeat
    from partita.launcher.watchdog import Watchdog

__all__ = [
    "DEFAULT_MASTER_PORT",
    "LaunchError",
    "LaunchOptions",
    "WorkerPlan",
    "bound_cores",
    "build_launch_config",
    "find_free_port",
    "launch",
    "listen_socket",
    "loopback_env",
    "plan_workers",
    "rank_setup_args",
    "store_bind_address",
    "visible_gpu_count",
    "with_parent_death_signal",
    "worker_command",
    "worker_entry",
    "worker_env",
]


#: Port used for multi-node launches when ``--master_port`` is not given. Every node must agree
#: on it, so it cannot be picked at random; 29500 is the torch and DeepSpeed default.
DEFAULT_MASTER_PORT = 29500

# The agent substitutes this placeholder in worker arguments with the worker's local rank
# (torch.distributed.elastic.utils.api.macros.local_rank, spelled out to avoid a torch import).
_LOCAL_RANK_MACRO = "${local_rank}"

# Where workers record their failures, under the launch's log directory (the agent's root).
_FAILURE_DIR = "failures"

# Static rendezvous keys its store entries by run id, so all nodes of one job must use the same
# one; a job is already identified by its master address and port.
_RUN_ID = "partita"


class LaunchError(Exception):
    """A launch request that cannot be satisfied on this machine (the message says why)."""


@dataclass(frozen=True)
class LaunchOptions:
    """What the user asked for; ``partita.launcher.cli`` builds and validates it.

    Attributes:
        script: training script path, module name (``module``) or executable (``no_python``).
        script_args: arguments passed to the script unchanged, after ``--local_rank``.
        num_gpus: GPU workers per node (``None``: all visible GPUs, or CPU if there are none).
        num_procs: CPU workers per node; excludes ``num_gpus``.
        num_nodes: nodes in the job; ``partita`` runs once on each.
        node_rank: this node's index in ``[0, num_nodes)``.
        master_addr: address of node 0, where the rendezvous store listens.
        master_port: port of that store (``None``: a free port, or 29500 for multi-node).
        max_restarts: times the agent restarts the whole worker group after a failure.
        module: run ``python -m script``.
        no_python: execute ``script`` directly, not through the Python interpreter.
        no_local_rank: do not pass ``--local_rank=<N>`` to the script.
        monitor_interval: seconds between the agent's worker health checks.
        bind_addr: address node 0's store listens on (``None``: what ``master_addr`` names).
        hang_timeout: seconds without progress before the job counts as hung (``None``: from
            ``PARTITA_HANG_TIMEOUT``, else 240; 0 disables the watchdog).
        node_addr: this node's address, where its workers' gloo/NCCL sockets listen (``None``:
            node 0 uses the store's bind address; other nodes let gloo/NCCL choose).
        min_nodes: elastic membership (``--nnodes MIN:MAX``): the job runs on ``min_nodes`` to
            ``num_nodes`` nodes through torch's dynamic c10d rendezvous (``None``: static).
        rdzv_conf: extra rendezvous settings (``last_call_timeout``, ``keep_alive_interval``...
            as torchrun's ``--rdzv-conf`` takes them).
        bind_cores_to_rank: run each worker on its own share of this node's cores, with
            ``OMP_NUM_THREADS`` that share's size (`partita.launcher.rank_setup`).
        bind_core_list: the cores to share out (``1,3-5``; ``None``: one per physical core).
        rank_log_dir: write each worker's stdout and stderr to
            ``<dir>/<YYYYmmddHHMMSS>_rank<R>.log`` instead of the launcher's (``None``: don't).
    """

    script: str
    script_args: tuple[str, ...] = ()
    num_gpus: int | None = None
    num_procs: int | None = None
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    max_restarts: int = 0
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    monitor_interval: float = 0.1
    bind_addr: str | None = None
    hang_timeout: float | None = None
    node_addr: str | None = None
    min_nodes: int | None = None
    rdzv_conf: tuple[tuple[str, str], ...] = ()
    bind_cores_to_rank: bool = False
    bind_core_list: str | None = None
    rank_log_dir: str | None = None


@dataclass(frozen=True)
class WorkerPlan:
    """Workers on this node: their device kind and how many."""

    device: Literal["cpu", "cuda"]
    nproc_per_node: int


def visible_gpu_count() -> int:
    """Number of CUDA devices this process can see (0 when CUDA is unavailable)."""
    import torch

    # device_count() answers from NVML where it can, so the launcher never creates a CUDA
    # context of its own before the workers start.
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan_workers(num_gpus: int | None, num_procs: int | None, visible_gpus: int) -> WorkerPlan:
    """Decide the device and the number of workers per node.

    ``num_procs`` always means CPU workers; ``num_gpus`` asks for GPU workers and must not
    exceed ``visible_gpus``; with neither, use every visible GPU, or one CPU worker.
    """
    if num_procs is not None:
        return WorkerPlan("cpu", num_procs)
    if num_gpus is not None:
        if visible_gpus == 0:
            raise LaunchError(
                f"--num_gpus {num_gpus} asks for GPU workers, but no CUDA device is visible "
                f"(torch.cuda.is_available() is False); use --num_procs {num_gpus} to run "
                f"{num_gpus} CPU processes"
            )
        if num_gpus > visible_gpus:
            raise LaunchError(
                f"--num_gpus {num_gpus} is more than the {visible_gpus} CUDA device(s) visible "
                f"on this node (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
            )
        return WorkerPlan("cuda", num_gpus)
    if visible_gpus > 0:
        return WorkerPlan("cuda", visible_gpus)
    return WorkerPlan("cpu", 1)


def _escape_macro(arg: str) -> str:
    # The agent runs every argument through string.Template.safe_substitute to fill in
    # ${local_rank}; doubling '$' makes user arguments come out exactly as typed.
    return arg.replace("$", "$$")


def _script_args(options: LaunchOptions) -> list[str]:
    args = [] if options.no_local_rank else [f"--local_rank={_LOCAL_RANK_MACRO}"]
    return args + [_escape_macro(arg) for arg in options.script_args]


def worker_command(options: LaunchOptions) -> tuple[str, list[str]]:
    """The worker's executable and its arguments (``${local_rank}`` filled in by the agent), as
    the user would type them; `worker_entry` is what the agent starts."""
    if options.no_python:
        return options.script, _script_args(options)
    # -u: unbuffered output, so worker prints interleave in real time and are not lost
    # when the agent kills a worker.
    module = ["-m"] if options.module else []
    return sys.executable, ["-u", *module, _escape_macro(options.script), *_script_args(options)]


def worker_entry(options: LaunchOptions, setup: Sequence[str] = ()) -> tuple[str, list[str]]:
    """What the agent starts for each worker: `worker_command` through
    `partita.launcher.worker_exec`, which ties the worker's life to the launcher's and, for a
    Python script, runs it in its own interpreter so that it can report how it failed. With
    ``setup`` (`rank_setup_args`) `partita.launcher.rank_setup` runs first, in the worker."""
    if options.no_python:
        exec_argv = [_escape_macro(options.script), *_script_args(options)]
    else:
        mode = RUN_MODULE if options.module else RUN_PATH
        exec_argv = [mode, _escape_macro(options.script), *_script_args(options)]
    if setup:
        shim = ["-u", "-m", "partita.launcher.rank_setup", *map(_escape_macro, setup), "--"]
        return sys.executable, [*shim, *exec_argv]
    if options.no_python:
        return sys.executable, ["-m", "partita.launcher.worker_exec", *exec_argv]
    return sys.executable, ["-u", "-m", "partita.launcher.worker_exec", *exec_argv]


def bound_cores(bind_core_list: str | None, ranks: int) -> list[int]:
    """The cores ``--bind_cores_to_rank`` shares out over ``ranks`` workers of this node:
    ``bind_core_list``'s, else one per physical core (`rank_setup.physical_cores`).

    Raises ``LaunchError`` for a bad list, a core this process may not run on, fewer cores
    than ranks, or ``KMP_AFFINITY`` set (Intel OpenMP would re-pin the threads; DeepSpeed
    refuses it too)."""
    from partita.launcher import rank_setup

    if "KMP_AFFINITY" in os.environ:
        raise LaunchError(
            "--bind_cores_to_rank: unset KMP_AFFINITY, which would override each rank's cores"
        )
    allowed = sorted(os.sched_getaffinity(0))
    if bind_core_list is None:
        cores = rank_setup.physical_cores()
    else:
        try:
            cores = rank_setup.parse_core_list(bind_core_list)
        except ValueError as err:
            raise LaunchError(f"--bind_core_list: {err}") from None
        foreign = [core for core in cores if core not in allowed]
        if foreign:
            raise LaunchError(
                f"--bind_core_list names core(s) {rank_setup.format_core_list(foreign)} this "
                f"process may not run on (allowed: {rank_setup.format_core_list(allowed)})"
            )
    try:
        rank_setup.cores_for_rank(cores, ranks, 0)
    except ValueError as err:
        raise LaunchError(f"--bind_cores_to_rank: {err}") from None
    return cores


def rank_setup_args(options: LaunchOptions, ranks: int) -> list[str]:
    """`partita.launcher.rank_setup`'s flags for ``options`` on a node of ``ranks`` workers
    (empty when nothing is to be set up); creates the ``rank_log_dir``. Raises ``LaunchError``
    before anything starts when the cores cannot be shared out or the directory made."""
    from partita.launcher import rank_setup

    args: list[str] = []
    if options.bind_cores_to_rank:
        cores = bound_cores(options.bind_core_list, ranks)
        args += ["--cores", rank_setup.format_core_list(cores)]
    if options.rank_log_dir is not None:
        folder = Path(options.rank_log_dir)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise LaunchError(
                f"--enable_each_rank_log {options.rank_log_dir!r}: cannot make the directory "
                f"({err.strerror or err})"
            ) from None
        args += ["--log", str(folder.resolve() / time.strftime("%Y%m%d%H%M%S"))]
    return args


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def worker_env(plan: WorkerPlan, environ: Mapping[str, str]) -> dict[str, str]:
    """Variables to add to the launcher's environment, which every worker inherits."""
    env: dict[str, str] = {env_vars.ACCELERATOR.name: plan.device}
    # Under the partita launcher `import deepspeed` is partita (Hugging Face's Trainer and
    # Accelerate find it there); the start-up hook installed with the package reads this.
    env[env_vars.AS_DEEPSPEED.name] = "1"
    if "OMP_NUM_THREADS" not in environ:
        # Without a limit every worker starts one thread per core and they fight for the
        # cores; CPU workers share the cores, GPU workers get one each (torchrun's default).
        if plan.device == "cpu":
            env["OMP_NUM_THREADS"] = str(max(1, _usable_cpus() // plan.nproc_per_node))
        elif plan.nproc_per_node > 1:
            env["OMP_NUM_THREADS"] = "1"
    return env


def with_parent_death_signal(entrypoint: str, args: list[str]) -> tuple[str, list[str]]:
    """The worker command started through `partita.launcher.worker_exec`, which makes the
    worker die with the launcher and then execs ``entrypoint args``."""
    shim = ["-m", "partita.launcher.worker_exec", _escape_macro(entrypoint)]
    return sys.executable, [*shim, *args]


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of `host` that is free right now (the kernel's choice for a bind to port 0)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _is_ip(addr: str) -> bool:
    try:
        ipaddress.ip_address(addr.strip("[]").split("%")[0])
    except ValueError:
        return False
    return True


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return False


def store_bind_address(options: LaunchOptions) -> str:
    """The address node 0's rendezvous store listens on: ``bind_addr`` if given, else
    ``master_addr`` if it is an IP address (127.0.0.1 for a default single-node launch), else
    the address that host name resolves to here.

    Raises ``LaunchError`` when ``master_addr`` does not resolve, or, in a multi-node job, is a
    host name that resolves to a loopback address here, which the other nodes cannot reach (a
    hostname mapped to 127.0.1.1 in /etc/hosts is the common case).
    """
    if options.bind_addr is not None:
        return options.bind_addr
    if _is_ip(options.master_addr):
        return options.master_addr.strip("[]")  # an address the user typed is what they meant
    try:
        infos = socket.getaddrinfo(options.master_addr, None, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise LaunchError(
            f"--master_addr {options.master_addr!r} does not resolve: {err}"
        ) from None
    resolved = str(infos[0][4][0])
    if options.num_nodes > 1 and _is_loopback(resolved):
        raise LaunchError(
            f"--master_addr {options.master_addr!r} resolves to {resolved} on this node, which "
            f"the other {options.num_nodes - 1} node(s) cannot reach; pass the IP address they "
            "use (--master_addr <IP>), or the address to listen on (--bind_addr)"
        )
    return resolved


def listen_socket(addr: str, port: int) -> socket.socket:
    """A TCP socket listening on ``addr:port`` (port 0: the kernel picks) for the store.

    Raises ``LaunchError`` naming the address and port when the bind fails.
    """
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As TCPStore does: a port left in TIME_WAIT by the last job can be reused at once.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and addr in ("::", "[::]"):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # and IPv4 too
        sock.bind((addr.strip("[]"), port))
        sock.listen(socket.SOMAXCONN)
    except OSError as err:
        sock.close()
        raise LaunchError(
            f"cannot listen on {_endpoint(addr, port)} for the rendezvous store: "
            f"{err.strerror or err} (choose another --master_port, or the address to listen "
            "on with --bind_addr)"
        ) from None
    return sock


def loopback_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Variables that keep a single-node job's gloo and NCCL sockets on the loopback interface
    (gloo otherwise binds the address the hostname resolves to); a user's own value wins."""
    import psutil

    names = [
        name
        for name, addrs in psutil.net_if_addrs().items()
        if any(a.family == socket.AF_INET and _is_loopback(a.address) for a in addrs)
    ]
    if not names:
        return {}
    return {
        var: names[0] for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if var not in environ
    }


def interface_of(addr: str) -> str | None:
    """The name of the network interface that carries ``addr`` (an IP address, or a name
    resolved here): the one holding exactly that address, else for a loopback address the
    loopback interface (127.0.0.2 is local though only 127.0.0.1 is listed); ``None`` when no
    interface of this machine carries it."""
    import psutil

    try:
        ip = ipaddress.ip_address(
            socket.getaddrinfo(addr.strip("[]"), None, type=socket.SOCK_STREAM)[0][4][0]
        )
    except (socket.gaierror, ValueError):
        return None
    containing = None
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6) or not a.netmask:
                continue
            here = ipaddress.ip_address(a.address.split("%")[0])
            if here == ip:
                return name
            prefix = bin(int(ipaddress.ip_address(a.netmask))).count("1")
            network = ipaddress.ip_network((here, prefix), strict=False)
            # Only loopback answers for every address of its network (127.0.0.2 is local).
            if containing is None and ip.is_loopback and ip in network:
                containing = name
    return containing


def _node_address(options: LaunchOptions, bind_addr: str | None) -> str | None:
    """This node's address: ``--node_addr``, else node 0's store address if it names one."""
    if options.node_addr is not None:
        return options.node_addr
    if bind_addr is None or bind_addr.strip("[]") in ("0.0.0.0", "::"):
        return None
    return bind_addr


def _endpoint(addr: str, port: int) -> str:
    host = f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr
    return f"{host}:{port}"


def build_launch_config(
    options: LaunchOptions,
    plan: WorkerPlan,
    master_port: int,
    log_dir: str,
    listen_fd: int | None = None,
) -> LaunchConfig:
    """The torchelastic ``LaunchConfig`` for this node: static rendezvous at master_addr, whose
    store (node 0) serves the listening socket ``listen_fd``."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    from partita.launcher import rendezvous

    rendezvous.register()
    configs: dict[str, object] = dict(options.rdzv_conf)
    if options.min_nodes is None:
        configs["rank"] = options.node_rank
    if listen_fd is not None:
        configs["listen_fd"] = listen_fd
    return LaunchConfig(
        min_nodes=options.num_nodes if options.min_nodes is None else options.min_nodes,
        max_nodes=options.num_nodes,
        nproc_per_node=plan.nproc_per_node,
        # Workers keep the launcher's stdout/stderr; the log dir only holds error files.
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        run_id=_RUN_ID,
        rdzv_backend=rendezvous.BACKEND
        if options.min_nodes is None
        else rendezvous.ELASTIC_BACKEND,
        rdzv_endpoint=_endpoint(options.master_addr, master_port),
        rdzv_configs=configs,
        local_addr=options.node_addr,
        max_restarts=options.max_restarts,
        monitor_interval=options.monitor_interval,
    )


def _debug_headline(err: ChildFailedError, node_rank: int) -> str:
    rank, failure = err.get_first_failure()
    return (
        f"partita: rank {rank} (local_rank {failure.local_rank} on node {node_rank}) failed "
        f"first, exit code {failure.exitcode}; the other workers were stopped. Summary:"
    )


def _hang_timeout(options: LaunchOptions) -> float:
    if options.hang_timeout is not None:
        return options.hang_timeout
    try:
        return env_vars.hang_timeout()
    except ValueError as err:
        raise LaunchError(str(err)) from None


def _start_watchdog(directory: Path, timeout: float) -> Watchdog | None:
    """Starts the hang watchdog over ``directory`` and tells the workers to beat there."""
    from partita.launcher.watchdog import Watchdog, heartbeat_interval

    if timeout == 0:
        return None
    interval = heartbeat_interval(timeout)
    os.environ[env_vars.HEARTBEAT_DIR.name] = str(directory)
    os.environ[env_vars.HEARTBEAT_INTERVAL.name] = str(interval)
    watchdog = Watchdog(directory, timeout, poll=interval)
    watchdog.start()
    return watchdog


def _prepare_environment(
    options: LaunchOptions, plan: WorkerPlan, bind_addr: str | None, failure_dir: Path
) -> None:
    """What every worker inherits (the agent copies this process's environment)."""
    os.environ.update(worker_env(plan, os.environ))
    failure_dir.mkdir()
    os.environ[env_vars.FAILURE_DIR.name] = str(failure_dir)
    if options.num_nodes == 1 and bind_addr is not None and _is_loopback(bind_addr):
        os.environ.update(loopback_env(os.environ))
    elif options.num_nodes > 1:
        os.environ.update(node_interface_env(_node_address(options, bind_addr), os.environ))
    os.environ[env_vars.LAUNCHER_PID.name] = str(os.getpid())


def node_interface_env(node_addr: str | None, environ: Mapping[str, str]) -> dict[str, str]:
    """Variables that put a multi-node job's gloo and NCCL sockets on the interface carrying
    this node's address (otherwise gloo listens where the host name resolves, which may be an
    interface the user never named); a user's own value wins. Raises ``LaunchError`` when no
    interface here carries ``node_addr``."""
    if node_addr is None:
        return {}
    name = interface_of(node_addr)
    if name is None:
        raise LaunchError(
            f"no network interface of this node carries {node_addr!r} (--node_addr, or node 0's "
            "--master_addr): give this node's own address"
        )
    return {var: name for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if var not in environ}


def launch(options: LaunchOptions) -> int:
    """Start the workers of this node, wait for them, and return partita's exit status.

    Returns 0 when every worker succeeded; 2 when the first rank to fail stopped on a
    `PartitaUserError` (a config error: its message printed once), 1 when it failed otherwise
    or the job hung (after one line naming that rank; see `partita.launcher.failures`);
    128 + signal number when partita itself was interrupted. Raises ``LaunchError`` for
    requests this machine cannot satisfy.
    """
    plan = plan_workers(options.num_gpus, options.num_procs, visible_gpu_count())
    hang_timeout = _hang_timeout(options)
    setup = rank_setup_args(options, plan.nproc_per_node)
    listener, bind_addr = None, None
    master_port = options.master_port or DEFAULT_MASTER_PORT
    if options.node_rank == 0:
        bind_addr = store_bind_address(options)
        default_port = 0 if options.num_nodes == 1 else DEFAULT_MASTER_PORT
        listener = listen_socket(bind_addr, options.master_port or default_port)
        master_port = int(listener.getsockname()[1])
    entrypoint, args = worker_entry(options, setup)
    with tempfile.TemporaryDirectory(prefix="partita_launch_") as log_dir:
        _prepare_environment(options, plan, bind_addr, Path(log_dir) / _FAILURE_DIR)
        watchdog = _start_watchdog(Path(log_dir) / "heartbeat", hang_timeout)
        # The store takes the descriptor over; detach so this socket object does not close it.
        listen_fd = None if listener is None else listener.detach()
        config = build_launch_config(options, plan, master_port, log_dir, listen_fd)
        beat = _start_agent_beat(options, master_port, _node_address(options, bind_addr))
        try:
            return _run_agent(config, entrypoint, args, options, watchdog)
        finally:
            if beat is not None:
                beat.stop()
            if watchdog is not None:
                watchdog.stop()


def _start_agent_beat(
    options: LaunchOptions, master_port: int, node_addr: str | None
) -> AgentBeat | None:
    """This agent's heartbeat in the rendezvous store, so a survivor can name a dead node."""
    from partita.launcher.peers import AgentBeat

    if options.num_nodes == 1:
        return None
    beat = AgentBeat(options.master_addr, master_port, options.node_rank, node_addr)
    beat.start()
    return beat


def _gone_nodes(options: LaunchOptions, master_port: int) -> list[str]:
    from partita.launcher.peers import gone_nodes

    if options.num_nodes == 1:
        return []
    return gone_nodes(options.master_addr, master_port, options.num_nodes, options.node_rank)


@contextlib.contextmanager
def _agent_logs_quiet(quiet: bool) -> Iterator[None]:
    """Mutes the agent's log lines below CRITICAL ("Sending process ... closing signal", "failed
    (exitcode: 1) local_rank: 1"): the launcher's own line says which rank failed and how."""
    if not quiet:
        yield
        return
    before = logging.root.manager.disable
    logging.disable(logging.ERROR)
    try:
        yield
    finally:
        logging.disable(before)


def _failure_report(
    err: ChildFailedError, config: LaunchConfig, options: LaunchOptions, hung: bool
) -> int:
    """Prints what the user needs to know of a failed job; returns the launcher's status."""
    records = Path(str(env_vars.failure_dir()))  # _prepare_environment set it for the workers
    line, status = failures.summarize(records, err.failures, options.node_rank, options.num_nodes)
    port = int(config.rdzv_endpoint.rpartition(":")[2])
    # A worker here failing because a peer vanished names this node; say which one left.
    lines = [f"partita: {gone}" for gone in _gone_nodes(options, port)]
    if hung:
        lines.append("partita: the job hung and was stopped (the watchdog's report is above).")
        status = failures.CRASH_EXIT
    if env_vars.debug():
        # As before failures were summarised: torch's block names each failed rank and pid.
        lines += [] if hung else [_debug_headline(err, options.node_rank)]
        lines.append(str(err))
    elif not hung:
        lines.append(line)
    print(*lines, sep="\n", file=sys.stderr)
    return status


def _run_agent(
    config: LaunchConfig,
    entrypoint: str,
    args: list[str],
    options: LaunchOptions,
    watchdog: Watchdog | None,
) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    try:
        with _agent_logs_quiet(not env_vars.debug()):
            elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as err:
        # The agent has already stopped the surviving workers.
        hung = watchdog is not None and bool(watchdog.reports)
        return _failure_report(err, config, options, hung)
    except SignalException as err:
        print(f"partita: stopped by {err.sigval.name}; workers terminated", file=sys.stderr)
        return 128 + int(err.sigval)
    return 0
