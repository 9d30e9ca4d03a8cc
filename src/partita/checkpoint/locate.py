"""Finding the checkpoint folder to read and its format (partita or DeepSpeed, read by
`partita.compat.checkpoint_reader`)."""

from __future__ import annotations

import os
from typing import Any

from partita.checkpoint.manifest import (
    LATEST_NAME,
    MANIFEST_NAME,
    read_latest,
    read_manifest,
    resolve_tag,
    tag_folder,
)
from partita.checkpoint.reader import PartitaSource, StateSource
from partita.checkpoint.slices import RecutSource, saved_degree, slice_meta

PARTITA = "partita"
DEEPSPEED = "deepspeed"


def _is_partita(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MANIFEST_NAME))


def locate(load_dir: str, tag: str | None) -> tuple[str, str] | None:
    """``(folder, format)`` of the checkpoint to read; None when `load_dir` holds none.

    `load_dir` may be a save directory (then `tag`, else `latest`, else the newest complete
    checkpoint, see `resolve_tag`) or, with no tag, one checkpoint folder itself. Raises
    `CheckpointError` naming the file when `latest` or the tag's folder is broken, or naming
    the value when the tag (or `latest`) leads outside `load_dir`.
    """
    # Imported here: the DeepSpeed reader (compat/) imports this package, so a top-level import
    # would make importing it first a cycle.
    from partita.compat.checkpoint_reader import is_deepspeed_folder

    if tag is None:
        if _is_partita(load_dir):
            return load_dir, PARTITA
        if is_deepspeed_folder(load_dir):
            return load_dir, DEEPSPEED
        named = read_latest(load_dir)
        if named is not None:
            what = f"{os.path.join(load_dir, LATEST_NAME)}: holds tag"
            folder = tag_folder(load_dir, named, what)
            if is_deepspeed_folder(folder) and not _is_partita(folder):
                return folder, DEEPSPEED
        resolved = resolve_tag(load_dir, None)
        return None if resolved is None else (os.path.join(load_dir, resolved), PARTITA)
    folder = tag_folder(load_dir, tag, "tag")
    if is_deepspeed_folder(folder) and not _is_partita(folder):
        return folder, DEEPSPEED
    resolve_tag(load_dir, tag)
    return folder, PARTITA


def open_source(
    folder: str,
    kind: str,
    trust_pickle: bool = False,
    manifest: dict[str, Any] | None = None,
    tp_rank: int | None = None,
    degree: int | None = None,
) -> StateSource:
    """A reader for the checkpoint in `folder` (`manifest`: an already parsed one). A
    tensor-parallel checkpoint is read as tensor slice `tp_rank`'s of tensor-parallel
    `degree` (None: the saved degree), re-cut at another degree, or with `tp_rank` None as
    the whole model (see [Note: tensor-parallel slices])."""
    if kind == DEEPSPEED:
        from partita.compat.checkpoint_reader import DeepSpeedSource  # see `locate`

        return DeepSpeedSource(folder, trust_pickle)
    meta = manifest if manifest is not None else read_manifest(folder)
    if saved_degree(meta) == 1:
        return PartitaSource(folder, meta)
    if tp_rank is None:
        return RecutSource(folder, meta)
    if degree is not None and degree != saved_degree(meta):
        return RecutSource(folder, meta, degree, tp_rank)
    return PartitaSource(folder, slice_meta(meta, tp_rank))


__all__ = ["DEEPSPEED", "PARTITA", "locate", "open_source"]
