"""The engine's state as checkpoint entries: which tensors exist, plain-data state, RNG.

Tensors are named by the module's ``state_dict()`` keys. A parameter the strategy trains is
"trainable" (its fp32 master and optimizer state are sharded over ranks); other parameters are
"frozen" and buffers "buffer" (both replicated, saved once by rank 0 in the module's dtype); a
key whose tensor already appeared under another name (tied weights) is an "alias". Expert
tensors go by their global expert index ([Note: expert slices] in `partita.checkpoint.experts`).
"""

from __future__ import annotations

import base64
import logging
import random
from dataclasses import dataclass
from typing import Any

import torch

from partita.checkpoint.experts import global_names, stacked_rows
from partita.checkpoint.manifest import CheckpointError
from partita.checkpoint.subject import CheckpointSubject
from partita.comm import ParallelDims
from partita.platform.accelerator import get_accelerator

logger = logging.getLogger("partita")


def file_place(dims: ParallelDims) -> tuple[int, int]:
    """This rank's place ``(rank, world size)`` among the ranks a checkpoint's shard files are
    named and cut by: the ranks ZeRO cuts its shards over, the shard group under hybrid
    sharding, else the data-parallel group (see [Note: checkpoints of replicas] in
    `partita.checkpoint.save`). Loads need no counterpart: each rank reads the ranges its
    strategy owns, from whatever files hold them."""
    if dims.hybrid:
        return dims.shard_ranks.index(dims.rank), len(dims.shard_ranks)
    # Under sequence parallelism ZeRO cuts over the sequence-data-parallel group (every rank
    # holding the parameters), more ranks than the data-parallel ones.
    return dims.grad_ranks.index(dims.rank), len(dims.grad_ranks)


def state_place(dims: ParallelDims) -> tuple[int, int]:
    """This rank's place ``(rank, world size)`` among the per-rank RNG and data loader states
    a checkpoint keeps: one per rank ZeRO reduces over (every data-parallel rank, times the
    sequence ranks under sequence parallelism: each rank of a sequence group draws its own
    random numbers)."""
    return dims.grad_ranks.index(dims.rank), len(dims.grad_ranks)


def writes_files(dims: ParallelDims) -> bool:
    """True on the ranks that write shard files: those of the group holding global rank 0
    (the shard group when hybrid, else the data-parallel group), or of every data-parallel
    group when each holds its own tensor slice; the others hold copies of their state."""
    if dims.tp_world_size > 1:
        return True
    return 0 in (dims.shard_ranks if dims.hybrid else dims.grad_ranks)


@dataclass(frozen=True)
class Entry:
    """One ``state_dict`` key of the module."""

    name: str
    tensor: torch.Tensor
    kind: str
    """"trainable", "frozen", "buffer" or "alias"."""
    alias_of: str | None = None
    offset: int = 0
    """Where this rank's elements start in the flattened checkpoint tensor (nonzero for the
    rows of a stacked expert weight: [Note: stacked expert rows] in
    `partita.checkpoint.experts`)."""
    full_shape: tuple[int, ...] | None = None
    """The checkpoint tensor's shape when it is not this rank's tensor's (stacked expert
    rows), else None."""

    @property
    def shape(self) -> list[int]:
        """The checkpoint tensor's shape."""
        return list(self.full_shape if self.full_shape is not None else self.tensor.shape)


def inventory(engine: CheckpointSubject) -> list[Entry]:
    """The module's state entries in ``state_dict`` order (see the module docstring)."""
    strategy = engine.param_states
    seen: dict[int, str] = {}
    entries = []
    param_ids = {id(p) for p in engine.module.parameters()}
    # Expert tensors go by their global names ([Note: expert slices] in
    # `partita.checkpoint.experts`).
    experts = global_names(engine.module, engine.dims)
    stacked = stacked_rows(engine.module)
    for local, t in engine.module.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            continue  # `_extra_state` objects are not tensors; modules re-create them
        name = experts[local].name if local in experts else local
        if id(t) in seen:
            entries.append(Entry(name, t, "alias", seen[id(t)]))
            continue
        seen[id(t)] = name
        kind = ("trainable" if strategy.owns(t) else "frozen") if id(t) in param_ids else "buffer"
        rows = stacked.get(local)
        if rows is None:
            entries.append(Entry(name, t, kind))
            continue
        entries.append(Entry(name, t, kind, offset=rows.offset, full_shape=rows.shape))
    return entries


