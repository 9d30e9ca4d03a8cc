"""The ``tensor_parallel`` section: DeepSpeed's AutoTP training (``TPTrainingConfig``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import Field

from .base import Bool, NonNegInt, PositiveInt, Section

__all__ = ["TensorParallelConfig", "TensorParallelGroupConfig"]


class TensorParallelGroupConfig(Section):
    """``tensor_parallel.tensor_parallel`` (alias ``tp``): DeepSpeed's inner ``TPConfig``."""

    tp_size: PositiveInt = Field(
        default=1, description="Tensor-parallel ranks; 1 or equal to autotp_size (which wins)."
    )
    tp_grain_size: PositiveInt = Field(
        default=1, description="Split granularity for uneven splits (partita splits evenly)."
    )
    mpu: Any = Field(
        default=None, description="A model-parallel unit object; pass mpu= to initialize instead."
    )
    tp_group: Any = Field(
        default=None, description="A process group object; partita builds the tensor groups."
    )


class TensorParallelConfig(Section):
    """``tensor_parallel``: tensor-parallel training of the model's linears over ``autotp_size``
    consecutive ranks, ZeRO over the data-parallel ranks of each slice (see
    ``docs/parallelism.md``)."""

    renamed_keys: ClassVar[Mapping[str, str]] = {
        "tp": "tensor_parallel",
        "kernel_inject": "replace_with_kernel_inject",
    }

    autotp_size: NonNegInt = Field(
        default=0,
        description="Ranks each linear is split across (consecutive ranks); 0 or 1: off. "
        "The data-parallel size is world / this.",
    )
    dtype: str | None = Field(
        default=None,
        description="DeepSpeed's model dtype for AutoTP; partita trains in the fp16/bf16 "
        "sections' precision.",
    )
    tp_overlap_comm: Bool = Field(
        default=False,
        description="Overlap the column-parallel all-reduce with the weight-gradient product.",
    )
    vocab_parallel_lm_head: Bool | None = Field(
        default=None,
        description="Vocabulary-parallel loss for an untied head split by vocabulary (the "
        "logits never gathered whole); None or true: on, false: the logits are gathered.",
    )
    sequence_parallel: Bool = Field(
        default=False,
        description="Megatron's sequence parallelism between the blocks: norms, residual adds "
        "and dropouts there on 1/autotp_size of the sequence (reduce-scatter and all-gather "
        "instead of all-reduce); the sequence length must divide by autotp_size.",
    )
    vocab_parallel_ce_backend: str = Field(
        default="torch", description="Cross-entropy kernel of the vocabulary-parallel head."
    )
    tensor_parallel: TensorParallelGroupConfig = Field(
        default_factory=TensorParallelGroupConfig,
        description="DeepSpeed's inner tensor-parallel settings (alias tp).",
    )
    injection_policy_tuple: Any = Field(
        default=None, description="DeepSpeed's AutoTP injection policy."
    )
    partition_config: dict[str, Any] | None = Field(
        default=None, description="Custom layer partitioning rules (DeepSpeed's TPLayerSpec)."
    )
    preset_model: str | None = Field(
        default=None, description="A built-in partitioning preset by architecture name."
    )
    keep_module_on_host: Bool = Field(
        default=False, description="Keep weights on the host while they are split."
    )
    replace_with_kernel_inject: Bool = Field(
        default=False, description="Inject DeepSpeed's inference kernels (alias kernel_inject)."
    )
