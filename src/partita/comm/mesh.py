"""The job's parallel dimensions as torch's `DeviceMesh`, and a mesh passed to `initialize`.

[Note: the job's mesh]
`ParallelDims` holds the process groups partita communicates over; `job_mesh` lays the same
groups out as one `torch.distributed.device_mesh.DeviceMesh` with named dimensions, built with
``DeviceMesh.from_group`` from the groups that exist (no new process group is made), so that
torch's own tools (DTensor, ``fully_shard(mesh=...)``, ``torch.distributed.pipelining``) and a
user's code see the layout partita trains on: ``("dp",)`` for plain data parallelism,
``("dp_replicate", "dp_shard")`` for hybrid sharding, ``("dp", "sp")`` for Ulysses,
``("dp", "tp")`` for tensor parallelism, ``("edp", "ep")`` for expert parallelism (a
factorization of the data-parallel ranks), ``("pp", "dp")`` for a pipeline. The engine exposes it as ``engine.mesh_device``
(DeepSpeed's name).

The other way round, ``initialize(mesh_param=...)`` takes DeepSpeed's ``(dp, sp)`` tuple or a
`DeviceMesh` whose dimensions carry those names (DeepSpeed's long names are aliases), and
`mesh_sizes` reads from it the sizes the config would otherwise give
(``sequence_parallel_size``, ``tensor_parallel.autotp_size``,
``zero_optimization.mics_shard_size``); `merge_mesh_sizes` writes them into the config,
refusing a config that says otherwise. partita builds its groups with the innermost dimension
on consecutive ranks, as ``init_device_mesh`` does: a mesh laid out differently is refused,
naming its dimensions, before any collective.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from partita.comm.collectives import all_gather_object
from partita.comm.process_group import ProcessGroup, get_rank, get_world_size, is_initialized

ALIASES: dict[str, str] = {
    "dp": "dp",
    "data_parallel": "dp",
    "sp": "sp",
    "cp": "sp",
    "sequence_parallel": "sp",
    "tp": "tp",
    "tensor_parallel": "tp",
    "dp_replicate": "dp_replicate",
    "dp_shard": "dp_shard",
}
"""Dimension names a passed mesh may use, and partita's name for each."""

LAYOUTS: dict[tuple[str, ...], str | None] = {
    ("dp",): None,
    ("dp", "sp"): "sequence_parallel_size",
    ("dp", "tp"): "tensor_parallel.autotp_size",
    ("dp_replicate", "dp_shard"): "zero_optimization.mics_shard_size",
}
"""The meshes partita trains on (outer to inner) and the config key the inner size sets."""

OFF: dict[str, tuple[Any, ...]] = {
    "sequence_parallel_size": (None, 1),
    "tensor_parallel.autotp_size": (None, 0, 1),
    "zero_optimization.mics_shard_size": (None, -1),
}
"""Values of each key that mean "not set" (a mesh may then set it)."""


@dataclass(frozen=True)
class MeshSizes:
    """What a passed mesh asks for: its dimensions (partita's names) and sizes, and the config
    key and value its inner dimension stands for (None for a 1-D data-parallel mesh)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    key: str | None

    @property
    def value(self) -> int:
        """The inner dimension's size (the config value of `key`)."""
        return self.shape[-1]


def mesh_sizes(mesh_param: Any, world: int) -> MeshSizes:
    """Reads ``initialize(mesh_param=...)``: DeepSpeed's ``(data_parallel_size,
    sequence_parallel_size)`` or a `DeviceMesh`. Raises ValueError naming the dimensions and
    sizes when the mesh does not cover the `world` or is not one partita lays out. No
    collective: every rank raises alike."""
    if isinstance(mesh_param, tuple | list):
        if len(mesh_param) != 2 or not all(isinstance(n, int) and n > 0 for n in mesh_param):
            raise ValueError(
                f"mesh_param={mesh_param!r}: DeepSpeed's form is a tuple of two positive sizes "
                "(data_parallel_size, sequence_parallel_size), or pass a DeviceMesh"
            )
        names, shape, layout = ("dp", "sp"), tuple(mesh_param), None
    else:
        raw = tuple(mesh_param.mesh_dim_names or ())
        names = tuple(ALIASES.get(n, n) for n in raw)
        shape, layout = tuple(mesh_param.mesh.shape), mesh_param.mesh
        if len(raw) != len(shape):
            raise ValueError("mesh_param: the DeviceMesh needs mesh_dim_names (e.g. ('dp', 'sp'))")
    described = ", ".join(f"{n}={s}" for n, s in zip(names, shape, strict=True))
    if names not in LAYOUTS:
        known = " | ".join(str(k) for k in LAYOUTS)
        raise ValueError(f"mesh_param ({described}): partita trains on the meshes {known}")
    total = int(torch.tensor(shape).prod())
    if total != world:
        raise ValueError(f"mesh_param ({described}) has {total} ranks; the job has {world}")
    if layout is not None and not torch.equal(layout.cpu(), torch.arange(world).view(shape)):
        raise ValueError(
            f"mesh_param ({described}): partita places the inner dimension on consecutive "
            "ranks (as init_device_mesh does); this mesh lays the ranks out differently"
        )
    return MeshSizes(names, shape, LAYOUTS[names])


