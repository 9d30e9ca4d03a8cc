"""Sharded loading: each rank reads only its slices of a Hugging Face safetensors folder (a
``partita export`` folder is one) or of a partita training checkpoint.

[Note: sharded loading memory]
The model skeleton is built with its parameters on the meta device (buffers such as rotary
frequencies are computed for real: they are small and not in checkpoints). Each parameter is
then read as this rank's slice through ``safe_open(...).get_slice(...)``, which views only
the requested rows (or copies the requested columns) of the memory-mapped file. The slice is
copied into memory of its own: a tensor left viewing the file would keep it mapped for the
engine's life and die with SIGBUS if the folder were rewritten meanwhile. A file is opened per
tensor and closed right after, so the mapped pages a read touches leave this process's
resident set with the mapping, instead of accumulating for the whole file. A rank's
peak host memory is then its own slices plus about one tensor, not the whole model (DeepSpeed
loads the full model on every rank first).

From a partita training checkpoint (a save directory or one checkpoint folder) the fp32 master
weights are read through the checkpoint's reader: a row slice as the flat ranges of its rows
(only those bytes), any other slice cut from its whole tensor, which is read alone, so the
bound is the same: this rank's slices plus one full tensor.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from safetensors import safe_open
from torch import nn

from partita.checkpoint.export import full_tensor, open_checkpoint
from partita.checkpoint.manifest import CheckpointError
from partita.inference.plan import RankSlice
from partita.inference.shard import set_parameter

__all__ = ["LoadError", "build_skeleton", "checkpoint_index", "load_slices"]


class LoadError(ValueError):
    """A checkpoint folder that cannot be loaded; names the folder, file or tensor."""


def checkpoint_index(folder: str) -> dict[str, str]:
    """Tensor name -> safetensors file path for a ``save_pretrained`` folder (sharded with
    ``model.safetensors.index.json``, or a single ``model.safetensors``)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise LoadError(f"{index}: no 'weight_map' object")
        return {k: os.path.join(folder, v) for k, v in weight_map.items()}
    if os.path.isfile(single):
        with safe_open(single, "pt") as f:
            return {k: single for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    raise LoadError(
        f"{folder}: no model.safetensors or model.safetensors.index.json (only safetensors "
        "folders written by save_pretrained can be loaded sharded)"
    )


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device; buffers stay real."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":  # a tie re-registers a meta one
            kind: Any = type(param)
            meta = param.to("meta")
            module._parameters[name] = kind(meta, requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def build_skeleton(folder: str, dtype: torch.dtype) -> nn.Module:
    """The causal-LM model of a Hugging Face folder, its parameters on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


class _Source(Protocol):
    shape: tuple[int, ...]

    def read(self, spec: RankSlice | None) -> torch.Tensor: ...


def _index(ndim: int, dim: int, a: int, b: int) -> tuple[slice, ...]:
    return (*(slice(None),) * (dim % ndim), slice(a, b))


@dataclass
class _Stored:
    """One tensor of one safetensors file."""

    path: str
    key: str
    shape: tuple[int, ...]

    def read(self, spec: RankSlice | None) -> torch.Tensor:
        with safe_open(self.path, "pt") as f:  # see [Note: sharded loading memory]
            if spec is None:
                return f.get_tensor(self.key).clone()
            part = f.get_slice(self.key)
            if spec.zero:
                dtype = f.get_slice(self.key).get_dtype()
                return torch.zeros(self.shape, dtype=_ST_DTYPES.get(dtype, torch.float32))
            ndim = len(self.shape)
            pieces = [part[_index(ndim, spec.dim, a, b)] for a, b in spec.ranges]
        return torch.cat(pieces, dim=spec.dim) if len(pieces) > 1 else pieces[0].clone()


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F64": torch.float64}  # fmt: skip


@dataclass
class _Concat:
    """Several stored tensors joined along `dim` (Mixtral's w1 and w3 as gate_up)."""

    parts: list[_Source]
    dim: int
    shape: tuple[int, ...]

    def read(self, spec: RankSlice | None) -> torch.Tensor:
        if spec is None or spec.zero or spec.dim % len(self.shape) != self.dim:
            return torch.cat([p.read(spec) for p in self.parts], dim=self.dim)
        pieces, offset = [], 0
        for part in self.parts:
            size = part.shape[self.dim]
            for a, b in spec.ranges:
                lo, hi = max(a, offset), min(b, offset + size)
                if lo < hi:
                    sub = RankSlice(self.dim, ((lo - offset, hi - offset),))
                    pieces.append(part.read(sub))
            offset += size
        return torch.cat(pieces, dim=self.dim)


@dataclass
class _Stack:
    """Per-expert tensors stacked into one 3-D parameter (Mixtral's experts)."""

    items: list[_Source]
    shape: tuple[int, ...]

    def read(self, spec: RankSlice | None) -> torch.Tensor:
        if spec is not None and not spec.zero:
            dim = spec.dim % len(self.shape)
            if dim == 0:
                raise LoadError("splitting experts across ranks is not supported")
            spec = RankSlice(dim - 1, spec.ranges)
        return torch.stack([item.read(spec) for item in self.items])


def _mixtral(name: str, stored: dict[str, _Source]) -> _Source | None:
    """Transformers 5 keeps Mixtral's experts as 3-D tensors but saves them per expert."""
    match = re.fullmatch(r"(.*)\.mlp\.experts\.(gate_up_proj|down_proj)", name)
    if not match:
        return None
    base = f"{match[1]}.mlp.experts"  # renamed from block_sparse_moe by `_renamed`
    count = 0
    while f"{base}.{count}.w1.weight" in stored:
        count += 1
    if not count:
        return None
    items: list[_Source] = []
    for e in range(count):
        if match[2] == "down_proj":
            items.append(stored[f"{base}.{e}.w2.weight"])
            continue
        w1, w3 = stored[f"{base}.{e}.w1.weight"], stored[f"{base}.{e}.w3.weight"]
        items.append(_Concat([w1, w3], 0, (w1.shape[0] + w3.shape[0], *w1.shape[1:])))
    return _Stack(items, (count, *items[0].shape))


def _stored(folder: str) -> dict[str, _Stored]:
    out: dict[str, _Stored] = {}
    by_file: dict[str, list[str]] = {}
    for key, path in checkpoint_index(folder).items():
        by_file.setdefault(path, []).append(key)
    for path, keys in by_file.items():
        if not os.path.isfile(path):
            raise LoadError(f"{path}: listed in the index of {folder} but missing")
        with safe_open(path, "pt") as f:
            for key in keys:
                out[key] = _Stored(path, key, tuple(f.get_slice(key).get_shape()))
    return out


@dataclass
class _Saved:
    """One parameter of a partita training checkpoint (`source` is its
    `partita.checkpoint.reader.StateSource`)."""

    source: Any
    name: str
    shape: tuple[int, ...]

    def read(self, spec: RankSlice | None) -> torch.Tensor:
        if spec is not None and spec.zero:
            return torch.zeros(self.shape)
        trainable = self.source.tensors[self.name]["kind"] == "trainable"
        if spec is None or not trainable or spec.dim % len(self.shape) != 0:
            whole = full_tensor(self.source, self.name)
            if spec is None:
                return whole
            ndim = len(self.shape)
            pieces = [whole[_index(ndim, spec.dim, a, b)] for a, b in spec.ranges]
            return torch.cat(pieces, dim=spec.dim).clone()
        row = math.prod(self.shape[1:])  # rows are contiguous: read only their elements
        ranges = [(a * row, (b - a) * row) for a, b in spec.ranges]
        flat = self.source.read(self.name, "param", ranges)
        if flat is None:
            raise LoadError(f"{self.source.folder}: no master weights for {self.name!r}")
        return flat.view(-1, *self.shape[1:])


def _is_hf_folder(folder: str) -> bool:
    return any(
        os.path.isfile(os.path.join(folder, f))
        for f in ("model.safetensors", "model.safetensors.index.json")
    )


def _saved(folder: str) -> dict[str, _Source]:
    """The parameters of the partita checkpoint in `folder`, by name (aliases of tied weights
    resolved to what they alias)."""
    try:
        source = open_checkpoint(folder, None, trust_pickle=False)
    except CheckpointError as error:
        raise LoadError(
            f"{folder}: neither a Hugging Face safetensors folder nor a partita checkpoint "
            f"({error})"
        ) from None
    out: dict[str, _Source] = {}
    for name, info in source.tensors.items():
        target = str(info["alias_of"]) if info["kind"] == "alias" else name
        kind = source.tensors[target]["kind"]
        if kind not in ("trainable", "frozen"):
            continue  # buffers are computed by the skeleton
        shape = tuple(int(d) for d in source.tensors[target]["shape"])
        out[name] = _Saved(source, target, shape)
    return out


def _renamed(model: nn.Module, stored: dict[str, _Stored]) -> dict[str, _Stored]:
    """`stored` plus each key as Transformers renames it on load (GPT-NeoX's ``embed_out``
    is ``lm_head``, Mixtral's ``block_sparse_moe`` is ``mlp``...)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings
    except ImportError:  # an older Transformers saves what it loads
        return stored
    renamings = [
        t
        for t in get_model_conversion_mapping(model)  # type: ignore[arg-type]
        if type(t) is WeightRenaming
    ]
    out = dict(stored)
    for key, value in stored.items():
        out.setdefault(apply_renamings(key, renamings), value)
    return out


def _source(name: str, model: nn.Module, stored: dict[str, _Source]) -> _Source | None:
    if name in stored:
        return stored[name]
    if getattr(getattr(model, "config", None), "model_type", "") == "mixtral":
        return _mixtral(name, stored)
    return None


def load_slices(
    model: nn.Module, folder: str, slices: dict[str, RankSlice], dtype: torch.dtype
) -> None:
    """Fills every meta parameter of `model` with this rank's slice (cast to `dtype`) read
    from `folder`; tied parameters stay tied. Raises `LoadError` naming missing tensors or a
    shape that does not match the model's."""
    stored: dict[str, _Source]
    stored = dict(_renamed(model, _stored(folder))) if _is_hf_folder(folder) else _saved(folder)
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    missing = []
    for names in groups.values():
        param = model.get_parameter(names[0])
        source = next((s for n in names if (s := _source(n, model, stored)) is not None), None)
        if source is None:
            missing.append(names[0])
            continue
        if tuple(source.shape) != tuple(param.shape):
            raise LoadError(f"{folder}: tensor for {names[0]} has shape {list(source.shape)}, "
                            f"the model expects {list(param.shape)}")  # fmt: skip
        value = nn.Parameter(source.read(slices.get(names[0])).to(dtype), requires_grad=False)
        for n in names:
            set_parameter(model, n, value)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise LoadError(f"{folder}: no tensor for {len(missing)} parameters: {shown}")


def config_dict(folder: str) -> dict[str, Any]:
    """The folder's ``config.json`` as a dict (no transformers import: for the CLI's checks)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise LoadError(f"{folder}: no config.json (not a Hugging Face model folder)")
    with open(path) as f:
        return dict(json.load(f))
