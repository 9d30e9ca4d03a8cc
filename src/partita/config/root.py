"""``DeepSpeedConfig``: the root model of a DeepSpeed ``ds_config.json``.

Build it with :func:`partita.config.load_config`, which derives the missing batch sizes from
the data-parallel world size before validating; this model holds the resolved values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from .errors import ConfigError
from .ledger import refused_problems
from .rules import check_rules
from .sections.base import Bool, NonNegFloat, PositiveFloat, PositiveInt, Section
from .sections.expert import ExpertParallelConfig
from .sections.monitor import CSVMonitorConfig, TensorBoardConfig, WandbConfig
from .sections.optim import OptimizerConfig, SchedulerConfig
from .sections.precision import BF16Config, DataTypesConfig, DTypeName, FP16Config
from .sections.profiling import CommsLoggerConfig, FlopsProfilerConfig
from .sections.runtime import ActivationCheckpointingConfig, AioConfig, CheckpointConfig
from .sections.tensor import TensorParallelConfig
from .sections.zero import ZeroConfig

__all__ = ["DeepSpeedConfig"]


class DeepSpeedConfig(Section):
    """A validated DeepSpeed config: every section, with DeepSpeed's defaults filled in.

    ``train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps *
    data-parallel world size`` holds for a config from ``load_config``.
    """

    renamed_keys: ClassVar[Mapping[str, str]] = {"bfloat16": "bf16"}

    train_batch_size: PositiveInt = Field(
        description="Samples per optimizer step over all data-parallel ranks (resolved)."
    )
    train_micro_batch_size_per_gpu: PositiveInt = Field(
        description="Samples per forward/backward on one rank (resolved)."
    )
    gradient_accumulation_steps: PositiveInt = Field(
        description="Micro-batches accumulated per optimizer step (resolved)."
    )
    optimizer: OptimizerConfig | None = Field(
        default=None, description="Optimizer built by the engine; None means the script passes one."
    )
    scheduler: SchedulerConfig | None = Field(
        default=None,
        description="LR scheduler built by the engine; None means none or the script's.",
    )
    fp16: FP16Config = Field(default_factory=FP16Config, description="float16 training.")
    bf16: BF16Config = Field(default_factory=BF16Config, description="bfloat16 training.")
    zero_optimization: ZeroConfig = Field(
        default_factory=ZeroConfig, description="ZeRO partitioning and offload."
    )
    aio: AioConfig = Field(default_factory=AioConfig, description="Async I/O for NVMe offload.")
    gradient_clipping: NonNegFloat = Field(
        default=1.0,
        description="Clip the global gradient norm to this value; 0 disables clipping. "
        "DeepSpeed's default became 1.0 in v0.19.3 (it was 0 before).",
    )
    steps_per_print: PositiveInt | None = Field(
        default=None,
        description="Log progress every this many optimizer steps; None (or infinity, which "
        "Hugging Face Accelerate writes) never.",
    )

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _infinite_is_never(cls, value: Any) -> Any:
        # Accelerate's DeepSpeedPlugin sets steps_per_print to float("inf") in every config.
        if isinstance(value, float) and value == float("inf"):
            return None
        return value

    wall_clock_breakdown: Bool = Field(
        default=False, description="Time forward, backward and step and log the breakdown."
    )
    memory_breakdown: Bool = Field(default=False, description="Log memory use along the step.")
    communication_data_type: DTypeName | None = Field(
        default=None,
        description="Dtype gradients are reduced in ('fp32', 'fp16', 'bf16'); None uses the "
        "training precision.",
    )
    prescale_gradients: Bool = Field(
        default=False,
        description="Divide gradients by the world size before the reduction, not after.",
    )
    gradient_predivide_factor: PositiveFloat = Field(
        default=1.0,
        description="Divide gradients by this before the reduction and by world_size / factor "
        "after it.",
    )
    gradient_allreduce_op: str = Field(
        default="mean",
        description="How data-parallel gradients combine: 'mean' (the average, the default) or "
        "'sum' (the plain sum: no division by the world size, no predivide factor); matched "
        "ignoring case. 'sum' is for ZeRO stages 0-2.",
    )

    @field_validator("gradient_allreduce_op", mode="before")
    @classmethod
    def _allreduce_op(cls, value: Any) -> Any:
        op = value.lower() if isinstance(value, str) else value
        if op not in ("mean", "sum"):
            raise ValueError(f"Invalid gradient_allreduce_op {value!r}: use 'mean' or 'sum'")
        return op

    zero_allow_untested_optimizer: Bool = Field(
        default=False, description="Allow ZeRO with an optimizer that is not on the tested list."
    )
    zero_force_ds_cpu_optimizer: Bool = Field(
        default=True,
        description="With optimizer offload, require the built-in CPU optimizer rather than "
        "a client optimizer.",
    )
    dump_state: Bool = Field(
        default=False, description="Print the engine state after initialisation."
    )
    dataloader_drop_last: Bool = Field(
        default=False, description="Drop the last incomplete batch in the engine's data loader."
    )
    data_parallel_size: PositiveInt | None = Field(
        default=None,
        description="Ranks that read different batches, with sequence_parallel_size (DeepSpeed "
        "builds its (data, sequence) mesh from the two); must be world / "
        "sequence_parallel_size.",
    )
    sequence_parallel_size: PositiveInt = Field(
        default=1,
        description="Ulysses sequence parallelism: ranks that split each sequence (consecutive "
        "ranks; a divisor of the world size). The data-parallel size is world / this.",
    )
    expert_parallel: ExpertParallelConfig = Field(
        default_factory=ExpertParallelConfig,
        description="Expert parallelism for Hugging Face MoE models (DeepSpeed's AutoEP): "
        "their experts split over autoep_size consecutive ranks.",
    )
    tensor_parallel: TensorParallelConfig = Field(
        default_factory=TensorParallelConfig,
        description="Tensor-parallel training (DeepSpeed's AutoTP): autotp_size consecutive "
        "ranks split each linear; the data-parallel size is world / autotp_size.",
    )
    tensorboard: TensorBoardConfig = Field(
        default_factory=TensorBoardConfig, description="TensorBoard monitor."
    )
    csv_monitor: CSVMonitorConfig = Field(
        default_factory=CSVMonitorConfig, description="CSV monitor."
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="W&B monitor.")
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig,
        description="Activation checkpointing behaviour.",
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpoint save/load behaviour."
    )
    flops_profiler: FlopsProfilerConfig = Field(
        default_factory=FlopsProfilerConfig, description="The FLOPs profiler."
    )
    comms_logger: CommsLoggerConfig = Field(
        default_factory=CommsLoggerConfig, description="The communication logger."
    )
    data_types: DataTypesConfig = Field(
        default_factory=DataTypesConfig, description="Dtype overrides."
    )

    @model_validator(mode="after")
    def _cross_field_rules(self) -> DeepSpeedConfig:
        # Raised as ConfigError so the loader can list each problem with its own path.
        problems = check_rules(self) + refused_problems(self)
        if problems:
            raise ConfigError(problems)
        return self

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as a plain JSON-ready dict (e.g. to save with a checkpoint).

        ``load_config(cfg.to_dict(), world_size=w)`` gives back an equal config.
        """
        return self.model_dump(mode="json")
