"""``deepspeed.checkpoint.reshape_3d_utils``: a checkpoint's (pipeline, tensor, data) parallel
layout, read from its folder, and the plan for merging it onto smaller degrees.

Source ranks are numbered ``dp * (pp_degree * tp_degree) + pp * tp_degree + tp``, the order in
which DeepSpeed's writer lays out ZeRO files. `model_3d_desc.reshape` merges the (pp, tp) grid
first (`reshape_meg_2d`), then spreads each cell's ranks over every source data-parallel
replica and cuts that run into one contiguous piece per target data-parallel rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from partita.checkpoint.manifest import CheckpointError
from partita.compat.checkpoint_reader import load_deepspeed_pickle
from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed.checkpoint.constants import (
    CHECKPOINT_PARALLEL_DIMS,
    CHECKPOINT_PP_DEGREE,
    CHECKPOINT_TP_DEGREE,
    LAYER_FILE_PREFIX,
    MODEL_FILE_PREFIX,
)
from partita.compat.deepspeed.checkpoint.reshape_meg_2d import (
    meg_2d_parallel_map,
    reshape_meg_2d_parallel,
)
from partita.compat.deepspeed.checkpoint.reshape_utils import (
    get_files,
    get_files_with_prefix,
    get_zero_files,
    partition_data,
)

PP_DIM = "PP"
TP_DIM = "TP"
DP_DIM = "DP"

ModelStateMetadata = list[tuple[str, dict[str, Any]]]


class ReshapeCheck(NamedTuple):
    """Whether a reshape is possible and, if not, why. Unpacks as DeepSpeed's ``(valid,
    errors)`` pair and is truthy only when the reshape is possible."""

    valid: bool
    errors: list[str]

    def __bool__(self) -> bool:
        return self.valid


class model_3d_desc:
    """A checkpoint's pipeline, tensor and data parallel degrees."""

    def __init__(self, pp_degree: int = 1, tp_degree: int = 1, dp_degree: int = 1) -> None:
        self.pp_degree = pp_degree
        self.tp_degree = tp_degree
        self.dp_degree = dp_degree

    def __repr__(self) -> str:
        return f"model_3d_desc({self.get_desc()})"

    def get_desc(self) -> str:
        """``"PP,TP,DP = (p, t, d)"``."""
        return (
            f"{PP_DIM},{TP_DIM},{DP_DIM} = ({self.pp_degree}, {self.tp_degree}, {self.dp_degree})"
        )

    def world_size(self) -> int:
        """The number of ranks that wrote (or will read) the checkpoint."""
        return self.pp_degree * self.tp_degree * self.dp_degree

    def _dims(self) -> tuple[tuple[str, int], ...]:
        return ((PP_DIM, self.pp_degree), (TP_DIM, self.tp_degree), (DP_DIM, self.dp_degree))

    def is_valid(self, pp_index: int, tp_index: int, dp_index: int) -> ReshapeCheck:
        """Whether (pp_index, tp_index, dp_index) is a position of this layout."""
        errors = [
            f"{name} indexing error: index {index} >= degree {degree}"
            for (name, degree), index in zip(
                self._dims(), (pp_index, tp_index, dp_index), strict=True
            )
            if index >= degree
        ]
        return ReshapeCheck(not errors, errors)

    def can_reshape(self, target: model_3d_desc) -> ReshapeCheck:
        """Whether this layout can be merged onto `target`: no degree may grow (a rank's files
        cannot be split), and each target degree must divide the source's."""
        errors = []
        for (name, old), (_, new) in zip(self._dims(), target._dims(), strict=True):
            if new > old:
                errors.append(f"Expansion reshape not supported - {name}: {old} ---> {new}")
            elif new < 1 or old % new:
                errors.append(f"{name} degree {new} does not divide the source's {old}")
        return ReshapeCheck(not errors, errors)

    def reshape(self, target: model_3d_desc, verbose: bool = False) -> list[meg_2d_parallel_map]:
        """Per target data-parallel rank, a (target pp x target tp) grid listing the source
        ranks merged into each cell. Raises `ValueError` naming why when `can_reshape` fails."""
        check = self.can_reshape(target)
        if not check:
            raise ValueError(
                f"cannot reshape {self.get_desc()} to {target.get_desc()}: "
                + "; ".join(check.errors)
            )
        grid = reshape_meg_2d_parallel(
            self.pp_degree, self.tp_degree, target.pp_degree, target.tp_degree, verbose
        )
        spread = flatten_dp_dimension(grid, self.pp_degree * self.tp_degree, self.dp_degree)
        return unflatten_dp_dimension(spread, target.dp_degree)


def flatten_dp_dimension(
    grid: meg_2d_parallel_map, src_2d_size: int, dp_degree: int
) -> meg_2d_parallel_map:
    """`grid` with each source rank ``r`` replaced by its copies in every data-parallel replica
    (``r, r + src_2d_size, ...``), kept next to each other."""
    out = meg_2d_parallel_map(grid.pp_degree, grid.tp_degree)
    for i in range(grid.pp_degree):
        for j in range(grid.tp_degree):
            for rank in grid.get_data(i, j):
                out.add_data(i, j, [rank + d * src_2d_size for d in range(dp_degree)])
    return out


