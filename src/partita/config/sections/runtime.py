"""Runtime sections: ``aio``, ``activation_checkpointing`` and ``checkpoint``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field

from .base import Bool, PositiveInt, Section

__all__ = [
    "ActivationCheckpointingConfig",
    "AioConfig",
    "CheckpointConfig",
    "ParallelWriteConfig",
    "TagValidation",
]


class AioConfig(Section):
    """``aio``: asynchronous file I/O used by NVMe offload."""

    renamed_keys: ClassVar[Mapping[str, str]] = {"thread_count": "intra_op_parallelism"}

    block_size: PositiveInt = Field(default=1_048_576, description="Bytes per I/O request.")
    queue_depth: PositiveInt = Field(default=8, description="I/O requests in flight per thread.")
    intra_op_parallelism: PositiveInt = Field(
        default=1,
        description="Threads that split each read or write (older spelling: thread_count).",
    )
    single_submit: Bool = Field(
        default=False, description="Submit requests one at a time instead of in batches."
    )
    overlap_events: Bool = Field(
        default=True, description="Overlap submitting new requests with waiting for completions."
    )
    use_gds: Bool = Field(default=False, description="Use NVIDIA GPUDirect Storage (CUDA only).")


class ActivationCheckpointingConfig(Section):
    """``activation_checkpointing``: how ``checkpointing.checkpoint`` stores activations."""

    partition_activations: Bool = Field(
        default=False, description="Partition checkpointed activations across model-parallel ranks."
    )
    cpu_checkpointing: Bool = Field(
        default=False,
        description="Keep checkpointed activations in CPU memory; with a Hugging Face model "
        "(gradient_checkpointing_enable), the engine also moves each checkpointed layer's input "
        "to host memory (partita.activations.offload_checkpoints).",
    )
    contiguous_memory_optimization: Bool = Field(
        default=False, description="Copy checkpointed activations into one contiguous buffer."
    )
    number_checkpoints: PositiveInt | None = Field(
        default=None, description="Number of checkpoints, sizing the contiguous buffer."
    )
    synchronize_checkpoint_boundary: Bool = Field(
        default=False, description="Synchronize the device at each checkpoint boundary."
    )
    profile: Bool = Field(default=False, description="Time the checkpointing functions.")


TagValidation = Literal["WARN", "IGNORE", "FAIL"]
"""What to do when ranks disagree on a checkpoint tag."""


def _upper(value: Any) -> Any:
    return value.upper() if isinstance(value, str) else value


class ParallelWriteConfig(Section):
    """``checkpoint.parallel_write``: spreading checkpoint writes over ranks."""

    pipeline_stage: Bool = Field(
        default=False, description="Let every pipeline stage write its own part of the checkpoint."
    )


class CheckpointConfig(Section):
    """``checkpoint``: checkpoint save and load behaviour."""

    tag_validation: Annotated[TagValidation, BeforeValidator(_upper)] = Field(
        default="WARN",
        description="Check that all ranks save under the same tag: 'Warn', 'Ignore' or "
        "'Fail' (case-insensitive).",
    )
    load_universal: Bool = Field(
        default=False, description="Load a universal (world-size independent) checkpoint."
    )
    use_node_local_storage: Bool = Field(
        default=False, description="Each node writes to its own local storage."
    )
    parallel_write: ParallelWriteConfig = Field(
        default_factory=ParallelWriteConfig, description="Parallel checkpoint writing."
    )
    async_save: Bool = Field(
        default=False,
        description="save_checkpoint returns once the states are copied to host memory; the "
        "files are written, fsynced and committed in the background (partita's own key).",
    )
