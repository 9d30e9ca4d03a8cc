"""``deepspeed.checkpoint.zero_checkpoint.ZeROCheckpoint``: a DeepSpeed checkpoint folder's ZeRO
optimizer-state files, arranged by (pipeline, tensor, data) parallel position, with the option
of merging them onto smaller degrees."""

from __future__ import annotations

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed.checkpoint.reshape_3d_utils import (
    get_model_3d_descriptor,
    model_3d_desc,
)
from partita.compat.deepspeed.checkpoint.reshape_meg_2d import meg_2d_parallel_map
from partita.compat.deepspeed.checkpoint.reshape_utils import (
    basic_folder_validation,
    get_zero_files,
)


class ZeROCheckpoint:
    """The ZeRO files of tag folder `dir`. `source_3d` is the folder's layout when the caller
    has already read it (`DeepSpeedCheckpoint` does, so model files are loaded only once)."""

    def __init__(self, dir: str, source_3d: model_3d_desc | None = None) -> None:
        basic_folder_validation(dir)
        self.dir = dir
        self.file_list = get_zero_files(dir)
        self.num_files = len(self.file_list)
        self.src_3d = source_3d if source_3d is not None else get_model_3d_descriptor(dir)
        self.target_3d = model_3d_desc(
            self.src_3d.pp_degree, self.src_3d.tp_degree, self.src_3d.dp_degree
        )
        self._3d_file_map: list[meg_2d_parallel_map] = self.src_3d.reshape(self.target_3d)

    def get_src_world_size(self) -> int:
        """The number of ranks that wrote the checkpoint."""
        return self.src_3d.world_size()

    def get_src_tp_degree(self) -> int:
        """The writer's tensor-parallel degree."""
        return self.src_3d.tp_degree

    def get_src_pp_degree(self) -> int:
        """The writer's pipeline-parallel degree."""
        return self.src_3d.pp_degree

    def get_src_dp_degree(self) -> int:
        """The writer's data-parallel degree."""
        return self.src_3d.dp_degree

    def get_file_indices_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> list[int]:
        """Indices into `file_list` of the source files merged into target position
        (pp_index, tp_index, dp_index)."""
        check = self.target_3d.is_valid(pp_index, tp_index, dp_index)
        if not check:
            raise IndexError("; ".join(check.errors))
        return self._3d_file_map[dp_index].get_data(pp_index, tp_index)

    def get_files_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> list[str]:
        """The source ZeRO files merged into target position (pp_index, tp_index, dp_index)."""
        indices = self.get_file_indices_for_rank(pp_index, tp_index, dp_index)
        return [self.file_list[i] for i in indices]

    def reshape(self, target_3d: model_3d_desc) -> None:
        """Plans reading this checkpoint at `target_3d`'s (smaller or equal) degrees."""
        self._3d_file_map = self.src_3d.reshape(target_3d)
        self.target_3d = target_3d


__getattr__ = module_getattr("deepspeed.checkpoint.zero_checkpoint")

__all__ = ["ZeROCheckpoint"]
