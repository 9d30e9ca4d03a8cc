"""`load_checkpoint`: any saved world size and stage into this engine's (see `reader`).

Phases (each a collective that fails every rank together, see `arrival`): arrival; rank 0
finds the checkpoint and reads its manifest; every rank checks a share of the files (size,
digest); every rank reads the ranges it owns and writes them through the state-access
interface (`engine.param_states`); the module's weights are refreshed from the masters;
counters, loss scale, scheduler, RNG and data loader position are restored.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from partita.checkpoint import background
from partita.checkpoint.arrival import WHOLE_JOB, Arrival, arrive, gather_agreed
from partita.checkpoint.experts import every_expert
from partita.checkpoint.locate import PARTITA, locate, open_source
from partita.checkpoint.manifest import CheckpointError, read_manifest
from partita.checkpoint.reader import StateSource
from partita.checkpoint.slices import check_degree, saved_degree
from partita.checkpoint.stages import check_stage_names, pipeline_place, stage_meta
from partita.checkpoint.state import (
    Entry,
    inventory,
    restore_optimizer_groups,
    restore_rank_state,
    set_module_value,
    state_place,
)
from partita.checkpoint.subject import CheckpointSubject
from partita.optim.cpu_adam import torch_class_name
from partita.zero.state_access import ParamStates

logger = logging.getLogger("partita")
T = TypeVar("T")


def load_checkpoint(
    engine: CheckpointSubject,
    load_dir: str,
    tag: str | None = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    trust_pickle: bool = False,
) -> tuple[str | None, dict[str, Any] | None]:
    """Loads a partita (or, with `trust_pickle`, DeepSpeed ZeRO 1-3) checkpoint saved at any
    world size and stage. Returns ``(checkpoint folder, client_state)``, or ``(None, None)``
    with a warning when `load_dir` holds no checkpoint at all. Every rank must call it; a
    broken checkpoint raises `CheckpointError` on every rank, naming the file and the check."""
    # Every rank of the job loads, every replica the same checkpoint (see [Note: checkpoints
    # of replicas] in `partita.checkpoint.save`); the files' checks are shared by all ranks.
    background.wait_for(engine)  # a background save first; raises its failure
    rank, world = engine.dims.rank, engine.dims.world_size
    arrival = arrive(load_dir, "load") if os.path.isdir(load_dir) else Arrival(None)
    found = gather_agreed(lambda: _find(load_dir, tag) if rank == 0 else None, WHOLE_JOB)[0]
    arrival.depart()
    if found is None:
        logger.warning("load_checkpoint: no checkpoint in %s; nothing loaded", load_dir)
        return None, None
    folder, kind, manifest = found
    dims = engine.dims
    # A tensor-parallel engine at the saved degree reads its own slice's files, and checks
    # them with the other ranks of its data-parallel group; at another degree (1: the whole
    # model) a rank reads from several slices' files, every rank checking a share of all
    # files (see [Note: tensor-parallel slices]).
    tp_rank = dims.tp_rank if dims.tp_world_size > 1 else None
    own_slice = tp_rank is not None and saved_degree(manifest) == dims.tp_world_size
    share = (dims.dp_rank, dims.dp_world_size) if own_slice else (rank, world)

    def open_checked() -> StateSource:
        if kind != PARTITA and dims.tp_world_size > 1:
            # The DeepSpeed reader reads mp_rank_00's files: every slice would get rank 0's.
            raise CheckpointError(
                f"{folder}: a DeepSpeed checkpoint loads into an engine without tensor "
                f"parallelism only; this one runs at tensor-parallel degree "
                f"{dims.tp_world_size}"
            )
        check_degree(manifest or {}, folder, dims.tp_world_size)
        return open_source(folder, kind, trust_pickle, manifest, tp_rank, dims.tp_world_size)

    source = _run_all(open_checked)
    try:
        gather_agreed(lambda: source.verify(*share), WHOLE_JOB)
        load_opt = load_optimizer_states and not load_module_only
        gather_agreed(
            lambda: _load_tensors(engine, source, load_module_strict, load_opt), WHOLE_JOB
        )
    finally:
        source.close()
    engine.param_states.refresh_params()
    if not load_module_only:
        gather_agreed(
            lambda: _restore_training_state(
                engine, source.meta, load_opt, load_lr_scheduler_states
            ),
            WHOLE_JOB,
        )
    if rank == 0:
        logger.info(
            "loaded checkpoint %s (saved at world size %s, stage %s, tensor-parallel degree %s)",
            folder,
            source.meta["world_size"],
            source.meta["zero_stage"],
            saved_degree(source.meta),
        )
    return folder, dict(source.meta.get("client_state") or {})


def _run_all(fn: Callable[[], T]) -> T:
    """`fn()` on every rank, failing every rank if it fails on one; this rank's result."""
    box: list[T] = []
    gather_agreed(lambda: box.append(fn()), WHOLE_JOB)
    return box[0]


