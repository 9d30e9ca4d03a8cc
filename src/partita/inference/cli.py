"""``partita generate``: text generation with a model split tensor-parallel over local ranks.

``partita generate --model DIR --tp 2 --prompt "..." [--max_new_tokens K]`` checks its input
(the folder, its config and weights, that the heads split over ``--tp``, the tokenizer, the
prompt file) before any rank starts, so a mistake costs one line, not a stack trace per rank.
The tokenizer is the model folder's, or ``--tokenizer DIR_OR_NAME`` (a folder or a hub name,
loaded by transformers' ``AutoTokenizer``); without one the prompt can be given as token ids
(``--prompt_ids 1,2,3``) and the output is printed as ids. It then
launches ``--tp`` CPU ranks (or one per GPU with ``--num_gpus``) through partita's launcher;
each loads only its slices (`partita.inference.from_pretrained`) and rank 0 prints the text
and the generation speed. Nothing here imports torch until a rank runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["check_model_folder", "check_tokenizer", "main", "parse_prompt_ids"]

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
    src.add_argument(
        "--prompt_ids",
        metavar="1,2,3",
        help="the prompt as token ids (no tokenizer needed; output printed as ids "
        "unless a tokenizer is found)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR_OR_NAME",
        help="a tokenizer folder or hub name (default: the --model folder's)",
    )
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
    """Raises ValueError with one line saying what is wrong with `folder` for `tp` ranks
    (its tokenizer is `check_tokenizer`'s)."""
    if not os.path.isdir(folder):
        raise ValueError(f"--model {folder}: no such folder")
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--model {folder}: no config.json (not a Hugging Face model folder)")
    weights = ("model.safetensors", "model.safetensors.index.json")
    if not any(os.path.isfile(os.path.join(folder, w)) for w in weights):
        raise ValueError(f"--model {folder}: no model.safetensors or its index (save the model "
                         "with save_pretrained(safe_serialization=True))")  # fmt: skip
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


def _has_tokenizer(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, t)) for t in _TOKENIZER_FILES)


# What a hub name looks like ("gpt2", "org/name"); anything else not on disk is a missing path.
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def check_tokenizer(model: str, tokenizer: str | None, ids_given: bool) -> str | None:
    """The tokenizer the ranks load: `tokenizer` (a folder, made absolute, or a hub name), else
    the `model` folder when it holds tokenizer files; None when there is none and the prompt
    is given as ids. Raises ValueError with one line saying what to pass."""
    files = ", ".join(_TOKENIZER_FILES)
    if tokenizer is not None:
        if os.path.isdir(tokenizer):
            if not _has_tokenizer(tokenizer):
                raise ValueError(f"--tokenizer {tokenizer}: no tokenizer files ({files}) in "
                                 f"{os.path.abspath(tokenizer)}")  # fmt: skip
            return os.path.abspath(tokenizer)
        if not _HUB_NAME.match(tokenizer) or os.path.exists(tokenizer):
            raise ValueError(f"--tokenizer {tokenizer}: no such folder (give a tokenizer "
                             "folder or a hub name such as gpt2)")  # fmt: skip
        return tokenizer  # transformers resolves a hub name (its cache, else the hub)
    if _has_tokenizer(model):
        return os.path.abspath(model)
    if ids_given:
        return None
    raise ValueError(
        f"--model {model}: no tokenizer files ({files}) in {os.path.abspath(model)}; pass "
        "--tokenizer DIR (a tokenizer folder or hub name), or the prompt as token ids with "
        "--prompt_ids 1,2,3"
    )


def parse_prompt_ids(text: str, vocab_size: int | None) -> list[int]:
    """``"1,2,3"`` as token ids; ValueError naming the value when one is not an integer in
    [0, `vocab_size`)."""
    ids = []
    for part in text.replace(" ", "").split(","):
        if not part.isdigit():
            raise ValueError(f"--prompt_ids {text!r}: {part!r} is not a token id (give "
                             "integers >= 0 separated by commas, e.g. 1,2,3)")  # fmt: skip
        if vocab_size is not None and int(part) >= vocab_size:
            raise ValueError(f"--prompt_ids {text!r}: token id {part} is outside the model's "
                             f"vocabulary of {vocab_size}")  # fmt: skip
        ids.append(int(part))
    return ids


