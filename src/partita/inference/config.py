"""The inference config: DeepSpeed's ``init_inference`` keys, validated strictly.

`DeepSpeedInferenceConfig` (deepspeed/inference/config.py) accepts ~35 keys and silently
ignores what it does not know. Here every key DeepSpeed accepts is known by name (with its
aliases, such as ``tp`` for ``tensor_parallel``); a key partita does not know fails with a
"did you mean"; a feature partita does not implement (kernel injection, CUDA graphs, Triton,
ZeRO-inference, quantization, expert parallelism...) fails naming the key, when it is set to
anything but its inactive default. Every problem is collected into one `ConfigError`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from partita.config.errors import ConfigError, Problem, did_you_mean, join_path

__all__ = ["InferenceConfig", "TensorParallelConfig", "load_inference_config"]

_DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "torch.float16": torch.float16, "fp32": torch.float32, "float32": torch.float32,
    "float": torch.float32, "torch.float32": torch.float32, "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16, "bfloat": torch.bfloat16, "torch.bfloat16": torch.bfloat16,
}  # fmt: skip

# DeepSpeed's alias -> field name.
_ALIASES = {
    "kernel_inject": "replace_with_kernel_inject",
    "tp": "tensor_parallel",
    "tm": "triangular_masking",
    "ckpt_config": "checkpoint_config",
    "injection_dict": "injection_policy",
    "args": "config",
    "max_tokens": "max_out_tokens",
    "min_tokens": "min_out_tokens",
    "expert_group": "ep_group",
    "expert_mp_group": "ep_mp_group",
}

# Keys partita acts on (besides tensor_parallel, dtype, checkpoint, injection_policy).
_ACCEPTED = {
    "base_dir": "",
    "keep_module_on_host": None,  # any bool: weights stay where the model is (CPU here)
    "max_out_tokens": None,
    "min_out_tokens": None,
    "replace_method": None,  # deprecated in DeepSpeed and ignored there too
    "mp_size": None,  # deprecated spelling of tensor_parallel.tp_size
    "mpu": None,  # deprecated spelling of tensor_parallel.mpu
}

# Keys DeepSpeed knows whose features partita does not implement: the inactive values allowed.
_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "replace_with_kernel_inject": ((False,), "kernel injection (DeepSpeed's fused CUDA "
                                   "kernels) is not implemented; partita runs the model's own "
                                   "modules tensor-parallel (AutoTP-style)"),
    "enable_cuda_graph": ((False,), "CUDA graph capture is not implemented"),
    "use_triton": ((False,), "Triton kernels are not implemented"),
    "triton_autotune": ((False,), "Triton kernels are not implemented"),
    "zero": (({}, None), "ZeRO-inference is not implemented; use tensor_parallel"),
    "triangular_masking": ((True,), "only the model's own (causal) masking is supported"),
    "moe": (({}, None, False, True, {"ep_size": 1}), "expert parallelism is not implemented; "
            "MoE experts are split tensor-parallel"),
    "quant": (({}, None), "quantization is not implemented"),
    "set_empty_params": ((False,), "empty-parameter modules are not implemented; build the "
                         "model on the meta device and pass checkpoint=<folder>"),
    "save_mp_checkpoint_path": ((None,), "saving a tensor-parallel checkpoint is not "
                                "implemented"),
    "checkpoint_config": (({}, None), "use checkpoint=<Hugging Face safetensors folder>"),
    "return_tuple": ((True,), "the model's own modules return what they return"),
    "training_mp_size": ((1,), "loading Megatron model-parallel checkpoints is not "
                         "implemented"),
    "injection_policy_tuple": ((None,), "use injection_policy"),
    "config": ((None,), "the model's own config is used"),
    "transposed_mode": ((False,), "transposed kernels are not implemented"),
    "ep_size": ((1,), "expert parallelism is not implemented"),
    "ep_group": ((None,), "expert parallelism is not implemented"),
    "ep_mp_group": ((None,), "expert parallelism is not implemented"),
    "moe_experts": (([1],), "expert parallelism is not implemented"),
    "moe_type": (("standard",), "expert parallelism is not implemented"),
}  # fmt: skip

_TP_KEYS = ("enabled", "tp_size", "tp_grain_size", "mpu", "tp_group", "vocab_parallel")
_KNOWN = {"tensor_parallel", "dtype", "checkpoint", "injection_policy", *_ACCEPTED, *_REFUSED}


@dataclass(frozen=True)
class TensorParallelConfig:
    """The ``tensor_parallel`` section (DeepSpeed's ``DeepSpeedTPConfig``)."""

    enabled: bool = True
    """False runs the model unsharded on every rank (tp_size 1)."""
    tp_size: int = 1
    """Ranks each model is split across; the world may hold several such groups."""
    tp_group: Any = None
    """An existing process group to split over (its ranks, in order); None: build groups of
    consecutive ranks."""
    vocab_parallel: bool = False
    """partita's addition: split the input embedding by vocabulary rows (one more all-reduce
    per forward) instead of replicating it, and a head tied to it with it. An output head with
    weights of its own is split by vocabulary rows either way (an all-gather of the logits per
    forward), unless ``injection_policy`` names it ``replicate``."""


@dataclass(frozen=True)
class InferenceConfig:
    """A validated ``init_inference`` config: only what partita acts on."""

    tensor_parallel: TensorParallelConfig
    """How the model is split."""
    dtype: torch.dtype = torch.float16
    """The dtype the weights are cast to (DeepSpeed's default, float16)."""
    checkpoint: str | None = None
    """A Hugging Face safetensors folder (``save_pretrained``) each rank reads its slices
    from; None shards the weights the model already holds."""
    injection_policy: Mapping[Any, Any] | None = None
    """An explicit sharding policy (overrides the model config's plan and the built-in
    rules): ``{"layers.*.mlp.up_proj": "colwise", ...}`` or DeepSpeed's form ``{LayerClass:
    ("o_proj", "down_proj")}`` naming the row-parallel linears of a layer class."""


def _value_problems(key: str, value: Any) -> list[Problem]:
    if key in _REFUSED:
        allowed, why = _REFUSED[key]
        if value in allowed or (
            key == "moe"
            and isinstance(value, Mapping)
            and value.get("ep_size", 1) == 1
            and set(value) <= {"enabled", "ep_size"}
        ):
            return []
        return [Problem(key, f"{value!r} is not supported: {why}")]
    return []


def _dtype(value: Any, problems: list[Problem]) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in _DTYPES.values():
        return value
    if isinstance(value, str) and value in _DTYPES:
        return _DTYPES[value]
    if value in (torch.int8, "int8", "torch.int8"):
        problems.append(Problem("dtype", "int8 (quantized inference) is not supported"))
    else:
        names = ", ".join(sorted({"fp16", "bf16", "fp32"}))
        problems.append(Problem("dtype", f"expected a torch dtype or one of {names}, got "
                                f"{value!r}"))  # fmt: skip
    return torch.float32


def _tensor_parallel(
    section: Any, legacy_size: Any, legacy_mpu: Any, problems: list[Problem]
) -> TensorParallelConfig:
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        problems.append(Problem("tensor_parallel", f"expected a dict, got {section!r}"))
        return TensorParallelConfig()
    for key in section:
        if key not in _TP_KEYS:
            problems.append(Problem(join_path("tensor_parallel", str(key)),
                                    f"unknown key{did_you_mean(str(key), _TP_KEYS)}"))  # fmt: skip
    size = section.get("tp_size", 1)
    if size == 1 and legacy_size not in (None, 1):
        size = legacy_size  # DeepSpeed's deprecated mp_size
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        problems.append(Problem("tensor_parallel.tp_size", f"must be an integer >= 1, got "
                                f"{size!r}"))  # fmt: skip
        size = 1
    mpu = section.get("mpu", legacy_mpu)
    group = section.get("tp_group")
    if mpu is not None:
        getter = getattr(mpu, "get_model_parallel_group", None)
        if not callable(getter):
            problems.append(Problem("tensor_parallel.mpu", "the object has no "
                                    "get_model_parallel_group()"))  # fmt: skip
        elif group is None:
            group = getter()
    enabled = section.get("enabled", True)
    if not isinstance(enabled, bool):
        problems.append(Problem("tensor_parallel.enabled", f"expected a bool, got {enabled!r}"))
    vocab = section.get("vocab_parallel", False)
    if not isinstance(vocab, bool):
        problems.append(Problem("tensor_parallel.vocab_parallel", f"expected a bool, got "
                                f"{vocab!r}"))  # fmt: skip
    return TensorParallelConfig(enabled=bool(enabled), tp_size=size if enabled else 1,
                                tp_group=group, vocab_parallel=vocab is True)  # fmt: skip


def _merge(config: str | Mapping[str, Any] | None, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSpeed's rule: the config (dict or JSON file) updated by the keyword arguments,
    a key given both ways with different values refused."""
    if config is None:
        merged: dict[str, Any] = {}
    elif isinstance(config, str | os.PathLike):
        with open(config) as f:
            merged = json.load(f)
    elif isinstance(config, Mapping):
        merged = dict(config)
    else:
        raise ConfigError([Problem("", f"config must be a dict or a JSON file path, got "
                                   f"{type(config).__name__}")])  # fmt: skip
    problems = [
        Problem(key, f"given as {merged[key]!r} in config and {value!r} as a keyword argument")
        for key, value in kwargs.items()
        if key in merged and merged[key] is not value and merged[key] != value
    ]
    if problems:
        raise ConfigError(problems, "init_inference")
    merged.update(kwargs)
    return {_ALIASES.get(k, k): v for k, v in merged.items()}


def load_inference_config(
    config: str | Mapping[str, Any] | None = None, **kwargs: Any
) -> InferenceConfig:
    """Validates DeepSpeed ``init_inference`` arguments; raises one `ConfigError` listing
    every problem (unknown keys with a suggestion, unsupported features by key)."""
    merged = _merge(config, kwargs)
    problems: list[Problem] = []
    for key, value in merged.items():
        if key not in _KNOWN:
            hint = did_you_mean(key, [*_KNOWN, *_ALIASES])
            problems.append(Problem(key, f"unknown key{hint}"))
        else:
            problems.extend(_value_problems(key, value))
    dtype = _dtype(merged.get("dtype", torch.float16), problems)
    tp = _tensor_parallel(merged.get("tensor_parallel"), merged.get("mp_size"),
                          merged.get("mpu"), problems)  # fmt: skip
    checkpoint = merged.get("checkpoint")
    if checkpoint is not None and not isinstance(checkpoint, str | os.PathLike):
        problems.append(Problem("checkpoint", "DeepSpeed's checkpoint descriptions are not "
                                "supported; pass a Hugging Face safetensors folder"))  # fmt: skip
        checkpoint = None
    elif checkpoint is not None:
        checkpoint = os.path.join(merged.get("base_dir") or "", os.fspath(checkpoint))
        if not os.path.isdir(checkpoint):
            problems.append(Problem("checkpoint", f"{checkpoint!r} is not a folder (expected "
                                    "a Hugging Face safetensors folder)"))  # fmt: skip
    policy = merged.get("injection_policy")
    if policy is not None and not isinstance(policy, Mapping):
        problems.append(Problem("injection_policy", f"expected a dict, got {policy!r}"))
        policy = None
    if problems:
        raise ConfigError(problems, "init_inference")
    return InferenceConfig(tp, dtype, checkpoint, policy)
