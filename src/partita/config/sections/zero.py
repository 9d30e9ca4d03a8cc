"""``zero_optimization``: the whole ZeRO block as DeepSpeed defines it, with its defaults.

Field names are the JSON keys users write (``stage3_prefetch_bucket_size``, not DeepSpeed's
internal ``prefetch_bucket_size``); DeepSpeed's other spellings are accepted through
``renamed_keys``, and its deprecated ``cpu_offload*`` flags are turned into offload blocks.
Which values partita implements is decided in ``rules.py``, not here.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from .base import Bool, Float, Int, NonNegInt, PositiveInt, Section, logger

__all__ = [
    "LEAF_MODULE_CLASSES",
    "REDUCE_BUCKET_NUMEL",
    "LeafModuleConfig",
    "OffloadDevice",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "ZeroConfig",
]

REDUCE_BUCKET_NUMEL = 1 << 22
"""Default ``reduce_bucket_size`` (elements): 4M, where DeepSpeed's is 5e8.

5e8 elements exceeds most models, which leaves one bucket that can only be reduced after
backward ends: nothing overlaps, and under ZeRO-2 the one bucket is the whole gradient. 4M
elements (16 MB in fp32, below DDP's 25 MB) keeps several buckets in flight while backward runs
and bounds ZeRO-2's transient gradient memory to a few of them. The bucket size changes when
gradients are reduced, never their values, so a DeepSpeed config without the key trains the
same; one that sets it (5e8 included) gets exactly that."""

OffloadDevice = Literal["none", "cpu", "nvme"]
"""Where offloaded state lives: nowhere (no offload), pinned CPU memory, or NVMe files."""

_NVME_PATH = "Directory on the NVMe device for offload files; required when device is 'nvme'."
_PIN = "Use page-locked CPU memory so transfers to and from the accelerator run asynchronously."


class OffloadParamConfig(Section):
    """``zero_optimization.offload_param``: where ZeRO-3 keeps parameter shards."""

    device: OffloadDevice = Field(default="none", description="Offload target for parameters.")
    nvme_path: str | None = Field(default=None, description=_NVME_PATH)
    buffer_count: PositiveInt = Field(
        default=5,
        description="NVMe: parameter shards read ahead of their gathers, at most this many.",
    )
    buffer_size: PositiveInt = Field(
        default=100_000_000,
        description="NVMe: the shards read ahead hold at most buffer_count x buffer_size "
        "elements (beyond the next one).",
    )
    max_in_cpu: NonNegInt = Field(
        default=0,
        description="NVMe: shard elements (per rank) kept in CPU memory instead, units in "
        "build order. DeepSpeed documents 1e9 but ignores the key (every shard goes to NVMe), "
        "so partita's default is 0, the behaviour a DeepSpeed config without it gets.",
    )
    pin_memory: Bool = Field(default=True, description=_PIN)


class OffloadOptimizerConfig(Section):
    """``zero_optimization.offload_optimizer``: where the master weights and optimizer state live.

    The optimizer step runs on the CPU whenever the device is not ``none``.
    """

    device: OffloadDevice = Field(default="none", description="Offload target for optimizer state.")
    nvme_path: str | None = Field(default=None, description=_NVME_PATH)
    buffer_count: PositiveInt = Field(
        default=4,
        description="NVMe swap buffers for the step: 4 per resident sub-group (master, gradient, "
        "two Adam moments); 8 or 12 to pipeline reads and writes.",
    )
    pin_memory: Bool = Field(default=True, description=_PIN)
    pipeline_read: Bool = Field(
        default=False,
        description="Overlap reading the next NVMe tile with the current tile's step.",
    )
    pipeline_write: Bool = Field(
        default=False,
        description="Overlap writing the previous NVMe tile with the current tile's step.",
    )
    fast_init: Bool = Field(
        default=False, description="Faster optimizer state initialisation when offloading to NVMe."
    )

    @property
    def pipeline(self) -> bool:
        """Whether NVMe reads or writes are pipelined (DeepSpeed's derived ``pipeline``)."""
        return bool(self.pipeline_read or self.pipeline_write)

    ratio: Float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="Stage 3, device cpu: fraction of the sub-groups whose optimizer state is "
        "offloaded (the last ones in build order; the first stay and step on the device).",
    )
    super_offload: Bool = Field(
        default=False, description="DeepSpeed's SuperOffload for superchips (ZeRO-3 only)."
    )
    cpuadam_cores_perc: Float = Field(
        default=0.8,
        ge=0.0,
        le=1.0,
        description="Fraction of CPU cores the CPU optimizer may use (with super_offload).",
    )


LEAF_MODULE_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)
"""DeepSpeed's default ``leaf_module.classes`` (MoE blocks; in partita they sit inside a
transformer block's unit already, so they change nothing)."""


