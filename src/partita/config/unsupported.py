"""DeepSpeed config keys partita does not support, and why.

A key here is an error unless its value is *inert* (the feature is switched off, e.g.
``"amp": {"enabled": false}``): such a block changes nothing in DeepSpeed either,
so it is accepted and dropped, which lets users keep their configs. Anything else fails with
the reason and what to use instead; silently ignoring it would train differently from what
the user asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from .errors import Problem

__all__ = ["UNSUPPORTED_KEYS", "Unsupported", "strip_unsupported"]


def _switched_off(value: Any) -> bool:
    """``None``, ``false``, ``{}`` or an object whose ``enabled`` is ``false``."""
    if value is None or value is False:
        return True
    if isinstance(value, Mapping):
        return not value or value.get("enabled") is False
    return False


def _equals(*inert: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or any(value == v and type(value) is type(v) for v in inert)


def _never(value: Any) -> bool:
    return False


def _always(value: Any) -> bool:
    return True


@dataclass(frozen=True)
class Unsupported:
    """Why a key is unsupported and which values are harmless."""

    reason: str
    inert: Callable[[Any], bool] = _switched_off


_OFF = "DeepSpeed feature not in partita"
UNSUPPORTED_KEYS: dict[str, Unsupported] = {
    "amp": Unsupported('NVIDIA Apex AMP is not used by partita; use "fp16" or "bf16"'),
    "torch_autocast": Unsupported('use the "bf16" or "fp16" section for mixed precision'),
    "sparse_attention": Unsupported(
        "DeepSpeed's block-sparse attention kernels are not part of partita; use the model's "
        "own attention (e.g. torch.nn.functional.scaled_dot_product_attention)",
        _never,
    ),
    "pipeline": Unsupported(
        "pipeline parallelism is not supported; partita does data parallelism with ZeRO",
        _never,
    ),
    "compression_training": Unsupported(f"{_OFF}: compression training", _never),
    "quantize_training": Unsupported(f"{_OFF}: MoQ quantize training"),
    "weight_quantization": Unsupported(f"{_OFF}: weight quantization", _never),
    "autotuning": Unsupported(f"{_OFF}: the autotuner; set batch and ZeRO values explicitly"),
    "elasticity": Unsupported(
        "elastic batch sizing is not supported; give fixed batch sizes (torchrun restarts "
        "still work)"
    ),
    "curriculum_learning": Unsupported(f"{_OFF}: legacy curriculum learning"),
    "data_efficiency": Unsupported(f"{_OFF}: data efficiency (curriculum, random-LTD)"),
    "progressive_layer_drop": Unsupported(f"{_OFF}: progressive layer drop"),
    "eigenvalue": Unsupported(f"{_OFF}: eigenvalue computation"),
    "hybrid_engine": Unsupported(f"{_OFF}: the RLHF hybrid engine"),
    "nebula": Unsupported("partita writes checkpoints with its own sharded format"),
    "datastates_ckpt": Unsupported("partita writes checkpoints with its own sharded format"),
    "compile": Unsupported("DeepCompile is not supported; call torch.compile on the model"),
    "use_data_before_expert_parallelism": Unsupported(
        f"{_OFF}: expert parallelism (MoE)", _equals(False)
    ),
    "seq_parallel_communication_data_type": Unsupported(
        "DeepSpeed's gradient dtype under sequence parallelism; partita reduces gradients in "
        "communication_data_type (default: the training precision) with or without it",
        _equals("fp32"),
    ),
    "comet": Unsupported(
        "the Comet monitor is not supported; use tensorboard, csv_monitor or wandb"
    ),
    "timers": Unsupported(f"{_OFF}: throughput timers; use wall_clock_breakdown"),
    "sparse_gradients": Unsupported(
        "sparse (embedding) gradients are not supported", _equals(False)
    ),
    "disable_allgather": Unsupported(f"{_OFF}: disable_allgather", _equals(False)),
    "graph_harvesting": Unsupported(f"{_OFF}: graph harvesting", _equals(False)),
    "managed_gradient_accumulation": Unsupported(
        "partita always manages gradient accumulation itself", _equals(True)
    ),
    "log_level": Unsupported(
        "configure logging with Python's logging module (logger 'partita')", _never
    ),
    # DeepSpeed only prints a tensor-core alignment hint for it.
    "vocabulary_size": Unsupported("informational only", _always),
    "optimizer.legacy_fusion": Unsupported(f"{_OFF}: legacy fused FP16 optimizer", _equals(False)),
    # An empty block turns ZenFlow on with its defaults in DeepSpeed: only null is inert.
    "zero_optimization.zenflow": Unsupported(f"{_OFF}: ZenFlow", _equals()),
    "checkpoint.writer": Unsupported(
        "partita writes checkpoints with its own sharded writer; remove 'writer'"
    ),
    "checkpoint.checkpoint_serialization": Unsupported(
        "partita's checkpoints do not use torch.save serialization", _equals(True)
    ),
}


def strip_unsupported(data: MutableMapping[str, Any]) -> list[Problem]:
    """Remove every unsupported key from ``data`` (in place); return a problem for each one
    whose value is not inert."""
    problems = []
    for path, entry in UNSUPPORTED_KEYS.items():
        *parents, key = path.split(".")
        holder: Any = data
        for parent in parents:
            holder = holder.get(parent) if isinstance(holder, Mapping) else None
        if not isinstance(holder, MutableMapping) or key not in holder:
            continue
        value = holder.pop(key)
        if not entry.inert(value):
            problems.append(
                Problem(path, f"not supported by partita: {entry.reason} (got {value!r})")
            )
    return problems
