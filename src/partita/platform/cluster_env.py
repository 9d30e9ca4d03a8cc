"""Where am I: rank, world size and local rank from the launcher's environment.

The only module that reads launcher variables. Sources, first match wins:
torchrun / partita (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
OpenMPI (OMPI_COMM_WORLD_*), PMI (MPICH/Intel MPI's PMI_RANK, PMI_SIZE, MPI_LOCALRANKID,
MPI_LOCALNRANKS; or PMI_LOCAL_RANK, PMI_LOCAL_SIZE), SLURM (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID, ...), Kubeflow Trainer's torch policy with one process per pod (PET_NNODES,
PET_NODE_RANK, PET_NPROC_PER_NODE=1, PET_MASTER_ADDR, PET_MASTER_PORT).
Without any of them the process is a single-process run (rank 0 of 1). `detect` gives this
process's ranks; `locate` adds its node's index and the node count.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from partita.platform import env as env_vars

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class ClusterEnv:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str
    """Which launcher the values came from: "torchrun", "openmpi", "pmi", "slurm", "kubeflow"
    or "none"."""


@dataclass(frozen=True)
class NodeLocation(ClusterEnv):
    """`ClusterEnv` plus this process's node: its index and the number of nodes."""

    node_rank: int = 0
    num_nodes: int = 1


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if raw is None:
        if default is None:
            raise ValueError(f"environment variable {key} is required but not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list such as ``node[003-005,010],other`` or
    ``rack[1-2]-gpu[01-04]`` (each bracket group contributes its first value)."""
    depth, end = 0, len(nodelist)
    for i, char in enumerate(nodelist):  # the first entry ends at a comma outside brackets
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = i
            break
    entry = nodelist[:end].strip()
    if not entry:
        return "127.0.0.1"
    return re.sub(r"\[([^\]]*)\]?", lambda m: m.group(1).split(",")[0].split("-")[0], entry)


def _slurm_tasks_on_node(env: Mapping[str, str], world: int, local_rank: int) -> int:
    """Tasks on this node: SLURM_TASKS_PER_NODE (``"2(x3),1"``) at index SLURM_NODEID, which
    handles uneven layouts; else an even split over SLURM_NNODES, raised to cover this task's
    local rank (the split is only a guess, so it must not make a valid layout look invalid)."""
    key = (
        "SLURM_STEP_TASKS_PER_NODE"
        if "SLURM_STEP_TASKS_PER_NODE" in env
        else "SLURM_TASKS_PER_NODE"
    )
    spec = env.get(key)
    if spec and "SLURM_NODEID" in env:
        counts: list[int] = []
        for part in spec.split(","):
            match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
            if not match:
                raise ValueError(f"environment variable {key}={spec!r} is malformed")
            counts += [int(match.group(1))] * int(match.group(2) or 1)
        node = _int(env, "SLURM_NODEID")
        if 0 <= node < len(counts):
            return counts[node]
    nodes = _int(env, "SLURM_NNODES", 1)
    return max(1, world // max(nodes, 1), local_rank + 1)


def _checked(cluster: ClusterEnv, names: tuple[str, str, str, str]) -> ClusterEnv:
    """Rejects impossible rank layouts, naming the variables (a bad layout would hang the job)."""
    rank, world, local_rank, local_world = names
    if cluster.world_size < 1:
        raise ValueError(f"environment variable {world}={cluster.world_size} must be >= 1")
    if not 0 <= cluster.rank < cluster.world_size:
        raise ValueError(
            f"environment variable {rank}={cluster.rank} is outside [0, {cluster.world_size}) "
            f"given {world}={cluster.world_size}"
        )
    if not 0 <= cluster.local_rank < cluster.local_world_size:
        raise ValueError(
            f"environment variable {local_rank}={cluster.local_rank} is outside "
            f"[0, {cluster.local_world_size}) given {local_world}={cluster.local_world_size}"
        )
    return cluster


def _slurm(env: Mapping[str, str], addr: str | None, port: int) -> ClusterEnv:
    """SLURM ``srun`` with a task per process (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID)."""
    world = _int(env, "SLURM_NTASKS")
    local_rank = _int(env, "SLURM_LOCALID", 0)
    # The step's nodes, not the allocation's: srun may run on a subset of them.
    nodelist = next(
        (
            env[k]
            for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
            if k in env
        ),
        "",
    )
    cluster = ClusterEnv(
        rank=_int(env, "SLURM_PROCID"),
        world_size=world,
        local_rank=local_rank,
        local_world_size=_slurm_tasks_on_node(env, world, local_rank),
        master_addr=addr or _first_slurm_host(nodelist),
        master_port=port,
        source="slurm",
    )
    names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_TASKS_PER_NODE")
    return _checked(cluster, names)


_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_OPENMPI = (
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
)


def _read(
    env: Mapping[str, str],
    names: tuple[str, str, str, str],
    addr: str | None,
    port: int,
    source: str,
    local_defaults: bool = True,
) -> ClusterEnv:
    """The layout in the variables `names` (rank, world size, local rank, local world size),
    checked. With `local_defaults` the local pair may be missing (one node: local rank 0 of
    the whole world); without, they are required."""
    rank, world_name, local_rank, local_world = names
    world = _int(env, world_name)
    cluster = ClusterEnv(
        rank=_int(env, rank),
        world_size=world,
        local_rank=_int(env, local_rank, 0 if local_defaults else None),
        local_world_size=_int(env, local_world, world if local_defaults else None),
        master_addr=addr or "127.0.0.1",
        master_port=port,
        source=source,
    )
    return _checked(cluster, (rank, world_name, local_rank, local_world))


def detect(env: Mapping[str, str] | None = None) -> ClusterEnv:
    """Reads the launcher environment (`os.environ` unless `env` is given).

    Raises ValueError naming the variable when a value is not an integer, a required companion
    variable is missing (RANK without WORLD_SIZE), or ranks fall outside the world size.
    """
    env = os.environ if env is None else env
    addr = env.get("MASTER_ADDR")
    port = _int(env, "MASTER_PORT", DEFAULT_MASTER_PORT)
    if "RANK" in env or "WORLD_SIZE" in env:
        # One without the other is a launcher mistake; running as a single process would hang
        # the ranks that were started.
        return _read(env, _TORCHRUN, addr, port, "torchrun")
    if "OMPI_COMM_WORLD_RANK" in env:
        cluster = _read(env, _OPENMPI, addr, port, "openmpi")
        return _needs_master(cluster, addr, _OPENMPI[1], _OPENMPI[3])
    if "PMI_RANK" in env or "PMI_SIZE" in env:
        return _pmi(env, addr, port)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _slurm(env, addr, port)
    if "PET_NNODES" in env or "PET_NODE_RANK" in env:
        return _kubeflow(env)
    return ClusterEnv(0, 1, 0, 1, addr or "127.0.0.1", port, "none")


def _needs_master(cluster: ClusterEnv, addr: str | None, world: str, local: str) -> ClusterEnv:
    """MPI variables do not say where rank 0 runs: a job wider than this node needs
    MASTER_ADDR (127.0.0.1 would leave the other nodes' ranks waiting forever)."""
    if addr is None and cluster.world_size > cluster.local_world_size:
        raise ValueError(
            f"environment variable MASTER_ADDR is required: {world}={cluster.world_size} is more "
            f"than this node's {local}={cluster.local_world_size}, and rank 0's address is "
            "not in the MPI environment (export MASTER_ADDR=<rank 0's host> to mpirun, -x)"
        )
    return cluster


def _pmi(env: Mapping[str, str], addr: str | None, port: int) -> ClusterEnv:
    """MPICH / Intel MPI (Hydra) and Cray PMI ranks."""
    if "MPI_LOCALRANKID" in env or "PMI_LOCAL_RANK" not in env:
        local_names = ("MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    else:
        local_names = ("PMI_LOCAL_RANK", "PMI_LOCAL_SIZE")
    names = ("PMI_RANK", "PMI_SIZE", *local_names)
    cluster = _read(env, names, addr, port, "pmi", local_defaults=False)
    return _needs_master(cluster, addr, "PMI_SIZE", local_names[1])


def _agreeing(env: Mapping[str, str], name: str, pet_name: str) -> str | None:
    """``PET_<name>``, which must equal ``<name>`` when both are set."""
    value, pet = env.get(name), env.get(pet_name)
    if value is not None and pet is not None and value != pet:
        raise ValueError(f"environment variable {name}={value!r} contradicts {pet_name}={pet!r}")
    return pet if pet is not None else value


def _kubeflow(env: Mapping[str, str]) -> ClusterEnv:
    """Kubeflow Trainer's torch policy (``PET_*``, torchrun's inputs) with one process per
    pod: the pod's node rank is the process's rank. More processes per pod need an agent."""
    nodes, node = _int(env, "PET_NNODES"), _int(env, "PET_NODE_RANK")
    nproc = _int(env, "PET_NPROC_PER_NODE", 1)
    if nproc != 1:
        raise ValueError(
            f"environment variable PET_NPROC_PER_NODE={nproc} asks for {nproc} processes per "
            "pod, but this process has no RANK: start it with partita or torchrun, which "
            "start that many and set RANK"
        )
    addr = _agreeing(env, "MASTER_ADDR", "PET_MASTER_ADDR")
    port_text = _agreeing(env, "MASTER_PORT", "PET_MASTER_PORT")
    port = _int({"PET_MASTER_PORT": port_text} if port_text else {}, "PET_MASTER_PORT", 29500)
    if addr is None and nodes > 1:
        raise ValueError(
            f"environment variable PET_MASTER_ADDR is required when PET_NNODES={nodes} > 1"
        )
    cluster = ClusterEnv(node, nodes, 0, 1, addr or "127.0.0.1", port, "kubeflow")
    return _checked(cluster, ("PET_NODE_RANK", "PET_NNODES", "PET_NODE_RANK", "PET_NNODES"))


def _node_of(cluster: ClusterEnv, env: Mapping[str, str]) -> tuple[int, int, str]:
    """(node rank, node count, the variable the node rank came from) of a detected process."""
    if cluster.source == "slurm":
        count = "SLURM_STEP_NUM_NODES" if "SLURM_STEP_NUM_NODES" in env else "SLURM_NNODES"
        return _int(env, "SLURM_NODEID", 0), _int(env, count, 1), "SLURM_NODEID"
    if cluster.source == "kubeflow":
        return cluster.rank, cluster.world_size, "PET_NODE_RANK"
    if cluster.source == "torchrun" and "GROUP_RANK" in env:
        return _int(env, "GROUP_RANK"), _int(env, "GROUP_WORLD_SIZE", 1), "GROUP_RANK"
    # MPI and plain torchrun variables carry no node index: ranks fill nodes in order (mpirun's
    # default by-slot mapping), so the node is the rank's block of local_world_size ranks.
    per_node = cluster.local_world_size
    nodes = -(-cluster.world_size // per_node)
    return cluster.rank // per_node, nodes, "rank // local world size"


def locate(env: Mapping[str, str] | None = None) -> NodeLocation:
    """`detect` plus the node: its index and the number of nodes in the job.

    Raises ValueError naming the variable as `detect` does, and when the node index falls
    outside the node count (SLURM_NODEID against SLURM_NNODES, GROUP_RANK against
    GROUP_WORLD_SIZE).
    """
    env = os.environ if env is None else env
    cluster = detect(env)
    node_rank, num_nodes, name = _node_of(cluster, env)
    if not 0 <= node_rank < num_nodes:
        raise ValueError(
            f"environment variable {name}={node_rank} is outside [0, {num_nodes}) nodes"
        )
    return NodeLocation(**vars(cluster), node_rank=node_rank, num_nodes=num_nodes)


@dataclass(frozen=True)
class HeartbeatSettings:
    """Where and how often this rank writes its heartbeat for the launcher's hang watchdog."""

    directory: str
    interval: float


def heartbeat_settings(env: Mapping[str, str] | None = None) -> HeartbeatSettings | None:
    """The heartbeat the ``partita`` launcher asked for (``PARTITA_HEARTBEAT_DIR`` and
    ``PARTITA_HEARTBEAT_INTERVAL``, see `partita.platform.env`), or None when it asked for none.

    Raises ValueError naming the variable when the interval is not a positive number.
    """
    directory = env_vars.heartbeat_dir(env)
    if directory is None:
        return None
    return HeartbeatSettings(directory, env_vars.heartbeat_interval(env))
