"""``deepspeed.checkpoint.DeepSpeedCheckpoint``: what a DeepSpeed checkpoint tag folder holds,
its (pipeline, tensor, data) parallel layout and the run-wide keys of its model-state files.

Each ``mp_rank_XX_model_states.pt`` is loaded exactly once, at construction, and only small
metadata is kept (`model_state_metadata`): the recorded parallel degrees, the parameter shapes,
AutoEP layer metadata and the expert-ordering flag of the config, so inspecting a large
checkpoint does not hold its weights in memory.
"""

from __future__ import annotations

from typing import Any

from partita.checkpoint.manifest import CheckpointError
from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed.checkpoint.constants import (
    ARGS_KEY,
    AUTOEP_LAYERS_KEY,
    AUTOEP_LAYERS_KEY_LEGACY,
    CHECKPOINT_INFO_KEY,
    CHECKPOINT_PARALLEL_DIMS,
    ITERATION_KEY,
    MODEL_FILE_PREFIX,
    PARAM_SHAPES,
    UNIVERSAL_CHECKPOINT_INFO,
    USE_DATA_BEFORE_EXPERT_PARALLELISM,
)
from partita.compat.deepspeed.checkpoint.reshape_3d_utils import (
    _state_dict,
    get_model_3d_descriptor_from_metadata,
    model_3d_desc,
)
from partita.compat.deepspeed.checkpoint.reshape_meg_2d import (
    meg_2d_parallel_map,
    reshape_meg_2d_parallel,
)
from partita.compat.deepspeed.checkpoint.reshape_utils import (
    basic_folder_validation,
    get_files,
    get_files_with_prefix,
    get_zero_files,
)
from partita.compat.deepspeed.checkpoint.zero_checkpoint import ZeROCheckpoint

_GLOBAL_KEYS = (ARGS_KEY, CHECKPOINT_INFO_KEY, UNIVERSAL_CHECKPOINT_INFO)


def _merged_shapes(value: Any) -> Any:
    """``param_shapes`` (a list of per-group name -> shape dicts) as one dict; anything else
    is kept as found, for the consumer to reject naming the file."""
    if isinstance(value, (list, tuple)) and all(isinstance(g, dict) for g in value):
        return {name: shape for group in value for name, shape in group.items()}
    return value


def _model_metadata(state: dict[str, Any]) -> dict[str, Any]:
    """The small part of one model-state file later consumers need."""
    autoep = state.get(AUTOEP_LAYERS_KEY)
    config = state.get("ds_config", {})
    if isinstance(config, dict):
        ordering = config.get(USE_DATA_BEFORE_EXPERT_PARALLELISM, False)
        config = {USE_DATA_BEFORE_EXPERT_PARALLELISM: ordering}
    return {
        CHECKPOINT_PARALLEL_DIMS: state.get(CHECKPOINT_PARALLEL_DIMS),
        PARAM_SHAPES: _merged_shapes(state.get(PARAM_SHAPES)),
        AUTOEP_LAYERS_KEY: autoep if autoep is not None else state.get(AUTOEP_LAYERS_KEY_LEGACY),
        "ds_config": config,
    }


class DeepSpeedCheckpoint:
    """DeepSpeed checkpoint tag folder `dir`, optionally planned for reading at other (smaller)
    tensor / pipeline / data parallel degrees (by default, the writer's)."""

    def __init__(
        self,
        dir: str,  # DeepSpeed's parameter name
        tp_degree: int | None = None,
        pp_degree: int | None = None,
        dp_degree: int | None = None,
    ) -> None:
        basic_folder_validation(dir)
        self.dir = dir
        self.file_list = get_files(dir)
        self.mp_rank_files = get_files_with_prefix(self.file_list, MODEL_FILE_PREFIX)
        if not self.mp_rank_files:
            raise CheckpointError(
                f"{dir}: no {MODEL_FILE_PREFIX}*_model_states.pt files; this "
                "is not a DeepSpeed checkpoint tag folder"
            )
        self.model_state_metadata, self.global_state = self._read_model_states()
        source = get_model_3d_descriptor_from_metadata(
            self.file_list, get_zero_files(dir), self.model_state_metadata
        )
        self.zero_checkpoint = ZeROCheckpoint(dir, source_3d=source)
        self.tp_degree = source.tp_degree if tp_degree is None else tp_degree
        self.pp_degree = source.pp_degree if pp_degree is None else pp_degree
        self.dp_degree = source.dp_degree if dp_degree is None else dp_degree
        self.original_world_size = source.world_size()
        self.world_size = self.tp_degree * self.pp_degree * self.dp_degree
        self.old_2d_map = meg_2d_parallel_map(source.pp_degree, source.tp_degree)
        self.old_2d_map.simple_init()
        self.new_2d_map = reshape_meg_2d_parallel(
            source.pp_degree, source.tp_degree, self.pp_degree, self.tp_degree
        )
        if self.is_change_pp_degree() or self.is_change_tp_degree() or self.is_change_dp_degree():
            self.zero_checkpoint.reshape(
                model_3d_desc(self.pp_degree, self.tp_degree, self.dp_degree)
            )

    def _read_model_states(self) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any]]:
        metadata = []
        global_state: dict[str, Any] = {}
        for index, path in enumerate(self.mp_rank_files):
            state = _state_dict(path)
            metadata.append((path, _model_metadata(state)))
            if index == 0:
                global_state[ITERATION_KEY] = state.get(ITERATION_KEY, 0)
                global_state.update({key: state.get(key) for key in _GLOBAL_KEYS})
        return metadata, global_state

    def is_change_tp_degree(self) -> bool:
        """Whether the planned tensor-parallel degree differs from the writer's."""
        return self.tp_degree != self.zero_checkpoint.get_src_tp_degree()

    def is_change_pp_degree(self) -> bool:
        """Whether the planned pipeline-parallel degree differs from the writer's."""
        return self.pp_degree != self.zero_checkpoint.get_src_pp_degree()

    def is_change_dp_degree(self) -> bool:
        """Whether the planned data-parallel degree differs from the writer's."""
        return self.dp_degree != self.zero_checkpoint.get_src_dp_degree()

    def get_iteration(self) -> Any:
        """The training iteration recorded in the first model-state file (0 when absent)."""
        return self.global_state[ITERATION_KEY]

    def get_args(self) -> Any:
        """The ``args`` the writer recorded (Megatron-style runs), or None."""
        return self.global_state.get(ARGS_KEY)

    def get_checkpoint_info(self, info_key: str = CHECKPOINT_INFO_KEY) -> Any:
        """A run-wide entry of the first model-state file: ``checkpoint_info`` by default, or
        ``universal_checkpoint_info`` / ``args``; None when the writer did not record it."""
        if info_key not in self.global_state:
            raise KeyError(
                f"{info_key!r} is not a run-wide checkpoint key; known: {sorted(self.global_state)}"
            )
        return self.global_state[info_key]

    def get_2d_parallel_files(self, tp_index: int, pp_index: int) -> list[str]:
        """The model-state files merged into planned position (pp_index, tp_index)."""
        return [self.mp_rank_files[i] for i in self.new_2d_map.get_data(pp_index, tp_index)]

    def get_zero_files(self, pp_index: int, tp_index: int, dp_index: int) -> list[str]:
        """The ZeRO files merged into planned position (pp_index, tp_index, dp_index)."""
        return self.zero_checkpoint.get_files_for_rank(pp_index, tp_index, dp_index)


__getattr__ = module_getattr("deepspeed.checkpoint.deepspeed_checkpoint")

__all__ = ["DeepSpeedCheckpoint"]
