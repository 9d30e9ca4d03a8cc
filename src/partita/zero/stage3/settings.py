"""The stage-3 settings, typed and frozen: what `FullySharded` reads of the config.

The strategy takes these instead of the ``zero_optimization`` section itself, so the seam
between the engine and ZeRO-3 names each value it depends on, with its type, and whatever else
plans a stage-3 job (the memory estimator) starts from the same defaults (`DEFAULTS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Stage3Settings:
    """The ``zero_optimization`` values stage 3 runs by (DeepSpeed's key in each docstring)."""

    sub_group_size: int
    """``sub_group_size``: elements per rank of one optimizer sub-group (stepped, swapped
    as a whole)."""
    reduce_bucket_size: int
    """``reduce_bucket_size``: gradient elements in reduce-scatters at once."""
    prefetch_bucket_size: int
    """``stage3_prefetch_bucket_size``: parameter elements gathered ahead of use."""
    max_live_parameters: int
    """``stage3_max_live_parameters``: gathered parameter elements alive at once."""
    max_reuse_distance: int
    """``stage3_max_reuse_distance``: a unit used again within this many elements stays."""
    param_persistence_threshold: int
    """``stage3_param_persistence_threshold``: parameters this small stay gathered."""
    check_divergence: bool
    """``stage3_check_divergence``: check the units' collectives agree across ranks."""
    leaf_module: Any
    """``leaf_module``: modules gathered whole ([Note: leaf modules] in `stage3.leaves`)."""
    hpz_partition_size: int = 1
    """``zero_hpz_partition_size``: ZeRO++ hpZ's node size (1: off)."""
    quantized_weights: bool = False
    """``zero_quantized_weights``: ZeRO++ qwZ."""
    quantized_nontrainable_weights: bool = False
    """``zero_quantized_nontrainable_weights``: frozen weights gathered quantized."""
    quantized_gradients: bool = False
    """``zero_quantized_gradients``: ZeRO++ qgZ."""
    quantized_gradients_bits: int = 8
    """``zero_quantized_gradients_bits``: qgZ's code width on both hops (partita's key)."""
    quantized_gradients_error_feedback: bool = False
    """``zero_quantized_gradients_error_feedback``: qgZ keeps and resends its quantization
    residuals (partita's key)."""

    @classmethod
    def from_config(cls, zero: Any) -> Stage3Settings:
        """From a validated ``zero_optimization`` section (`partita.config.ZeroConfig`)."""
        return cls(
            sub_group_size=int(zero.sub_group_size),
            reduce_bucket_size=int(zero.reduce_bucket_size),
            prefetch_bucket_size=int(zero.stage3_prefetch_bucket_size),
            max_live_parameters=int(zero.stage3_max_live_parameters),
            max_reuse_distance=int(zero.stage3_max_reuse_distance),
            param_persistence_threshold=int(zero.stage3_param_persistence_threshold),
            check_divergence=bool(zero.stage3_check_divergence),
            leaf_module=zero.leaf_module,
            hpz_partition_size=int(zero.zero_hpz_partition_size),
            quantized_weights=bool(zero.zero_quantized_weights),
            quantized_nontrainable_weights=bool(zero.zero_quantized_nontrainable_weights),
            quantized_gradients=bool(zero.zero_quantized_gradients),
            quantized_gradients_bits=int(zero.zero_quantized_gradients_bits),
            quantized_gradients_error_feedback=bool(zero.zero_quantized_gradients_error_feedback),
        )

    @classmethod
    def defaults(cls) -> Stage3Settings:
        """The settings of a config that sets none of the keys (the schema's defaults)."""
        from partita.config.sections.zero import ZeroConfig

        return cls.from_config(ZeroConfig())


__all__ = ["Stage3Settings"]
