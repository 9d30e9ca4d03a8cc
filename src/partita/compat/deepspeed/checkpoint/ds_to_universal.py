"""``deepspeed.checkpoint.ds_to_universal``: checks for turning a DeepSpeed checkpoint into a
universal (parallelism-independent) one: the layouts a conversion cannot handle, the per-tensor-
rank parameter shapes across pipeline stages, and the AutoEP metadata of ZeRO 1/2 files.

The conversion itself (`main`, `merge_tp_slices`) rewrites DeepSpeed's optimizer fragments
into DeepSpeed's universal layout, which only DeepSpeed's optimizer reads back: it raises
`FeatureNotInPartita`; partita's own checkpoints reshard on load, and
``partita.checkpoint.export`` turns a DeepSpeed checkpoint into plain weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

from partita.checkpoint.manifest import CheckpointError
from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed._placeholder import not_in_partita
from partita.compat.deepspeed.checkpoint.constants import (
    AUTOEP_EXPERT_KEY_PREFIX,
    AUTOEP_LAYERS_KEY,
    AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS,
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


def _validate_autotp_conversion_support(universal_checkpoint_info: dict[str, Any]) -> None:
    """Raises `ValueError` listing every parameter pattern the writer marked as impossible to
    convert (``autotp_unsupported_parameter_patterns``: pattern -> reason); older metadata
    without the key passes."""
    unsupported = universal_checkpoint_info.get(AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS) or {}
    if unsupported:
        details = ", ".join(f"{pattern}: {why}" for pattern, why in sorted(unsupported.items()))
        raise ValueError(f"AutoTP universal checkpoint conversion is not supported for {details}")


def _group_per_tp_shapes(
    slice_shapes_by_tp: Sequence[dict[str, Any]], pp_degree: int, tp_degree: int
) -> dict[str, list[Any]]:
    """Per parameter name, its shape on each tensor rank (None where that rank has none), from
    the model files' shapes in mp-rank order (pipeline-major: index ``pp * tp_degree + tp``).
    A parameter in several pipeline stages (a tied embedding) must have one shape in all."""
    per_tp: list[dict[str, Any]] = []
    for tp in range(tp_degree):
        shapes: dict[str, Any] = {}
        for pp in range(pp_degree):
            for name, shape in slice_shapes_by_tp[pp * tp_degree + tp].items():
                if name in shapes and shapes[name] != shape:
                    raise AssertionError(
                        f"pipeline replicas of {name} on tp rank {tp} disagree on shape: "
                        f"{shapes[name]} (an earlier stage) vs {shape} (stage {pp})"
                    )
                shapes[name] = shape
        per_tp.append(shapes)
    names = sorted({name for shapes in per_tp for name in shapes})
    return {name: [shapes.get(name) for shapes in per_tp] for name in names}


_CONVERSION = (
    "conversion to DeepSpeed's universal checkpoint layout (partita's checkpoints reshard on "
    "load; partita.checkpoint.export writes plain weights from a DeepSpeed checkpoint)"
)


def merge_tp_slices(*args: Any, **kwargs: Any) -> NoReturn:
    """Not in partita: one step of DeepSpeed's universal-checkpoint conversion."""
    raise not_in_partita("deepspeed.checkpoint.ds_to_universal.merge_tp_slices", _CONVERSION)


def main(args: Any = None) -> NoReturn:
    """Not in partita: DeepSpeed's ``ds_to_universal`` command."""
    raise not_in_partita("deepspeed.checkpoint.ds_to_universal.main", _CONVERSION)


__getattr__ = module_getattr("deepspeed.checkpoint.ds_to_universal")

__all__ = ["DeepSpeedCheckpoint", "main", "merge_tp_slices"]