def _find(load_dir: str, tag: str | None) -> tuple[str, str, dict[str, Any] | None] | None:
    found = locate(load_dir, tag)
    if found is None:
        return None
    folder, kind = found
    manifest = read_manifest(folder) if kind == PARTITA else None
    if tag is None:
        logger.info("load_checkpoint: no tag given; loading %s", folder)
    return folder, kind, manifest


def _check_names(
    entries: list[Entry],
    saved: dict[str, dict[str, Any]],
    strict: bool,
    folder: str,
    rank: int,
    part: bool = False,
    others: set[str] | None = None,
) -> None:
    """Strict: the module's tensors (with `others`: the experts other ranks hold) and the
    checkpoint's are the same names; with `part` (pipeline stages, see [Note: pipeline stage
    checkpoints]) the module's are among them."""
    here = {e.name for e in entries if e.kind != "alias"} | (others or set())
    stored = {n for n, i in saved.items() if i["kind"] != "alias"}
    excluded = {n for n, i in saved.items() if i.get("stored") is False}
    missing = sorted(here - stored)
    unexpected = [] if part else sorted(stored - here)
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{folder}: module state mismatch (load_module_strict=True): missing from the "
            f"checkpoint {missing[:10]}, unexpected in it {unexpected[:10]}"
        )
    if excluded & here and rank == 0:
        logger.info(
            "%d frozen parameters were excluded from the checkpoint; the module "
            "keeps its own values for them",
            len(excluded & here),
        )


def _load_tensors(
    engine: CheckpointSubject, src: StateSource, strict: bool, load_opt: bool
) -> None:
    entries = inventory(engine)
    saved = src.tensors
    part = check_stage_names(src.meta, pipeline_place(engine))
    others = set(every_expert(engine.module, engine.dims))  # [Note: expert slices]
    _check_names(entries, saved, strict, src.folder, engine.dims.rank, part, others)
    if load_opt:
        _check_optimizer(engine, src.meta)
    keys = list(src.meta.get("optimizer_state_keys") or []) if load_opt else []
    todo = []
    for e in entries:
        info = saved.get(e.name)
        if info is None or e.kind == "alias" or info.get("stored") is False:
            continue
        if list(info["shape"]) != e.shape:
            raise CheckpointError(
                f"{src.folder}: {e.name!r} has shape {info['shape']} in the checkpoint, "
                f"{e.shape} in the module"
            )
        src.check_split(e.name, e.tensor)
        todo.append((e, info))
    # Frozen parameters and buffers first: under stage 3 writing a frozen parameter re-shards
    # its whole unit from the module's values, masters of trainable neighbours included, so
    # the masters must be loaded after it.
    for e, info in todo:
        if e.kind != "trainable":
            _load_module_tensor(src, e, info)
    for e, info in todo:
        if e.kind == "trainable":
            _load_trainable(engine.param_states, src, e, info, keys)


