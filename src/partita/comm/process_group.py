"""Process-group set-up: the one place that creates or tears down torch.distributed state."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch.distributed as dist

from partita.comm.heartbeat import start_heartbeat, stop_heartbeat
from partita.platform import cluster_env, shutdown
from partita.platform.accelerator import get_accelerator

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
"""Collective timeout when none is given (DeepSpeed's default is 30 minutes too)."""

ProcessGroup = dist.ProcessGroup


def is_initialized() -> bool:
    """True once a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int | None = None,
    verbose: bool = True,
    timeout: datetime.timedelta | float | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
    store: dist.Store | None = None,
) -> None:
    """Creates the default process group, or keeps the one that already exists.

    Idempotent: a second call, or a call after the user (or torchrun tooling) already created a
    group, changes nothing. Rank and world size come from the arguments, else from the launcher
    environment (torchrun, SLURM, OpenMPI; see `partita.platform.cluster_env`). The backend
    defaults to the accelerator's (NCCL on CUDA, gloo on CPU). `timeout` (seconds or timedelta) bounds every
    collective, so a rank that never arrives fails the job instead of hanging it. Under the
    ``partita`` launcher the rank also starts its heartbeat for the hang watchdog
    (`partita.comm.heartbeat`).
    """
    del auto_mpi_discovery, verbose, config  # accepted for DeepSpeed signature compatibility
    if is_initialized():
        start_heartbeat(dist.get_rank())
        _register_shutdown()
        return
    if dist_init_required is False:
        raise RuntimeError(
            "init_distributed(dist_init_required=False) but no process group exists; "
            "create one first or pass dist_init_required=True"
        )
    env = cluster_env.detect()
    if rank < 0:
        rank = env.rank
    if world_size < 0:
        world_size = env.world_size
    backend = dist_backend or get_accelerator().communication_backend
    kwargs: dict[str, Any] = {"timeout": _as_timedelta(timeout)}
    if store is not None:
        kwargs["store"] = store
    else:
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        port = distributed_port if distributed_port is not None else env.master_port
        os.environ.setdefault("MASTER_PORT", str(port))
        kwargs["init_method"] = init_method or "env://"
    device_id = get_accelerator().device_for_rank(env.local_rank)
    if device_id is not None:
        kwargs["device_id"] = device_id
    dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    start_heartbeat(dist.get_rank())
    _register_shutdown()


def _register_shutdown() -> None:
    """What this layer stops at exit, in order: [Note: ordered shutdown] in
    `partita.platform.shutdown`."""
    shutdown.register(shutdown.Phase.THREADS, "comm.heartbeat", stop_heartbeat)
    shutdown.register(shutdown.Phase.DEVICE, "accelerator", get_accelerator().synchronize)
    shutdown.register(shutdown.Phase.PROCESS_GROUP, "comm.process_group", destroy_process_group)


def _as_timedelta(timeout: datetime.timedelta | float | None) -> datetime.timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


def destroy_process_group() -> None:
    """Tears down the default group if one exists (and stops this rank's heartbeat: a rank
    outside the group cannot hang it)."""
    stop_heartbeat()
    if is_initialized():
        dist.destroy_process_group()


def get_rank(group: ProcessGroup | None = None) -> int:
    """Rank in `group` (0 when no process group exists: a single-process run)."""
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Size of `group` (1 when no process group exists)."""
    return dist.get_world_size(group) if is_initialized() else 1


def get_global_rank(group: ProcessGroup | None, rank: int) -> int:
    """Global rank of `group`'s rank `rank` (collectives name their source globally)."""
    if group is None or not is_initialized():
        return rank
    return dist.get_global_rank(group, rank)


def get_local_rank() -> int:
    """Rank within this node, from the launcher environment."""
    return cluster_env.detect().local_rank


def get_backend(group: ProcessGroup | None = None) -> str:
    """Backend name of `group`'s process group."""
    return str(dist.get_backend(group))


def new_group(ranks: list[int], backend: str | None = None) -> ProcessGroup:
    """A sub-group of the given global ranks (every rank must call it), on `backend` (the
    default process group's when None; "gloo" gives a host-side group beside NCCL)."""
    return dist.new_group(ranks, backend=backend)
