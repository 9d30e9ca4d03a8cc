"""load_config: malformed values, unknown keys, unsupported keys, "auto" leftovers, rules."""

from __future__ import annotations

import ast
import copy
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

import partita.config as config_pkg
from partita.config import ConfigError, DeepSpeedConfig, load_config

BASE: dict[str, Any] = {"train_batch_size": 8}


def _merged(extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(BASE)
    out.update(copy.deepcopy(extra))
    return out


def _problems(raw: dict[str, Any], world_size: int = 1) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        load_config(raw, world_size=world_size)
    return [(p.path, p.message) for p in info.value.problems]


# (config fragment, dotted path expected in the message, fragment of the message)
MALFORMED = [
    (
        {"zero_optimization": {"reduce_bucket_sz": 5e8}},
        "zero_optimization.reduce_bucket_sz",
        "did you mean 'reduce_bucket_size'?",
    ),
    ({"fp16": {"enabeld": True}}, "fp16.enabeld", "did you mean 'enabled'?"),
    ({"bf16": {"enable": True}}, "bf16.enable", "did you mean 'enabled'?"),
    (
        {"gradient_accumulation_step": 2},
        "gradient_accumulation_step",
        "did you mean 'gradient_accumulation_steps'?",
    ),
    (
        {"zero_optimization": {"offload_optimizer": {"devcie": "cpu"}}},
        "zero_optimization.offload_optimizer.devcie",
        "did you mean 'device'?",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memroy": True}}},
        "zero_optimization.offload_param.pin_memroy",
        "did you mean 'pin_memory'?",
    ),
    (
        {"optimizer": {"type": "AdamW", "parms": {"lr": 1e-3}}},
        "optimizer.parms",
        "did you mean 'params'?",
    ),
    ({"scheduler": {"params": {}}}, "scheduler.type", "required key is missing"),
    ({"wandb": {"enabled": True, "projct": "x"}}, "wandb.projct", "did you mean 'project'?"),
    ({"aio": {"block_sze": 4096}}, "aio.block_sze", "did you mean 'block_size'?"),
    (
        {"zero_optimization": {"stage3_prefetch_bucketsize": 10}},
        "zero_optimization.stage3_prefetch_bucketsize",
        "did you mean 'stage3_prefetch_bucket_size'?",
    ),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage", "less than or equal to 3"),
    ({"zero_optimization": {"stage": -1}}, "zero_optimization.stage", "greater than or equal to 0"),
    ({"zero_optimization": {"stage": 1.5}}, "zero_optimization.stage", "whole number"),
    ({"zero_optimization": {"stage": "2"}}, "zero_optimization.stage", "expected an integer"),
    (
        {"zero_optimization": {"reduce_bucket_size": 0}},
        "zero_optimization.reduce_bucket_size",
        "greater than 0",
    ),
    (
        {"zero_optimization": {"reduce_bucket_size": 2.5e-1}},
        "zero_optimization.reduce_bucket_size",
        "whole number",
    ),
    (
        {"zero_optimization": {"allgather_bucket_size": -5}},
        "zero_optimization.allgather_bucket_size",
        "greater than 0",
    ),
    (
        {"zero_optimization": {"stage3_prefetch_bucket_size": -1}},
        "zero_optimization.stage3_prefetch_bucket_size",
        "greater than or equal to 0",
    ),
    ({"fp16": {"loss_scale": -1}}, "fp16.loss_scale", "greater than or equal to 0"),
    ({"fp16": {"loss_scale": float("nan")}}, "fp16.loss_scale", "finite number"),
    ({"fp16": {"enabled": "true"}}, "fp16.enabled", "valid boolean"),
    ({"fp16": {"initial_scale_power": 16.5}}, "fp16.initial_scale_power", "whole number"),
    ({"fp16": {"hysteresis": 0}}, "fp16.hysteresis", "greater than 0"),
    (
        {"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
        "zero_optimization.offload_optimizer.device",
        "'none', 'cpu' or 'nvme'",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}},
        "zero_optimization.offload_optimizer.ratio",
        "less than or equal to 1",
    ),
    ({"gradient_clipping": -1.0}, "gradient_clipping", "greater than or equal to 0"),
    ({"gradient_clipping": "1.0"}, "gradient_clipping", "expected a number"),
    ({"gradient_clipping": True}, "gradient_clipping", "boolean"),
    ({"communication_data_type": "fp8"}, "communication_data_type", "'fp32', 'fp16' or 'bf16'"),
    ({"steps_per_print": 0}, "steps_per_print", "greater than 0"),
    ({"tensorboard": {"output_path": 3}}, "tensorboard.output_path", "valid string"),
    ({"csv_monitor": {"enabled": 1}}, "csv_monitor.enabled", "valid boolean"),
    (
        {"activation_checkpointing": {"number_checkpoints": 0}},
        "activation_checkpointing.number_checkpoints",
        "greater than 0",
    ),
    ({"checkpoint": {"tag_validation": "maybe"}}, "checkpoint.tag_validation", "'WARN'"),
    ({"data_types": {"grad_accum_dtype": "int8"}}, "data_types.grad_accum_dtype", "'fp32'"),
    ({"zero_optimization": True}, "zero_optimization", 'write an object such as {"stage": 1}'),
    ({"optimizer": "Adam"}, "optimizer", "expected an object"),
    ({"gradient_predivide_factor": 0}, "gradient_predivide_factor", "greater than 0"),
]


