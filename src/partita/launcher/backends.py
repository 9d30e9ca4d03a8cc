"""``--launcher openmpi | mpich | slurm | pdsh``: a hostfile job started by the scheduler's tool.

As DeepSpeed's runner does, partita builds the tool's own command and runs it; the tool then
starts the processes on the hosts:

- ``openmpi``: ``mpirun -n TOTAL -hostfile H --mca btl ^openib --mca btl_tcp_if_include eth0
  [--launcher_args] -x K=V ... RANK_COMMAND``; TOTAL is every slot of the hostfile, which
  mpirun reads itself (the ``btl_tcp_if_include`` default goes when ``--launcher_args`` names
  one); ``--include``/``--exclude``/``--num_nodes``/``--num_gpus`` are refused, as DeepSpeed
  refuses them;
- ``mpich``: ``mpirun -n TOTAL -ppn PER_NODE [--launcher_args] -genv K V ... -hosts H1,H2
  RANK_COMMAND``; every host needs the same slots; the same refusals;
- ``slurm``: ``srun -n TOTAL [--launcher_args] [--nodelist H1,H2 --nodes K] [--nodes K]
  [--gpus-per-node N] --export=ALL,K=V,... RANK_COMMAND``, TOTAL counted after the filters,
  which must keep the first N slots of every host, the same N (srun places tasks by count);
- ``pdsh``: ``pdsh -S -f 1024 -w H1,H2 [--launcher_args] 'export ...; cd CWD; exec python -u
  -m partita.launcher --num_nodes K --node_rank %n ...'``: a partita agent per host, as the
  ssh fan-out starts (pdsh replaces ``%n`` by the host's index); every host needs the same
  slots, the first N (each agent takes ``--num_gpus N``); ``--ssh_port`` goes to ssh through
  ``PDSH_SSH_ARGS_APPEND``.

``RANK_COMMAND`` is ``python -u -m partita.launcher.rank_setup [--local_rank] -- --run-path
SCRIPT ARGS``: each rank maps the scheduler's variables to torch's (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), gets ``--local_rank=<N>`` unless ``--no_local_rank``,
and runs the script as partita's own workers do (`partita.launcher.rank_setup`). Every rank
gets ``MASTER_ADDR`` (``--master_addr``, else the first host) and ``MASTER_PORT``,
``PARTITA_AS_DEEPSPEED=1``, the working directory first on ``PYTHONPATH`` (as DeepSpeed puts
it), and the variables the ssh fan-out forwards (`partita.launcher.multinode.exported_env`).

Everything but `run` is a pure function: a refusal, or a tool missing from PATH, is a
`LaunchError` before anything starts.
"""

from __future__ import annotations

import itertools
import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType

from partita.launcher.hostfile import Resources
from partita.launcher.launch import LaunchError, LaunchOptions
from partita.launcher.multinode import agent_flags
from partita.launcher.worker_exec import RUN_MODULE, RUN_PATH
from partita.platform import env as env_vars

__all__ = [
    "BACKENDS",
    "Job",
    "build_command",
    "check_request",
    "find_tools",
    "rank_command",
    "rank_env",
    "run",
]

#: ``--launcher`` value -> the programs it needs on PATH (the first is the one run).
BACKENDS: dict[str, tuple[str, ...]] = {
    "openmpi": ("mpirun", "ompi_info"),  # DeepSpeed tells OpenMPI by its ompi_info
    "mpich": ("mpirun",),
    "slurm": ("srun",),
    "pdsh": ("pdsh",),
}
PDSH_MAX_FAN_OUT = 1024  # DeepSpeed's


