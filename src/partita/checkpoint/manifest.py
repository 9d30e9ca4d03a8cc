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
buffer / alias), for every shard file its rank, size, digest (``{algorithm: hex}``; ``sha256`` in
older manifests) and the (offset, length) ranges of each flattened parameter it holds (padding
never stored), the optimizer state keys and group
hyperparameters, counters, loss-scaler and scheduler state, per-rank RNG and data loader
states, the config and the client state. A tensor-parallel checkpoint has one set of shard
files per slice, and records the degree and how each tensor is split (see [Note:
tensor-parallel slices] in `partita.checkpoint.slices`).
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


def states_by_part(
    manifest: dict[str, Any], per_part: list[list[dict[str, Any]]], key: str
) -> dict[str, Any]:
    """`manifest` with the ranks' RNG and data loader states kept per part (a pipeline stage or
    a tensor slice; `per_part` holds each part's rank reports in order) under `key`, and the
    first part's also as the manifest's own ``rng`` / ``data_loader``."""
    states = [
        {"rng": [r["rng"] for r in rs], "data_loader": [r["data_loader"] for r in rs]}
        for rs in per_part
    ]
    manifest[key] = states
    manifest["rng"], manifest["data_loader"] = states[0]["rng"], states[0]["data_loader"]
    return manifest


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
    _check_structure(data, path)
    return data


def _fail(path: str, where: str, value: Any, expected: str) -> CheckpointError:
    return CheckpointError(f"{path}: manifest entry {where} is {value!r}; expected {expected}")


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _check_structure(data: dict[str, Any], path: str) -> None:
    """The types and ranges load and fallback rely on, so a hand-edited or foreign manifest
    fails here, naming the file and the entry, instead of deep inside a load."""
    if not isinstance(data.get("saved_at", 0.0), (int, float)):
        raise _fail(path, "'saved_at'", data["saved_at"], "a number (seconds since the epoch)")
    for key in ("world_size", "zero_stage"):
        if not _is_int(data[key]):
            raise _fail(path, repr(key), data[key], "a non-negative integer")
    counters = data["counters"]
    if not isinstance(counters, dict) or not all(_is_int(v) for v in counters.values()):
        raise _fail(path, "'counters'", counters, "a mapping of non-negative integers")
    tensors = data["tensors"]
    if not isinstance(tensors, dict):
        raise _fail(path, "'tensors'", tensors, "a mapping")
    for name, info in tensors.items():
        shape = info.get("shape") if isinstance(info, dict) else None
        if not isinstance(shape, list) or not all(_is_int(n) for n in shape):
            raise _fail(path, f"'tensors'[{name!r}]", info, "kind, shape (integers), dtype")
    files = data["files"]
    if not isinstance(files, dict):
        raise _fail(path, "'files'", files, "a mapping")
    _check_slices(data, path)
    for fname, info in files.items():
        check_file_name(fname, path)
        where = f"'files'[{fname!r}]"
        expected = "rank, bytes, digest (or sha256) and ranges"
        if not isinstance(info, dict) or not _is_int(info.get("rank")):
            raise _fail(path, where, info, expected)
        # Which algorithm, and whether it is known, is checked by the file's reader
        # (`digest.expected_digest`), naming the file and the algorithm.
        has_digest = isinstance(info.get("digest"), dict) or isinstance(info.get("sha256"), str)
        if not _is_int(info.get("bytes")) or not has_digest:
            raise _fail(path, where, info, expected)
        ranges = info.get("ranges")
        if not isinstance(ranges, dict):
            raise _fail(path, f"{where}['ranges']", ranges, "a mapping")
        for name, pairs in ranges.items():
            ok = isinstance(pairs, list) and all(
                isinstance(p, list) and len(p) == 2 and _is_int(p[0]) and _is_int(p[1])
                for p in pairs
            )
            if not ok:
                raise _fail(path, f"{where}['ranges'][{name!r}]", pairs,
                            "a list of [offset, length] pairs of non-negative integers")  # fmt: skip


def _check_slices(data: dict[str, Any], path: str) -> None:
    """The tensor-parallel entries (see [Note: tensor-parallel slices] in
    `partita.checkpoint.slices`): the degree, each file's slice, each split tensor's shapes."""
    degree = data.get("tp_world_size", 1)
    if not _is_int(degree, 1):
        raise _fail(path, "'tp_world_size'", degree, "a positive integer")
    if degree == 1:
        return
    states = data.get("tp_rank_state", [{}] * degree)
    if not (isinstance(states, list) and len(states) == degree
            and all(isinstance(s, dict) for s in states)):  # fmt: skip
        raise _fail(path, "'tp_rank_state'", states, f"one mapping per tensor rank ({degree})")
    for fname, info in data["files"].items():
        tp = info.get("tp_rank") if isinstance(info, dict) else None
        if not _is_int(tp) or tp >= degree:
            raise _fail(path, f"'files'[{fname!r}]['tp_rank']", tp, f"an integer below {degree}")
    for name, info in data["tensors"].items():
        layout = info.get("tp")
        if layout is None or layout == {"layout": "replicated"}:
            continue
        dim, shapes = layout.get("partition_dim"), layout.get("shapes")
        ok = (
            isinstance(layout, dict)
            and layout.get("layout") == "sliced"
            and (dim is None or _is_int(dim))
            and _is_int(layout.get("partition_stride"), 1)
            and isinstance(shapes, list)
            and len(shapes) == degree
            and all(isinstance(s, list) and all(_is_int(n) for n in s) for s in shapes)
            and (dim is None or all(dim < len(s) for s in shapes))
        )
        if not ok:
            raise _fail(path, f"'tensors'[{name!r}]['tp']", layout,
                        "replicated, or sliced with partition_dim, partition_stride and one "
                        f"shape per tensor rank ({degree})")  # fmt: skip


