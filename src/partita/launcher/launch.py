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

torch is imported only inside functions so that ``partita --help`` stays fast.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig

__all__ = [
    "ACCELERATOR_ENV",
    "DEFAULT_MASTER_PORT",
    "LaunchError",
    "LaunchOptions",
    "WorkerPlan",
    "build_launch_config",
    "find_free_port",
    "launch",
    "plan_workers",
    "visible_gpu_count",
    "worker_command",
    "worker_env",
]

#: Environment variable the launcher sets in every worker: ``cpu`` or ``cuda``.
ACCELERATOR_ENV = "PARTITA_ACCELERATOR"

#: Port used for multi-node launches when ``--master_port`` is not given. Every node must agree
#: on it, so it cannot be picked at random; 29500 is the torch and DeepSpeed default.
DEFAULT_MASTER_PORT = 29500

# The agent substitutes this placeholder in worker arguments with the worker's local rank
# (torch.distributed.elastic.utils.api.macros.local_rank, spelled out to avoid a torch import).
_LOCAL_RANK_MACRO = "${local_rank}"

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


def worker_command(options: LaunchOptions) -> tuple[str, list[str]]:
    """The worker's executable and its arguments (``${local_rank}`` filled in by the agent)."""
    args: list[str] = []
    if options.no_python:
        entrypoint = options.script
    else:
        # -u: unbuffered output, so worker prints interleave in real time and are not lost
        # when the agent kills a worker.
        entrypoint = sys.executable
        args.append("-u")
        if options.module:
            args.append("-m")
        args.append(_escape_macro(options.script))
    if not options.no_local_rank:
        args.append(f"--local_rank={_LOCAL_RANK_MACRO}")
    args.extend(_escape_macro(arg) for arg in options.script_args)
    return entrypoint, args


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def worker_env(plan: WorkerPlan, environ: Mapping[str, str]) -> dict[str, str]:
    """Variables to add to the launcher's environment, which every worker inherits."""
    env: dict[str, str] = {ACCELERATOR_ENV: plan.device}
    if "OMP_NUM_THREADS" not in environ:
        # Without a limit every worker starts one thread per core and they fight for the
        # cores; CPU workers share the cores, GPU workers get one each (torchrun's default).
        if plan.device == "cpu":
            env["OMP_NUM_THREADS"] = str(max(1, _usable_cpus() // plan.nproc_per_node))
        elif plan.nproc_per_node > 1:
            env["OMP_NUM_THREADS"] = "1"
    return env


def find_free_port() -> int:
    """A TCP port that is free right now (the kernel's choice for a bind to port 0)."""
    # Bind on all interfaces: the rendezvous store listens on all of them, so the port must be
    # free everywhere, not only on loopback.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _endpoint(addr: str, port: int) -> str:
    host = f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr
    return f"{host}:{port}"


def build_launch_config(
    options: LaunchOptions, plan: WorkerPlan, master_port: int, log_dir: str
) -> LaunchConfig:
    """The torchelastic ``LaunchConfig`` for this node: static rendezvous at master_addr."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=options.num_nodes,
        max_nodes=options.num_nodes,
        nproc_per_node=plan.nproc_per_node,
        # Workers keep the launcher's stdout/stderr; the log dir only holds error files.
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        run_id=_RUN_ID,
        rdzv_backend="static",
        rdzv_endpoint=_endpoint(options.master_addr, master_port),
        rdzv_configs={"rank": options.node_rank},
        max_restarts=options.max_restarts,
        monitor_interval=options.monitor_interval,
    )


def _failure_headline(err: ChildFailedError, node_rank: int) -> str:
    rank, failure = err.get_first_failure()
    return (
        f"partita: rank {rank} (local_rank {failure.local_rank} on node {node_rank}) failed "
        f"first, exit code {failure.exitcode}; the other workers were stopped. Summary:"
    )


def launch(options: LaunchOptions) -> int:
    """Start the workers of this node, wait for them, and return partita's exit status.

    Returns 0 when every worker succeeded, 1 when one failed (after printing the agent's
    failure summary, which names the failed ranks), 128 + signal number when partita itself
    was interrupted. Raises ``LaunchError`` for requests this machine cannot satisfy.
    """
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    plan = plan_workers(options.num_gpus, options.num_procs, visible_gpu_count())
    master_port = options.master_port
    if master_port is None:
        master_port = find_free_port() if options.num_nodes == 1 else DEFAULT_MASTER_PORT
    # The agent gives each worker a copy of this process's environment plus its own variables.
    os.environ.update(worker_env(plan, os.environ))
    entrypoint, args = worker_command(options)
    with tempfile.TemporaryDirectory(prefix="partita_launch_") as log_dir:
        config = build_launch_config(options, plan, master_port, log_dir)
        try:
            elastic_launch(config, entrypoint)(*args)
        except ChildFailedError as err:
            # The agent has already stopped the surviving workers; the summary names each
            # failed rank, its exit code and pid.
            print(_failure_headline(err, options.node_rank), err, sep="\n", file=sys.stderr)
            return 1
        except SignalException as err:
            print(f"partita: stopped by {err.sigval.name}; workers terminated", file=sys.stderr)
            return 128 + int(err.sigval)
    return 0