@pytest.mark.parametrize(("fragment", "path", "text"), MALFORMED)
def test_malformed_config_names_dotted_path(fragment: dict, path: str, text: str) -> None:
    problems = _problems(_merged(fragment))
    assert [p for p, _ in problems] == [path]
    assert text in problems[0][1]


def test_message_lists_every_problem_with_its_path() -> None:
    raw = _merged(
        {
            "fp16": {"enabled": True, "loss_scale": -2},
            "zero_optimization": {"stage": 7, "reduce_bucket_sz": 1},
            "wandb": {"team": 5},
            "steps_per_prnt": 10,
        }
    )
    with pytest.raises(ConfigError) as info:
        load_config(raw, world_size=1)
    error = info.value
    assert isinstance(error, ValueError)
    assert error.source == "<dict>"
    expected = [
        "fp16.loss_scale",
        "zero_optimization.stage",
        "zero_optimization.reduce_bucket_sz",
        "wandb.team",
        "steps_per_prnt",
    ]
    assert [p.path for p in error.problems] == expected
    text = str(error)
    assert "5 problems" in text
    for path in expected:
        assert f"  - {path}: " in text
    assert "did you mean 'steps_per_print'?" in text


# ---- cross-field rules ---------------------------------------------------------------------

RULES = [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled", "both enabled"),
    (
        {"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}},
        "gradient_allreduce_op",
        "'sum' is not supported with ZeRO stage 3",
    ),
    (
        {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
        "zero_optimization.offload_optimizer",
        "stage 1, 2 or 3 (got stage 0)",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
        "zero_optimization.offload_param.nvme_path",
        "needs an nvme_path",
    ),
    (
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
        "zero_optimization.offload_optimizer.nvme_path",
        "needs an nvme_path",
    ),
    (
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
        "zero_optimization.offload_optimizer.ratio",
        "partial optimizer offload",
    ),
    (
        {
            "bf16": {"enabled": True, "bf16_optimizer_states": True},
            "zero_optimization": {"stage": 1},
        },
        "bf16.bf16_optimizer_states",
        "needs bf16.bf16_master_weights_and_grads",
    ),
    (
        {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
        "fp16.fp16_master_weights_and_grads",
        "got stage 0",
    ),
    (  # qwZ changes stage 3's gathers and stages 1-2's all-gather: refused at stage 0
        {"zero_optimization": {"stage": 0, "zero_quantized_weights": True}},
        "zero_optimization.zero_quantized_weights",
        "applies to zero_optimization.stage 1-3 only",
    ),
    (  # the frozen weights' option changes stage 3's gathers only
        {"zero_optimization": {"stage": 2, "zero_quantized_nontrainable_weights": True}},
        "zero_optimization.zero_quantized_nontrainable_weights",
        "applies to zero_optimization.stage 3 only",
    ),
    (
        {"zero_optimization": {"stage": 1, "zero_hpz_partition_size": 8}},
        "zero_optimization.zero_hpz_partition_size",
        "hpZ",
    ),
    (
        {"zero_optimization": {"stage": 0, "mics_shard_size": 8}},
        "zero_optimization.mics_shard_size",
        "MiCS",
    ),
    (
        {"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}},
        "zero_optimization.zero_quantized_gradients",
        "qgZ",
    ),
]


@pytest.mark.parametrize(("fragment", "path", "text"), RULES)
def test_cross_field_rules(fragment: dict, path: str, text: str) -> None:
    problems = _problems(_merged(fragment))
    assert [p for p, _ in problems] == [path]
    assert text in problems[0][1]


@pytest.mark.parametrize(
    ("fragment", "feature", "feature_path"),
    [
        (
            {"zero_optimization": {"stage": 2, "zenflow": {}}},
            "ZenFlow",
            "zero_optimization.zenflow",
        ),
        ({"compile": {"deepcompile": True}}, "DeepCompile", "compile"),
    ],
)
def test_summed_gradients_conflict_named_before_the_refused_feature(
    fragment: dict, feature: str, feature_path: str
) -> None:
    # DeepSpeed names the gradient_allreduce_op conflict; partita lists it first, then its own
    # refusal of the feature, so both keys to change are named.
    problems = _problems(_merged({"gradient_allreduce_op": "sum", **fragment}))
    assert [p for p, _ in problems] == ["gradient_allreduce_op", feature_path]
    assert f"'sum' is not supported with {feature}" in problems[0][1]
    assert _problems(_merged(fragment))[0][0] == feature_path  # the mean alone: only the refusal


def test_cross_field_rules_are_all_reported() -> None:
    raw = _merged(
        {
            "fp16": {"enabled": True},
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "nvme"}},
        }
    )
    assert [p for p, _ in _problems(raw)] == [
        "fp16.enabled",
        "zero_optimization.offload_optimizer.nvme_path",
        "zero_optimization.offload_optimizer",
    ]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_offload_param_below_stage3_is_ignored_with_a_warning(
    stage: int, caplog: pytest.LogCaptureFixture
) -> None:
    # DeepSpeed ignores the block below stage 3 (even on NVMe without a path); so does partita,
    # saying so, and the engine places no parameter anywhere else.
    from partita.engine.setup import offload_placement

    raw = _merged({"zero_optimization": {"stage": stage, "offload_param": {"device": "nvme"}}})
    with caplog.at_level("WARNING", logger="partita.config"):
        cfg = load_config(raw, world_size=1)
    assert f"offload_param has no effect at stage {stage}" in caplog.text
    assert offload_placement(cfg).params.where == "device"


@pytest.mark.parametrize(("value", "expected"), [("mean", "mean"), ("SUM", "sum"), ("Sum", "sum")])
def test_gradient_allreduce_op_values(value: str, expected: str) -> None:
    cfg = load_config(_merged({"gradient_allreduce_op": value}), world_size=1)
    assert cfg.gradient_allreduce_op == expected
    assert load_config(_merged({}), world_size=1).gradient_allreduce_op == "mean"


def test_gradient_allreduce_op_refuses_other_ops() -> None:
    problems = _problems(_merged({"gradient_allreduce_op": "max"}))
    assert [p for p, _ in problems] == ["gradient_allreduce_op"]
    assert "Invalid gradient_allreduce_op 'max': use 'mean' or 'sum'" in problems[0][1]


def test_direct_model_validation_also_applies_rules() -> None:
    raw = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 1,
    }
    with pytest.raises(ValidationError, match="not a multiple"):
        DeepSpeedConfig.model_validate(raw)


# ---- unsupported and renamed keys ----------------------------------------------------------


@pytest.mark.parametrize(
    ("fragment", "path"),
    [
        ({"amp": {"enabled": True, "opt_level": "O1"}}, "amp"),
        ({"sparse_attention": {"mode": "fixed"}}, "sparse_attention"),
        ({"pipeline": {"stages": "auto"}}, "pipeline"),
        ({"autotuning": {"enabled": True}}, "autotuning"),
        ({"elasticity": {"enabled": True, "max_train_batch_size": 64}}, "elasticity"),
        ({"compression_training": {}}, "compression_training"),
        ({"data_efficiency": {"enabled": True}}, "data_efficiency"),
        ({"curriculum_learning": {"enabled": True}}, "curriculum_learning"),
        ({"optimizer": {"type": "Adam", "legacy_fusion": True}}, "optimizer.legacy_fusion"),
        ({"zero_optimization": {"zenflow": {"topk_ratio": 0.1}}}, "zero_optimization.zenflow"),
        ({"zero_optimization": {"zenflow": {}}}, "zero_optimization.zenflow"),  # on, defaults
        ({"checkpoint": {"writer": {"type": "fast"}}}, "checkpoint.writer"),
    ],
)
def test_unsupported_keys_are_errors(fragment: dict, path: str) -> None:
    problems = _problems(_merged(fragment))
    assert [p for p, _ in problems] == [path]
    assert "not supported by partita" in problems[0][1]


def test_switched_off_unsupported_blocks_are_accepted() -> None:
    raw = _merged(
        {
            "amp": {"enabled": False},
            "gradient_allreduce_op": "mean",
            "vocabulary_size": 50257,
            "optimizer": {"type": "Adam", "legacy_fusion": False},
        }
    )
    cfg = load_config(raw, world_size=1)
    assert "amp" not in cfg.to_dict()
    assert cfg.optimizer is not None and cfg.optimizer.type == "Adam"


def test_older_spellings_are_accepted() -> None:
    raw = _merged(
        {
            "bfloat16": {"enabled": True},
            "aio": {"thread_count": 2},
            "zero_optimization": {
                "stage": 3,
                "stage3_gather_fp16_weights_on_model_save": True,
                "prefetch_bucket_size": 1000,
                "cpu_offload": True,
                "cpu_offload_param": True,
                "cpu_offload_use_pin_memory": False,
            },
        }
    )
    cfg = load_config(raw, world_size=1)
    zero = cfg.zero_optimization
    assert cfg.bf16.enabled and cfg.aio.intra_op_parallelism == 2
    assert zero.stage3_gather_16bit_weights_on_model_save
    assert zero.stage3_prefetch_bucket_size == 1000
    assert zero.offload_optimizer is not None and zero.offload_optimizer.device == "cpu"
    assert zero.offload_param is not None and zero.offload_param.device == "cpu"
    assert zero.offload_param.pin_memory is False


@pytest.mark.parametrize(
    ("fragment", "path", "text"),
    [
        (
            {"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
            "zero_optimization",
            "both 'cpu_offload' and 'offload_optimizer'",
        ),
        (
            {
                "zero_optimization": {
                    "stage3_gather_fp16_weights_on_model_save": True,
                    "stage3_gather_16bit_weights_on_model_save": True,
                }
            },
            "zero_optimization",
            "keep only 'stage3_gather_16bit_weights_on_model_save'",
        ),
        ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "", "keep only 'bf16'"),
    ],
)
def test_both_spellings_is_an_error(fragment: dict, path: str, text: str) -> None:
    problems = _problems(_merged(fragment))
    assert [p for p, _ in problems] == [path]
    assert text in problems[0][1]


# ---- "auto" leftovers ----------------------------------------------------------------------


def test_auto_leftovers_are_each_named() -> None:
    raw = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
    }
    problems = _problems(raw, world_size=2)
    assert [p for p, _ in problems] == [
        "train_micro_batch_size_per_gpu",
        "optimizer.params.lr",
        "optimizer.params.betas",
        "zero_optimization.reduce_bucket_size",
    ]
    assert all("resolve_auto" in message for _, message in problems)