@dataclass(frozen=True)
class Job:
    """A hostfile job for a scheduler's tool.

    Attributes:
        launcher: a key of `BACKENDS`.
        hostfile: the hostfile's path (mpirun reads it for ``openmpi``).
        pool: every host of the hostfile and its slots.
        resources: the hosts and slots left after ``--include``/``--exclude``/``--num_nodes``/
            ``--num_gpus``.
        options: the launch (script, its arguments, ``--module``...).
        master_addr: rank 0's host.
        master_port: its rendezvous port.
        launcher_args: ``--launcher_args``, split as a shell would.
        exports: variables every rank gets (the allow-listed ones and ``.deepspeed_env``).
        cwd: the working directory.
        filtered: ``--include`` or ``--exclude`` was given.
        num_nodes: ``--num_nodes`` as given.
        per_node: ``--num_gpus``/``--num_procs`` as given.
        gpus: the slots are GPUs (not ``--num_procs``).
        ssh_port: ``--ssh_port`` (pdsh passes it to ssh).
    """

    launcher: str
    hostfile: str
    pool: Mapping[str, int]
    resources: Resources
    options: LaunchOptions
    master_addr: str
    master_port: int
    launcher_args: tuple[str, ...] = ()
    exports: Mapping[str, str] | None = None
    cwd: str = "."
    filtered: bool = False
    num_nodes: int | None = None
    per_node: int | None = None
    gpus: bool = True
    ssh_port: int | None = None


def check_request(job: Job) -> None:
    """Refuses what the backend cannot express, as DeepSpeed's runners do (`LaunchError`)."""
    name = job.launcher
    if name in ("openmpi", "mpich"):
        if job.filtered:
            raise LaunchError(
                f"--launcher {name} runs every slot of the hostfile; --include/--exclude "
                "cannot be used with it (edit the hostfile)"
            )
        if job.num_nodes is not None or job.per_node is not None:
            raise LaunchError(
                f"--launcher {name} runs every slot of the hostfile; --num_nodes/--num_gpus/"
                "--num_procs cannot be used with it (edit the hostfile)"
            )
        counts = set(job.pool.values())
        if name == "mpich" and len(counts) > 1:
            raise LaunchError(
                f"--launcher mpich needs the same slots on every host (-ppn), got {dict(job.pool)}"
            )
        return
    counts = {len(slots) for slots in job.resources.values()}
    for host, slots in job.resources.items():
        if list(slots) != list(range(len(slots))):
            raise LaunchError(
                f"--launcher {name} cannot select slots {','.join(map(str, slots))} of host "
                f"{host!r}: keep whole hosts, or the first N slots of every host"
            )
    if len(counts) > 1:
        sizes = {host: len(slots) for host, slots in job.resources.items()}
        raise LaunchError(f"--launcher {name} needs the same slots on every host, got {sizes}")


def find_tools(launcher: str, environ: Mapping[str, str]) -> str:
    """The path of the backend's program; `LaunchError` naming each one missing from PATH."""
    missing = [
        tool for tool in BACKENDS[launcher] if not shutil.which(tool, path=environ.get("PATH"))
    ]
    if missing:
        raise LaunchError(
            f"--launcher {launcher} runs {BACKENDS[launcher][0]}, but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not on PATH; install it, or use partita's "
            "own ssh fan-out (no --launcher)"
        )
    return str(shutil.which(BACKENDS[launcher][0], path=environ.get("PATH")))


def rank_command(options: LaunchOptions, python: str = sys.executable) -> list[str]:
    """What the scheduler starts as each rank (`partita.launcher.rank_setup`)."""
    command = [python, "-u", "-m", "partita.launcher.rank_setup"]
    if not options.no_local_rank:
        command.append("--local_rank")
    command.append("--")
    if options.no_python:
        return [*command, options.script, *options.script_args]
    mode = RUN_MODULE if options.module else RUN_PATH
    return [*command, mode, options.script, *options.script_args]