def _check(ns: argparse.Namespace) -> str:
    """The prompt text (ids as given), after checking every input (ValueError with one line);
    `ns.tokenizer` becomes what the ranks load (None: ids in, ids out)."""
    if ns.max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens must be >= 1, got {ns.max_new_tokens}")
    check_model_folder(ns.model, ns.tp)
    ns.tokenizer = check_tokenizer(ns.model, ns.tokenizer, ns.prompt_ids is not None)
    if ns.prompt_ids is not None:
        with open(os.path.join(ns.model, "config.json")) as f:
            vocab = json.load(f).get("vocab_size")
        parse_prompt_ids(ns.prompt_ids, vocab if isinstance(vocab, int) else None)
        return str(ns.prompt_ids)
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

    source = "--prompt" if ns.prompt_ids is None else "--prompt_ids"
    args: tuple[str, ...] = ("--model", os.path.abspath(ns.model), "--tp", str(ns.tp), source, prompt,
            "--max_new_tokens", str(ns.max_new_tokens), "--dtype", ns.dtype)  # fmt: skip
    if ns.tokenizer is not None:
        args += ("--tokenizer", ns.tokenizer)
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
    """What each launched rank runs: load its slices, generate, rank 0 prints (the text, or
    the token ids when there is no tokenizer)."""
    import torch

    from partita.comm import get_rank, init_distributed
    from partita.inference import from_pretrained

    ns = _parser().parse_args(argv)
    try:  # the launcher checked these; a rank run by hand gets the same one line
        ns.tokenizer = check_tokenizer(ns.model, ns.tokenizer, ns.prompt_ids is not None)
        tokenizer = _load_tokenizer(ns.tokenizer)
    except (ValueError, OSError) as err:
        print(f"partita generate: error: {err}", file=sys.stderr)
        return 2
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[ns.dtype]
    if ns.tp > 1:
        init_distributed()
    started = time.perf_counter()
    engine = from_pretrained(ns.model, tensor_parallel={"tp_size": ns.tp}, dtype=dtype)
    loaded = time.perf_counter() - started
    if ns.prompt_ids is not None:
        vocab = getattr(engine.module.config, "vocab_size", None)
        ids = torch.tensor([parse_prompt_ids(ns.prompt_ids, vocab)])
    else:
        assert tokenizer is not None  # check_tokenizer: text needs one
        ids = tokenizer(ns.prompt, return_tensors="pt").input_ids
    started = time.perf_counter()
    out = engine.generate(ids, max_new_tokens=ns.max_new_tokens, do_sample=False,
                          pad_token_id=_pad_id(tokenizer, engine.module.config))  # fmt: skip
    seconds = time.perf_counter() - started
    new = out.shape[1] - ids.shape[1]
    if get_rank() == 0:
        if tokenizer is None:
            print(",".join(str(int(t)) for t in out[0]))
        else:
            print(tokenizer.decode(out[0], skip_special_tokens=True))
        print(f"[partita generate] tp={ns.tp} loaded in {loaded:.2f} s; {new} new tokens in "
              f"{seconds:.2f} s ({new / seconds:.1f} tokens/s)", flush=True)  # fmt: skip
    return 0


def _load_tokenizer(name: str | None) -> Any:
    """transformers' AutoTokenizer for a folder or hub name; None for none."""
    if name is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:  # one line, not transformers' paragraph
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"--tokenizer {name}: could not be loaded ({first})") from err


def _pad_id(tokenizer: Any, config: Any) -> int:
    """The tokenizer's pad id, else the model config's pad or end-of-sequence id, else 0."""
    for pad in (getattr(tokenizer, "pad_token_id", None), getattr(config, "pad_token_id", None),
                getattr(config, "eos_token_id", None)):  # fmt: skip
        if isinstance(pad, list) and pad:
            pad = pad[0]
        if isinstance(pad, int):
            return pad
    return 0


if __name__ == "__main__":
    sys.exit(rank_main())