def unflatten_dp_dimension(grid: meg_2d_parallel_map, dp_degree: int) -> list[meg_2d_parallel_map]:
    """`grid` split into `dp_degree` grids: each cell's ranks cut into contiguous equal runs."""
    grids = [meg_2d_parallel_map(grid.pp_degree, grid.tp_degree) for _ in range(dp_degree)]
    for i in range(grid.pp_degree):
        for j in range(grid.tp_degree):
            for part, ranks in zip(
                grids, partition_data(grid.get_data(i, j), dp_degree), strict=True
            ):
                part.add_data(i, j, ranks)
    return grids


def _positive(value: Any, key: str, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(
            f"{path}: {CHECKPOINT_PARALLEL_DIMS}[{key!r}] must be a positive integer, got {value!r}"
        )
    return value


def _recorded_dims(metadata: ModelStateMetadata) -> tuple[int, int] | None:
    """The (pp, tp) degrees every model-state file records, or None when none records them
    (checkpoints written before DeepSpeed recorded them)."""
    dims: dict[str, tuple[int, int]] = {}
    missing = []
    for path, meta in metadata:
        recorded = meta.get(CHECKPOINT_PARALLEL_DIMS)
        if recorded is None:
            missing.append(path)
            continue
        if not isinstance(recorded, dict):
            raise CheckpointError(
                f"{path}: {CHECKPOINT_PARALLEL_DIMS} must be a dictionary, "
                f"got {type(recorded).__name__}"
            )
        dims[path] = (
            _positive(recorded.get(CHECKPOINT_PP_DEGREE), CHECKPOINT_PP_DEGREE, path),
            _positive(recorded.get(CHECKPOINT_TP_DEGREE), CHECKPOINT_TP_DEGREE, path),
        )
    if not dims:
        return None
    if missing:
        raise CheckpointError(
            f"{CHECKPOINT_PARALLEL_DIMS} is missing from model-state files "
            f"{missing} but recorded in {sorted(dims)}"
        )
    if len(set(dims.values())) != 1:
        raise CheckpointError(
            f"{CHECKPOINT_PARALLEL_DIMS} disagrees across model-state files: "
            + ", ".join(f"{p}: (pp, tp) = {d}" for p, d in dims.items())
        )
    return next(iter(dims.values()))


def get_model_3d_descriptor_from_metadata(
    file_list: Sequence[str],
    zero_file_list: Sequence[str],
    model_state_metadata: ModelStateMetadata,
) -> model_3d_desc:
    """The layout from already-read model-state metadata (``[(path, {key: value})]``): the
    recorded (pp, tp) degrees, checked against the file counts; without them, DeepSpeed's older
    rule (pipeline layer files ``layer_01*`` give tp; otherwise each model file is a tp rank)."""
    model_files = len(model_state_metadata)
    recorded = _recorded_dims(model_state_metadata)
    if recorded is not None:
        pp, tp = recorded
        if model_files != pp * tp:
            raise CheckpointError(
                f"{model_files} model-state files do not match the recorded "
                f"{CHECKPOINT_PP_DEGREE}={pp} * {CHECKPOINT_TP_DEGREE}={tp}"
            )
        if len(zero_file_list) % (pp * tp):
            raise CheckpointError(
                f"{len(zero_file_list)} ZeRO files are not divisible by the "
                f"recorded {CHECKPOINT_PP_DEGREE}={pp} * {CHECKPOINT_TP_DEGREE}={tp}"
            )
    else:
        layer_files = len(get_files_with_prefix(file_list, f"{LAYER_FILE_PREFIX}01"))
        tp = layer_files or model_files
        pp = model_files // tp if layer_files else 1
    return model_3d_desc(pp, tp, max(1, len(zero_file_list) // (pp * tp)))


def get_model_3d_descriptor(folder: str) -> model_3d_desc:
    """The layout of DeepSpeed checkpoint tag folder `folder` (loads each model-state file)."""
    files = get_files(folder)
    metadata = [
        (path, {CHECKPOINT_PARALLEL_DIMS: _state_dict(path).get(CHECKPOINT_PARALLEL_DIMS)})
        for path in get_files_with_prefix(files, MODEL_FILE_PREFIX)
    ]
    return get_model_3d_descriptor_from_metadata(files, get_zero_files(folder), metadata)


def _mpu_degree(mpu: Any, getters: tuple[str, ...], default: int = 1) -> int:
    for name in getters:
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    return default


def checkpoint_parallel_metadata(mpu: Any = None) -> dict[str, dict[str, int]]:
    """The ``checkpoint_parallel_dimensions`` entry a writer records in each model-state file:
    the pipeline and tensor degrees of model-parallel unit `mpu` (Megatron's or DeepSpeed's
    getter names, newest first), 1 and 1 without one."""
    pp = _mpu_degree(
        mpu, ("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size")
    )
    tp = _mpu_degree(
        mpu,
        (
            "get_tensor_model_parallel_world_size",
            "get_slice_parallel_world_size",
            "get_model_parallel_world_size",
        ),
    )
    return {CHECKPOINT_PARALLEL_DIMS: {CHECKPOINT_PP_DEGREE: pp, CHECKPOINT_TP_DEGREE: tp}}


def _state_dict(path: str) -> dict[str, Any]:
    state = load_deepspeed_pickle(path)
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{path}: expected a dict of checkpoint keys, got {type(state).__name__}"
        )
    return state


__getattr__ = module_getattr("deepspeed.checkpoint.reshape_3d_utils")

__all__ = [
    "ReshapeCheck",
    "checkpoint_parallel_metadata",
    "flatten_dp_dimension",
    "get_model_3d_descriptor",
    "get_model_3d_descriptor_from_metadata",
    "model_3d_desc",
    "unflatten_dp_dimension",
]
