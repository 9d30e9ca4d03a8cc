"""The checkpoint manifest: what a checkpoint folder holds, and which folders are checkpoints.

Layout of a save directory::

    save_dir/
      latest                         # the tag of the last checkpoint saved with save_latest
      global_step20/
        manifest.json                # written last: its presence makes the folder a checkpoint
        rank00000-of-00002.safetensors
        rank00001-of-00002.safetensors

The manifest (JSON) records the format version, partita and torch versions, the tag, world size
and ZeRO stage at save time, every saved tensor (name, shape, dtype, kind: trainable / frozen /
buffer / alias), for every shard file its rank, size, sha256 and the (offset, length) ranges of
each flattened parameter it holds (padding never stored), the optimizer state keys and group
hyperparameters, counters, loss-scaler and scheduler state, per-rank RNG and data loader
states, the config and the client state.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
FORMAT_NAME = "partita-checkpoint"
FORMAT_VERSION = 1
MODULE_PREFIX = "module::"
"""Tensor-name prefix of frozen parameters and buffers (module dtype, saved by rank 0)."""

logger = logging.getLogger("partita")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the file and the check."""


def shard_file_name(rank: int, world_size: int) -> str:
    """Name of `rank`'s tensor file in a checkpoint saved at `world_size`."""
    return f"rank{rank:05d}-of-{world_size:05d}.safetensors"


def state_key(what: str, name: str) -> str:
    """Tensor name of state `what` ("param", "exp_avg"...) of parameter `name` in a shard."""
    return f"{what}::{name}"


def read_manifest(folder: str) -> dict[str, Any]:
    """Parses and checks `folder`'s manifest; raises `CheckpointError` naming the file and
    what is wrong (missing, unreadable, not JSON, not a partita manifest, wrong version)."""
    path = os.path.join(folder, MANIFEST_NAME)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{path}: manifest missing; {folder} is not a complete checkpoint "
            "(a save was interrupted, or this is not a partita checkpoint)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: manifest unreadable ({e})") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path}: not a partita checkpoint manifest (no format marker)")
    if data.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {data.get('format_version')!r}, this partita reads "
            f"{FORMAT_VERSION}"
        )
    for key in ("tensors", "files", "world_size", "zero_stage", "counters"):
        if key not in data:
            raise CheckpointError(f"{path}: manifest has no {key!r} entry")
    return data


@dataclass(frozen=True)
class Candidate:
    """A complete checkpoint found in a directory."""

    tag: str
    saved_at: float
    global_steps: int
    save_latest: bool


def complete_checkpoints(load_dir: str) -> list[Candidate]:
    """Every sub-folder of `load_dir` with a readable manifest, oldest first."""
    found = []
    try:
        names = sorted(os.listdir(load_dir))
    except FileNotFoundError:
        return []
    for name in names:
        folder = os.path.join(load_dir, name)
        if not os.path.isfile(os.path.join(folder, MANIFEST_NAME)):
            continue
        try:
            m = read_manifest(folder)
        except CheckpointError as e:
            logger.warning("ignoring %s: %s", folder, e)
            continue
        found.append(
            Candidate(
                tag=name,
                saved_at=float(m.get("saved_at", 0.0)),
                global_steps=int(m["counters"].get("global_steps", 0)),
                save_latest=bool(m.get("save_latest", True)),
            )
        )
    return sorted(found, key=lambda c: (c.saved_at, c.global_steps))


def read_latest(load_dir: str) -> str | None:
    """The tag in `load_dir/latest`; None when there is no such file; `CheckpointError` when it
    is empty or unreadable."""
    path = os.path.join(load_dir, LATEST_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            tag = f.read().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from e
    if not tag:
        raise CheckpointError(f"{path}: empty; expected the tag of a checkpoint folder")
    return tag


def resolve_tag(load_dir: str, tag: str | None) -> str | None:
    """The checkpoint folder name to load.

    With `tag`, that folder (its manifest must exist). Without, the tag in `latest`, checked
    to be complete; if a complete checkpoint saved with ``save_latest`` is newer than it (a
    crash between the manifest and `latest`), that one. None when `load_dir` holds no
    checkpoint and no `latest` at all (a first run).
    """
    if tag is not None:
        read_manifest(os.path.join(load_dir, tag))
        return tag
    named = read_latest(load_dir)
    candidates = [c for c in complete_checkpoints(load_dir) if c.save_latest]
    if named is None:
        if candidates:
            logger.info(
                "no %s file in %s; loading the newest complete checkpoint %s",
                LATEST_NAME,
                load_dir,
                candidates[-1].tag,
            )
            return candidates[-1].tag
        return None
    folder = os.path.join(load_dir, named)
    if not os.path.isdir(folder):
        raise CheckpointError(
            f"{os.path.join(load_dir, LATEST_NAME)}: names tag {named!r} but {folder} does not "
            "exist"
        )
    named_manifest = read_manifest(folder)
    newest = candidates[-1] if candidates else None
    if (
        newest is not None
        and newest.tag != named
        and newest.saved_at > float(named_manifest.get("saved_at", 0.0))
    ):
        logger.warning(
            "%s names %s but %s is a newer complete checkpoint (the save was interrupted "
            "before %s was updated); loading %s",
            LATEST_NAME,
            named,
            newest.tag,
            LATEST_NAME,
            newest.tag,
        )
        return newest.tag
    return named


__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LATEST_NAME",
    "MANIFEST_NAME",
    "MODULE_PREFIX",
    "Candidate",
    "CheckpointError",
    "complete_checkpoints",
    "read_latest",
    "read_manifest",
    "resolve_tag",
    "shard_file_name",
    "state_key",
]
