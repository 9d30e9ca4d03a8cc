"""Checkpoints of a pipeline: one set of shard files per stage, one manifest for the model.

[Note: pipeline stage checkpoints]
A `PipelineEngine` stage holds some of the model's layers, trained by the stage's own
data-parallel group, so (as for tensor-parallel slices, [Note: tensor-parallel slices] in
`partita.checkpoint.slices`) every stage's data-parallel group writes its own shard files
(`stage_file_name`), cut by data-parallel rank. Unlike tensor slices, stages hold *different*
tensors, named as in the whole `PipelineModule` (layer index, or ``tied_modules.<key>``), so
one manifest describes the whole model:

- ``tensors`` is every stage's table merged (`merge_tables`); a tied module, present on the
  first and the last stage, is saved once, by the first stage holding it (the other copies
  are the ones `PipelineModule.replicated_tied_parameters` lists: equal values and state);
- every file records its ``pp_rank``; the manifest ``pp_world_size``;
- RNG and data loader states are kept per stage (``pp_rank_state``; ``rng`` and
  ``data_loader`` are stage 0's).

Loading reads tensors by name from whichever files hold them ([Note: resharding] in
`partita.checkpoint.reader`), so a stage at any other pipeline degree (pp 1 included), at any
data-parallel size and ZeRO stage, finds its layers: nothing is converted. Only the name check
changes: a stage's module holds part of the saved tensors (`check_stage_names`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from partita.checkpoint.manifest import states_by_part
from partita.checkpoint.subject import CheckpointSubject


def pipeline_place(engine: CheckpointSubject) -> tuple[int, int] | None:
    """``(stage, stages)`` of a pipeline engine with more than one stage, else None."""
    found = engine.pipeline_place()
    return found if found is not None and found[1] > 1 else None


def tied_copies(engine: CheckpointSubject) -> set[int]:
    """Ids of the tensors this stage leaves to an earlier stage's files."""
    return {id(t) for t in engine.pipeline_tied_copies()}


def stage_file_name(stage: int, stages: int, rank: int, world: int) -> str:
    """Name of data-parallel rank `rank`'s file of pipeline stage `stage`."""
    return f"pp{stage:02d}-of-{stages:02d}-rank{rank:05d}-of-{world:05d}.safetensors"


def merge_tables(tables: Sequence[dict[str, dict[str, Any]] | None]) -> dict[str, Any]:
    """The stages' tensor tables (in stage order; None from ranks that sent none) as one:
    a name on several stages (a tied module) keeps the first stage's entry."""
    merged: dict[str, Any] = {}
    for table in tables:
        for name, info in (table or {}).items():
            merged.setdefault(name, info)
    return merged


def stage_states(manifest: dict[str, Any], reports: list[dict[str, Any]]) -> dict[str, Any]:
    """`manifest` with the ranks' RNG and data loader states kept per stage (reports come
    sorted by stage, then data-parallel rank)."""
    stages = int(manifest["pp_world_size"])
    per_stage = [[r for r in reports if r.get("pp_rank") == s] for s in range(stages)]
    return states_by_part(manifest, per_stage, "pp_rank_state")


def stage_meta(meta: dict[str, Any], place: tuple[int, int] | None) -> dict[str, Any]:
    """`meta` with the RNG and data loader states of stage `place` when the checkpoint was
    saved at the same pipeline degree (stage 0's otherwise, as saved)."""
    states = meta.get("pp_rank_state")
    if not states or place is None or len(states) != place[1]:
        return meta
    return {**meta, **states[place[0]]}


def check_stage_names(meta: dict[str, Any], place: tuple[int, int] | None) -> bool:
    """True when the checkpoint's tensors may be more than this engine's: it was saved by a
    pipeline, or is loaded into one (a stage holds part of the model). Names missing from the
    checkpoint are still errors."""
    return place is not None or int(meta.get("pp_world_size", 1)) > 1


__all__ = [
    "check_stage_names",
    "merge_tables",
    "pipeline_place",
    "stage_file_name",
    "stage_meta",
    "stage_states",
    "tied_copies",
]
