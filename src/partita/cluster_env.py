"""Where am I: rank, world size and local rank from the launcher's environment.

The only module that reads launcher variables. Sources, first match wins:
torchrun / partita (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
OpenMPI (OMPI_COMM_WORLD_*), SLURM (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, ...).
Without any of them the process is a single-process run (rank 0 of 1).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from partita import env as env_vars

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
    """Which launcher the values came from: "torchrun", "openmpi", "slurm" or "none"."""


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
        world = _int(env, "WORLD_SIZE")
        cluster = ClusterEnv(
            rank=_int(env, "RANK"),
            world_size=world,
            local_rank=_int(env, "LOCAL_RANK", 0),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", world),
            master_addr=addr or "127.0.0.1",
            master_port=port,
            source="torchrun",
        )
        return _checked(cluster, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    if "OMPI_COMM_WORLD_RANK" in env:
        world = _int(env, "OMPI_COMM_WORLD_SIZE")
        cluster = ClusterEnv(
            rank=_int(env, "OMPI_COMM_WORLD_RANK"),
            world_size=world,
            local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
            local_world_size=_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", world),
            master_addr=addr or "127.0.0.1",
            master_port=port,
            source="openmpi",
        )
        return _checked(
            cluster,
            (
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE",
            ),
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = _int(env, "SLURM_NTASKS")
        local_rank = _int(env, "SLURM_LOCALID", 0)
        nodelist = env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", ""))
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
    return ClusterEnv(0, 1, 0, 1, addr or "127.0.0.1", port, "none")


@dataclass(frozen=True)
class HeartbeatSettings:
    """Where and how often this rank writes its heartbeat for the launcher's hang watchdog."""

    directory: str
    interval: float


def heartbeat_settings(env: Mapping[str, str] | None = None) -> HeartbeatSettings | None:
    """The heartbeat the ``partita`` launcher asked for (``PARTITA_HEARTBEAT_DIR`` and
    ``PARTITA_HEARTBEAT_INTERVAL``, see `partita.env`), or None when it asked for none.

    Raises ValueError naming the variable when the interval is not a positive number.
    """
    directory = env_vars.heartbeat_dir(env)
    if directory is None:
        return None
    return HeartbeatSettings(directory, env_vars.heartbeat_interval(env))
