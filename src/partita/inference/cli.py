"""``partita generate``: text generation with a model split tensor-parallel over local ranks.

``partita generate --model DIR --tp 2 --prompt "..." [--max_new_tokens K]`` checks its input
(the folder, its config and weights, that the heads split over ``--tp``, the prompt file)
before any rank starts, so a mistake costs one line, not a stack trace per rank. It then
launches ``--tp`` CPU ranks (or one per GPU with ``--num_gpus``) through partita's launcher;
each loads only its slices (`partita.inference.from_pretrained`) and rank 0 prints the text
and the generation speed. Nothing here imports torch until a rank runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["check_model_folder", "main"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="partita generate",
        description="Generate text with a Hugging Face model split tensor-parallel over ranks.",
    )
    p.add_argument(
        "--model",
        required=True,
        metavar="DIR",
        help="a save_pretrained folder (safetensors weights, config, tokenizer)",
    )
    p.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel ranks")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt_file", metavar="FILE", help="read the prompt from FILE")
    p.add_argument("--max_new_tokens", type=int, default=32, metavar="K")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--num_gpus", type=int, default=None, help="run on GPUs (one rank each)")
    return p  # fmt: skip


def _heads(config: dict[str, Any]) -> tuple[int | None, int | None]:
    heads = config.get("num_attention_heads", config.get("n_head"))
    kv = config.get("num_key_value_heads", config.get("num_kv_heads"))
    if config.get("model_type") == "falcon" and config.get("multi_query", True):
        kv = None if config.get("new_decoder_architecture") else 1
    return heads, kv


def check_model_folder(folder: str, tp: int) -> None:
    """Raises ValueError with one line saying what is wrong with `folder` for `tp` ranks."""
    if not os.path.isdir(folder):
        raise ValueError(f"--model {folder}: no such folder")
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--model {folder}: no config.json (not a Hugging Face model folder)")
    weights = ("model.safetensors", "model.safetensors.index.json")
    if not any(os.path.isfile(os.path.join(folder, w)) for w in weights):
        raise ValueError(f"--model {folder}: no model.safetensors or its index (save the model "
                         "with save_pretrained(safe_serialization=True))")  # fmt: skip
    if not any(os.path.isfile(os.path.join(folder, t)) for t in _TOKENIZER_FILES):
        raise ValueError(f"--model {folder}: no tokenizer files (tokenizer.json, ...)")
    with open(path) as f:
        config = json.load(f)
    heads, kv = _heads(config)
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    if isinstance(heads, int) and heads % tp:
        raise ValueError(f"--tp {tp}: the model's {heads} attention heads do not split over "
                         f"{tp} ranks")  # fmt: skip
    if isinstance(kv, int) and kv != 1 and kv % tp:
        raise ValueError(f"--tp {tp}: the model's {kv} key/value heads do not split over "
                         f"{tp} ranks")  # fmt: skip


def _check(ns: argparse.Namespace) -> str:
    """The prompt text, after checking every input (ValueError with one line)."""
    if ns.max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens must be >= 1, got {ns.max_new_tokens}")
    check_model_folder(ns.model, ns.tp)
    if ns.prompt_file is not None:
        if not os.path.isfile(ns.prompt_file):
            raise ValueError(f"--prompt_file {ns.prompt_file}: no such file")
        with open(ns.prompt_file) as f:
            return f.read()
    return str(ns.prompt)


def main(argv: Sequence[str] | None = None) -> int:
    """``partita generate`` entry point; returns the exit status."""
    ns = _parser().parse_args(argv)
    try:
        prompt = _check(ns)
    except (ValueError, OSError) as err:
        print(f"partita generate: error: {err}", file=sys.stderr)
        return 2
    from partita.launcher.launch import LaunchError, LaunchOptions, launch

    args = ("--model", os.path.abspath(ns.model), "--tp", str(ns.tp), "--prompt", prompt,
            "--max_new_tokens", str(ns.max_new_tokens), "--dtype", ns.dtype)  # fmt: skip
    options = LaunchOptions(
        script="partita.inference.cli",
        script_args=args,
        num_procs=None if ns.num_gpus else ns.tp,
        num_gpus=ns.num_gpus,
        module=True,
        no_local_rank=True,
    )
    try:
        return launch(options)
    except LaunchError as err:
        print(f"partita generate: error: {err}", file=sys.stderr)
        return 2


def rank_main(argv: Sequence[str] | None = None) -> int:
    """What each launched rank runs: load its slices, generate, rank 0 prints."""
    import torch
    from transformers import AutoTokenizer

    from partita.comm import get_rank, init_distributed
    from partita.inference import from_pretrained

    ns = _parser().parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[ns.dtype]
    if ns.tp > 1:
        init_distributed()
    started = time.perf_counter()
    engine = from_pretrained(ns.model, tensor_parallel={"tp_size": ns.tp}, dtype=dtype)
    loaded = time.perf_counter() - started
    tokenizer = AutoTokenizer.from_pretrained(ns.model)
    ids = tokenizer(ns.prompt, return_tensors="pt").input_ids
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    started = time.perf_counter()
    out = engine.generate(ids, max_new_tokens=ns.max_new_tokens, do_sample=False,
                          pad_token_id=pad)  # fmt: skip
    seconds = time.perf_counter() - started
    new = out.shape[1] - ids.shape[1]
    if get_rank() == 0:
        print(tokenizer.decode(out[0], skip_special_tokens=True))
        print(f"[partita generate] tp={ns.tp} loaded in {loaded:.2f} s; {new} new tokens in "
              f"{seconds:.2f} s ({new / seconds:.1f} tokens/s)", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(rank_main())