# ---- files ---------------------------------------------------------------------------------


def test_json_file_with_scientific_integers(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(
        '{"train_batch_size": 16, "zero_optimization": {"stage": 2, '
        '"reduce_bucket_size": 5e8, "allgather_bucket_size": 2e8}}'
    )
    cfg = load_config(path, world_size=2)
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert isinstance(cfg.zero_optimization.allgather_bucket_size, int)
    assert cfg.train_micro_batch_size_per_gpu == 8


def test_json_duplicate_keys_name_key_and_file(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(
        '{"train_batch_size": 8, "zero_optimization": {"stage": 2, "stage": 3},'
        ' "train_batch_size": 16}'
    )
    with pytest.raises(ConfigError) as info:
        load_config(str(path), world_size=1)
    assert [p.path for p in info.value.problems] == [
        "train_batch_size",
        "zero_optimization.stage",
    ]
    assert str(path) in str(info.value)
    assert "more than once" in str(info.value)


def test_hjson_file_and_its_duplicates(tmp_path: Path) -> None:
    good = tmp_path / "ds.hjson"
    good.write_text("{\n  # comment\n  train_batch_size: 8\n  fp16: {enabled: true}\n}\n")
    assert load_config(good, world_size=1).fp16.enabled
    bad = tmp_path / "bad.hjson"
    bad.write_text("{\n  fp16: {\n    enabled: true\n    enabled: false\n  }\n}\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad, world_size=1)
    assert [p.path for p in info.value.problems] == ["fp16.enabled"]
    assert str(bad) in str(info.value)


def test_json_file_with_comments_loads_like_deepspeed(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{\n  // DeepSpeed reads config files with hjson\n  "train_batch_size": 4\n}')
    assert load_config(path, world_size=4).train_micro_batch_size_per_gpu == 1


@pytest.mark.parametrize(
    ("text", "fragment"),
    [('{"train_batch_size": 8,,}', "not valid JSON/hjson"), ("[1, 2]", "must be an object")],
)
def test_unparsable_files(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        load_config(path, world_size=1)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(tmp_path / "absent.json", world_size=1)


def test_input_dict_is_not_modified() -> None:
    raw = {"train_batch_size": 8, "bfloat16": {"enabled": True}, "amp": {"enabled": False}}
    before = copy.deepcopy(raw)
    load_config(raw, world_size=2)
    assert raw == before


def test_to_dict_round_trips() -> None:
    raw = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95]}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
    }
    cfg = load_config(raw, world_size=4)
    again = load_config(cfg.to_dict(), world_size=4)
    assert again == cfg
    assert cfg.to_dict()["train_batch_size"] == 32


def test_models_are_frozen() -> None:
    cfg = load_config(BASE, world_size=1)
    with pytest.raises(ValidationError):
        cfg.zero_optimization.stage = 2


def test_config_package_never_imports_torch() -> None:
    root = Path(config_pkg.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            assert not any(n.split(".")[0] == "torch" for n in names), path


def test_json_text_is_not_a_path() -> None:
    with pytest.raises(TypeError, match="looks like JSON text"):
        load_config('{"train_batch_size": 8}', world_size=1)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_elastic_checkpoint_is_accepted_and_warned_about_at_stage_3(
    stage: int, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="partita.config"):
        cfg = load_config(
            _merged({"zero_optimization": {"stage": stage, "elastic_checkpoint": True}}),
            world_size=1,
        )
    assert cfg.zero_optimization.elastic_checkpoint is True
    warned = [r for r in caplog.records if "elastic checkpointing is deprecated" in r.getMessage()]
    assert len(warned) == (1 if stage == 3 else 0)
