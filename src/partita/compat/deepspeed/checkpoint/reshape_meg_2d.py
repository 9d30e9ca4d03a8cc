"""``deepspeed.checkpoint.reshape_meg_2d``: which source model-parallel ranks merge into each
(pipeline, tensor) position when a checkpoint moves to smaller pipeline/tensor degrees.

Source ranks are numbered pipeline-major, as DeepSpeed's writer numbers ``mp_rank_XX`` files:
rank ``i`` sits at pipeline stage ``i // tp_degree``, tensor rank ``i % tp_degree``. Shrinking
a degree merges neighbours: the ranks along that dimension are cut into equal contiguous runs,
one per new index (tensor dimension first, then pipeline).
"""

from __future__ import annotations

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed.checkpoint.reshape_utils import partition_data


class meg_2d_parallel_map:
    """A pp_degree x tp_degree grid; each cell lists the source ranks merged into it."""

    def __init__(self, pp_degree: int, tp_degree: int) -> None:
        self.pp_degree = pp_degree
        self.tp_degree = tp_degree
        self.map: dict[tuple[int, int], list[int]] = {}

    def simple_init(self) -> None:
        """The identity layout: cell (pp, tp) holds source rank ``pp * tp_degree + tp``."""
        self.map = {
            (i // self.tp_degree, i % self.tp_degree): [i]
            for i in range(self.pp_degree * self.tp_degree)
        }

    def add_data(self, pp_index: int, tp_index: int, data: list[int]) -> None:
        """Appends `data` (a list of ranks) to cell (pp_index, tp_index)."""
        self._validate_indices(pp_index, tp_index)
        if not isinstance(data, list):
            raise TypeError(f"add_data takes a list of ranks, got {type(data).__name__}")
        self.map.setdefault((pp_index, tp_index), []).extend(data)

    def get_data(self, pp_index: int | None = None, tp_index: int | None = None) -> list[int]:
        """The ranks of one cell; None for an index means every index of that dimension
        (pipeline-major order)."""
        self._validate_indices(pp_index, tp_index)
        pps = range(self.pp_degree) if pp_index is None else [pp_index]
        tps = range(self.tp_degree) if tp_index is None else [tp_index]
        return [rank for i in pps for j in tps for rank in self.map.get((i, j), [])]

    def print_data(self, tag: str) -> None:
        """Prints the grid under a heading `tag` (a debugging aid DeepSpeed offers)."""
        print(tag)
        for (i, j), ranks in sorted(self.map.items()):
            print(f"{i},{j} = {ranks}")

    def _validate_indices(self, pp_index: int | None, tp_index: int | None) -> None:
        for name, index, degree in (
            ("pp", pp_index, self.pp_degree),
            ("tp", tp_index, self.tp_degree),
        ):
            if index is not None and not 0 <= index < degree:
                raise IndexError(f"{name}_index {index} is outside 0..{degree - 1}")


def _merge_tp(old: meg_2d_parallel_map, new_tp_degree: int) -> meg_2d_parallel_map:
    new = meg_2d_parallel_map(old.pp_degree, new_tp_degree)
    for i in range(old.pp_degree):
        for j, ranks in enumerate(partition_data(old.get_data(pp_index=i), new_tp_degree)):
            new.add_data(i, j, ranks)
    return new


def _merge_pp(old: meg_2d_parallel_map, new_pp_degree: int) -> meg_2d_parallel_map:
    new = meg_2d_parallel_map(new_pp_degree, old.tp_degree)
    for j in range(old.tp_degree):
        for i, ranks in enumerate(partition_data(old.get_data(tp_index=j), new_pp_degree)):
            new.add_data(i, j, ranks)
    return new


def reshape_meg_2d_parallel(
    old_pp_degree: int,
    old_tp_degree: int,
    new_pp_degree: int,
    new_tp_degree: int,
    verbose: bool = False,
) -> meg_2d_parallel_map:
    """The grid of the new (pipeline, tensor) degrees, each cell listing the source ranks it
    merges. Only shrinking is possible (a rank's file cannot be split); degrees must divide."""
    if new_pp_degree > old_pp_degree or new_tp_degree > old_tp_degree:
        raise ValueError(
            f"cannot expand (pp, tp) = ({old_pp_degree}, {old_tp_degree}) to "
            f"({new_pp_degree}, {new_tp_degree}): only merging ranks is supported"
        )
    grid = meg_2d_parallel_map(old_pp_degree, old_tp_degree)
    grid.simple_init()
    if new_tp_degree != old_tp_degree:
        grid = _merge_tp(grid, new_tp_degree)
    if new_pp_degree != old_pp_degree:
        grid = _merge_pp(grid, new_pp_degree)
    if verbose:
        grid.print_data("reshaped 2d map:")
    return grid


__getattr__ = module_getattr("deepspeed.checkpoint.reshape_meg_2d")

__all__ = ["meg_2d_parallel_map", "reshape_meg_2d_parallel"]
