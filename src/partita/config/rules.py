"""Cross-field rules: combinations of values DeepSpeed rejects or partita does not implement.

Each rule returns problems instead of asserting, so one pass reports all of them. The
``_NOT_IMPLEMENTED`` table is the single place that says which DeepSpeed features partita
lacks; drop an entry when the feature lands.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .errors import Problem

logger = logging.getLogger("partita.config")

if TYPE_CHECKING:
    from .root import DeepSpeedConfig
    from .sections.zero import OffloadOptimizerConfig, OffloadParamConfig

__all__ = ["check_raw_rules", "check_rules"]

# (dotted path, getter, "is this value in use?", what the feature is, what to write instead)
_NOT_IMPLEMENTED: tuple[
    tuple[str, Callable[[DeepSpeedConfig], Any], Callable[[Any], bool], str, str], ...
] = (
    (
        "zero_optimization.zeropp_loco_param",
        lambda c: c.zero_optimization.zeropp_loco_param,
        lambda v: v is not None,
        "LoCo-ZeRO++",
        "remove the key",
    ),
    (
        "zero_optimization.mics_hierarchical_params_gather",
        lambda c: c.zero_optimization.mics_hierarchical_params_gather,
        bool,
        "MiCS hierarchical all-gather",
        "use false",
    ),
    (
        "zero_optimization.legacy_stage1",
        lambda c: c.zero_optimization.legacy_stage1,
        bool,
        "DeepSpeed's old stage 1 implementation",
        "use false",
    ),
    (
        "zero_optimization.offload_optimizer.super_offload",
        lambda c: (
            c.zero_optimization.offload_optimizer is not None
            and c.zero_optimization.offload_optimizer.super_offload
        ),
        bool,
        "SuperOffload",
        "use false",
    ),
)


def _not_implemented(cfg: DeepSpeedConfig) -> list[Problem]:
    problems = []
    for path, get, in_use, feature, instead in _NOT_IMPLEMENTED:
        value = get(cfg)
        if in_use(value):
            problems.append(
                Problem(path, f"{feature} is not supported by partita (got {value!r}); {instead}")
            )
    return problems


def _hybrid_shard(cfg: DeepSpeedConfig) -> list[Problem]:
    """MiCS-style hybrid sharding (``mics_shard_size``) is implemented for stages 1-3;
    whether the size divides the world is checked once the world is known (engine.setup)."""
    zero = cfg.zero_optimization
    size = zero.mics_shard_size
    if size == -1:
        return []
    path = "zero_optimization.mics_shard_size"
    if size < 1:
        return [Problem(path, f"{size}: use -1 (off) or a positive shard group size")]
    if zero.stage not in (1, 2, 3):
        return [
            Problem(
                path,
                f"MiCS hybrid sharding shards ZeRO's states: it needs zero_optimization.stage "
                f"1-3 (got stage {zero.stage}); use -1 or stage 1-3",
            )
        ]
    return []


_ZEROPP_STAGE3: tuple[tuple[str, str, str], ...] = (
    ("zero_hpz_partition_size", "ZeRO++ hierarchical partitioning (hpZ)", "use 1"),
    ("zero_quantized_nontrainable_weights", "ZeRO++ quantized frozen weights", "use false"),
    ("zero_quantized_gradients", "ZeRO++ quantized gradient reduce-scatter (qgZ)", "use false"),
    ("zero_quantized_gradients_error_feedback", "qgZ's error feedback", "use false"),
)


def _zeropp_stage(cfg: DeepSpeedConfig) -> list[Problem]:
    """ZeRO++'s options change stage 3's parameter gathers and gradient reduce-scatters
    (qwZ also stages 1-2's all-gather of the updated weights); where they do nothing DeepSpeed
    ignores the keys silently. A config asking for them there expects fewer bytes it would not
    get, so partita says so, naming the key."""
    zero = cfg.zero_optimization
    if zero.stage == 3:
        if zero.zero_quantized_gradients_error_feedback and not zero.zero_quantized_gradients:
            key = "zero_optimization.zero_quantized_gradients_error_feedback"
            return [Problem(key, "true needs zero_optimization.zero_quantized_gradients true")]
        return []
    problems = []
    if zero.stage == 0 and zero.zero_quantized_weights is True:  # stages 1-2: the all-gather
        problems.append(
            Problem(
                "zero_optimization.zero_quantized_weights",
                "ZeRO++ quantized weight all-gather (qwZ) applies to zero_optimization.stage "
                "1-3 only (stage 0 gathers no weights); use false or stage 1-3",
            )
        )
    for key, feature, instead in _ZEROPP_STAGE3:
        value = getattr(zero, key)
        if value is True or (type(value) is int and value > 1):
            problems.append(
                Problem(
                    f"zero_optimization.{key}",
                    f"{feature} applies to zero_optimization.stage 3 only (got {value!r} at "
                    f"stage {zero.stage}); {instead} or stage 3",
                )
            )
    return problems


def _precision(cfg: DeepSpeedConfig) -> list[Problem]:
    problems = []
    stage = cfg.zero_optimization.stage
    if cfg.fp16.enabled and cfg.bf16.enabled:
        problems.append(
            Problem("fp16.enabled", "fp16 and bf16 are both enabled; enable at most one")
        )
    needs_zero = (
        ("fp16.fp16_master_weights_and_grads", cfg.fp16.fp16_master_weights_and_grads),
        ("bf16.bf16_master_weights_and_grads", cfg.bf16.bf16_master_weights_and_grads),
        ("bf16.bf16_optimizer_states", cfg.bf16.bf16_optimizer_states),
    )
    for path, on in needs_zero:
        if on and stage == 0:
            problems.append(Problem(path, "needs zero_optimization.stage 1, 2 or 3 (got stage 0)"))
    if cfg.bf16.bf16_optimizer_states and not cfg.bf16.bf16_master_weights_and_grads:
        problems.append(
            Problem(
                "bf16.bf16_optimizer_states",
                "needs bf16.bf16_master_weights_and_grads to be true",
            )
        )
    if cfg.fp16.fp16_master_weights_and_grads and not cfg.fp16.enabled:
        problems.append(
            Problem("fp16.fp16_master_weights_and_grads", "needs fp16.enabled to be true")
        )
    return problems


def _offload_target(
    path: str, block: OffloadParamConfig | OffloadOptimizerConfig | None
) -> list[Problem]:
    if block is not None and block.device == "nvme" and not block.nvme_path:
        return [Problem(f"{path}.nvme_path", "device 'nvme' needs an nvme_path directory")]
    return []


def _offload(cfg: DeepSpeedConfig) -> list[Problem]:
    zero = cfg.zero_optimization
    problems = _offload_target("zero_optimization.offload_optimizer", zero.offload_optimizer)
    if zero.stage == 3:
        problems += _offload_target("zero_optimization.offload_param", zero.offload_param)
    elif zero.offload_param is not None and zero.offload_param.device != "none":
        # DeepSpeed ignores the block below stage 3 (its own tests carry one at stage 0), so a
        # config written for it must load; the numbers trained are the same either way.
        logger.warning(
            "zero_optimization.offload_param has no effect at stage %d: parameters are offloaded "
            "at stage 3 only (DeepSpeed ignores it too); use offload_optimizer for stages 1-2",
            zero.stage,
        )
    opt = zero.offload_optimizer
    if opt is not None and opt.device != "none" and zero.stage == 0:
        problems.append(
            Problem(
                "zero_optimization.offload_optimizer",
                "optimizer offload needs zero_optimization.stage 1, 2 or 3 (got stage 0)",
            )
        )
    if opt is not None and opt.ratio < 1.0 and (opt.device != "cpu" or zero.stage != 3):
        problems.append(
            Problem(
                "zero_optimization.offload_optimizer.ratio",
                f"partial optimizer offload (ratio {opt.ratio} < 1) needs device 'cpu' and "
                f"zero_optimization.stage 3 (got device {opt.device!r}, stage {zero.stage})",
            )
        )
    return problems


def _batch_identity(cfg: DeepSpeedConfig) -> list[Problem]:
    # Without the world size only divisibility can be checked; load_config checks equality.
    per_rank = cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps
    if cfg.train_batch_size % per_rank:
        return [
            Problem(
                "train_batch_size",
                f"train_batch_size={cfg.train_batch_size} is not a multiple of "
                f"train_micro_batch_size_per_gpu={cfg.train_micro_batch_size_per_gpu} * "
                f"gradient_accumulation_steps={cfg.gradient_accumulation_steps}",
            )
        ]
    return []


def _allreduce_op(cfg: DeepSpeedConfig) -> list[Problem]:
    # Stage 3 reduce-scatters each gradient straight into its shard with the average built in;
    # DeepSpeed refuses the sum there as well.
    if cfg.gradient_allreduce_op == "sum" and cfg.zero_optimization.stage == 3:
        return [
            Problem(
                "gradient_allreduce_op",
                "'sum' is not supported with ZeRO stage 3; use 'mean' or stage 0-2",
            )
        ]
    return []


def check_raw_rules(data: Mapping[str, Any]) -> list[Problem]:
    """Rules on keys that the loader strips before typing the config (ZenFlow, DeepCompile).

    The summed gradient reduction conflicts with both in DeepSpeed, which says so by the
    ``gradient_allreduce_op`` key; partita refuses both features anyway, but naming the
    conflict first tells a user who only wanted the sum which key to change.
    """
    if data.get("gradient_allreduce_op") != "sum":
        return []
    problems = []
    zero = data.get("zero_optimization")
    if isinstance(zero, Mapping) and zero.get("zenflow") is not None:
        problems.append(
            Problem("gradient_allreduce_op", "'sum' is not supported with ZenFlow; use 'mean'")
        )
    compile_section = data.get("compile")
    if isinstance(compile_section, Mapping) and compile_section.get("deepcompile") is True:
        problems.append(
            Problem("gradient_allreduce_op", "'sum' is not supported with DeepCompile; use 'mean'")
        )
    return problems


def check_rules(cfg: DeepSpeedConfig) -> list[Problem]:
    """Every cross-field problem of an otherwise well-typed config (empty when fine)."""
    return (
        _batch_identity(cfg)
        + _precision(cfg)
        + _offload(cfg)
        + _hybrid_shard(cfg)
        + _zeropp_stage(cfg)
        + _not_implemented(cfg)
        + _allreduce_op(cfg)
    )
