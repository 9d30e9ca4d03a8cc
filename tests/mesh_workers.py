"""Rank-side code of tests/test_mesh.py: the job's `DeviceMesh` (``engine.mesh_device``) for
each layout, and ``initialize(mesh_param=...)`` with DeepSpeed's tuple or a `DeviceMesh`."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import partita
from engine_workers import base_config, train
from models import STEPS, global_batches, make_model, rank_micro_batch
from partita import comm
from partita.config import ConfigError


def _describe(engine: Any) -> dict[str, Any]:
    """The engine's mesh: dimension names, layout, and each dimension's group's ranks."""
    mesh = engine.mesh_device
    names = tuple(mesh.mesh_dim_names)
    return {
        "names": names,
        "layout": mesh.mesh.tolist(),
        "groups": {n: dist.get_process_group_ranks(mesh.get_group(n)) for n in names},
        "sp": engine.dims.sp_world_size,
        "zero_world": engine.dims.zero_world_size,
    }


def _mesh(spec: Any) -> Any:
    """A mesh_param from its description: a tuple stays; ``{"names", "shape"}`` becomes
    init_device_mesh's; ``{"names", "layout"}`` a DeviceMesh with that rank layout."""
    if not isinstance(spec, dict):
        return tuple(spec)
    if "layout" in spec:
        return DeviceMesh("cpu", torch.tensor(spec["layout"]), mesh_dim_names=spec["names"])
    return init_device_mesh("cpu", tuple(spec["shape"]), mesh_dim_names=spec["names"])


def probe(config: dict[str, Any], mesh: Any = None) -> dict[str, Any] | str:
    """Builds an engine (config, optional mesh_param) and describes its mesh; the error text
    when initialize refuses."""
    try:
        engine, _, _, _ = partita.initialize(
            model=make_model(), config=config, mesh_param=None if mesh is None else _mesh(mesh)
        )
    except (ConfigError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    out = _describe(engine)
    engine.destroy()
    return out


def train_with_mesh(config: dict[str, Any], mesh: Any) -> list[float]:
    """STEPS steps of the shared batches with ``initialize(mesh_param=...)``; mean losses."""
    rank, world = comm.get_rank(), comm.get_world_size()
    micro = config["train_micro_batch_size_per_gpu"]
    engine, _, _, _ = partita.initialize(model=make_model(), config=config, mesh_param=_mesh(mesh))
    losses = []
    for batch in global_batches(STEPS, micro * world):
        loss = engine(*rank_micro_batch(batch, rank, world, micro, 0))
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        comm.all_reduce(total, tag="test")
        losses.append(total.item() / world)
    engine.destroy()
    return losses


def mesh_grid(cases: list[dict[str, Any]]) -> list[Any]:
    """Every case in one set of processes: ``{"probe": (config, mesh)}``, ``{"train": case}``
    (engine_workers' `train`) or ``{"mesh_train": (config, mesh)}``."""
    out: list[Any] = []
    for case in cases:
        if "probe" in case:
            out.append(probe(*case["probe"]))
        elif "mesh_train" in case:
            out.append(train_with_mesh(*case["mesh_train"]))
        else:
            out.append(train(**case["train"])["losses"])
    return out


__all__ = ["base_config", "mesh_grid"]
