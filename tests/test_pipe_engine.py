"""Pipeline parallelism with DeepSpeed's API: a GPT-ish stack of `LayerSpec`s (embedding,
residual blocks, norm, head, optionally the head tied to the embedding) as a `PipelineModule`,
trained by the `PipelineEngine` that `partita.initialize` returns, 1F1B over
``gradient_accumulation_steps`` = 4 micro-batches. fp32: per-step losses within rtol 1e-6 of
one process running the same layers on the same micro-batches with torch's AdamW, and bitwise
equal when run again; at 2 ranks (pp 2) and 4 ranks (pp 2 x dp 2, pp 4), ZeRO 0-3 (2 and 3
under torch's interleaved and zero-bubble schedules too), with clipping over the whole pipeline, activation checkpointing, and DeepSpeed's script shape
(``deepspeed.initialize(training_data=...)`` then ``train_batch()``); ``eval_batch`` after
training matches the one-process loss too. Partitions are DeepSpeed's (checked without processes); bad
set-ups fail on every rank naming what is wrong. One spawn per world size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from models import LOSS_RTOL, Block
from partita.checkpoint.export import export_checkpoint
from partita.parallel.pipe_module import (
    LayerSpec,
    TiedLayerSpec,
    partition,
    partition_balanced,
    partition_uniform,
)
from partita.testing import run_distributed_grid
from pipe_workers import RESUME_LOADS, layer_specs, loader_batches, pipe_grid, reference

STEPS = 4
BASE = {"micro": 2, "gas": 4, "steps": STEPS}

TWO = [
    {"tied": False, "stages": 2, "dp": 1, **BASE},
    {"tied": True, "stages": 2, "dp": 1, **BASE},
    {"tied": False, "stages": 2, "dp": 1, "partition": "uniform", "ckpt": 2, **BASE},
    {"tied": False, "stages": 2, "dp": 1, **BASE},  # the first again: bitwise
    {"tied": False, "stages": 2, "dp": 1, "inf_step": 1, **BASE},  # inf on the last stage
    # torch's schedules over 2 chunks per rank ([Note: torch pipeline schedules]).
    {"tied": True, "stages": 2, "dp": 1, "virtual": 2, "schedule": "interleaved_1f1b", **BASE},
    {
        "tied": True,
        "stages": 2,
        "dp": 1,
        "virtual": 2,
        "schedule": "zero_bubble",
        "stage": 1,
        "clip": 0.05,
        **BASE,
    },
    {"tied": True, "stages": 2, "dp": 1, "virtual": 2, "schedule": "interleaved_1f1b", **BASE},
    {"tied": True, "stages": 2, "dp": 1, "stage": 2, **BASE},  # ZeRO 2 in the stages
    # ZeRO 2 and 3 under torch's schedules (every gradient held until the schedule ends).
    {
        "tied": True,
        "stages": 2,
        "dp": 1,
        "virtual": 2,
        "schedule": "zero_bubble",
        "stage": 2,
        "clip": 0.05,
        **BASE,
    },
    {
        "tied": True,
        "stages": 2,
        "dp": 1,
        "virtual": 2,
        "schedule": "interleaved_1f1b",
        "stage": 3,
        **BASE,
    },
    {
        "tied": True,
        "stages": 2,
        "dp": 1,
        "virtual": 2,
        "schedule": "zero_bubble",
        "stage": 3,
        "clip": 0.05,
        **BASE,
    },
    # ... with activation checkpointing of every layer.
    {
        "tied": True,
        "stages": 2,
        "dp": 1,
        "virtual": 2,
        "schedule": "zero_bubble",
        "stage": 3,
        "partition": "uniform",
        "ckpt": 1,
        **BASE,
    },
]
TORCH_ZERO23_TWO = [9, 10, 11, 12]
ZB_PP4 = {"tied": True, "stages": 4, "dp": 1, "schedule": "zero_bubble", "stage": 2,
          "clip": 0.05, **BASE}  # fmt: skip
FOUR = [
    {"tied": False, "stages": 2, "dp": 2, **BASE},
    {"tied": True, "stages": 2, "dp": 2, "stage": 1, "clip": 0.05, **BASE},
    {"tied": True, "stages": 4, "dp": 1, **BASE},
    {"tied": True, "stages": 4, "dp": 1, "stage": 1, "clip": 0.05, **BASE},
    {"tied": True, "stages": 4, "dp": 1, **BASE},  # pp 4 again: bitwise
    {"tied": True, "stages": 2, "dp": 2, "loader": True, **BASE},  # training_data, train_batch()
    {"tied": True, "stages": 2, "dp": 2, "virtual": 2, "schedule": "zero_bubble", **BASE},
    {"tied": True, "stages": 4, "dp": 1, "schedule": "interleaved_1f1b", "stage": 1, **BASE},
    {"tied": True, "stages": 2, "dp": 2, "stage": 2, "clip": 0.05, **BASE},
    {"tied": True, "stages": 2, "dp": 2, "stage": 2, "inf_step": 1, **BASE},
    {"tied": False, "stages": 2, "dp": 2, "stage": 3, **BASE},  # ZeRO 3 in the stages
    {"tied": True, "stages": 2, "dp": 2, "stage": 3, "clip": 0.05, **BASE},
    # A model (tensor) axis: pp 2 x tp 2, the blocks split over the grid's slices.
    {"tied": False, "stages": 2, "dp": 1, "tp": 2, **BASE},
    {"tied": True, "stages": 2, "dp": 1, "tp": 2, "stage": 1, "clip": 0.05, **BASE},
    {"tied": True, "stages": 2, "dp": 1, "tp": 2, "stage": 3, "clip": 0.05, **BASE},
    # ZeRO 2 and 3 under torch's schedules, sharded over the stages' data-parallel pairs.
    {
        "tied": True,
        "stages": 2,
        "dp": 2,
        "virtual": 2,
        "schedule": "zero_bubble",
        "stage": 2,
        **BASE,
    },
    {
        "tied": True,
        "stages": 2,
        "dp": 2,
        "virtual": 2,
        "schedule": "interleaved_1f1b",
        "stage": 3,
        "clip": 0.05,
        **BASE,
    },
    {
        "tied": False,
        "stages": 2,
        "dp": 2,
        "virtual": 2,
        "schedule": "zero_bubble",
        "stage": 3,
        **BASE,
    },
    # pp 4 under zero-bubble (one chunk per rank), then again: bitwise.
    ZB_PP4,
    ZB_PP4,
]
TORCH_ZERO23_FOUR = [15, 16, 17, 18]
BAD_TWO = [
    {"stages": 3},  # does not divide 2 ranks
    {"stages": 2, "layers": [LayerSpec(nn.Linear, 4, 4)]},  # fewer layers than stages
    {"stages": 2, "schedule": "gpipe"},
    {"stages": 2, "virtual": 2, "schedule": "1f1b"},
    {"stages": 2, "schedule": "zero_bubble", "gas": 1},  # fewer micro-batches than stages
    {"stages": 2, "virtual": 4},  # 7 layers cannot fill 8 chunks
    {"stages": 1, "virtual": 2, "schedule": "zero_bubble", "gas": 2},  # torch needs 2 stages
    {"stages": 2, "gas": 1},  # 1F1B with fewer micro-batches than stages
]


def _bad_tied() -> list[Any]:
    return [
        TiedLayerSpec("embed", nn.Embedding, 64, 32),
        LayerSpec(nn.Linear, 32, 32),
        TiedLayerSpec("embed", nn.Embedding, 64, 16),
    ]


SAVE16 = {"tied": True, "stages": 2, "dp": 2, "stage": 3, **BASE, "steps": 2}
"""`save_16bit_model` of a pipeline: pp 2 x dp 2, ZeRO 3 inside the stages, tied head."""


@pytest.fixture(scope="module")
def two() -> dict[str, Any]:
    cases = [{"kind": "train", "case": c} for c in TWO]
    bad = [*BAD_TWO, {"stages": 2, "layers": _bad_tied()}]
    cases += [{"kind": "bad", "case": c} for c in bad]
    out = run_distributed_grid(pipe_grid, 2, cases, timeout=240)
    return {"train": out[: len(TWO)], "bad": out[len(TWO) :]}


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    cases = [{"kind": "train", "case": c} for c in FOUR]
    where = str(tmp_path_factory.mktemp("pipe_layers"))
    cases.append({"kind": "reshard", "case": {**BASE, "dir": where}})
    saved = str(tmp_path_factory.mktemp("pipe_checkpoint"))
    cases.append({"kind": "resume", "case": {**BASE, "dir": saved}})
    cases.append({"kind": "save16", "case": {**SAVE16, "dir": str(tmp_path_factory.mktemp("s16"))}})
    where = str(tmp_path_factory.mktemp("pipe_tensor_layers"))
    cases.append({"kind": "tensor_layers", "case": {"dir": where}})
    return run_distributed_grid(pipe_grid, 4, cases, timeout=300)


def _assert_parity(per_rank: list[dict[str, Any]], case: dict[str, Any]) -> None:
    batches = loader_batches(case, per_rank[0]["seed"]) if case.get("loader") else None
    logits: list[torch.Tensor] = []
    want, want_eval = reference(case, batches, logits)
    # eval_batch(return_logits=True): the last stage's outputs of its last micro-batch, with
    # every schedule (torch's merged outputs cut back to that micro-batch). Logits of order 1
    # after 4 AdamW steps whose sums ran in another order: elementwise within 1e-5.
    last = [r for r in per_rank if r["logits"] is not None]
    assert len(last) == len(per_rank) // case["stages"] and {r["stage"] for r in last} == {
        case["stages"] - 1
    }
    for result in last:
        torch.testing.assert_close(result["logits"], logits[result["dp_rank"]], rtol=1e-5,
                                   atol=1e-5)  # fmt: skip
    for rank, result in enumerate(per_rank):
        assert result["engine"] == "PipelineEngine"
        got = result["losses"]
        assert len(got) == len(want)
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            assert abs(g - w) <= LOSS_RTOL * abs(w), (rank, step, got, want)
        # eval_batch after training: the trained weights and the forward-only schedule.
        assert abs(result["eval"] - want_eval) <= LOSS_RTOL * abs(want_eval), rank
    # Every stage returns the loss the last stage computed, bit for bit.
    assert len({tuple(r["losses"]) for r in per_rank}) == 1
    assert len({r["eval"] for r in per_rank}) == 1


@pytest.mark.parity
@pytest.mark.parametrize("index", [0, 1, 2, 5, 6, 8])
def test_two_stages_match_one_process(two: dict[str, Any], index: int) -> None:
    _assert_parity(two["train"][index], TWO[index])


@pytest.mark.parity
@pytest.mark.parametrize("index", [0, 1, 2, 3, 5, 6, 7, 8, 10, 11])
def test_four_ranks_match_one_process(four: list[list[dict[str, Any]]], index: int) -> None:
    _assert_parity(four[index], FOUR[index])


@pytest.mark.parity
@pytest.mark.parametrize("world, index", [(2, i) for i in TORCH_ZERO23_TWO]
                         + [(4, i) for i in TORCH_ZERO23_FOUR])  # fmt: skip
def test_zero2_and_3_under_torch_schedules_match_one_process(
    two: dict[str, Any], four: list[list[dict[str, Any]]], world: int, index: int
) -> None:
    """ZeRO 2 and 3 inside the stages with torch's interleaved 1F1B and zero-bubble
    schedules: the zero-bubble weight step assigns ``.grad`` without autograd's hooks, and
    those gradients still reach the buckets and units (`Strategy.absorb_grads`)."""
    cases, results = (TWO, two["train"]) if world == 2 else (FOUR, four)
    assert cases[index]["schedule"] != "1f1b" and cases[index]["stage"] >= 2
    _assert_parity(results[index], cases[index])


@pytest.mark.parity
@pytest.mark.parametrize("index", [12, 13, 14])
def test_pipeline_with_a_tensor_axis_matches_one_process(
    four: list[list[dict[str, Any]]], index: int
) -> None:
    """``PipeModelDataParallelTopology(2, 2, 1)``: each stage's blocks split over its two
    slices (Megatron's column- and row-parallel MLP); the norm and clipping over the pipe and
    slice ranks count a parameter the slices hold whole once. The one-process losses, with
    ZeRO 0, 1 and 3 in the stages and the tied head."""
    assert FOUR[index]["tp"] == 2
    _assert_parity(four[index], FOUR[index])
    assert [r["stage"] for r in four[index]] == [0, 0, 1, 1]


def test_reruns_are_bitwise(two: dict[str, Any], four: list[list[dict[str, Any]]]) -> None:
    assert [r["losses"] for r in two["train"][3]] == [r["losses"] for r in two["train"][0]]
    assert [r["losses"] for r in two["train"][7]] == [r["losses"] for r in two["train"][5]]
    assert [r["losses"] for r in four[4]] == [r["losses"] for r in four[2]]
    assert [r["losses"] for r in four[19]] == [r["losses"] for r in four[18]]  # zero-bubble


def test_overflow_on_one_stage_skips_the_step_on_every_stage(two: dict[str, Any]) -> None:
    """An inf gradient on the last stage only: the norm is summed over the pipeline, so both
    stages skip step 1 and apply the others."""
    for result in two["train"][4]:
        assert result["applied"] == [True, False, True, True], result["stage"]
        assert result["skipped"] == 1
    clean = two["train"][0]  # the same run without the inf
    assert two["train"][4][0]["losses"][:2] == clean[0]["losses"][:2]


def test_weights_saved_per_layer_load_at_another_pipeline_degree(
    four: list[list[dict[str, Any]]],
) -> None:
    """save_state_dict at pp 2 x dp 2, load_state_dir into differently seeded modules at pp 4
    and pp 1 (dp 4): the same evaluation loss."""
    for per_rank in four[len(FOUR)]:
        want = per_rank["pp2"]
        for degree in ("pp4", "pp1"):
            assert abs(per_rank[degree] - want) <= LOSS_RTOL * abs(want), per_rank


@pytest.mark.parity
def test_engine_checkpoint_of_every_stage_resumes_and_loads_at_other_degrees(
    four: list[list[dict[str, Any]]],
) -> None:
    """save_checkpoint at pp 2 x dp 2 (ZeRO 1, tied embedding) after step 2 of 4: modules built
    with another seed load it and train steps 3-4. At pp 2 x dp 2 the losses are bitwise the
    uninterrupted run's; at pp 4 (ZeRO 0) and pp 1 x dp 4 (ZeRO 1) within rtol 1e-6 of one
    process on the same batches (master weights and Adam state come from every stage's
    files)."""
    want, _ = reference({"tied": True, "steps": STEPS, "micro": 2, "gas": 4, "dp": 2})
    for per_rank in four[len(FOUR) + 1 : len(FOUR) + 2]:  # the resume case
        for got in per_rank:
            # Each stage's data-parallel group wrote its own two files.
            shards = [f for f in got["files"] if f.endswith(".safetensors")]
            assert shards == [f"pp{s:02d}-of-02-rank{r:05d}-of-00002.safetensors"
                              for s in (0, 1) for r in (0, 1)], got["files"]  # fmt: skip
            assert len(got["whole"]) == STEPS
            for g, w in zip(got["whole"], want, strict=True):
                assert abs(g - w) <= LOSS_RTOL * abs(w), (got, want)
            assert got[(2, 1)] == got["whole"][2:]
            for load in RESUME_LOADS[1:]:
                for g, w in zip(got[load], want[2:], strict=True):
                    assert abs(g - w) <= LOSS_RTOL * abs(w), (load, got[load], want)


def test_pipeline_checkpoint_exports_the_whole_model(
    four: list[list[dict[str, Any]]], tmp_path: Path
) -> None:
    """`partita export` of the pp 2 x dp 2 checkpoint: one Hugging Face safetensors layout
    holding every stage's weights (the tied embedding once), named as in the whole
    `PipelineModule`, equal to what the stages' modules held when it was saved."""
    per_rank = four[len(FOUR) + 1]
    where = Path(per_rank[0]["dir"])
    export_checkpoint(str(where), str(tmp_path), tag="two")
    exported: dict[str, torch.Tensor] = {}
    for f in tmp_path.glob("*.safetensors"):
        exported.update(load_file(str(f)))
    held: dict[str, torch.Tensor] = {}
    for result in per_rank:
        held.update(result["saved"])
    assert sorted(exported) == sorted(held)
    assert any(name.startswith("tied_modules.") for name in exported)
    for name, value in held.items():
        assert torch.equal(exported[name], value), name


def test_zero2_and_3_in_stages_shard_optimizer_state_and_skip_overflow_everywhere(
    four: list[list[dict[str, Any]]],
) -> None:
    """ZeRO 2 and 3 inside pp 2 x dp 2 stages: each rank holds half its stage's Adam state
    (two moments of half the parameters, plus at most a few padding elements per bucket or
    unit), where ZeRO 0 holds all of it; an inf gradient on the last stage skips that step on
    every rank."""
    for zero0, *sharded in zip(four[0], four[8], four[10], four[15], four[17], strict=True):
        # ZeRO 2, 3, then both again under torch's zero-bubble schedule.
        assert zero0["opt_numel"] == 2 * zero0["stage_numel"]
        for zero2 in sharded[0::2]:
            assert 0 <= zero2["opt_numel"] - zero2["stage_numel"] <= 64, zero2
        for zero3 in sharded[1::2]:
            assert 0 <= zero3["opt_numel"] - zero0["stage_numel"] <= 64, zero3
    for result in four[9]:
        assert result["applied"] == [True, False, True, True], result["stage"]


def test_each_rank_builds_only_its_stage(
    two: dict[str, Any], four: list[list[dict[str, Any]]]
) -> None:
    # 7 layers: embedding, 4 blocks, norm, head; "parameters" balances the blocks.
    first, second = two["train"][0]
    assert first["parts"] == [0, 3, 7] and first["stage"] == 0 and second["stage"] == 1
    assert set(first["layers"]) == {0, 1, 2} and set(second["layers"]) == {3, 4, 5, 6}
    assert first["first_last"] == (True, False) and second["first_last"] == (False, True)
    assert two["train"][2][0]["parts"] == [0, 4, 7]  # uniform
    pp4 = four[2]
    assert [r["stage"] for r in pp4] == [0, 1, 2, 3]
    # pp 2 x dp 2: ranks 0, 1 are stage 0 (data is the fast axis), 2, 3 stage 1.
    assert [r["stage"] for r in four[0]] == [0, 0, 1, 1]
    # The job's mesh says so: ("pp", "dp"), stages across, data-parallel lanes inside.
    for rank, result in enumerate(four[0]):
        mesh = result["mesh"]
        assert mesh["names"] == ("pp", "dp") and mesh["layout"] == [[0, 1], [2, 3]]
        assert mesh["groups"] == {
            "pp": [rank % 2, rank % 2 + 2],
            "dp": [rank - rank % 2, rank - rank % 2 + 1],
        }
    assert [r["mesh"]["names"] for r in pp4] == [("pp", "dp")] * 4
    # Tied layers live in tied_modules, not under a layer index.
    assert 0 not in two["train"][1][0]["layers"]


def test_bad_setups_fail_on_every_rank_naming_the_problem(two: dict[str, Any]) -> None:
    for per_rank in two["bad"]:
        assert per_rank[0] and len(set(per_rank)) == 1  # the same error on both ranks
    divide, few, gpipe, one_chunk, micro, chunks, single, micro_1f1b, tied = (
        per_rank[0] for per_rank in two["bad"]
    )
    assert "pipeline.schedule" in gpipe and "'gpipe' is not one of" in gpipe
    assert "virtual_stages=2" in one_chunk and "'interleaved_1f1b'" in one_chunk
    assert "gradient_accumulation_steps (1)" in micro and "2 stages" in micro
    assert "7 layers cannot fill 2 stages x 4 virtual stages" in chunks
    assert "'zero_bubble' needs at least 2 pipeline stages" in single and "'1f1b'" in single
    assert "'1f1b' needs gradient_accumulation_steps (1)" in micro_1f1b
    assert "at least the 2 pipeline stages" in micro_1f1b
    assert "num_stages (3) must divide distributed world size (2)" in divide
    assert "1 layers cannot fill 2 pipeline stages" in few
    assert "TiedLayerSpec key 'embed'" in tied and "layer 2" in tied


# ---- partitions: DeepSpeed's (values from deepspeed.runtime.utils 0.19.8) ----------------------


def test_partition_uniform_matches_deepspeed() -> None:
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(7, 2) == [0, 4, 7]
    assert partition_uniform(8, 4) == [0, 2, 4, 6, 8]
    assert partition_uniform(2, 4) == [0, 1, 2, 2, 2]


def test_partition_balanced_matches_deepspeed() -> None:
    assert partition_balanced([0, 1, 1, 1, 1, 0], 2) == [0, 3, 6]
    assert partition_balanced([0, 10, 10, 10, 10, 10, 10, 0], 4) == [0, 3, 5, 6, 8]
    assert partition_balanced([1] * 10, 4) == [0, 3, 6, 8, 10]
    assert partition_balanced([5, 1, 1, 1, 1, 1, 5], 3) == [0, 1, 6, 7]
    assert partition_balanced([100, 0, 0, 1], 2) == [0, 3, 4]  # ties: the last cut wins


def test_partition_methods_place_layers_as_deepspeed() -> None:
    specs = layer_specs(tied=True)  # embed(2048) 4 x Block(8416) LayerNorm(64) embed(2048)
    assert partition(specs, 2, "parameters") == [0, 3, 7]
    assert partition(specs, 4, "parameters") == [0, 2, 3, 4, 7]
    assert partition(specs, 4, "uniform") == [0, 2, 4, 6, 7]
    assert partition(specs, 2, "type:block") == [0, 3, 7]
    assert partition(specs, 4, "type:Block") == [0, 2, 3, 4, 7]
    assert partition(specs, 2, "type:embed|norm") == [0, 6, 7]
    with pytest.raises(RuntimeError, match="found no valid layers"):
        partition(specs, 2, "type:Conv")
    with pytest.raises(NotImplementedError, match="profile"):
        partition(specs, 2, "profile")
    # A layer given as a built module or a function counts as DeepSpeed counts it.
    mixed = [nn.Linear(4, 4), torch.relu, LayerSpec(Block, 4), nn.Linear(4, 4)]
    assert partition(mixed, 2, "parameters") == [0, 3, 4]


def test_deepspeed_names_resolve_to_partitas_pipeline() -> None:
    import importlib

    from partita.parallel.pipe_engine import PipelineEngine
    from partita.parallel.pipe_module import PipelineModule

    ds = "partita.compat.deepspeed"
    pipe = importlib.import_module(f"{ds}.pipe")
    assert pipe.PipelineModule is PipelineModule and pipe.LayerSpec is LayerSpec
    assert pipe.TiedLayerSpec is TiedLayerSpec
    assert importlib.import_module(f"{ds}.runtime.pipe.module").PipelineModule is PipelineModule
    assert importlib.import_module(f"{ds}.runtime.pipe.engine").PipelineEngine is PipelineEngine
    top = importlib.import_module(ds)
    assert top.PipelineModule is PipelineModule and top.PipelineEngine is PipelineEngine


def test_repeating_loader_starts_over_and_is_deepspeeds_name() -> None:
    import importlib

    from partita.parallel.pipe_engine import RepeatingLoader

    utils = importlib.import_module("partita.compat.deepspeed.utils")
    assert utils.RepeatingLoader is RepeatingLoader  # DeepSpeed's pipeline tests import it there
    loader = RepeatingLoader([1, 2, 3])
    assert iter(loader) is loader
    assert [next(loader) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    with pytest.raises(StopIteration):  # an empty loader ends rather than looping forever
        next(RepeatingLoader([]))


def test_config_pipeline_section_sets_the_interval_and_refuses_other_keys() -> None:
    from partita.config import ConfigError
    from partita.parallel.pipe_engine import take_pipeline_section

    class Module:  # stands in for a PipelineModule: only its interval setter is used
        interval = 3

        def set_checkpoint_interval(self, interval: int) -> None:
            self.interval = interval

    m = Module()
    cfg = {"train_batch_size": 2, "pipeline": {"activation_checkpoint_interval": 0}}
    assert take_pipeline_section(cfg, m) == {"train_batch_size": 2} and m.interval == 3
    section = {"activation_checkpoint_interval": 2, "use_reentrant": False}
    assert take_pipeline_section({"pipeline": section}, m) == {} and m.interval == 2
    assert take_pipeline_section("ds.json", m) == "ds.json"  # a path goes to the loader as is
    with pytest.raises(ConfigError, match="pipe_partitioned"):
        take_pipeline_section({"pipeline": {"pipe_partitioned": False}}, m)
    with pytest.raises(ConfigError, match="activation_checkpoint_interval"):
        take_pipeline_section({"pipeline": {"activation_checkpoint_interval": -1}}, m)


def test_save_16bit_model_merges_every_stage_into_one_file(
    four: list[list[dict[str, Any]]],
) -> None:
    """pp 2 x dp 2 at ZeRO 3: one ``model.safetensors`` (written by global rank 0) holds every
    stage's weights under the module's names (global layer indices), the tied embedding once,
    each bitwise what its stage holds (gathered) after training."""
    from safetensors.torch import load_file

    per_rank = four[-2]  # the save16 case, one result per rank
    saved = load_file(f"{per_rank[0]['dir']}/model.safetensors")
    stages = {r["stage"]: r["state"] for r in per_rank if r["dp_rank"] == 0}
    assert sorted(stages) == [0, 1]
    want: dict[str, torch.Tensor] = {}
    for stage in (0, 1):
        for name, value in stages[stage].items():
            want.setdefault(name, value)
    assert sorted(saved) == sorted(want)
    for name, value in want.items():
        assert torch.equal(saved[name], value), name
    tied = [n for n in saved if n.startswith("tied_modules.")]
    assert tied and all(n in stages[0] and n in stages[1] for n in tied)
    layers = {int(n.split(".")[0]) for n in saved if n[0].isdigit()}
    assert layers == set(range(min(layers), max(layers) + 1))  # no stage's layers missing


def test_pipeline_with_a_tensor_axis_saves_its_layers_per_slice(
    four: list[list[dict[str, Any]]],
) -> None:
    """pp 2 x tp 2: ``save_state_dict`` writes one file per layer and tensor slice (DeepSpeed's
    ``layer_XX-model_YY`` names), and a freshly seeded module loading them evaluates as the
    trained one did; the engine's own checkpoints are refused by name with a model axis."""
    for result in four[-1]:
        assert result["loaded"] == result["trained"] != result["fresh"]
        assert "tensor slices" in result["refused"] and "save_state_dict" in result["refused"]
        blocks = [f"layer_{i:02d}-model_{m:02d}.safetensors" for i in range(1, 5) for m in (0, 1)]
        assert set(blocks) <= set(result["files"]), result["files"]
