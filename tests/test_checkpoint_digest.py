"""Checkpoint checksums (issue 21 item 1): new saves record XXH3-128 per file, loads check it
and still check the sha256 of manifests written before; an unknown algorithm is refused
naming the file and the algorithm (see [Note: digest algorithms] in
`partita.checkpoint.digest`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
import xxhash

import partita
from models import global_batches, make_model, rank_micro_batch
from partita.checkpoint import stfile
from partita.testing import run_distributed

TAG = "t"
FILE = "rank00000-of-00001.safetensors"
_CFG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 3},
    "steps_per_print": 10**6,
}


def _states(engine: Any) -> dict[str, torch.Tensor]:
    return {n: engine.param_states.local_state(p, "exp_avg").clone() for n, p in
            engine.module.named_parameters()}  # fmt: skip


def _variant(src: str, dst: str, change: Callable[[str, dict[str, Any]], None]) -> None:
    """A copy of the save directory `src` at `dst`, with `change(folder, file entry)` applied
    to the checkpoint and its manifest."""
    shutil.copytree(src, dst)
    folder = os.path.join(dst, TAG)
    path = os.path.join(folder, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    change(folder, manifest["files"][FILE])
    with open(path, "w") as f:
        json.dump(manifest, f)


def _flip_byte(folder: str, entry: dict[str, Any]) -> None:
    path = os.path.join(folder, FILE)
    with open(path, "r+b") as f:
        f.seek(entry["bytes"] - 3)  # tensor data: the header stays valid
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def _as_old_manifest(folder: str, entry: dict[str, Any]) -> None:
    entry.pop("digest", None)
    with open(os.path.join(folder, FILE), "rb") as f:
        entry["sha256"] = hashlib.sha256(f.read()).hexdigest()


def _unknown_algorithm(folder: str, entry: dict[str, Any]) -> None:
    entry.pop("sha256", None)
    entry["digest"] = {"blake9": "00" * 16}


def digest_worker(root: str) -> dict[str, Any]:
    """Saves once, then loads variants of the save; returns what each did."""
    save_dir = os.path.join(root, "save")
    engine, *_ = partita.initialize(model=make_model(seed=2), config=_CFG)
    for batch in global_batches(2, 2, seed=3):
        tokens, targets = rank_micro_batch(batch, 0, 1, 2, 0)
        engine.backward(engine(tokens, targets))
        engine.step()
    engine.save_checkpoint(save_dir, tag=TAG)
    saved = _states(engine)
    engine.destroy()
    with open(os.path.join(save_dir, TAG, "manifest.json")) as f:
        manifest = json.load(f)
    with open(os.path.join(save_dir, TAG, FILE), "rb") as f:
        data = f.read()
    out: dict[str, Any] = {
        "checksum": manifest["checksum"],
        "entry": manifest["files"][FILE],
        "xxh3": xxhash.xxh3_128(data).hexdigest(),
    }
    variants = {"flipped": _flip_byte, "old": _as_old_manifest, "unknown": _unknown_algorithm}
    for name, change in variants.items():
        where = os.path.join(root, name)
        _variant(save_dir, where, change)
        engine, *_ = partita.initialize(model=make_model(seed=9), config=_CFG)
        try:
            engine.load_checkpoint(where, tag=TAG)
            loaded = _states(engine)
            out[name] = ("ok", all(torch.equal(saved[n], loaded[n]) for n in saved))
        except Exception as e:
            out[name] = (type(e).__name__, str(e))
        engine.destroy()
    return out


def test_save_records_xxh3_and_loads_check_every_algorithm(tmp_path: Any) -> None:
    (result,) = run_distributed(digest_worker, 1, str(tmp_path), timeout=240)
    # New saves: XXH3-128 of the bytes as written, recorded per file.
    assert result["checksum"] == "xxh3_128"
    assert result["entry"]["digest"] == {"xxh3_128": result["xxh3"]}
    assert "sha256" not in result["entry"]
    # One flipped byte in the tensor data is caught, naming the file and the algorithm.
    kind, message = result["flipped"]
    assert kind == "CheckpointError" and FILE in message and "xxh3_128" in message, message
    assert "checksum check failed" in message, message
    # A manifest from before (sha256 per file) still loads, bitwise.
    assert result["old"] == ("ok", True)
    # An algorithm this partita does not know: refused, naming the file and the algorithm.
    kind, message = result["unknown"]
    assert kind == "CheckpointError" and FILE in message and "'blake9'" in message, message


def test_stream_writer_digest_is_xxh3_of_the_bytes_written(tmp_path: Any) -> None:
    gen = torch.Generator().manual_seed(4)
    tensors = {"a": torch.randn(300_001, generator=gen), "b": torch.arange(7)}
    path = str(tmp_path / "x.safetensors")
    written = stfile.write_safetensors(path, tensors)
    with open(path, "rb") as f:
        data = f.read()
    assert (written.algorithm, written.digest) == ("xxh3_128", xxhash.xxh3_128(data).hexdigest())
