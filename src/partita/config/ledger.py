"""The ledger: what partita does with every field of the config schema.

A DeepSpeed config is a promise about how training runs; silently dropping part of it trains
differently from what the user wrote. So every field of every section model has exactly one
entry here (``tests/test_config_ledger.py`` walks the schema and fails on a field without one):

- ``HONOURED``: the engine reads it and does what DeepSpeed does with it. The note lists the
  files (under ``src/partita``) that read it.
- ``REFUSED``: partita does not implement it. Its default is what partita does; any other value
  is an error naming the key (checked here at load time, or by the rule named in
  ``enforced_by``), before any process group exists.
- ``INERT``: a DeepSpeed tuning knob that has no meaning in partita (it changes how DeepSpeed
  schedules or packs work, never the numbers trained); accepted with any valid value and
  ignored, for the reason in the note.

Keys DeepSpeed has but the schema does not (``pipeline``, ``autotuning``, ...) are listed in
``unsupported.py``; they never reach the models.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from .errors import Problem

if TYPE_CHECKING:
    from .root import DeepSpeedConfig

__all__ = ["LEDGER", "Entry", "Status", "refused_problems", "schema_paths"]


class Status(enum.Enum):
    """What partita does with a schema field."""

    HONOURED = "honoured"
    REFUSED = "refused"
    INERT = "accepted-inert"


@dataclass(frozen=True)
class Entry:
    """One field's ledger entry.

    Attributes:
        status: honoured, refused or accepted-inert.
        note: honoured: the files that read the field; refused / inert: why.
        example: refused: a non-default value the tests expect to be rejected.
        context: refused: other keys the example needs to be otherwise valid.
        enforced_by: refused: where the refusal lives when not here (``rules``,
            ``engine.setup.check_supported``); None: `refused_problems` enforces it.
        accepts: refused: which values are fine for this config (default: the default only).
    """

    status: Status
    note: str
    example: Any = None
    context: Mapping[str, Any] = field(default_factory=dict)
    enforced_by: str | None = None
    accepts: Callable[[Any, DeepSpeedConfig], bool] | None = None


def _read(*files: str) -> Entry:
    return Entry(Status.HONOURED, " ".join(files))


def _inert(why: str) -> Entry:
    return Entry(Status.INERT, why)


def _refused(why: str, example: Any, **kwargs: Any) -> Entry:
    return Entry(Status.REFUSED, why, example, **kwargs)


_SETUP = "engine/setup.py"
_STAGE3 = "zero/stage3/settings.py"  # Stage3Settings, what FullySharded runs by
_ZEROPP = "zero/stage3/settings.py"  # ZeRO++, stage 3 only (rules: _zeropp_stage)
_MONITOR = "monitor/monitor.py"
_RULES = "rules (_NOT_IMPLEMENTED)"
_CHECK = "engine.setup.check_supported"
_TENSOR = "engine/tensor_parallel.py"
_EXPERTS = "engine/experts.py"
_FP32_MASTERS = "partita keeps fp32 master weights and optimizer states"
_NO_PIPELINE = "pipeline parallelism is not supported by partita"
# deepspeed.checkpointing.checkpoint (partita.activations) reads the section; initialize()
# applies it unless the script configured checkpointing itself.
_ACTIVATIONS = "activations/checkpointing.py"
_FLOPS = "profiling/engine_hooks.py"
_COMMS = "profiling/comms.py"
_COMM_CHOICE = "a choice between collectives that compute the same sums"

LEDGER: dict[str, Entry] = {
    "train_batch_size": _read("engine/core.py"),
    "train_micro_batch_size_per_gpu": _read("engine/core.py", "api.py"),
    "gradient_accumulation_steps": _read("engine/core.py"),
    "optimizer.type": _read(_SETUP),
    "optimizer.params": _read(_SETUP),
    "scheduler.type": _read(_SETUP),
    "scheduler.params": _read(_SETUP),
    "fp16.enabled": _read(_SETUP),
    "fp16.auto_cast": _refused(
        "the engine does not cast the forward's inputs to float16; cast them in the script",
        True,
    ),
    "fp16.loss_scale": _read(_SETUP),
    "fp16.initial_scale_power": _read(_SETUP),
    "fp16.loss_scale_window": _read(_SETUP),
    "fp16.hysteresis": _read(_SETUP),
    "fp16.consecutive_hysteresis": _read(_SETUP),
    "fp16.min_loss_scale": _read(_SETUP),
    "fp16.fp16_master_weights_and_grads": _refused(
        _FP32_MASTERS, True, context={"fp16": {"enabled": True}}, enforced_by=_CHECK
    ),
    "bf16.enabled": _read(_SETUP),
    "bf16.immediate_grad_update": _refused(
        "stages 0-1 accumulate micro-batch gradients in the training dtype and reduce them "
        "at the boundary; only stages 2-3 add each micro-batch's gradients into fp32 at once",
        True,
        accepts=lambda value, cfg: not value or cfg.zero_optimization.stage >= 2,
    ),
    "bf16.check_grad_overflow": _refused(
        "partita always checks gradients for inf/NaN and skips the step", False
    ),
    "bf16.bf16_master_weights_and_grads": _refused(_FP32_MASTERS, True, enforced_by=_CHECK),
    "bf16.bf16_optimizer_states": _refused(
        _FP32_MASTERS,
        True,
        context={"bf16": {"bf16_master_weights_and_grads": True}},
        enforced_by=_CHECK,
    ),
    "zero_optimization.stage": _read(_SETUP),
    "zero_optimization.contiguous_gradients": _inert(
        "partita always writes gradients into flat bucket buffers"
    ),
    "zero_optimization.reduce_scatter": _inert(
        f"{_COMM_CHOICE}: partita reduce-scatters in stages 1-3 and all-reduces in stage 0"
    ),
    "zero_optimization.reduce_bucket_size": _read(_SETUP, _STAGE3),
    "zero_optimization.use_multi_rank_bucket_allreduce": _inert(
        f"{_COMM_CHOICE}: DeepSpeed's packing for its all-reduce path"
    ),
    "zero_optimization.allgather_partitions": _inert(
        f"{_COMM_CHOICE}: DeepSpeed's broadcast fallback; partita always all-gathers"
    ),
    "zero_optimization.allgather_bucket_size": _inert(
        "stages 1-2 all-gather each reduce bucket's shards straight into the module's flat "
        "buffer, so there is no separate gather buffer to size"
    ),
    "zero_optimization.overlap_comm": _inert(
        "partita always overlaps gradient reduction with the backward pass"
    ),
    "zero_optimization.load_from_fp32_weights": _refused(
        "partita restores master weights from the fp32 copies in its checkpoints", False
    ),
    "zero_optimization.elastic_checkpoint": _inert(
        "partita's checkpoints always load at another world size, which is what DeepSpeed's "
        "elastic layout was for (stage 3 warns that DeepSpeed deprecated it)"
    ),
    "zero_optimization.offload_param.device": _read(_SETUP),
    "zero_optimization.offload_param.nvme_path": _read(_SETUP),
    "zero_optimization.offload_param.buffer_count": _read(_SETUP),
    "zero_optimization.offload_param.buffer_size": _read(_SETUP),
    "zero_optimization.offload_param.max_in_cpu": _read(_SETUP),
    "zero_optimization.offload_param.pin_memory": _read(_SETUP),
    "zero_optimization.offload_optimizer.device": _read(_SETUP),
    "zero_optimization.offload_optimizer.nvme_path": _read(_SETUP),
    "zero_optimization.offload_optimizer.buffer_count": _read("zero/stage3/nvme.py"),
    "zero_optimization.offload_optimizer.pin_memory": _read(_SETUP),
    "zero_optimization.offload_optimizer.pipeline_read": _read("zero/stage3/nvme.py"),
    "zero_optimization.offload_optimizer.pipeline_write": _read("zero/stage3/nvme.py"),
    "zero_optimization.offload_optimizer.fast_init": _inert(
        "speeds up DeepSpeed's NVMe state initialisation; partita's needs no switch"
    ),
    "zero_optimization.offload_optimizer.ratio": _read(_SETUP),
    "zero_optimization.offload_optimizer.super_offload": _refused(
        "SuperOffload", True, enforced_by=_RULES
    ),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": _inert(
        "applies only with super_offload, which partita refuses"
    ),
    "zero_optimization.sub_group_size": _read(_SETUP, _STAGE3),
    "zero_optimization.stage3_prefetch_bucket_size": _read(_STAGE3),
    "zero_optimization.stage3_param_persistence_threshold": _read(_STAGE3),
    "zero_optimization.stage3_model_persistence_threshold": _refused(
        "partita has no bound on the total of unpartitioned parameters; use "
        "stage3_param_persistence_threshold",
        1000,
    ),
    "zero_optimization.stage3_max_live_parameters": _read(_STAGE3),
    "zero_optimization.stage3_max_reuse_distance": _read(_STAGE3),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": _inert(
        "engine.save_16bit_model always gathers the full weights under stage 3 (DeepSpeed "
        "skips the save when this is false)"
    ),
    "zero_optimization.stage3_module_granularity_threshold": _refused(
        "partita fetches stage-3 parameters per unit module; there is no granularity merging",
        100,
    ),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": _inert(
        f"{_COMM_CHOICE}: partita fetches stage-3 parameters with all-gather"
    ),
    "zero_optimization.stage3_allgather_sequential": _inert(
        f"{_COMM_CHOICE}: partita gathers stage-3 parameters per unit"
    ),
    "zero_optimization.ignore_unused_parameters": _refused(
        "partita always accepts parameters that get no gradient (they reduce zeros)", False
    ),
    "zero_optimization.legacy_stage1": _refused(
        "DeepSpeed's old stage 1", True, enforced_by=_RULES
    ),
    "zero_optimization.round_robin_gradients": _inert(
        "orders DeepSpeed's gradient copies to CPU across ranks; partita's offload needs none"
    ),
    "zero_optimization.zero_hpz_partition_size": _read(_ZEROPP),
    "zero_optimization.zero_quantized_weights": _read(_ZEROPP),
    "zero_optimization.zero_quantized_nontrainable_weights": _read(_ZEROPP),
    "zero_optimization.zero_quantized_gradients": _read(_ZEROPP),
    "zero_optimization.zero_quantized_gradients_bits": _read(_ZEROPP),
    "zero_optimization.zero_quantized_gradients_error_feedback": _read(_ZEROPP),
    "zero_optimization.zeropp_loco_param": _refused(
        "LoCo-ZeRO++", {"err_beta": 0.8, "reset_T": 1024}, enforced_by=_RULES
    ),
    "zero_optimization.mics_shard_size": _read(_SETUP),
    "sequence_parallel_size": _read(_SETUP),
    "data_parallel_size": _read(_SETUP),
    "zero_optimization.mics_hierarchical_params_gather": _refused("MiCS", True, enforced_by=_RULES),
    "zero_optimization.memory_efficient_linear": _inert(
        "DeepSpeed's stage-3 replacement of F.linear that saves activation memory; partita "
        "keeps torch's linear, with the same results"
    ),
    "zero_optimization.pipeline_loading_checkpoint": _refused(_NO_PIPELINE, True),
    "zero_optimization.override_module_apply": _refused(
        "partita does not gather stage-3 parameters around nn.Module.apply; gather them "
        "explicitly with partita.zero.gather.GatheredParameters",
        True,
    ),
    "zero_optimization.log_trace_cache_warnings": _inert(
        "logs DeepSpeed's parameter trace cache, which partita does not have"
    ),
    "zero_optimization.enable_sanity_checks": _inert(
        "switches on DeepSpeed's internal debug assertions; partita has none to switch"
    ),
    "zero_optimization.leaf_module.classes": _read("zero/stage3/leaves.py"),
    "zero_optimization.leaf_module.names": _read("zero/stage3/leaves.py"),
    "zero_optimization.leaf_module.name_suffixes": _read("zero/stage3/leaves.py"),
    "zero_optimization.stage3_check_divergence": _read(_STAGE3),
    "zero_optimization.save_muon_momentum_buffer_in_memory": _inert(
        "applies only to DeepSpeed's Muon optimizer, which partita refuses (optimizer.type)"
    ),
    "aio.block_size": _read("offload/aio.py"),
    "aio.queue_depth": _read("offload/aio.py"),
    "aio.intra_op_parallelism": _read("offload/aio.py"),
    "aio.single_submit": _inert(
        "libaio submission batching; partita's thread-pool I/O submits no batches"
    ),
    "aio.overlap_events": _inert(
        "libaio completion handling; partita's thread-pool I/O has no event loop to overlap"
    ),
    "aio.use_gds": _read("offload/checks.py"),
    "gradient_clipping": _read("engine/core.py"),
    "steps_per_print": _read("engine/core.py"),
    "wall_clock_breakdown": _read("engine/core.py"),
    "memory_breakdown": _read("engine/core.py"),
    "communication_data_type": _read(_SETUP),
    "prescale_gradients": _read(_SETUP),
    "gradient_predivide_factor": _read(_SETUP),
    "gradient_allreduce_op": _read(_SETUP),
    "zero_allow_untested_optimizer": _inert(
        "partita has no list of tested optimizers: every torch optimizer runs under ZeRO"
    ),
    "zero_force_ds_cpu_optimizer": _inert(
        "partita steps any optimizer on the host under offload; there is no DeepSpeed CPU "
        "optimizer to insist on"
    ),
    "dump_state": _inert("prints DeepSpeed's engine state at start-up; no effect on training"),
    "dataloader_drop_last": _read("api.py"),
    "tensorboard.enabled": _read(_MONITOR),
    "tensorboard.output_path": _read(_MONITOR),
    "tensorboard.job_name": _read(_MONITOR),
    "csv_monitor.enabled": _read(_MONITOR),
    "csv_monitor.output_path": _read(_MONITOR),
    "csv_monitor.job_name": _read(_MONITOR),
    "wandb.enabled": _read(_MONITOR),
    "wandb.team": _read(_MONITOR),
    "wandb.group": _read(_MONITOR),
    "wandb.project": _read(_MONITOR),
    "activation_checkpointing.partition_activations": _read(_ACTIVATIONS),
    "activation_checkpointing.cpu_checkpointing": _read(_ACTIVATIONS),
    "activation_checkpointing.contiguous_memory_optimization": _read(_ACTIVATIONS),
    "activation_checkpointing.number_checkpoints": _read(_ACTIVATIONS),
    "activation_checkpointing.synchronize_checkpoint_boundary": _read(_ACTIVATIONS),
    "activation_checkpointing.profile": _read(_ACTIVATIONS),
    "flops_profiler.enabled": _read(_SETUP),
    "flops_profiler.recompute_fwd_factor": _read(_FLOPS),
    "flops_profiler.profile_step": _read(_FLOPS),
    "flops_profiler.module_depth": _read(_FLOPS),
    "flops_profiler.top_modules": _read(_FLOPS),
    "flops_profiler.detailed": _read(_FLOPS),
    "flops_profiler.output_file": _read(_FLOPS),
    "comms_logger.enabled": _read(_SETUP, _COMMS),
    "comms_logger.verbose": _read(_COMMS),
    "comms_logger.prof_all": _read(_COMMS),
    "comms_logger.debug": _read(_COMMS),
    "comms_logger.prof_ops": _read(_COMMS),
    "checkpoint.tag_validation": _read("checkpoint/save.py"),
    "checkpoint.async_save": _read("checkpoint/save.py"),
    "checkpoint.load_universal": _refused(
        "partita's checkpoints reshard on load by themselves; DeepSpeed's universal "
        "checkpoints are not read",
        True,
    ),
    "checkpoint.use_node_local_storage": _refused(
        "partita writes every checkpoint to the one shared directory", True
    ),
    "checkpoint.parallel_write.pipeline_stage": _refused(_NO_PIPELINE, True),
    "data_types.grad_accum_dtype": _refused(
        "a separate accumulation dtype", "fp32", enforced_by=_CHECK
    ),
    "data_types.param_dtype": _refused(
        "parameters follow fp16 / bf16 / fp32 training; there is no separate parameter dtype",
        "bf16",
    ),
    "data_types.buffer_dtype": _refused(
        "module buffers keep the training dtype; there is no separate buffer dtype", "fp32"
    ),
    "expert_parallel.enabled": _read(_EXPERTS),
    "expert_parallel.autoep_size": _read(_EXPERTS),
    "expert_parallel.preset_model": _inert(
        "partita reads the experts' layout from the model's own base_model_ep_plan (a module "
        "not laid out as it computes is refused by name)"
    ),
    "tensor_parallel.autotp_size": _read(_TENSOR),
    "tensor_parallel.tensor_parallel.tp_size": _read(_TENSOR),
    "tensor_parallel.dtype": _inert(
        "partita trains in the precision of the fp16 / bf16 sections (DeepSpeed's AutoTP "
        "training does too)"
    ),
    "tensor_parallel.tp_overlap_comm": _inert(
        "overlaps DeepSpeed's column-parallel gradient all-reduce with compute; the numbers "
        "are the same"
    ),
    "tensor_parallel.keep_module_on_host": _inert(
        "where DeepSpeed's AutoTP keeps weights while it slices them; partita slices the "
        "model where it is and the engine places it"
    ),
    "tensor_parallel.vocab_parallel_lm_head": _read(_TENSOR),
    "tensor_parallel.sequence_parallel": _read(_TENSOR),
    "tensor_parallel.vocab_parallel_ce_backend": _refused("the Liger cross-entropy", "liger"),
    "tensor_parallel.tensor_parallel.tp_grain_size": _refused(
        "uneven splits (every split is even, or refused by name)", 64
    ),
    "tensor_parallel.tensor_parallel.mpu": _refused(
        "an mpu in the config; pass initialize(mpu=...)", "mpu"
    ),
    "tensor_parallel.tensor_parallel.tp_group": _refused(
        "a tensor group in the config; partita builds the groups from autotp_size", "group"
    ),
    "tensor_parallel.injection_policy_tuple": _refused(
        "an AutoTP injection policy for training (the model's tp plan and the name rules decide)",
        ["o_proj"],
    ),
    "tensor_parallel.partition_config": _refused(
        "custom AutoTP layer specs (the model's tp plan and the name rules decide)",
        {"layer_specs": []},
    ),
    "tensor_parallel.preset_model": _refused(
        "AutoTP presets (the model's tp plan and the name rules decide)", "llama"
    ),
    "tensor_parallel.replace_with_kernel_inject": _refused("DeepSpeed's inference kernels", True),
}
"""Dotted schema path -> what partita does with it (see the module docstring)."""


def _section(annotation: Any) -> type[BaseModel] | None:
    from .schema import _model_in  # schema imports root, which imports this module

    return _model_in(annotation)


def schema_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted paths of every leaf field under ``model`` (sections are walked, not listed)."""
    paths: list[str] = []
    for name, info in model.model_fields.items():
        sub = _section(info.annotation)
        if sub is None:
            paths.append(prefix + name)
        else:
            paths.extend(schema_paths(sub, f"{prefix}{name}."))
    return paths


def _value_and_default(cfg: DeepSpeedConfig, path: str) -> tuple[bool, Any, Any]:
    """(present, value, default) of the field at ``path``; absent under a section that is
    None (``zero_optimization.offload_param`` not given)."""
    *parents, name = path.split(".")
    holder: Any = cfg
    for part in parents:
        holder = getattr(holder, part)
        if holder is None:
            return False, None, None
    info = type(holder).model_fields[name]
    return True, getattr(holder, name), info.get_default(call_default_factory=True)


def refused_problems(cfg: DeepSpeedConfig) -> list[Problem]:
    """A problem for every refused field (enforced here) set to a value partita does not do."""
    problems = []
    for path, entry in LEDGER.items():
        if entry.status is not Status.REFUSED or entry.enforced_by is not None:
            continue
        present, value, default = _value_and_default(cfg, path)
        if not present:
            continue
        fine = entry.accepts(value, cfg) if entry.accepts is not None else value == default
        if not fine:
            problems.append(
                Problem(
                    path,
                    f"not supported by partita: {entry.note} (got {value!r}; remove the key "
                    f"or use {default!r})",
                )
            )
    return problems