def check_file_name(name: Any, manifest_path: str) -> str:
    """`name` if it is a plain file name (the manifest lists files inside its own folder);
    else `CheckpointError` naming the manifest and the value."""
    if not isinstance(name, str) or not name:
        reason = "is not a file name"
    elif os.path.isabs(name) or name.startswith(("/", "\\")):
        reason = "is an absolute path"
    elif "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
        reason = "contains '..' or a path separator"
    else:
        return name
    raise CheckpointError(
        f"{manifest_path}: file name {name!r} in 'files' {reason}; a checkpoint's files must "
        "lie directly in its folder (refused: it would read data from outside the checkpoint)"
    )


def check_tag(tag: Any, what: str) -> str:
    """`tag` if it names one folder directly inside a save directory; else `CheckpointError`
    starting with `what` (e.g. ``"tag"`` or the path of `latest`) and naming the value."""
    if not isinstance(tag, str) or not tag or "\0" in tag:
        reason = "is not a folder name"
    elif os.path.isabs(tag) or tag.startswith(("/", "\\")):
        reason = "is an absolute path"
    elif "/" in tag or "\\" in tag or tag in (".", ".."):
        reason = "contains '..' or a path separator"
    elif tag.startswith(".partita-"):
        reason = "names one of partita's own in-progress folders"
    else:
        return tag
    raise CheckpointError(
        f"{what} {tag!r} {reason}; a checkpoint tag must name a folder directly inside the "
        "save directory (refused: it would read data from outside the checkpoint directory)"
    )


def inside(root: str, path: str, what: str) -> str:
    """`path` if it resolves (symlinks followed) inside `root`; else `CheckpointError`
    starting with `what` and naming both resolved paths."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
        raise CheckpointError(
            f"{what}: {path} resolves to {real}, outside {real_root} (a symbolic link leading "
            "out of the checkpoint directory; refused)"
        )
    return path


def tag_folder(load_dir: str, tag: Any, what: str) -> str:
    """``load_dir/tag``, checked with `check_tag` and `inside`."""
    folder = os.path.join(load_dir, check_tag(tag, what))
    return inside(load_dir, folder, f"{what} {tag!r}")


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
        # Hidden folders are in-progress saves (`atomic.Staging`), never candidates.
        if name.startswith(".") or not os.path.isfile(os.path.join(folder, MANIFEST_NAME)):
            continue
        try:
            m = read_manifest(inside(load_dir, folder, "checkpoint folder"))
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
    is empty, unreadable or not a folder name inside `load_dir` (see `check_tag`)."""
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
    return check_tag(tag, f"{path}: holds tag")


def resolve_tag(load_dir: str, tag: str | None) -> str | None:
    """The checkpoint folder name to load.

    With `tag`, that folder (inside `load_dir`; its manifest must exist and be valid).
    Without, the tag in `latest` when that checkpoint is complete; if a complete checkpoint
    saved with ``save_latest`` is newer (a crash between the manifest and `latest`), that one.
    When `latest` names a missing folder or one without a manifest (an interrupted save), the
    newest complete checkpoint, with a warning naming both. None when `load_dir` holds no
    checkpoint and no `latest` at all (a first run).
    """
    if tag is not None:
        read_manifest(tag_folder(load_dir, tag, "tag"))
        return tag
    latest_path = os.path.join(load_dir, LATEST_NAME)
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
    folder = tag_folder(load_dir, named, f"{latest_path}: holds tag")
    if not os.path.isfile(os.path.join(folder, MANIFEST_NAME)):
        return _fall_back(latest_path, named, folder, candidates)
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


def _fall_back(latest_path: str, named: str, folder: str, candidates: list[Candidate]) -> str:
    """The newest complete checkpoint when `latest` names an incomplete or missing one."""
    state = (
        f"{folder} has no {MANIFEST_NAME} (manifest missing: an interrupted save)"
        if os.path.isdir(folder)
        else f"{folder} does not exist"
    )
    if not candidates:
        raise CheckpointError(
            f"{latest_path}: names tag {named!r} but {state}, and no complete checkpoint is "
            "left to fall back to"
        )
    chosen = candidates[-1].tag
    logger.warning(
        "%s names tag %r but %s; loading the newest complete checkpoint %r instead",
        latest_path,
        named,
        state,
        chosen,
    )
    return chosen


__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LATEST_NAME",
    "MANIFEST_NAME",
    "MODULE_PREFIX",
    "Candidate",
    "CheckpointError",
    "check_file_name",
    "check_tag",
    "complete_checkpoints",
    "inside",
    "read_latest",
    "read_manifest",
    "resolve_tag",
    "shard_file_name",
    "state_key",
    "states_by_part",
    "tag_folder",
]
