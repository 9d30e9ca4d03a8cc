"""`save_checkpoint`: every rank writes what it holds; rank 0 commits the manifest last.

Phases (each ends in a collective that fails every rank if one failed, see `arrival`):

1. arrival: every rank has called save (else the missing ranks are named);
2. agree on the tag and the client state; rank 0 removes the leftovers of dead saves (only
   those: another live job's save is left alone) and opens a staging folder beside the tag
   folders (`atomic.Staging`), whose path every rank receives;
3. each rank writes its shard file there (temporary name, fsync, rename) and reports its size,
   digest (XXH3-128), ranges, stored dtypes, RNG and data loader states;
4. rank 0 writes the manifest into the staging folder, swaps it in for ``save_dir/tag`` (an
   existing checkpoint under that tag stays complete and loadable until the atomic swap), then
   writes `latest` (atomically) and removes the old content.

A save that fails or is killed at any point leaves ``save_dir/tag`` as it was.

[Note: checkpoints of replicas]
A checkpoint holds one data-parallel group's state per model slice: shard files are named and
cut by data-parallel rank, and the manifest's ``world_size`` is the data-parallel world size.
When the world is several replicas (`partita.comm.ParallelDims`), every rank takes part in every
phase (all must call save). Replicas of the same model (replicated data parallelism): only the
replica holding global rank 0 writes, and every replica loads the same files. Replicas holding
different slices (a tensor-parallel mpu): every slice's data-parallel group writes its own set
of files, and loads read their own slice's (see [Note: tensor-parallel slices] in
`partita.checkpoint.slices`); before that, only tensor rank 0's slices were saved.

Hybrid sharding ([Note: hybrid sharding] in `partita.comm.dims`) cuts ZeRO's shards over the
shard group, and every shard group holds the same state: its checkpoint is the checkpoint of
one shard group, the one holding global rank 0, whose files are named and cut by the rank
within the shard group, the manifest's ``world_size`` the shard size (`file_place`,
`writes_files` in `partita.checkpoint.state`). Any engine then loads it as it loads an
S-rank checkpoint: a hybrid one in each shard group, as an S-rank job would, a plain one at
any world size and stage. Only the RNG and data loader states are kept for every
data-parallel rank (every rank reads its own micro-batches, so the data consumed is that of
all of them): the manifest lists one per data-parallel rank, more than ``world_size``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from partita.checkpoint import background, digest, experts, stfile
from partita.checkpoint.arrival import (
    WHOLE_JOB,
    arrive,
    gather_agreed,
    job_member,
    remove_stale_markers,
)
from partita.checkpoint.atomic import Staging, remove_dead_saves, write_atomic
from partita.checkpoint.manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    LATEST_NAME,
    MANIFEST_NAME,
    MODULE_PREFIX,
    CheckpointError,
    shard_file_name,
    state_key,
    states_by_part,
)
from partita.checkpoint.slices import slice_file_name, tensor_layout
from partita.checkpoint.stages import (
    merge_tables,
    pipeline_place,
    stage_file_name,
    stage_states,
    tied_copies,
)
from partita.checkpoint.state import (
    Entry,
    check_client_state,
    dtype_name,
    file_place,
    full_module_value,
    inventory,
    optimizer_groups,
    rng_state,
    to_plain,
    writes_files,
)
from partita.checkpoint.subject import CheckpointSubject
from partita.optim.cpu_adam import torch_class_name

logger = logging.getLogger("partita")
_TAG_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=+-]*$")


def save_checkpoint(
    engine: CheckpointSubject,
    save_dir: str,
    tag: str | None = None,
    client_state: dict[str, Any] | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
    async_save: bool | None = None,
) -> bool:
    """Saves `engine`'s state under ``save_dir/tag`` (default tag ``global_step{N}``) and,
    with `save_latest`, points ``save_dir/latest`` at it. Every rank must call it. Returns True
    on every rank once the checkpoint is committed; raises `CheckpointError` on every rank
    otherwise (the previous checkpoints stay intact).

    With `async_save` (default: the config's ``checkpoint.async_save``) it returns once the
    states are copied to host memory and writes, fsyncs and commits in the background (see
    [Note: asynchronous saves] in `partita.checkpoint.background`)."""
    background.wait_for(engine)  # the previous background save first; raises its failure
    wanted = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    asked = engine.checkpoint_config.async_save if async_save is None else bool(async_save)
    os.makedirs(save_dir, exist_ok=True)
    arrival = arrive(save_dir, "save")
    start = time.perf_counter()
    calls = gather_agreed(lambda: _check_call(wanted, client_state or {}, asked), WHOLE_JOB)
    arrival.depart()
    is_async = _agreed_async(calls)
    members = gather_agreed(job_member, WHOLE_JOB)
    agreed = _agreed_tag(engine, [t for t, _ in calls])
    rank = engine.dims.rank
    staging = Staging(save_dir, agreed)
    try:
        group = background.writer_group() if is_async else WHOLE_JOB
        opened = gather_agreed(
            lambda: _open_staging(staging, members) if rank == 0 else "", WHOLE_JOB
        )
        options = (client_state or {}, save_latest, exclude_frozen_parameters)
        # Into rank 0's staging folder every writing rank writes its shard. The snapshot
        # stays on this rank (`box`): only errors travel in the collective.
        box: list[_Snapshot] = []

        def take() -> Any:
            box.append(_snapshot(engine, opened[0], agreed, is_async, *options))
            # Hybrid sharding: the ranks that write no file read their own data too. A
            # pipeline: each stage's first rank its stage's tensors (rank 0 holds its own).
            if engine.dims.hybrid:
                return _rank_state(engine)
            if place is not None and engine.dims.dp_rank == 0:
                return place[0], _tensor_table(engine, exclude_frozen_parameters)
            return None

        place = pipeline_place(engine)
        states = gather_agreed(take, WHOLE_JOB)
        snap = box[0]
        if snap.manifest is not None and engine.dims.hybrid:
            snap.manifest["rank_states"] = [states[r] for r in engine.dims.dp_ranks]
        if snap.manifest is not None and place is not None:
            tables = sorted((s for s in states if s is not None), key=lambda s: s[0])
            snap.manifest["tensors"] = merge_tables([table for _, table in tables])
    except BaseException:
        staging.close()
        raise
    folder = os.path.join(save_dir, agreed)
    if not is_async:
        _write_and_commit(snap, staging, group, start)
        return True
    if rank == 0:
        logger.info("checkpoint %s: states copied in %.2f s; writing in the background",
                    folder, time.perf_counter() - start)  # fmt: skip
    background.start(engine, folder, lambda: _write_and_commit(snap, staging, group, start), group)
    return True


@dataclass
class _Snapshot:
    """What one rank writes: its tensors (copies, for a background save) and report, and on
    rank 0 the manifest without the per-rank parts (the state at the time of the call)."""

    rank: int
    folder: str
    shard: _Shard | None
    report: dict[str, Any] | None
    manifest: dict[str, Any] | None


def _snapshot(
    engine: CheckpointSubject,
    folder: str,
    tag: str,
    copy: bool,
    client_state: dict[str, Any],
    save_latest: bool,
    exclude_frozen: bool,
) -> _Snapshot:
    """This rank's part of the save, taken now (training may change the engine afterwards)."""
    dims = engine.dims
    # Collective for stage-3 frozen parameters: every rank takes the inventory's tensors.
    shard, report = _shard_state(engine, exclude_frozen, borrow=not copy)
    if copy and shard is not None:
        shard = shard.taken()
    manifest = None
    if dims.rank == 0:
        manifest = _manifest(engine, tag, client_state, save_latest, exclude_frozen)
    return _Snapshot(dims.rank, folder, shard, report, manifest)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` in host memory, where training cannot change it. Host tensors are used as they are:
    `_shard_tensors` gets fresh copies already (``ParamStates.local_state`` concatenates or
    clones, `full_module_value` clones); test_checkpoint_async's in-flight test shows the
    files stay bitwise those of a synchronous save while training steps run."""
    return t if t.device.type == "cpu" else t.to("cpu")


def _write_and_commit(snap: _Snapshot, staging: Staging, group: Any, start: float) -> None:
    """Phases 3 and 4 (see the module docstring), over `group`; the staging folder's leftovers
    are removed whatever happens."""
    try:
        written = gather_agreed(lambda: _write_shard(snap), group)
        reports = sorted(
            (r for r in written if r is not None),
            key=lambda r: (r.get("pp_rank", 0), r.get("tp_rank", 0), r["rank"]),
        )
        gather_agreed(
            lambda: _commit(staging, snap.manifest, reports) if snap.rank == 0 else None, group
        )
    finally:
        # Every rank has left the phase that failed (each phase ends in a collective), so
        # nobody writes into the staging folder any more.
        staging.close()
    if snap.rank == 0:
        total = sum(r["bytes"] for r in reports if r["file"])
        logger.info(
            "saved checkpoint %s (%.1f MB in %d files) in %.2f s",
            os.path.join(staging.save_dir, staging.tag),
            total / 1e6,
            sum(1 for r in reports if r["file"]),
            time.perf_counter() - start,
        )


def _check_call(tag: str, client_state: Any, is_async: bool) -> tuple[str, bool]:
    if not _TAG_PATTERN.match(tag):
        raise CheckpointError(
            f"tag {tag!r}: use letters, digits and _ . = + - (no path separators, no leading "
            "dot: the tag is a folder name)"
        )
    check_client_state(client_state)
    return tag, is_async


def _agreed_async(calls: list[tuple[str, bool]]) -> bool:
    """Every rank's `async_save` (all ranks see the same list, so all raise or none)."""
    modes = [a for _, a in calls]
    if len(set(modes)) > 1:
        raise CheckpointError(
            f"ranks passed different async_save values {dict(enumerate(modes))}; every rank "
            "must save the same way (async_save argument or checkpoint.async_save)"
        )
    return modes[0]


def _agreed_tag(engine: CheckpointSubject, tags: list[str]) -> str:
    if len(set(tags)) == 1:
        return tags[0]
    mode = engine.checkpoint_config.tag_validation
    text = f"ranks passed different checkpoint tags {dict(enumerate(tags))}"
    if mode == "FAIL":
        raise CheckpointError(text + " (checkpoint.tag_validation=FAIL)")
    if mode == "WARN":
        logger.warning("%s; saving under rank 0's tag %r", text, tags[0])
    return tags[0]


def _commit(staging: Staging, base: dict[str, Any] | None, reports: list[dict[str, Any]]) -> None:
    """Rank 0: the manifest into the staging folder, the folder in place, then `latest`."""
    assert base is not None  # rank 0 took it in `_snapshot`
    manifest = _complete_manifest(base, reports)
    write_atomic(os.path.join(staging.path, MANIFEST_NAME), _json_bytes(manifest))
    staging.commit()
    if manifest["save_latest"]:
        latest = os.path.join(staging.save_dir, LATEST_NAME)
        write_atomic(latest, manifest["tag"].encode(), tmp=staging.latest_temp())


def _open_staging(staging: Staging, members: list[tuple[str, int]]) -> str:
    """Rank 0: removes dead saves' leftovers and stale call markers, opens `staging`."""
    remove_stale_markers(staging.save_dir, members)
    removed = remove_dead_saves(staging.save_dir)
    if removed:
        logger.info("removed leftovers of interrupted saves in %s: %s", staging.save_dir, removed)
    return staging.open()


Producer = Callable[[], torch.Tensor]
"""Makes one tensor of a shard when it is written."""


def _shard_tensors(
    engine: CheckpointSubject, entries: list[Entry], exclude_frozen: bool, borrow: bool
) -> tuple[list[stfile.TensorSpec], dict[str, Producer], dict[str, list[list[int]]]]:
    """This rank's tensors: owned slices of every trainable parameter's master and optimizer
    state (replicated state: the parameters `_replicated_writers` gives this rank); frozen
    parameters and buffers on rank 0 only (an expert's on the rank `experts.writers` names).
    Their specs, in file order, and how to make each: trainable state when it is written (a
    synchronous save then copies each state while the disk writes the previous one), module
    tensors now (stage 3 gathers frozen parameters collectively, in the same order on every
    rank)."""
    strategy = engine.param_states
    rank, world = file_place(engine.dims)
    mine = experts.writers(engine.module, engine.dims)  # this rank's experts: who writes
    writers = _stage0_writers(entries, world, mine) if strategy.replicated else {}
    keys = ["param", *strategy.optimizer_state_keys()]
    specs: list[stfile.TensorSpec] = []
    producers: dict[str, Producer] = {}
    ranges: dict[str, list[list[int]]] = {}
    for e in entries:
        if e.kind == "trainable" and writers.get(e.name, rank) == rank:
            owned = [
                [int(o) + e.offset, int(n)] for o, n in strategy.owned_ranges(e.tensor) if n > 0
            ]
            if not owned:
                continue
            ranges[e.name] = owned
            for what in keys:
                spec = strategy.local_state_spec(e.tensor, what)
                if spec is not None:
                    key = state_key(what, e.name)
                    specs.append((key, *spec))
                    producers[key] = functools.partial(
                        _local_state, strategy, e.tensor, what, borrow
                    )
        elif e.kind == "buffer" or (e.kind == "frozen" and not exclude_frozen):
            value = full_module_value(e)  # collective for stage-3 frozen parameters
            if rank == mine.get(e.name, 0):
                # Stacked expert rows: this group's rows only ([Note: stacked expert rows]).
                stored = (
                    e.name if e.full_shape is None else experts.rows_key(e.name, value, e.offset)
                )
                key = MODULE_PREFIX + stored
                specs.append((key, value.dtype, tuple(value.shape)))
                producers[key] = functools.partial(lambda v: v, value)
    return specs, producers, ranges


def _stage0_writers(entries: list[Entry], world: int, mine: dict[str, int]) -> dict[str, int]:
    """`_replicated_writers` of the tensors every rank holds, and `mine`, the writers of this
    rank's experts, which other expert-parallel ranks do not hold ([Note: expert slices] in
    `partita.checkpoint.experts`)."""
    return {**_replicated_writers([e for e in entries if e.name not in mine], world), **mine}


def _replicated_writers(entries: list[Entry], world: int) -> dict[str, int]:
    """Which rank writes each trainable parameter when every rank holds all of them (stage
    0): rank 0 writing everything alone would copy, hash and write the whole model on one
    core while the others wait. Largest first, each to the rank with the fewest elements so
    far; the same on every rank (same inventory). The manifest's per-file ranges already say
    which file holds what, so loads (of these and of older checkpoints) need nothing new."""
    trainable = [e for e in entries if e.kind == "trainable"]
    load = [0] * max(world, 1)
    writers: dict[str, int] = {}
    for e in sorted(trainable, key=lambda e: (-e.tensor.numel(), e.name)):
        writer = min(range(len(load)), key=lambda r: (load[r], r))
        writers[e.name] = writer
        load[writer] += e.tensor.numel()
    return writers


def _local_state(strategy: Any, param: torch.Tensor, what: str, borrow: bool) -> torch.Tensor:
    """This rank's elements of `what`: with `borrow`, a view of the engine's own tensor when
    one serves (a synchronous save writes and hashes it before the engine runs again, and
    before the next tensor is made, see `stfile.write_safetensors_stream`), else a copy (a
    background save's snapshot must not change while training goes on)."""
    view = strategy.local_state_view(param, what) if borrow else None
    if view is not None:
        return view
    value = strategy.local_state(param, what)
    assert value is not None  # its spec said it exists
    return value


def _shard_state(
    engine: CheckpointSubject, exclude_frozen: bool, borrow: bool
) -> tuple[_Shard | None, dict[str, Any] | None]:
    """This rank's shard (specs and producers) and report (without the file's name, size and
    checksum) on the ranks that write files (`writes_files`); (None, None) on the others (see
    [Note: checkpoints of replicas]). With `borrow` (a synchronous save) the producers give
    views of the engine's state where no copy is needed (see `_local_state`)."""
    dims = engine.dims
    place = pipeline_place(engine)  # every stage writes its own files
    if not (writes_files(dims) or place is not None):
        return None, None
    rank, world = file_place(dims)
    entries = inventory(engine)
    copies = tied_copies(engine)  # an earlier stage saves these
    mine = [e for e in entries if id(e.tensor) not in copies]
    specs, producers, ranges = _shard_tensors(engine, mine, exclude_frozen, borrow)
    report: dict[str, Any] = {"rank": rank, "file": None, "bytes": 0, "digest": None}
    report["world"] = world
    if place is not None:
        report["pp"] = place
    if dims.tp_world_size > 1:
        report["tp"] = (dims.tp_rank, dims.tp_world_size)
        # This slice's shapes of the split tensors (slices may differ in size).
        report["slice_shapes"] = {
            e.name: list(e.tensor.shape)
            for e in entries
            if e.kind != "alias" and tensor_layout(e.tensor) != {"layout": "replicated"}
        }
    report["ranges"] = ranges
    report["scalar_keys"] = sorted(
        {k.partition("::")[0] for k, _, shape in specs if shape == () and "::" in k
         and not k.startswith(MODULE_PREFIX)}
    )  # fmt: skip
    report["state_dtypes"] = {
        key.partition("::")[2]: dtype_name(dtype)
        for key, dtype, _ in specs
        if key.startswith("param::")
    }
    report.update(_rank_state(engine))
    return _Shard(specs, producers), report


def _rank_state(engine: CheckpointSubject) -> dict[str, Any]:
    """This rank's RNG and data loader states."""
    loader = engine.training_dataloader
    state = loader.state_dict() if loader is not None and hasattr(loader, "state_dict") else None
    return {"rng": rng_state(), "data_loader": state}


@dataclass
class _Shard:
    """One rank's shard file to be: tensor specs in file order and how to make each."""

    specs: list[stfile.TensorSpec]
    producers: dict[str, Producer]

    def taken(self) -> _Shard:
        """The values made now, in host memory (a background save's snapshot)."""
        values = {k: _host_copy(p()) for k, p in self.producers.items()}
        return _Shard(self.specs, {k: functools.partial(lambda v: v, v) for k, v in
                                   values.items()})  # fmt: skip


def _write_shard(snap: _Snapshot) -> dict[str, Any] | None:
    """Writes this rank's shard file into the staging folder; its report, or None on ranks
    that do not write."""
    if snap.report is None or snap.shard is None:
        return None
    report = dict(snap.report)
    shard, snap.shard = snap.shard, None  # freed once written
    rank, world = report["rank"], report.pop("world")
    tp, pp = report.pop("tp", None), report.pop("pp", None)
    if tp is not None:
        report["tp_rank"] = tp[0]
    if pp is not None:
        report["pp_rank"] = pp[0]
    if shard.specs:
        if pp is not None:
            name = stage_file_name(pp[0], pp[1], rank, world)
        elif tp is not None:
            name = slice_file_name(tp[0], tp[1], rank, world)
        else:
            name = shard_file_name(rank, world)
        path = os.path.join(snap.folder, name)
        produce = _one_use(shard.producers)
        try:
            written = stfile.write_safetensors_stream(
                path, shard.specs, produce, {"format": "pt", "rank": str(rank)}
            )
        except OSError as e:
            raise CheckpointError(f"{path}: writing rank {rank}'s shard failed ({e})") from e
        report.update(file=name, bytes=written.nbytes, digest={written.algorithm: written.digest})
    return report


def _one_use(producers: dict[str, Producer]) -> Callable[[str], torch.Tensor]:
    """`producers` as the stream writer's `produce`, each dropped once used (so a background
    save's copies are freed as they are written)."""
    return lambda name: producers.pop(name)()


def _tensor_table(engine: CheckpointSubject, exclude_frozen: bool) -> dict[str, dict[str, Any]]:
    """Every tensor's kind, shape and dtype (`_complete_manifest` adds each trainable one's
    stored state dtype when the stored masters do not share one dtype); with tensor
    parallelism how it is split (the shapes are tensor rank 0's)."""
    sliced = engine.dims.tp_world_size > 1
    table = {}
    for e in inventory(engine):
        info: dict[str, Any] = {
            "kind": e.kind,
            "shape": e.shape,
            "dtype": dtype_name(e.tensor.dtype),
        }
        if e.alias_of is not None:
            info["alias_of"] = e.alias_of
        if e.kind == "frozen" and exclude_frozen:
            info["stored"] = False
        if sliced and e.kind != "alias":
            info["tp"] = tensor_layout(e.tensor)
        table[e.name] = info
    return experts.table(table, engine.module, engine.dims)  # every expert, not rank 0's only


def _manifest(
    engine: CheckpointSubject,
    tag: str,
    client_state: dict[str, Any],
    save_latest: bool,
    exclude_frozen: bool,
) -> dict[str, Any]:
    """The manifest as of the call, without what the ranks' reports add (plain data: a
    background save builds the rest from it while training goes on)."""
    from partita import __version__

    scheduler = engine.lr_scheduler
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "partita_version": __version__,
        "torch_version": torch.__version__,
        "tag": tag,
        "saved_at": time.time(),
        "save_latest": save_latest,
        "world_size": file_place(engine.dims)[1],
        **({"tp_world_size": engine.dims.tp_world_size} if engine.dims.tp_world_size > 1 else {}),
        **({"pp_world_size": place[1]} if (place := pipeline_place(engine)) else {}),
        **({"ep_world_size": len(engine.dims.ep_ranks)} if engine.dims.ep_ranks else {}),
        "zero_stage": engine.zero_optimization_stage(),
        "replicated": bool(engine.param_states.replicated),
        "param_dtype": dtype_name(engine.policy.param_dtype),
        "sharding": "per file and trainable parameter: the (offset, length) ranges of the "
        "flattened parameter it holds, concatenated in order; padding is never stored",
        "checksum": digest.ALGORITHM,
        "tensors": _tensor_table(engine, exclude_frozen),
        "optimizer": torch_class_name(engine.optimizer),
        "optimizer_state_keys": engine.param_states.optimizer_state_keys(),
        "optimizer_param_groups": optimizer_groups(engine.optimizer),
        "counters": {
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps,
            "micro_steps": engine.micro_steps,
        },
        "loss_scaler": to_plain(engine.loss_scaler.state_dict(), "loss_scaler"),
        "lr_scheduler": None
        if scheduler is None
        else to_plain(scheduler.state_dict(), "lr_scheduler.state_dict()"),
        "config": engine.config_dict(),
        "client_state": json.loads(json.dumps(client_state)),  # a copy the caller cannot change
        "exclude_frozen_parameters": exclude_frozen,
    }


def _complete_manifest(base: dict[str, Any], reports: list[dict[str, Any]]) -> dict[str, Any]:
    """`base` with the ranks' files, stored dtypes, RNG and data loader states."""
    manifest = dict(base)
    stored = {n: d for r in reports for n, d in r["state_dtypes"].items()}
    # One dtype for all stored states (the usual case) is recorded once; else per tensor.
    common = set(stored.values())
    manifest["state_dtype"] = next(iter(common)) if len(common) == 1 else "float32"
    if len(common) > 1:
        manifest["tensors"] = {
            name: {**info, "state_dtype": stored[name]} if name in stored else info
            for name, info in base["tensors"].items()
        }
    manifest["scalar_state_keys"] = sorted({k for r in reports for k in r["scalar_keys"]})
    manifest["files"] = {
        r["file"]: {"rank": r["rank"], "bytes": r["bytes"], "digest": r["digest"],
                    "ranges": r["ranges"],
                    **{k: r[k] for k in ("tp_rank", "pp_rank") if k in r}}
        for r in reports
        if r["file"]
    }  # fmt: skip
    if "tp_world_size" in manifest:
        return _complete_slices(manifest, reports)
    if "pp_world_size" in manifest:
        return stage_states(manifest, reports)
    # Hybrid sharding: every data-parallel rank's, not only the writers' (see the module note).
    ranks = manifest.pop("rank_states", None) or reports
    manifest["rng"] = [r["rng"] for r in ranks]
    manifest["data_loader"] = [r["data_loader"] for r in ranks]
    return manifest


def _complete_slices(manifest: dict[str, Any], reports: list[dict[str, Any]]) -> dict[str, Any]:
    """A tensor-parallel manifest's per-slice parts (see [Note: tensor-parallel slices]):
    the split tensors' shapes on every tensor rank, and the ranks' states per slice (reports
    come sorted by tensor rank, then data-parallel rank)."""
    degree = manifest["tp_world_size"]
    per_slice = [[r for r in reports if r["tp_rank"] == t] for t in range(degree)]
    shapes = [next(r["slice_shapes"] for r in rs if r["rank"] == 0) for rs in per_slice]
    manifest["tensors"] = {
        name: {**info, "tp": {**info["tp"], "shapes": [s[name] for s in shapes]}}
        if info.get("tp", {}).get("layout") == "sliced"
        else info
        for name, info in manifest["tensors"].items()
    }
    return states_by_part(manifest, per_slice, "tp_rank_state")


def _json_bytes(data: Any) -> bytes:
    return json.dumps(data, indent=1).encode()


__all__ = ["save_checkpoint"]
