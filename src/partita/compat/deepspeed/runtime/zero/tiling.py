"""``deepspeed.runtime.zero.tiling``: ``TiledLinear`` and ``TiledLinearReturnBias``, a linear
layer stored as tiles so that ZeRO-3 gathers one tile at a time (`partita.tiling.linear`)."""

from partita.compat.deepspeed._missing import module_getattr
from partita.tiling.linear import (
    TiledLinear,
    TiledLinearReturnBias,
    split_tensor_along_last_dim,
)

__getattr__ = module_getattr("deepspeed.runtime.zero.tiling")

__all__ = ["TiledLinear", "TiledLinearReturnBias", "split_tensor_along_last_dim"]
