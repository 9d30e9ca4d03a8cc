"""``deepspeed.checkpoint.ds_to_universal``: checks and merges for turning a DeepSpeed
checkpoint into a universal (parallelism-independent) one."""

from __future__ import annotations

from typing import Any

from partita.checkpoint.manifest import CheckpointError
from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed.checkpoint.constants import (
    AUTOEP_EXPERT_KEY_PREFIX,
    AUTOEP_LAYERS_KEY,
    PARAM_SHAPES,
    USE_DATA_BEFORE_EXPERT_PARALLELISM,
)
from partita.compat.deepspeed.checkpoint.deepspeed_checkpoint import DeepSpeedCheckpoint


def _autoep_layers(path: str, layers: Any, found: dict[str, tuple[str, dict[str, Any]]]) -> None:
    """Adds one file's AutoEP layer entries to `found` (prefix -> (first file, entry)),
    refusing malformed entries and two files that describe one layer differently."""
    if layers is None:
        return
    if not isinstance(layers, list):
        raise CheckpointError(
            f"AutoEP metadata must be a list in {path}, got {type(layers).__name__}"
        )
    for layer in layers:
        if not isinstance(layer, dict):
            raise CheckpointError(f"AutoEP layer metadata must contain dictionaries in {path}")
        prefix = layer.get(AUTOEP_EXPERT_KEY_PREFIX)
        if not isinstance(prefix, str) or not prefix:
            raise CheckpointError(
                f"AutoEP {AUTOEP_EXPERT_KEY_PREFIX} must be a non-empty string in {path}"
            )
        first = found.setdefault(prefix, (path, layer))
        if first[1] != layer:
            raise CheckpointError(
                f"Conflicting AutoEP metadata for {AUTOEP_EXPERT_KEY_PREFIX} "
                f"{prefix!r} in {first[0]} and {path}"
            )


def _expert_ordering(path: str, config: Any) -> bool:
    if not isinstance(config, dict):
        raise CheckpointError(f"DeepSpeed checkpoint ds_config must be a dictionary in {path}")
    ordering = config.get(USE_DATA_BEFORE_EXPERT_PARALLELISM, False)
    if not isinstance(ordering, bool):
        raise CheckpointError(
            f"DeepSpeed checkpoint {USE_DATA_BEFORE_EXPERT_PARALLELISM} must "
            f"be a boolean in {path}, got {ordering!r}"
        )
    return ordering


def _aggregate_autoep_zero12_metadata(
    model_state_metadata: list[tuple[str, dict[str, Any]]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, bool]:
    """From `DeepSpeedCheckpoint.model_state_metadata`: each model file's parameter shapes (in
    mp-rank order), the AutoEP layer entries merged across files (None without AutoEP), and
    the ``use_data_before_expert_parallelism`` flag every file must agree on."""
    shapes = []
    layers: dict[str, tuple[str, dict[str, Any]]] = {}
    orderings: dict[str, bool] = {}
    for path, metadata in model_state_metadata:
        param_shapes = metadata[PARAM_SHAPES]
        if not isinstance(param_shapes, dict):
            raise CheckpointError(
                f"DeepSpeed checkpoint {PARAM_SHAPES} must contain dictionaries in {path}"
            )
        shapes.append(param_shapes)
        _autoep_layers(path, metadata[AUTOEP_LAYERS_KEY], layers)
        orderings[path] = _expert_ordering(path, metadata["ds_config"])
    if len(set(orderings.values())) != 1:
        raise CheckpointError(
            f"DeepSpeed checkpoint {USE_DATA_BEFORE_EXPERT_PARALLELISM} "
            f"disagrees across model-state files: {orderings}"
        )
    merged = [layer for _, layer in layers.values()] or None
    return shapes, merged, next(iter(orderings.values()))


__getattr__ = module_getattr("deepspeed.checkpoint.ds_to_universal")

__all__ = ["DeepSpeedCheckpoint"]
