"""``deepspeed.utils.zero_to_fp32``: full fp32 weights from a sharded checkpoint, whatever world
size and stage saved it (partita's `partita.checkpoint.export`). partita's checkpoints need no
pickle; a DeepSpeed checkpoint does, and is read only with ``trust_pickle=True``."""

from __future__ import annotations

from typing import Any

from partita.checkpoint.export import (
    export_checkpoint,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from partita.compat.deepspeed._missing import module_getattr


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str,
    output_dir: str,
    max_shard_size: str | int = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    trust_pickle: bool = False,
) -> list[str]:
    """Writes the checkpoint's fp32 weights to `output_dir` as Hugging Face safetensors shards
    (with an index when there are several) and returns the files written. partita writes
    safetensors only: ``safe_serialization=False`` (DeepSpeed's ``pytorch_model.bin``) is
    refused, naming the flag, before anything is read."""
    if not safe_serialization:
        raise NotImplementedError(
            "convert_zero_checkpoint_to_fp32_state_dict(safe_serialization=False): partita "
            "writes safetensors only; pass safe_serialization=True (or torch.save the dict "
            "get_fp32_state_dict_from_zero_checkpoint returns)"
        )
    return export_checkpoint(
        checkpoint_dir,
        output_dir,
        dtype="fp32",
        max_shard_size=max_shard_size,
        tag=tag,
        trust_pickle=trust_pickle,
        exclude_frozen_parameters=exclude_frozen_parameters,
    )


__getattr__: Any = module_getattr(
    "deepspeed.utils.zero_to_fp32", instead="partita.checkpoint.export"
)

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]