def _check_optimizer(engine: CheckpointSubject, meta: dict[str, Any]) -> None:
    saved = meta.get("optimizer")
    here = torch_class_name(engine.optimizer)
    if saved is not None and saved != here:
        raise CheckpointError(
            f"optimizer state was saved from {saved}, this engine's optimizer is {here}; "
            "use load_optimizer_states=False to load the weights only"
        )


def _load_trainable(
    strategy: ParamStates, src: StateSource, e: Entry, info: dict, keys: list[str]
) -> None:
    ranges = [(int(o) + e.offset, int(n)) for o, n in strategy.owned_ranges(e.tensor)]
    if info["kind"] == "trainable":
        # Borrowed: copied into the engine's state at once (one copy from the verified bytes).
        value = src.read(e.name, "param", ranges, borrow=True)
        if value is None:
            raise CheckpointError(f"{src.folder}: no master weights for {e.name!r}")
    else:  # saved frozen (or as a buffer), trained now: start from its saved value
        if keys:
            raise CheckpointError(
                f"{src.folder}: {e.name!r} was frozen when saved (no optimizer state) but is "
                "trained now; load with load_optimizer_states=False"
            )
        flat = src.read_module(e.name).float().reshape(-1)
        value = torch.cat([flat[o : o + n] for o, n in ranges]) if ranges else flat[:0]
    strategy.set_local_state(e.tensor, "param", value.to(e.tensor.device))
    scalars = set(src.meta.get("scalar_state_keys") or [])
    for what in keys:
        state = (
            src.scalar(e.name, what)
            if what in scalars
            else src.read(e.name, what, ranges, borrow=True)
        )
        if state is not None:
            strategy.set_local_state(e.tensor, what, state.to(e.tensor.device))


def _load_module_tensor(src: StateSource, e: Entry, info: dict) -> None:
    numel = e.tensor.numel()
    if info["kind"] == "trainable":  # trained when saved, frozen now: its master weight
        value = src.read(e.name, "param", [(e.offset, numel)])
        assert value is not None
    else:
        value = src.read_module(e.name)
        if e.full_shape is not None:  # this rank's rows of a stacked expert weight
            value = value.reshape(-1)[e.offset : e.offset + numel]
    set_module_value(e, value.to(e.tensor.device))


def _restore_training_state(
    engine: CheckpointSubject, meta: dict[str, Any], load_opt: bool, load_scheduler: bool
) -> None:
    counters = meta["counters"]
    engine.global_steps = int(counters["global_steps"])
    engine.global_samples = int(counters["global_samples"])
    engine.skipped_steps = int(counters["skipped_steps"])
    engine.micro_steps = int(
        counters.get("micro_steps", engine.global_steps * engine.gradient_accumulation_steps())
    )
    scaler = meta.get("loss_scaler")
    if scaler is not None:
        if scaler.get("kind") == engine.loss_scaler.state_dict().get("kind"):
            engine.loss_scaler.load_state_dict(scaler)
        elif engine.dims.rank == 0:
            logger.warning(
                "checkpoint has a %s loss scaler, the engine a %s one; not loaded",
                scaler.get("kind"),
                engine.loss_scaler.state_dict().get("kind"),
            )
    if load_opt and meta.get("optimizer_param_groups"):
        restore_optimizer_groups(engine.optimizer, meta["optimizer_param_groups"])
    sched = meta.get("lr_scheduler")
    if load_scheduler and sched is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(sched)
    _restore_rank_state(engine, meta)


def _restore_rank_state(engine: CheckpointSubject, meta: dict[str, Any]) -> None:
    """RNG and data loader position, per data-parallel rank; at another data-parallel world
    size what is well defined (see `partita.checkpoint.state.restore_rank_state`)."""
    meta = stage_meta(meta, pipeline_place(engine))
    restore_rank_state(engine, meta, *state_place(engine.dims))


__all__ = ["load_checkpoint"]
