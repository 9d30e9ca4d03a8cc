"""``deepspeed.module_inject.tp_shard``: how a dimension is divided among tensor-parallel ranks.

Whole units go to ranks, the remainder to the lowest ranks (10 over 4 is 3, 3, 2, 2): a unit is
one attention head when the layout metadata names a key/value head count that divides the
dimension, else ``tp_grain_size`` elements (default 1). partita's own tensor parallelism only
accepts dimensions that divide evenly, where this gives equal shares.
"""

from __future__ import annotations

from typing import Any

from partita.compat.deepspeed._missing import module_getattr


def _unit(total_size: int, meta: Any) -> int:
    heads = getattr(meta, "num_kv_heads", None)
    if isinstance(heads, int) and heads > 0 and total_size % heads == 0:
        return total_size // heads
    grain = getattr(meta, "tp_grain_size", None)
    return grain if isinstance(grain, int) and grain > 0 else 1


def get_shard_size_list(
    total_size: int, mp_size: int, meta: Any = None, name: str | None = None
) -> list[int]:
    """Each of `mp_size` ranks' share of a dimension of `total_size`; `meta` may carry
    ``num_kv_heads`` / ``tp_grain_size`` (DeepSpeed's AutoTP metadata; anything else, such as
    a layer name passed positionally, means element grain). Raises `ValueError` naming the
    layer when the dimension is not a whole number of units or has fewer units than ranks."""
    if mp_size < 1:
        raise ValueError(f"tensor-parallel size must be positive, got {mp_size}")
    unit = _unit(total_size, meta)
    layer = name if name is not None else (meta if isinstance(meta, str) else "?")
    units, rest = divmod(total_size, unit)
    if rest:
        raise ValueError(
            f"layer {layer!r}: dimension {total_size} is not a whole number of {unit}-element units"
        )
    base, extra = divmod(units, mp_size)
    return [(base + (rank < extra)) * unit for rank in range(mp_size)]


def get_shard_size(
    total_size: int,
    mp_size: int,
    meta: Any = None,
    name: str | None = None,
    rank: int | None = None,
) -> int:
    """Rank `rank`'s share of the dimension (`get_shard_size_list`); rank 0 when None."""
    return get_shard_size_list(total_size, mp_size, meta, name)[0 if rank is None else rank]


__getattr__ = module_getattr("deepspeed.module_inject.tp_shard")

__all__ = ["get_shard_size", "get_shard_size_list"]
