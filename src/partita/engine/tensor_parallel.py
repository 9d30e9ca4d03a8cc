"""What `initialize` builds for tensor-parallel training (DeepSpeed's AutoTP training): the
tensor-parallel size, from ``tensor_parallel.autotp_size`` or `tp_model_init`, checked with the
model's shapes before any collective; the groups (``ParallelDims.tensor_parallel``: blocks of
``autotp_size`` consecutive ranks, data-parallel lanes across them, ZeRO over each lane); the
split model. Composition only: the layers live in `partita.parallel.tensor`
([Note: tensor-parallel training])."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from partita import comm
from partita.config import ConfigError, DeepSpeedConfig, config_error
from partita.config.reader import read_config_file
from partita.inference.plan import PlanError
from partita.platform import cluster_env

__all__ = [
    "autotp_size",
    "check_intra_node",
    "check_tensor_parallel",
    "parallelize_model",
    "tensor_dims",
    "tp_model_init",
    "with_autotp",
]

KEY = "tensor_parallel.autotp_size"


@dataclass(frozen=True)
class _InitArgs:
    """What `tp_model_init` recorded."""

    tp_size: int
    dtype: torch.dtype | None
    intra_node: bool = False
    """partita's ``tp_model_init(..., intra_node=True)``: each tensor group must lie within one
    node (its all-reduces on the node's links), or the job is refused."""


_RECORDED: list[_InitArgs] = []
_VOCAB_LOSS: list[bool] = []
_SEQUENCE: list[bool] = []
"""Whether the job's config asks for sequence parallelism between the blocks
(``tensor_parallel.sequence_parallel``; read and used as `_VOCAB_LOSS` is)."""
"""Whether the job's config lets a vocabulary-split head feed a vocabulary-parallel loss (read by
`check_tensor_parallel`, used by `parallelize_model`; `api.initialize` passes neither the config)."""


def tp_model_init(
    model: torch.nn.Module,
    tp_size: int,
    dtype: torch.dtype | None = None,
    config: Any = None,
    **kwargs: Any,
) -> torch.nn.Module:
    """DeepSpeed's ``tp_model_init``: records the tensor-parallel size (and dtype) for the next
    `initialize`, which splits the model; returns `model` unchanged, as DeepSpeed 0.19 does.
    A second call with other values, or a ``tp_group`` (partita builds the groups), raises.
    partita's ``intra_node=True`` asks for every tensor group within one node
    (`check_intra_node`)."""
    if kwargs.get("tp_group") is not None:
        raise ValueError(
            "tp_model_init(tp_group=...): partita builds the tensor groups from tp_size "
            "(consecutive ranks); drop tp_group"
        )
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size {tp_size!r} must be a positive integer")
    intra_node = kwargs.get("intra_node", False)
    if not isinstance(intra_node, bool):
        raise ValueError(f"tp_model_init: intra_node {intra_node!r} must be True or False")
    args = _InitArgs(tp_size, dtype, intra_node)
    if _RECORDED and _RECORDED[0] != args:
        raise ValueError(
            f"tp_model_init: conflicting calls (tp_size {_RECORDED[0].tp_size} then {tp_size}, "
            f"dtype {_RECORDED[0].dtype} then {dtype})"
        )
    _RECORDED[:] = [args]
    return model


def _raw_section(source: Any) -> Mapping[str, Any] | None:
    """The config's ``tensor_parallel`` section before validation (None: absent/unreadable)."""
    if isinstance(source, DeepSpeedConfig):
        return source.tensor_parallel.to_dict()
    raw: Any = None
    if isinstance(source, Mapping):
        raw = source
    elif isinstance(source, str | os.PathLike) and not str(source).lstrip().startswith("{"):
        try:
            raw = read_config_file(source)
        except (OSError, ValueError, ConfigError):
            return None
    section = raw.get("tensor_parallel") if isinstance(raw, Mapping) else None
    return section if isinstance(section, Mapping) else None


def autotp_size(source: Any, world: int) -> int:
    """The tensor-parallel size (1: off) from the config `source` (a dict, a path or a
    `DeepSpeedConfig`) and `tp_model_init`, read before the config is validated and checked
    against the `world` with the key named, before any collective."""
    section = _raw_section(source) or {}
    raw = section.get("autotp_size")
    if raw is not None and (isinstance(raw, bool) or not isinstance(raw, int) or raw < 0):
        return 1  # of the wrong type: validation names it
    size = max(int(raw or 0), 1)
    if _RECORDED:
        recorded = _RECORDED[0].tp_size
        if raw is not None and max(int(raw), 1) != recorded:
            raise config_error(
                KEY, f"{raw}, but tp_model_init(tp_size={recorded}) asked for {recorded}"
            )
        size = recorded
    if size > 1 and world % size:
        raise config_error(
            KEY,
            f"{size} does not divide the world size {world} (tensor groups of consecutive "
            "ranks, of equal size)",
        )
    return size


def check_tensor_parallel(
    config: DeepSpeedConfig, model: Any, tp: int, world: int, sequence_parallel: int, mpu: Any
) -> None:
    """Raises, naming the key and the value, when the config or the model cannot train at
    tensor-parallel size `tp`; reads shapes only (no collective: every rank raises alike)."""
    section = config.tensor_parallel
    # None (unset) or true: on where the head is split by vocabulary; false: gathered logits.
    _VOCAB_LOSS[:] = [section.vocab_parallel_lm_head is not False]
    _SEQUENCE[:] = [bool(section.sequence_parallel)]
    if not _RECORDED and max(section.autotp_size, 1) != tp:  # the raw read missed the file
        raise config_error(KEY, f"{section.autotp_size}: read as {tp} before validation")
    inner = section.tensor_parallel.tp_size
    if inner not in (1, tp) and tp > 1:
        raise config_error(
            "tensor_parallel.tensor_parallel.tp_size",
            f"{inner} does not match tensor_parallel.autotp_size {tp}",
        )
    if tp == 1:
        return
    if sequence_parallel > 1:
        raise config_error(
            KEY,
            f"{tp}: tensor parallelism together with sequence_parallel_size "
            f"{sequence_parallel} is not supported by partita yet",
        )
    if int(config.zero_optimization.mics_shard_size) != -1:
        raise config_error(
            KEY,
            f"{tp}: tensor parallelism together with zero_optimization.mics_shard_size "
            "(hybrid sharding) is not supported by partita yet",
        )
    if _RECORDED and _RECORDED[0].intra_node:
        check_intra_node(tp, cluster_env.detect().local_world_size)
    if not isinstance(model, torch.nn.Module):
        raise config_error(KEY, f"{tp}: tensor parallelism needs an nn.Module model")
    _check_other_dimensions(model, tp)
    from partita.parallel.tensor import check_tensor_parallel as check_model

    try:
        check_model(model, tp, world, bool(section.sequence_parallel))
    except (PlanError, ValueError) as error:
        raise config_error(KEY, f"{tp}: {error}") from None


def check_intra_node(tp: int, local_world: int) -> None:
    """Raises, naming the key and both sizes, when tensor groups of `tp` consecutive ranks
    would cross nodes of `local_world` consecutive ranks (``LOCAL_WORLD_SIZE``, as the
    launchers place ranks) although ``tp_model_init(intra_node=True)`` asked for groups within
    a node: `tp` must divide `local_world`. Reads sizes only (every rank raises alike)."""
    if local_world % tp == 0:
        return
    why = (
        "larger than"
        if tp > local_world
        else "not dividing (so some tensor groups would straddle two nodes)"
    )
    raise config_error(
        KEY,
        f"{tp} tensor ranks per group, {why} this node's {local_world} ranks "
        f"(LOCAL_WORLD_SIZE={local_world}), but tp_model_init(intra_node=True) asked for each "
        "tensor group within one node",
    )


def with_autotp(config: DeepSpeedConfig, tp: int) -> DeepSpeedConfig:
    """`config` with ``tensor_parallel.autotp_size`` set to `tp` when `tp_model_init` set the
    size and the config did not (DeepSpeed merges its arguments into the config so)."""
    section = config.tensor_parallel
    if tp == 1 or section.autotp_size == tp:
        return config
    merged = section.model_copy(update={"autotp_size": tp})
    return config.model_copy(update={"tensor_parallel": merged})


def _check_other_dimensions(model: torch.nn.Module, tp: int) -> None:
    """Refuses the model-splitting dimensions partita does not compose with AutoTP yet."""
    from partita.moe.layer import moe_layers
    from partita.parallel.pipe_module import PipelineModule

    if isinstance(model, PipelineModule):
        raise config_error(
            KEY, f"{tp}: tensor parallelism inside pipeline stages is not supported by partita yet"
        )
    if moe_layers(model):
        raise config_error(
            KEY,
            f"{tp}: tensor parallelism together with MoE layers (expert parallelism) is not "
            "supported by partita yet",
        )


def tensor_dims(tp: int, from_mpu: comm.ParallelDims | None) -> comm.ParallelDims:
    """The job's dimensions for tensor size `tp` > 1: the mpu's when it brings a tensor group
    of that size, else blocks of `tp` consecutive ranks (collective over the world)."""
    if from_mpu is None:
        return comm.ParallelDims.tensor_parallel(tp)
    if from_mpu.tp_world_size != tp:
        raise config_error(
            KEY,
            f"{tp}, but the mpu's tensor-parallel group has {from_mpu.tp_world_size} ranks",
        )
    return from_mpu


def parallelize_model(model: Any, dims: comm.ParallelDims) -> None:
    """Splits `model` over the tensor group of `dims` (nothing without one); collective over
    that group. Only for AutoTP (``autotp_size`` > 1): with an mpu alone, the user's model is
    split already. A Transformers causal LM whose head is split by vocabulary then computes
    its loss from the head's slices ([Note: vocabulary-parallel loss of a Hugging Face causal
    LM] in `partita.parallel.vocab_loss`) unless ``tensor_parallel.vocab_parallel_lm_head`` is
    false."""
    if dims.tp_world_size == 1:
        return
    from partita.parallel.tensor import parallelize
    from partita.parallel.vocab_loss import install_causal_lm_loss

    sequence = bool(_SEQUENCE and _SEQUENCE[0])
    split = parallelize(model, dims.tp_group, dims.tp_ranks, dims.tp_rank, sequence)
    if not (_VOCAB_LOSS[0] if _VOCAB_LOSS else True):
        return
    for name, style in split.replaced.items():
        if style == "vocab_head":
            install_causal_lm_loss(model, name)


def clear_recorded() -> None:
    """Forgets `tp_model_init`'s arguments and the config's loss switch (one job's; tests run
    several in one process)."""
    _RECORDED.clear()
    _VOCAB_LOSS.clear()
    _SEQUENCE.clear()