def full_module_value(entry: Entry) -> torch.Tensor:
    """A copy of a frozen parameter's or buffer's full value. Stage 3 shards frozen parameters
    too, so they are gathered first (a collective: every rank calls this, in the same order;
    a no-op gather for other stages)."""
    from partita.zero.gather import GatheredParameters

    if entry.kind != "frozen":
        return entry.tensor.detach().clone()
    with GatheredParameters([entry.tensor]):
        return entry.tensor.detach().clone()


@torch.no_grad()
def set_module_value(entry: Entry, value: torch.Tensor) -> None:
    """Writes a frozen parameter's or buffer's full value (the same on every rank). Under
    stage 3 the new value becomes every rank's shard (collective, like `full_module_value`)."""
    from partita.zero.gather import GatheredParameters

    if entry.kind != "frozen":
        entry.tensor.copy_(value.reshape(entry.tensor.shape))
        return
    with GatheredParameters([entry.tensor], modifier_rank=0):
        entry.tensor.copy_(value.reshape(entry.tensor.shape))


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """Inverse of `dtype_name`."""
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in manifest")
    return value


def to_plain(value: Any, where: str) -> Any:
    """`value` as JSON data (tuples become lists, 0-dim tensors numbers); raises
    `CheckpointError` naming the first key path that is not plain data."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value  # inf/nan round-trip through Python's json (Infinity/NaN)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return to_plain(value.item(), where)
    if isinstance(value, list | tuple):
        return [to_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str | int):
                raise CheckpointError(f"{where}: key {k!r} is a {type(k).__name__}, not str")
            out[str(k)] = to_plain(v, f"{where}[{k!r}]")
        return out
    raise CheckpointError(
        f"{where} is a {type(value).__name__}; checkpoints store plain JSON data only "
        "(dict, list, str, int, float, bool, None)"
    )


def check_client_state(client_state: Any) -> Any:
    """`client_state` itself, checked to be JSON data; a value that is not raises
    `CheckpointError` naming its key path."""
    if not isinstance(client_state, dict):
        raise CheckpointError(f"client_state must be a dict, got {type(client_state).__name__}")
    _refuse_non_json(client_state, "client_state")
    return client_state


def _refuse_non_json(value: Any, where: str) -> None:
    if value is None or isinstance(value, bool | int | float | str):
        return
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _refuse_non_json(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise CheckpointError(f"{where}: key {k!r} is a {type(k).__name__}, not str")
            _refuse_non_json(v, f"{where}[{k!r}]")
        return
    raise CheckpointError(
        f"{where} is a {type(value).__name__}, not JSON data; client_state must hold plain "
        "data (dict, list, str, int, float, bool, None); save tensors in the model or as lists"
    )


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    """This process's RNG states (Python, NumPy, torch CPU, CUDA devices) as JSON data."""
    version, internal, gauss = random.getstate()
    out: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "torch_cpu": _b64(torch.get_rng_state()),
    }
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        out["numpy"] = [kind, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    if get_accelerator().is_cuda:
        out["cuda"] = [_b64(s) for s in get_accelerator().get_rng_states()]
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Restores `rng_state` output, or the generators a partial one names."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch_cpu" in state:
        torch.set_rng_state(_unb64(state["torch_cpu"]))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and get_accelerator().is_cuda:
        get_accelerator().set_rng_states([_unb64(s) for s in state["cuda"]])


def rng_for_rank(
    saved: list[dict[str, Any]] | None, rank: int, world: int
) -> tuple[dict[str, Any] | None, list[str]]:
    """The RNG state `rank` of `world` restores from the saved ranks' states, and the
    generators not restored.

    At the saved world size each rank gets its own. At another, a generator (python,
    torch_cpu, numpy, cuda) is restored only when every saved rank had the same state for it
    (ranks seeded alike and drawing alike, the usual data-parallel case): then every new rank
    continues that one stream. Per-rank streams that differ have no counterpart at another
    world size and are left as they are."""
    if not saved:
        return None, []
    if len(saved) == world:
        return saved[rank], []
    common: dict[str, Any] = {}
    differ = []
    for key in sorted(set().union(*saved)):
        values = [state.get(key) for state in saved]
        if values[0] is not None and all(v == values[0] for v in values):
            common[key] = values[0]
        else:
            differ.append(key)
    return common, differ


def loader_for_rank(
    saved: list[dict[str, Any] | None] | None, rank: int, world: int
) -> tuple[dict[str, Any] | None, str | None]:
    """The data loader state `rank` of `world` restores, and why not all of the position is
    restored (None when all of it is).

    At the saved world size each rank gets its own. At another (partita's loader, which counts
    samples): the saved ranks consumed ``samples`` each of the same epoch's shuffle, and a
    `DistributedSampler` deals that shuffle out round-robin, so together they consumed exactly
    its first ``samples x saved ranks`` positions. Each new rank skips ``total // world`` of
    its own share, which skips exactly those positions when `world` divides the total; when it
    does not, the last ``total % world`` consumed positions are consumed again (never
    skipped)."""
    if not saved or any(state is None for state in saved):
        return None, None
    if len(saved) == world:
        return saved[rank], None
    first = saved[0]
    assert first is not None
    if "samples" not in first:
        return None, "the saved loader state does not count samples"
    where = [(s["epoch"], s["samples"]) for s in saved if s is not None]
    if len(set(where)) != 1:
        return None, f"the saved ranks were at different positions {where}"
    total = int(first["samples"]) * len(saved)
    per_rank, repeat = divmod(total, world)
    state = {**first, "samples": per_rank}
    if repeat:
        return state, (
            f"{total} samples of epoch {first['epoch']} were consumed, not a multiple of "
            f"{world} ranks: the last {repeat} of them are consumed again"
        )
    return state, None


def restore_rank_state(
    engine: CheckpointSubject, meta: dict[str, Any], rank: int, world: int
) -> None:
    """RNG and data loader position of this rank (see `rng_for_rank`, `loader_for_rank`);
    at another world size than the saved one, rank 0 warns about what is not restored. The
    saved states are one per saved data-parallel rank (more than the manifest's
    ``world_size`` under hybrid sharding, see [Note: checkpoints of replicas])."""
    rng, differ = rng_for_rank(meta.get("rng"), rank, world)
    loader = engine.training_dataloader
    loaders = meta.get("data_loader")
    state, note = loader_for_rank(loaders, rank, world)
    saved = len(meta.get("rng") or loaders or ()) or meta["world_size"]
    if rank == 0 and saved != world and (differ or note):
        logger.warning(
            "checkpoint saved at world size %d, loading at %d:%s%s",
            saved,
            world,
            f" RNG {differ} not restored (the saved ranks' states differ);" if differ else "",
            f" data loader: {note}" if note else "",
        )
    if rng:
        set_rng_state(rng)
    if state is not None and loader is not None and hasattr(loader, "load_state_dict"):
        loader.load_state_dict(state)


def optimizer_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's hyperparameters (everything but the tensors) as JSON data."""
    return [
        to_plain({k: v for k, v in g.items() if k != "params"}, f"optimizer.param_groups[{i}]")
        for i, g in enumerate(optimizer.param_groups)
    ]


def restore_optimizer_groups(optimizer: torch.optim.Optimizer, saved: list[dict]) -> None:
    """Writes saved hyperparameters back (only keys both sides have). Groups match by
    position, except the expert groups split off a mixed group (``"moe": True``, see
    `partita.engine.experts.split_expert_groups`), which exist at some layouts only (expert
    parallelism at stages 0-2): those match by position among themselves, or take the values
    of the group they were split from (``moe_of``) when the checkpoint has none; a checkpoint's
    expert groups the optimizer lacks repeat their origin's values and are skipped."""
    here = [g for g in optimizer.param_groups if not g.get("moe")]
    there = [g for g in saved if not g.get("moe")]
    experts_here = [g for g in optimizer.param_groups if g.get("moe")]
    experts_there = [g for g in saved if g.get("moe")]
    if experts_here and experts_there:
        here, there = here + experts_here, there + experts_there
    elif experts_here and all(isinstance(g.get("moe_of"), int) for g in experts_here):
        here = here + experts_here
        there = there + [there[g["moe_of"]] for g in experts_here if g["moe_of"] < len(there)]
    elif experts_here:
        here, there = list(optimizer.param_groups), saved
    if len(here) != len(there):
        raise CheckpointError(
            f"checkpoint has {len(saved)} optimizer parameter groups, the optimizer has "
            f"{len(optimizer.param_groups)}"
        )
    for group, values in zip(here, there, strict=True):
        _restore_group(group, values)


def _restore_group(group: dict[str, Any], values: dict[str, Any]) -> None:
    for k, v in values.items():
        if k not in group or k in ("params", "moe", "moe_of"):
            continue
        current = group[k]
        if isinstance(current, torch.Tensor):
            current.fill_(v)
        elif isinstance(current, tuple) and isinstance(v, list):
            group[k] = tuple(v)
        else:
            group[k] = v


__all__ = [
    "Entry",
    "check_client_state",
    "dtype_name",
    "file_place",
    "full_module_value",
    "inventory",
    "loader_for_rank",
    "optimizer_groups",
    "parse_dtype",
    "restore_optimizer_groups",
    "restore_rank_state",
    "rng_for_rank",
    "rng_state",
    "set_module_value",
    "set_rng_state",
    "to_plain",
    "writes_files",
]