class LeafModuleConfig(Section):
    """``zero_optimization.leaf_module``: stage-3 modules that some ranks may not run (a vision
    tower, MoE experts), gathered with their parent module on every rank."""

    classes: list[str] = Field(
        default_factory=lambda: list(LEAF_MODULE_CLASSES),
        description="Module classes, by class name or fully qualified name.",
    )
    names: list[str] = Field(
        default_factory=list,
        description="Module names as named_modules() gives them; each must exist.",
    )
    name_suffixes: list[str] = Field(
        default_factory=list,
        description="Suffixes of module names; each must match at least one module.",
    )

    @model_validator(mode="before")
    @classmethod
    def _single_strings(cls, data: Any) -> Any:
        # DeepSpeed accepts one string where a list is expected.
        if isinstance(data, Mapping):
            return {k: [v] if isinstance(v, str) else v for k, v in data.items()}
        return data


def _legacy_offload_flags(data: dict[str, Any]) -> None:
    """Turn DeepSpeed's deprecated ``cpu_offload*`` booleans into offload blocks, in place."""
    pin = data.pop("cpu_offload_use_pin_memory", None)
    converted = False
    for flag, block in (
        ("cpu_offload", "offload_optimizer"),
        ("cpu_offload_param", "offload_param"),
    ):
        if flag not in data:
            continue
        value = data.pop(flag)
        if not isinstance(value, bool):
            raise ValueError(f"'{flag}' must be true or false, got {value!r}")
        if block in data:
            raise ValueError(f"both '{flag}' and '{block}' are set; keep only '{block}'")
        logger.warning("DeepSpeed config key '%s' is deprecated; use '%s'", flag, block)
        if value:
            data[block] = {"device": "cpu"} if pin is None else {"device": "cpu", "pin_memory": pin}
            converted = True
    if pin is not None and not converted:
        raise ValueError(
            "'cpu_offload_use_pin_memory' only applies together with 'cpu_offload' or "
            "'cpu_offload_param'; set 'pin_memory' inside 'offload_optimizer' / 'offload_param'"
        )


