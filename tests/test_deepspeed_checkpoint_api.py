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
from partita.compat.deepspeed._placeholder import FeatureNotInPartita
from partita.compat.deepspeed.checkpoint import (
    DeepSpeedCheckpoint,
    ZeROCheckpoint,
    get_model_3d_descriptor,
    get_model_ckpt_name_for_rank,
    model_3d_desc,
)
from partita.compat.deepspeed.checkpoint import constants as C
from partita.compat.deepspeed.checkpoint.ds_to_universal import (
    _aggregate_autoep_zero12_metadata,
    _group_per_tp_shapes,
    _validate_autotp_conversion_support,
    merge_tp_slices,
)
from partita.compat.deepspeed.checkpoint.universal_checkpoint import (
    LayoutError,
    _get_param_uc_restore_meta,
    _resolve_autotp_partition,
)
from partita.compat.deepspeed.module_inject.tp_shard import get_shard_size_list
from partita.compat.deepspeed.runtime.engine import _checkpoint_parallel_metadata
from partita.compat.deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer


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


def _tp_param(meta: dict[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(**{C.DS_AUTOTP_UC_META: meta})


def test_autotp_slice_of_a_row_parallel_weight() -> None:
    full = torch.arange(32.0).view(4, 8)
    meta = {"partition_dim": 1, "logical_shape": (4, 8)}
    got = _resolve_autotp_partition(_tp_param(meta), {}, full, tp_rank=1, tp_world_size=2)
    assert got is not None and torch.equal(got, full[:, 4:].flatten())


def test_autotp_slice_of_a_fused_weight_cuts_each_sub_parameter() -> None:
    # Q, K, V of 8, 4, 4 rows over 2 ranks: rank 1 holds Q rows 4-7, K rows 10-11, V rows 14-15.
    full = torch.arange(32.0).view(16, 2)
    meta = {"partition_dim": 0, "logical_shape": (16, 2), "sub_param_sizes": (8, 4, 4)}
    got = _resolve_autotp_partition(_tp_param(meta), {}, full, tp_rank=1, tp_world_size=2)
    assert got is not None and torch.equal(got, full[[4, 5, 6, 7, 10, 11, 14, 15]].flatten())
    widths = {**meta, C.UNIVERSAL_CHECKPOINT_VERSION_KEY: 0.4,
              "sub_param_shard_widths": [[6, 2], [3, 1], [3, 1]]}  # fmt: skip
    got = _resolve_autotp_partition(_tp_param(widths), {}, full, tp_rank=1, tp_world_size=2)
    assert got is not None and torch.equal(got, full[[6, 7, 11, 15]].flatten())


def test_autotp_slice_uses_recorded_uneven_sizes_and_refuses_to_guess() -> None:
    full = torch.arange(10.0)
    meta = {"partition_dim": 0, "logical_shape": (10,), "partition_sizes": (3, 3, 2, 2)}
    got = _resolve_autotp_partition(_tp_param(meta), {}, full, tp_rank=2, tp_world_size=4)
    assert got is not None and torch.equal(got, full[6:8])
    unknown = {"partition_dim": 0, "logical_shape": (10,)}
    with pytest.raises(LayoutError, match="records no partition_sizes"):
        _resolve_autotp_partition(_tp_param(unknown), {}, full, tp_rank=0, tp_world_size=4)
    fused = {**unknown, "sub_param_sizes": (6, 4)}
    with pytest.raises(AssertionError, match=r"\[4\] are not divisible by tp_world_size 3"):
        _resolve_autotp_partition(_tp_param(fused), {}, torch.zeros(10), tp_rank=0, tp_world_size=3)


def test_autotp_slice_of_replicated_or_unannotated_parameters() -> None:
    full = torch.arange(4.0)
    replicated = _tp_param({"replicated": True, "partition_dim": None})
    assert torch.equal(_resolve_autotp_partition(replicated, {}, full, 1, 2), full)  # type: ignore[arg-type]
    assert _resolve_autotp_partition(SimpleNamespace(), {}, full, 1, 2) is None
    assert _get_param_uc_restore_meta(replicated) == {"replicated": True, "partition_dim": None}


def test_conversion_support_names_the_unsupported_patterns() -> None:
    _validate_autotp_conversion_support({})
    info = {C.AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS: {r"^qkv\.weight$": "interleaved heads"}}
    with pytest.raises(ValueError, match=r"\^qkv\\.weight\$: interleaved heads"):
        _validate_autotp_conversion_support(info)


def test_per_tp_shapes_union_pipeline_stages_and_check_tied_copies() -> None:
    stages = [{"emb": (3, 4), "l0": (2, 4)}, {"emb": (2, 4), "l0": (2, 4)},
              {"emb": (3, 4), "l1": (1, 4)}, {"emb": (2, 4)}]  # fmt: skip
    assert _group_per_tp_shapes(stages, pp_degree=2, tp_degree=2) == {
        "emb": [(3, 4), (2, 4)], "l0": [(2, 4), (2, 4)], "l1": [(1, 4), None],
    }  # fmt: skip
    stages[2]["emb"] = (1, 4)
    with pytest.raises(AssertionError, match="replicas of emb on tp rank 0 disagree"):
        _group_per_tp_shapes(stages, pp_degree=2, tp_degree=2)


@pytest.mark.parametrize(
    "total,ranks,meta,expected",
    [
        (12, 4, None, [3, 3, 3, 3]),
        (10, 4, "lm_head", [3, 3, 2, 2]),
        (12, 2, SimpleNamespace(num_kv_heads=3, tp_grain_size=None), [8, 4]),
        (12, 4, SimpleNamespace(num_kv_heads=None, tp_grain_size=2), [4, 4, 2, 2]),
    ],
)
def test_shard_sizes_give_the_remainder_to_low_ranks(
    total: int, ranks: int, meta: Any, expected: list[int]
) -> None:
    assert get_shard_size_list(total, ranks, meta) == expected
    assert sum(expected) == total


def test_conversion_and_deepspeed_optimizer_classes_are_clear_refusals() -> None:
    with pytest.raises(FeatureNotInPartita, match="merge_tp_slices is not in partita"):
        merge_tp_slices({}, "out", "slices", 2, ("w", []))
    with pytest.raises(FeatureNotInPartita, match="DeepSpeedZeroOptimizer"):
        DeepSpeedZeroOptimizer()
