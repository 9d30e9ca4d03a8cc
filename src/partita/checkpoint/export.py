"""Consolidated weights from any checkpoint: Python functions and ``partita export``.

``partita export CHECKPOINT_DIR OUT_DIR [--dtype fp32|bf16|fp16] [--max-shard-size 5GB]
[--tag TAG] [--trust-pickle]`` writes the Hugging Face layout: ``model.safetensors``, or
``model-0000i-of-0000n.safetensors`` shards with ``model.safetensors.index.json``. It runs
offline on CPU and streams tensor by tensor: each tensor is assembled from the shard files
(memory-mapped), cast and written before the next is read, so memory stays near one tensor
plus the page cache. Tied weights are written under every name the module's ``state_dict``
has, so both ``load_state_dict`` and ``from_pretrained`` accept the result.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Any

import torch

from partita.checkpoint.atomic import write_atomic
from partita.checkpoint.locate import locate, open_source
from partita.checkpoint.manifest import CheckpointError
from partita.checkpoint.reader import StateSource
from partita.checkpoint.state import parse_dtype
from partita.checkpoint.stfile import TensorSpec, write_safetensors_stream

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def open_checkpoint(checkpoint_dir: str, tag: str | None, trust_pickle: bool) -> StateSource:
    """A reader for the checkpoint in `checkpoint_dir` (a save directory or one checkpoint
    folder); `CheckpointError` when there is none."""
    found = locate(checkpoint_dir, tag)
    if found is None:
        raise CheckpointError(f"{checkpoint_dir}: no checkpoint found")
    source = open_source(*found, trust_pickle=trust_pickle)
    source.verify(0, 1)
    return source


def full_tensor(source: StateSource, name: str) -> torch.Tensor:
    """Parameter or buffer `name` of a saved checkpoint, whole (trainable ones from the fp32
    masters; aliases of tied weights resolved)."""
    info = source.tensors[name]
    if info["kind"] == "alias":
        return full_tensor(source, info["alias_of"])
    if info["kind"] == "trainable":
        shape = [int(s) for s in info["shape"]]
        value = source.read(name, "param", [(0, math.prod(shape))])
        if value is None:
            raise CheckpointError(f"{source.folder}: no master weights for {name!r}")
        return value.view(shape)
    return source.read_module(name)


def _exported_names(source: StateSource, exclude_frozen: bool) -> list[str]:
    names = []
    for name, info in source.tensors.items():
        target = source.tensors.get(info.get("alias_of") or name, info)
        if target.get("stored") is False or (exclude_frozen and target["kind"] == "frozen"):
            continue
        names.append(name)
    return names


def _out_dtype(info: dict[str, Any], dtype: torch.dtype | None, source: StateSource) -> torch.dtype:
    if info["kind"] == "alias":
        info = source.tensors[info["alias_of"]]
    saved = torch.float32 if info["kind"] == "trainable" else parse_dtype(info["dtype"])
    if not saved.is_floating_point:
        return saved
    return dtype if dtype is not None else torch.float32


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    trust_pickle: bool = False,
) -> dict[str, torch.Tensor]:
    """The consolidated state dict (floating tensors in fp32, tied names sharing one tensor) of
    the checkpoint in `checkpoint_dir`, whatever world size and stage saved it. DeepSpeed ZeRO
    1-3 checkpoints need `trust_pickle=True` (this call only)."""
    source = open_checkpoint(checkpoint_dir, tag, trust_pickle)
    out: dict[str, torch.Tensor] = {}
    try:
        for name in _exported_names(source, exclude_frozen_parameters):
            info = source.tensors[name]
            if info["kind"] == "alias" and info["alias_of"] in out:
                out[name] = out[info["alias_of"]]
                continue
            t = full_tensor(source, name)
            out[name] = t.float() if t.is_floating_point() else t.clone()
    finally:
        source.close()
    return out


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str, tag: str | None = None, trust_pickle: bool = False
) -> torch.nn.Module:
    """Loads the consolidated fp32 weights into `model` (moved to CPU, as DeepSpeed does) with
    ``strict=False``; returns it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, trust_pickle=trust_pickle)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5 * 10**9; ``"2GiB"`` -> 2 * 2**30; plain numbers are bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).upper() not in _UNITS:
        raise ValueError(f"size {text!r}: expected a number with an optional unit like 5GB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _plan(specs: list[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = math.prod(spec[2]) * torch.empty((), dtype=spec[1]).element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def export_checkpoint(
    checkpoint_dir: str,
    out_dir: str,
    dtype: str = "fp32",
    max_shard_size: str | int = "5GB",
    tag: str | None = None,
    trust_pickle: bool = False,
    exclude_frozen_parameters: bool = False,
) -> list[str]:
    """Writes the checkpoint's weights to `out_dir` in Hugging Face safetensors layout; returns
    the files written (see the module docstring)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {sorted(DTYPES)}")
    limit = parse_size(max_shard_size) if isinstance(max_shard_size, str) else int(max_shard_size)
    source = open_checkpoint(checkpoint_dir, tag, trust_pickle)
    try:
        names = _exported_names(source, exclude_frozen_parameters)
        specs: list[TensorSpec] = [
            (n, _out_dtype(source.tensors[n], DTYPES[dtype], source),
             tuple(int(s) for s in source.tensors[n]["shape"]))
            for n in names
        ]  # fmt: skip
        return _write_shards(source, out_dir, _plan(specs, limit))
    finally:
        source.close()


def _write_shards(source: StateSource, out_dir: str, shards: list[list[TensorSpec]]) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    dtypes = {n: dt for shard in shards for n, dt, _ in shard}

    def produce(name: str) -> torch.Tensor:
        return full_tensor(source, name).to(dtypes[name]).contiguous()

    files, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards):
        fname = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        written = write_safetensors_stream(
            os.path.join(out_dir, fname), shard, produce, {"format": "pt"}
        )
        files.append(written.path)
        for name, dt, shape in shard:
            weight_map[name] = fname
            total += math.prod(shape) * torch.empty((), dtype=dt).element_size()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        path = os.path.join(out_dir, "model.safetensors.index.json")
        write_atomic(path, json.dumps(index, indent=2).encode())
        files.append(path)
    return files


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="partita export",
        description="Write a checkpoint's weights as Hugging Face safetensors (any world size "
        "and ZeRO stage; DeepSpeed ZeRO 1-3 folders with --trust-pickle).",
    )
    p.add_argument("checkpoint_dir", help="save directory (uses latest) or one checkpoint folder")
    p.add_argument("out_dir", help="output folder")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="fp32",
        help="dtype of floating tensors (default fp32)",
    )
    p.add_argument("--max-shard-size", default="5GB", help="largest file (default 5GB)")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    p.add_argument("--exclude-frozen-parameters", action="store_true")
    p.add_argument(
        "--trust-pickle",
        action="store_true",
        help="allow reading a DeepSpeed checkpoint: its .pt files are pickles, which "
        "can run arbitrary code when loaded; use only for files you trust",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """``partita export`` entry point; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        files = export_checkpoint(
            args.checkpoint_dir, args.out_dir, dtype=args.dtype,
            max_shard_size=args.max_shard_size, tag=args.tag, trust_pickle=args.trust_pickle,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
        )  # fmt: skip
    except (CheckpointError, ValueError) as e:
        print(f"partita export: error: {e}", file=sys.stderr)
        return 1
    for f in files:
        print(f)
    return 0


__all__ = [
    "export_checkpoint",
    "full_tensor",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "main",
    "open_checkpoint",
    "parse_size",
]