def merge_mesh_sizes(source: Any, sizes: MeshSizes) -> Any:
    """The config `source` (a dict, a JSON string or file, or a `DeepSpeedConfig`) as a dict
    with the mesh's size written under its key; raises the config error naming the key when
    the config sets another size there."""
    from partita.config import config_error

    if sizes.key is None:
        return source
    data = _as_dict(source)
    *path, leaf = sizes.key.split(".")
    node = data
    for part in path:
        node = node.setdefault(part, {})
    current = node.get(leaf)
    if current not in OFF[sizes.key] and current != sizes.value:
        raise config_error(
            sizes.key,
            f"{current}, but mesh_param's {sizes.names[-1]} dimension has {sizes.value} ranks; "
            "set one or make them agree",
        )
    node[leaf] = sizes.value
    return data


def _as_dict(source: Any) -> dict[str, Any]:
    from partita.config import DeepSpeedConfig
    from partita.config.reader import read_config_file

    if isinstance(source, DeepSpeedConfig):
        return source.to_dict()
    if isinstance(source, Mapping):
        return json.loads(json.dumps(source))  # a deep copy: the caller's dict stays as given
    if isinstance(source, str) and source.lstrip().startswith("{"):
        return dict(json.loads(source))
    if isinstance(source, str | os.PathLike):
        return dict(read_config_file(source))
    raise TypeError(f"config of type {type(source).__name__}: pass a dict, a path or JSON")


def mesh_dims(dims: Any) -> list[tuple[str, ProcessGroup | None, tuple[int, ...]]]:
    """The named dimensions of `dims` (a `ParallelDims`), outer to inner: (name, this rank's
    group, that group's global ranks in order); see [Note: the job's mesh]."""
    if dims.hybrid:
        return [
            ("dp_replicate", dims.replicate_group, dims.replicate_ranks),
            ("dp_shard", dims.shard_group, dims.shard_ranks),
        ]
    dp = ("dp", dims.dp_group, dims.dp_ranks)
    if dims.pp_ranks:
        return [("pp", dims.pp_group, dims.pp_ranks), dp]
    if dims.sp_ranks:
        return [dp, ("sp", dims.sp_group, dims.sp_ranks)]
    if dims.tp_ranks:
        return [dp, ("tp", dims.tp_group, dims.tp_ranks)]
    if dims.ep_ranks:
        return [("edp", dims.edp_group, dims.edp_ranks), ("ep", dims.ep_group, dims.ep_ranks)]
    return [dp]


def job_mesh(dims: Any) -> Any:
    """`dims` as a `DeviceMesh` over the groups that exist ([Note: the job's mesh]); None
    without a process group, or when the dimensions leave ranks out (an mpu whose other
    dimensions partita does not know). Collective over the world (one object all-gather: each
    rank's place in every dimension), except for a one-dimensional mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    if not is_initialized():
        return None
    named = mesh_dims(dims)
    shape = tuple(len(ranks) for _, _, ranks in named)
    if len(named) == 1:  # the data-parallel ranks (a pipeline stage's lane: not the world)
        layout = torch.tensor(named[0][2], dtype=torch.int)
    elif int(torch.tensor(shape).prod()) != get_world_size():
        return None
    else:
        rank = get_rank()
        place = tuple(ranks.index(rank) for _, _, ranks in named)
        layout = torch.empty(shape, dtype=torch.int)
        for r, where in enumerate(all_gather_object(place, group=None)):
            layout[where] = r
    world_group = dist.group.WORLD
    assert world_group is not None  # the process group is initialized
    groups = [world_group if g is None else g for _, g, _ in named]
    device = "cpu" if dist.get_backend() == "gloo" else "cuda"
    names = tuple(n for n, _, _ in named)
    return DeviceMesh.from_group(groups, device, layout, mesh_dim_names=names)


__all__ = [
    "ALIASES",
    "LAYOUTS",
    "MeshSizes",
    "job_mesh",
    "merge_mesh_sizes",
    "mesh_dims",
    "mesh_sizes",
]