class ZeroConfig(Section):
    """``zero_optimization``: ZeRO partitioning of optimizer state, gradients and parameters."""

    renamed_keys: ClassVar[Mapping[str, str]] = {
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "model_persistence_threshold": "stage3_model_persistence_threshold",
        "max_live_parameters": "stage3_max_live_parameters",
        "max_reuse_distance": "stage3_max_reuse_distance",
        "module_granularity_threshold": "stage3_module_granularity_threshold",
        "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
        "allgather_sequential": "stage3_allgather_sequential",
    }

    stage: Int = Field(
        default=0,
        ge=0,
        le=3,
        description="0: plain data parallelism; 1: partition optimizer state; 2: also "
        "gradients; 3: also parameters.",
    )
    contiguous_gradients: Bool = Field(
        default=True, description="Copy gradients into one contiguous buffer as they are produced."
    )
    reduce_scatter: Bool = Field(
        default=True, description="Average gradients with reduce-scatter instead of all-reduce."
    )
    reduce_bucket_size: PositiveInt = Field(
        default=REDUCE_BUCKET_NUMEL,
        description="Gradient elements per reduction bucket (stages 0-2: bucket of one "
        "collective; stage 3: gradient elements in flight in reduce-scatters, at least one "
        "segment). Default 4M elements, not DeepSpeed's 5e8: see REDUCE_BUCKET_NUMEL.",
    )
    use_multi_rank_bucket_allreduce: Bool = Field(
        default=True,
        description="Combine the reduce buckets of several ranks into one all-reduce.",
    )
    allgather_partitions: Bool = Field(
        default=True,
        description="Gather updated parameters with all-gather rather than a series of broadcasts.",
    )
    allgather_bucket_size: PositiveInt = Field(
        default=500_000_000, description="Parameter elements all-gathered per collective."
    )
    overlap_comm: Bool = Field(
        default=False,
        description="Overlap gradient reduction with the backward pass. When the key is "
        "absent it defaults to true for stage 3 and false otherwise, as in DeepSpeed.",
    )
    load_from_fp32_weights: Bool = Field(
        default=True,
        description="Initialise master weights from the fp32 copies in a checkpoint rather "
        "than from the 16-bit model weights.",
    )
    elastic_checkpoint: Bool = Field(
        default=False, description="DeepSpeed's legacy elastic checkpoint layout (stages 1-2)."
    )
    offload_param: OffloadParamConfig | None = Field(
        default=None, description="Parameter offload (stage 3 only)."
    )
    offload_optimizer: OffloadOptimizerConfig | None = Field(
        default=None, description="Optimizer state offload and CPU optimizer step (stages 1-3)."
    )
    sub_group_size: PositiveInt = Field(
        default=1_000_000_000,
        description="Parameter elements per optimizer step tile (stage 3 offload).",
    )
    stage3_prefetch_bucket_size: NonNegInt = Field(
        default=50_000_000, description="Parameter elements fetched ahead of use (stage 3)."
    )
    stage3_param_persistence_threshold: NonNegInt = Field(
        default=100_000, description="Parameters smaller than this stay unpartitioned (stage 3)."
    )
    stage3_model_persistence_threshold: NonNegInt = Field(
        default=sys.maxsize,
        description="Upper bound on the total elements kept unpartitioned (stage 3).",
    )
    stage3_max_live_parameters: NonNegInt = Field(
        default=1_000_000_000,
        description="Gathered parameter elements allowed per GPU before releasing (stage 3).",
    )
    stage3_max_reuse_distance: NonNegInt = Field(
        default=1_000_000_000,
        description="Keep a gathered parameter if it is reused within this many elements "
        "(stage 3).",
    )
    stage3_gather_16bit_weights_on_model_save: Bool = Field(
        default=False,
        description="Gather the partitioned 16-bit weights when saving the model (stage 3). "
        "Older spelling: stage3_gather_fp16_weights_on_model_save.",
    )
    stage3_module_granularity_threshold: NonNegInt = Field(
        default=0,
        description="Modules finer than this (params per descendant) are fetched as one unit "
        "(stage 3); 0 disables.",
    )
    stage3_use_all_reduce_for_fetch_params: Bool = Field(
        default=False, description="Fetch stage 3 parameters with all-reduce instead of all-gather."
    )
    stage3_allgather_sequential: Bool = Field(
        default=False, description="All-gather stage 3 parameters one by one, without bucketing."
    )
    ignore_unused_parameters: Bool = Field(
        default=True, description="Tolerate parameters that receive no gradient (stage 2)."
    )
    legacy_stage1: Bool = Field(
        default=False, description="DeepSpeed's old stage 1 implementation."
    )
    round_robin_gradients: Bool = Field(
        default=False,
        description="Spread gradient copies to CPU across ranks (stages 1-2 with offload).",
    )
    zero_hpz_partition_size: PositiveInt = Field(
        default=1, description="ZeRO++ hpZ: ranks in the secondary parameter partition group."
    )
    zero_quantized_weights: Bool = Field(
        default=False,
        description="ZeRO++ qwZ: int8 blocks for the weights' all-gather (stage 3's gathers; "
        "stages 1-2's all-gather of the updated weights after the step).",
    )
    zero_quantized_nontrainable_weights: Bool = Field(
        default=False, description="Store frozen weights quantized (ZeRO++)."
    )
    zero_quantized_gradients: Bool = Field(
        default=False, description="ZeRO++ qgZ: quantize gradients for the reduction."
    )
    zero_quantized_gradients_bits: Literal[4, 8] = Field(
        default=8,
        description="qgZ's code width on both hops: 8 (the default: held the loss within 0.03% "
        "of ZeRO-3 over 300 steps) or 4 (DeepSpeed's ZeRO++ width, half the bytes; 5.8% off "
        "there, 2.0% with error feedback: docs/zero.md). partita's own key.",
    )
    zero_quantized_gradients_error_feedback: Bool = Field(
        default=False,
        description="qgZ keeps each rank's quantization residual and adds it to the next "
        "reduction of the same gradients (memory: about 1 + 1/hpz fp32 copies of the "
        "gradient). partita's own key; DeepSpeed's LoCo variant (zeropp_loco_param) is "
        "refused.",
    )
    zeropp_loco_param: dict[str, Any] | None = Field(
        default=None, description="LoCo-ZeRO++ error feedback settings (err_beta, reset_T)."
    )
    mics_shard_size: Int = Field(default=-1, description="MiCS shard group size; -1 disables MiCS.")
    mics_hierarchical_params_gather: Bool = Field(
        default=False, description="MiCS hierarchical parameter all-gather."
    )
    memory_efficient_linear: Bool = Field(
        default=True, description="Memory efficient linear layer implementation (stage 3)."
    )
    pipeline_loading_checkpoint: Bool = Field(
        default=False, description="Load checkpoints in pipeline mode (stage 3)."
    )
    override_module_apply: Bool = Field(
        default=False,
        description="Gather parameters around nn.Module.apply (stage 3). DeepSpeed's default "
        "is true; partita does not gather there, so its default is false and true is refused.",
    )
    log_trace_cache_warnings: Bool = Field(
        default=False, description="Log parameter trace cache invalidations (stage 3)."
    )
    enable_sanity_checks: Bool = Field(
        default=False, description="Run internal consistency checks."
    )
    leaf_module: LeafModuleConfig = Field(
        default_factory=LeafModuleConfig,
        description="Stage 3: modules gathered with their parent whether or not a rank runs "
        "them (DeepSpeed's leaf modules).",
    )
    stage3_check_divergence: Bool = Field(
        default=True,
        description="partita: check before each stage-3 gather and reduce-scatter that every "
        "rank is at the same unit, and raise naming each rank's unit and step if not.",
    )
    save_muon_momentum_buffer_in_memory: Bool = Field(
        default=False,
        description="Keep the Muon momentum buffer in memory rather than on NVMe.",
    )

    @model_validator(mode="before")
    @classmethod
    def _legacy_forms(cls, data: Any) -> Any:
        if isinstance(data, bool):
            raise ValueError(
                'the boolean form of "zero_optimization" is deprecated in DeepSpeed and not '
                'accepted by partita; write an object such as {"stage": 1}'
            )
        if not isinstance(data, Mapping):
            return data
        out = dict(data)
        _legacy_offload_flags(out)
        # DeepSpeed resolves an absent overlap_comm from the stage: on for ZeRO-3 only.
        if out.get("overlap_comm") is None:
            out["overlap_comm"] = out.get("stage", 0) == 3
        return out

    @model_validator(mode="after")
    def _elastic_checkpoint_at_stage3(self) -> ZeroConfig:
        # Inert everywhere (partita's checkpoints always reshard); DeepSpeed's warning is kept
        # at stage 3 so a config that relied on it hears what DeepSpeed would have said.
        if self.stage == 3 and self.elastic_checkpoint:
            logger.warning(
                "zero_optimization.elastic_checkpoint: ZeRO-3 elastic checkpointing is "
                "deprecated in DeepSpeed; ignored here, since partita's checkpoints load at any "
                "world size"
            )
        return self


def _read_as(field: str) -> property:
    """A read-only view of `field` under another name."""
    return property(lambda self: getattr(self, field), doc=f"The value of ``{field}``.")


# DeepSpeed's model names its stage-3 fields without the "stage3_" prefix
# (``config.prefetch_bucket_size``); the prefixed JSON keys stay partita's fields, and the
# unprefixed names read them.
for _name, _field in ZeroConfig.renamed_keys.items():
    if not _name.startswith("stage3_"):
        setattr(ZeroConfig, _name, _read_as(_field))
del _name, _field
