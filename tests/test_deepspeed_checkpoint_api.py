"""DeepSpeed's checkpoint-inspection API on partita's stand-in (``deepspeed.checkpoint``): the
layout of a DeepSpeed checkpoint folder, the plan for merging it onto smaller degrees, and the
universal-checkpoint tensor-parallel merge. Folders are written here in DeepSpeed's layout with
plain ``torch.save``; reshape maps are checked against hand-worked examples."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from partita.checkpoint.manifest import CheckpointError
from partita.compat.deepspeed.checkpoint import (
    DeepSpeedCheckpoint,
    ZeROCheckpoint,
    get_model_3d_descriptor,
    get_model_ckpt_name_for_rank,
    model_3d_desc,
)
from partita.compat.deepspeed.checkpoint import constants as C
from partita.compat.deepspeed.checkpoint.ds_to_universal import _aggregate_autoep_zero12_metadata
from partita.compat.deepspeed.runtime.engine import _checkpoint_parallel_metadata


def _dims(pp: int, tp: int) -> dict[str, int]:
    return {C.CHECKPOINT_PP_DEGREE: pp, C.CHECKPOINT_TP_DEGREE: tp}


def _write_folder(folder: Path, dims: list[dict[str, int] | None], **extra: Any) -> None:
    """One model-state file per model-parallel rank and two bf16 ZeRO files for each."""
    for mp, recorded in enumerate(dims):
        state: dict[str, Any] = {C.PARAM_SHAPES: [{"w": (2, 2)}], "ds_config": {}, **extra}
        if recorded is not None:
            state[C.CHECKPOINT_PARALLEL_DIMS] = recorded
        torch.save(state, get_model_ckpt_name_for_rank(str(folder), f"{mp:02d}"))
        for d in range(2):
            torch.save({}, folder / f"bf16_zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states.pt")


def test_constants_are_deepspeeds_key_names() -> None:
    # The keys inside DeepSpeed's files: a different spelling would read nothing.
    assert C.CHECKPOINT_PARALLEL_DIMS == "checkpoint_parallel_dimensions"
    assert C.UNIVERSAL_CHECKPOINT_INFO == "universal_checkpoint_info"
    assert C.BF16_ZERO_FILE_PREFIX == "bf16_zero_pp_rank_"
    assert C.UNIVERSAL_CHECKPOINT_VERSION_VALUE == 0.4


# Source ranks are dp * 4 + pp * 2 + tp for (pp, tp, dp) = (2, 2, 2).
@pytest.mark.parametrize(
    "target,expected",
    [
        ((1, 1, 1), [{(0, 0): [0, 4, 1, 5, 2, 6, 3, 7]}]),
        ((1, 2, 1), [{(0, 0): [0, 4, 2, 6], (0, 1): [1, 5, 3, 7]}]),
        ((1, 2, 2), [{(0, 0): [0, 4], (0, 1): [1, 5]}, {(0, 0): [2, 6], (0, 1): [3, 7]}]),
        ((2, 1, 1), [{(0, 0): [0, 4, 1, 5], (1, 0): [2, 6, 3, 7]}]),
        (
            (2, 2, 2),
            [
                {(0, 0): [0], (0, 1): [1], (1, 0): [2], (1, 1): [3]},
                {(0, 0): [4], (0, 1): [5], (1, 0): [6], (1, 1): [7]},
            ],
        ),
    ],
)
def test_reshape_lists_the_source_ranks_merged_into_each_target_cell(
    target: tuple[int, int, int], expected: list[dict[tuple[int, int], list[int]]]
) -> None:
    source, goal = model_3d_desc(2, 2, 2), model_3d_desc(*target)
    assert source.can_reshape(goal)
    grids = source.reshape(goal)
    assert len(grids) == goal.dp_degree
    for grid, cells in zip(grids, expected, strict=True):
        assert (grid.pp_degree, grid.tp_degree) == target[:2]
        assert {cell: grid.get_data(*cell) for cell in cells} == cells


def test_reshape_refuses_growth_and_uneven_merges() -> None:
    valid, errors = model_3d_desc(1, 2, 2).can_reshape(model_3d_desc(2, 2, 1))
    assert not valid and "PP: 1 ---> 2" in errors[0]
    assert not model_3d_desc(1, 4, 1).can_reshape(model_3d_desc(1, 3, 1))
    with pytest.raises(ValueError, match="Expansion reshape not supported - TP"):
        model_3d_desc(1, 1, 1).reshape(model_3d_desc(1, 2, 1))


def test_descriptor_reads_recorded_dimensions(tmp_path: Path) -> None:
    _write_folder(tmp_path, [_dims(2, 1), _dims(2, 1)])
    desc = get_model_3d_descriptor(str(tmp_path))
    assert (desc.pp_degree, desc.tp_degree, desc.dp_degree) == (2, 1, 2)


def test_descriptor_without_recorded_dimensions_counts_model_files_as_tp(tmp_path: Path) -> None:
    _write_folder(tmp_path, [None, None])
    desc = get_model_3d_descriptor(str(tmp_path))
    assert (desc.pp_degree, desc.tp_degree, desc.dp_degree) == (1, 2, 2)
    assert ZeROCheckpoint(str(tmp_path)).get_src_tp_degree() == 2


@pytest.mark.parametrize(
    "dims,message",
    [
        ([_dims(2, 1), None], r"missing from model-state files \[.*mp_rank_01_model_states.pt"),
        ([_dims(2, 1), _dims(1, 2)], "disagrees across model-state files: .*mp_rank_00"),
        ([_dims(1, 1), _dims(1, 1)], "2 model-state files do not match .*pp_degree=1"),
        ([{"pp_degree": 0, "tp_degree": 1}], r"mp_rank_00_model_states.pt: .*\['pp_degree'\]"),
    ],
)
def test_descriptor_errors_name_the_files(
    tmp_path: Path, dims: list[dict[str, int] | None], message: str
) -> None:
    _write_folder(tmp_path, dims)
    with pytest.raises(CheckpointError, match=message):
        get_model_3d_descriptor(str(tmp_path))


def test_deepspeed_checkpoint_loads_each_model_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dims = _checkpoint_parallel_metadata(
        SimpleNamespace(
            get_pipe_parallel_world_size=lambda: 2, get_slice_parallel_world_size=lambda: 1
        )
    )[C.CHECKPOINT_PARALLEL_DIMS]
    assert dims == _dims(2, 1)
    _write_folder(tmp_path, [dims, dims], **{C.UNIVERSAL_CHECKPOINT_INFO: {"v": 1}, "iteration": 7})
    loads: list[str] = []
    real_load = torch.load

    def counting_load(path: Any, *args: Any, **kwargs: Any) -> Any:
        loads.append(str(path))
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counting_load)
    ckpt = DeepSpeedCheckpoint(str(tmp_path))
    assert loads == ckpt.mp_rank_files
    assert (ckpt.pp_degree, ckpt.tp_degree, ckpt.dp_degree) == (2, 1, 2)
    assert ckpt.get_checkpoint_info(C.UNIVERSAL_CHECKPOINT_INFO) == {"v": 1}
    assert ckpt.get_iteration() == 7
    assert ckpt.model_state_metadata[0][1][C.PARAM_SHAPES] == {"w": (2, 2)}
    zero_files = ckpt.get_zero_files(pp_index=1, tp_index=0, dp_index=1)
    assert [os.path.basename(f) for f in zero_files] == [
        "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt"
    ]


def test_deepspeed_checkpoint_plans_a_smaller_layout(tmp_path: Path) -> None:
    _write_folder(tmp_path, [_dims(2, 1), _dims(2, 1)])
    ckpt = DeepSpeedCheckpoint(str(tmp_path), pp_degree=1, dp_degree=1)
    names = [os.path.basename(f) for f in ckpt.get_zero_files(0, 0, 0)]
    # Ranks 0 (pp0 dp0), 2 (pp0 dp1), 1 (pp1 dp0), 3 (pp1 dp1), in the zero-file order.
    assert names == [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt",
    ]
    assert ckpt.get_2d_parallel_files(tp_index=0, pp_index=0) == ckpt.mp_rank_files


def test_autoep_metadata_is_checked_and_merged(tmp_path: Path) -> None:
    layer = {C.AUTOEP_EXPERT_KEY_PREFIX: "layers.0.experts", C.AUTOEP_NUM_EXPERTS: 4}
    _write_folder(tmp_path, [None, None], **{C.AUTOEP_LAYERS_KEY: [layer]})
    shapes, layers, ordering = _aggregate_autoep_zero12_metadata(
        DeepSpeedCheckpoint(str(tmp_path)).model_state_metadata
    )
    assert shapes == [{"w": (2, 2)}, {"w": (2, 2)}] and layers == [layer] and ordering is False
    bad = [("a.pt", {C.PARAM_SHAPES: {}, C.AUTOEP_LAYERS_KEY: "x", "ds_config": {}})]
    with pytest.raises(RuntimeError, match=r"AutoEP metadata must be a list in a\.pt"):
        _aggregate_autoep_zero12_metadata(bad)