def rank_env(job: Job, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables every rank gets, in the order they are passed."""
    result = dict(job.exports or {})
    if job.launcher == "openmpi":
        result.setdefault("UCX_TLS", "tcp")  # as DeepSpeed's OpenMPI runner exports
    path = environ.get("PYTHONPATH")
    cwd = os.path.abspath(job.cwd)
    result["PYTHONPATH"] = cwd if not path else f"{cwd}{os.pathsep}{path}"
    result[env_vars.AS_DEEPSPEED.name] = "1"
    if not job.gpus:
        result[env_vars.ACCELERATOR.name] = "cpu"
    result["MASTER_ADDR"] = job.master_addr
    result["MASTER_PORT"] = str(job.master_port)
    return result


def _total(slots: Mapping[str, int]) -> int:
    return sum(slots.values())


def _openmpi(job: Job, exports: Mapping[str, str]) -> list[str]:
    args = list(job.launcher_args)
    named = any(
        a in ("-mca", "--mca") and b == "btl_tcp_if_include" for a, b in itertools.pairwise(args)
    )
    command = ["mpirun", "-n", str(_total(job.pool)), "-hostfile", job.hostfile]
    command += ["--mca", "btl", "^openib"]
    command += [] if named else ["--mca", "btl_tcp_if_include", "eth0"]
    command += args
    for key, value in exports.items():
        command += ["-x", f"{key}={value}"]
    return command


def _mpich(job: Job, exports: Mapping[str, str]) -> list[str]:
    per_node = next(iter(job.pool.values()))
    command = ["mpirun", "-n", str(_total(job.pool)), "-ppn", str(per_node)]
    command += list(job.launcher_args)
    for key, value in exports.items():
        command += ["-genv", key, value]  # hydra's documented two-argument form
    return [*command, "-hosts", ",".join(job.pool)]


def _slurm(job: Job, exports: Mapping[str, str]) -> list[str]:
    total = sum(len(slots) for slots in job.resources.values())
    command = ["srun", "-n", str(total), *job.launcher_args]
    if job.filtered:
        # srun has no --include; --nodelist is an upper bound, so --nodes pins the count.
        command += ["--nodelist", ",".join(job.resources), "--nodes", str(len(job.resources))]
    if job.num_nodes is not None:
        command += ["--nodes", str(job.num_nodes)]
    if job.per_node is not None and job.gpus:
        command += ["--gpus-per-node", str(job.per_node)]  # --num_gpus is per node
    pairs = ",".join(f"{key}={value}" for key, value in exports.items())
    return [*command, f"--export=ALL,{pairs}"]


def _pdsh(job: Job, exports: Mapping[str, str], python: str) -> list[str]:
    slots = len(next(iter(job.resources.values())))
    agent = [python, "-u", "-m", "partita.launcher", "--num_nodes", str(len(job.resources))]
    agent += ["--node_rank", "%n", "--master_addr", job.master_addr]
    agent += ["--master_port", str(job.master_port)]
    agent += ["--num_gpus" if job.gpus else "--num_procs", str(slots)]
    agent += agent_flags(job.options)
    agent += [job.options.script, *job.options.script_args]
    remote = [f"export {key}={shlex.quote(value)};" for key, value in exports.items()]
    remote += [f"cd {shlex.quote(os.path.abspath(job.cwd))};", "exec", shlex.join(agent)]
    hosts = ",".join(job.resources)
    command = ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", hosts, *job.launcher_args]
    return [*command, " ".join(remote)]


def build_command(
    job: Job, environ: Mapping[str, str], python: str = sys.executable
) -> tuple[list[str], dict[str, str]]:
    """The tool's argv, and the variables to add to its own environment."""
    exports = rank_env(job, environ)
    if job.launcher == "pdsh":
        # pdsh's %n is the node rank only with its ssh module; the agent sets up its workers.
        del exports[env_vars.AS_DEEPSPEED.name], exports["MASTER_ADDR"], exports["MASTER_PORT"]
        exports.pop(env_vars.ACCELERATOR.name, None)
        extra = {"PDSH_RCMD_TYPE": "ssh"}
        if job.ssh_port is not None:
            before = environ.get("PDSH_SSH_ARGS_APPEND", "")
            extra["PDSH_SSH_ARGS_APPEND"] = f"{before} -p {job.ssh_port}".strip()
        return _pdsh(job, exports, python), extra
    build = {"openmpi": _openmpi, "mpich": _mpich, "slurm": _slurm}[job.launcher]
    return [*build(job, exports), *rank_command(job.options, python)], {}


def run(argv: Sequence[str], extra_env: Mapping[str, str]) -> int:
    """Runs the tool with ``extra_env`` added and returns its exit status (SIGINT/SIGTERM to
    partita are passed on to it: the tool stops its ranks)."""
    proc = subprocess.Popen(list(argv), env={**os.environ, **extra_env})

    def forward(signum: int, frame: FrameType | None) -> None:
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - status if status < 0 else status  # killed by a signal: as a shell reports it
