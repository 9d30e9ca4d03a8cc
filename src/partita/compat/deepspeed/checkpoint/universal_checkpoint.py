"""``deepspeed.checkpoint.universal_checkpoint``: the pieces of DeepSpeed's universal checkpoint
that are plain tensor arithmetic: which slice of a full (universal) parameter a tensor-parallel
rank holds, from the AutoTP layout metadata recorded on the parameter.

Loading a universal checkpoint into DeepSpeed's optimizer (``load_hp_checkpoint_state``) works on
DeepSpeed's internal fp32 fragment mappings, which partita does not have: it raises
`FeatureNotInPartita`; partita reshards its own checkpoints on load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from partita.checkpoint.manifest import CheckpointError
from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed._placeholder import not_in_partita
from partita.compat.deepspeed.checkpoint.constants import (
    DS_AUTOTP_UC_META,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
)

# From this universal-checkpoint version on, fused parameters record each rank's width of each
# sub-parameter; older metadata can only describe even splits.
WIDTHS_VERSION = 0.4


class LayoutError(CheckpointError, AssertionError):
    """Tensor-parallel layout metadata that cannot describe the tensor it is applied to. An
    AssertionError too, as DeepSpeed raises there, so callers catching that keep working."""


@dataclass
class SubparamShape:
    """A fused parameter (QKV, gate/up) made of sub-parameters: the name `patterns` it applies
    to, its `shape` as a view spec whose `partition_dim` entry holds the sub-parameter sizes
    (a tuple) or, in older checkpoints, their count, and the dimension tensor parallelism cuts."""

    patterns: list[str]
    shape: tuple[Any, ...]
    partition_dim: int


def _get_param_uc_restore_meta(param: Any) -> dict[str, Any] | None:
    """The AutoTP restore metadata recorded on `param` (``ds_autotp_universal_checkpoint_meta``),
    or None when it has none."""
    return getattr(param, DS_AUTOTP_UC_META, None)


def _even_widths(sizes: Sequence[int], tp_world_size: int) -> list[list[int]]:
    uneven = [size for size in sizes if size % tp_world_size]
    if uneven:
        raise LayoutError(
            f"sub-parameter sizes {uneven} are not divisible by tp_world_size {tp_world_size}, "
            "and the metadata records no sub_param_shard_widths: the uneven layout is unknown"
        )
    return [[size // tp_world_size] * tp_world_size for size in sizes]


def narrow_sub_params(
    full: torch.Tensor, dim: int, sizes: Sequence[int], widths: Sequence[Sequence[int]], rank: int
) -> torch.Tensor:
    """Rank `rank`'s piece of every sub-parameter of `full` along `dim`, concatenated: `sizes`
    are the sub-parameters' sizes, `widths[s][r]` rank r's share of sub-parameter s."""
    if sum(sizes) != full.shape[dim]:
        raise LayoutError(
            f"sub-parameter sizes {list(sizes)} sum to {sum(sizes)}, but dimension "
            f"{dim} of the parameter is {full.shape[dim]}"
        )
    if len(widths) != len(sizes):
        raise LayoutError(f"{len(widths)} shard-width entries for {len(sizes)} sub-parameters")
    pieces, offset = [], 0
    for size, per_rank in zip(sizes, widths, strict=True):
        if sum(per_rank) != size:
            raise LayoutError(f"shard widths {list(per_rank)} sum to {sum(per_rank)}, not {size}")
        pieces.append(full.narrow(dim, offset + sum(per_rank[:rank]), per_rank[rank]))
        offset += size
    return torch.cat(pieces, dim=dim)


def _sub_param_sizes(meta: dict[str, Any], dim: int) -> tuple[Sequence[int] | None, int]:
    """The sub-parameter sizes along the partition dimension (and that dimension), if fused."""
    if meta.get("sub_param_sizes") is not None:
        return meta["sub_param_sizes"], dim
    spec = meta.get("sub_param_shape")
    if spec is None:
        return None, dim
    if isinstance(spec, SubparamShape):
        sizes = spec.shape[spec.partition_dim]
        dim = spec.partition_dim
    else:
        sizes = spec[dim]
    return (tuple(sizes) if isinstance(sizes, (tuple, list)) else (sizes,)), dim


def _resolve_autotp_partition(
    current_param: Any,
    ckpt_dict: dict[str, Any],
    full_hp_param: torch.Tensor,
    tp_rank: int,
    tp_world_size: int,
    state_key: str = "fp32",
) -> torch.Tensor | None:
    """Tensor-parallel rank `tp_rank`'s slice (flattened) of `full_hp_param`, the universal
    checkpoint's full tensor, per the AutoTP metadata on `current_param`; None without metadata
    (the caller falls back to its own rule). Uneven layouts need recorded sizes or widths."""
    del ckpt_dict, state_key  # DeepSpeed's signature; the metadata on the parameter decides
    meta = _get_param_uc_restore_meta(current_param)
    if not meta:
        return None
    conversion = meta.get("conversion") or {}
    if conversion.get("unsupported_reason") or conversion.get("affine_map") is not None:
        raise not_in_partita("AutoTP affine-map / unsupported layouts", "AutoTP training")
    dim, shape = meta.get("partition_dim"), meta.get("logical_shape")
    if meta.get("replicated", False):
        return full_hp_param.flatten()
    if dim is None or shape is None:
        return None
    full = full_hp_param.view(shape)
    sizes, dim = _sub_param_sizes(meta, dim)
    if sizes is not None:
        widths = meta.get("sub_param_shard_widths")
        if meta.get(UNIVERSAL_CHECKPOINT_VERSION_KEY, 0.0) < WIDTHS_VERSION or widths is None:
            widths = _even_widths(sizes, tp_world_size)
        return narrow_sub_params(full, dim, sizes, widths, tp_rank).flatten()
    if meta.get("partition_sizes") is not None:
        sizes = meta["partition_sizes"]
        return full.narrow(dim, sum(sizes[:tp_rank]), sizes[tp_rank]).flatten()
    if full.shape[dim] % tp_world_size:
        raise LayoutError(
            f"dimension {dim} of size {full.shape[dim]} is not divisible by tp_world_size "
            f"{tp_world_size}, and this checkpoint records no partition_sizes: the uneven "
            "layout cannot be reconstructed"
        )
    return full.chunk(tp_world_size, dim=dim)[tp_rank].flatten()


def load_hp_checkpoint_state(
    self: Any, folder: str, tp_rank: int, tp_world_size: int, ep_rank: int = 0, ep_size: int = 1
) -> NoReturn:
    """Not in partita: fills DeepSpeed's optimizer fp32 fragments from a universal checkpoint."""
    raise not_in_partita(
        "deepspeed.checkpoint.universal_checkpoint.load_hp_checkpoint_state",
        "loading universal checkpoints into DeepSpeed's optimizer fragments "
        "(partita reshards its own checkpoints on load)",
    )


def enable_universal_checkpoint(param_list: Any) -> NoReturn:
    """Not in partita: attaches the universal-checkpoint loader to DeepSpeed's parameters."""
    raise not_in_partita(
        "deepspeed.checkpoint.universal_checkpoint.enable_universal_checkpoint",
        "DeepSpeed's universal-checkpoint loading",
    )


__getattr__ = module_getattr("deepspeed.checkpoint.universal_checkpoint")

__all__ = [
    "LayoutError",
    "SubparamShape",
    "enable_universal_checkpoint",
    "load_hp_checkpoint_state",
    "narrow_sub_params",
]
