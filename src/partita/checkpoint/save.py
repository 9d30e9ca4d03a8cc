"""`save_checkpoint`: every rank writes what it holds; rank 0 commits the manifest last.

Phases (each ends in a collective that fails every rank if one failed, see `rendezvous`):

1. arrival: every rank has called save (else the missing ranks are named);
2. agree on the tag and the client state; rank 0 removes the leftovers of dead saves (only
   those: another live job's save is left alone) and opens a staging folder beside the tag
   folders (`atomic.Staging`), whose path every rank receives;
3. each rank writes its shard file there (temporary name, fsync, rename) and reports its size,
   sha256, ranges, stored dtypes, RNG and data loader states;
4. rank 0 writes the manifest into the staging folder, swaps it in for ``save_dir/tag`` (an
   existing checkpoint under that tag stays complete and loadable until the atomic swap), then
   writes `latest` (atomically) and removes the old content.

A save that fails or is killed at any point leaves ``save_dir/tag`` as it was.

[Note: checkpoints of replicas]
A checkpoint holds one data-parallel group's state: shard files are named and cut by
data-parallel rank, and the manifest's ``world_size`` is the data-parallel world size. When the
world is several replicas (`partita.comm.ParallelDims`), every rank takes part in every phase
(all must call save), but only the replica holding global rank 0 writes; every replica loads
the same checkpoint. That is right while replicas hold the same model (replicated data
parallelism); model-parallel slices will need one set of files per slice.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any

import torch

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
)
from partita.checkpoint.rendezvous import (
    WHOLE_JOB,
    arrive,
    gather_agreed,
    job_member,
    remove_stale_markers,
)
from partita.checkpoint.state import (
    Entry,
    check_client_state,
    dtype_name,
    full_module_value,
    inventory,
    optimizer_groups,
    rng_state,
    to_plain,
)
from partita.checkpoint.stfile import CHECKSUM, write_safetensors
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
) -> bool:
    """Saves `engine`'s state under ``save_dir/tag`` (default tag ``global_step{N}``) and,
    with `save_latest`, points ``save_dir/latest`` at it. Every rank must call it. Returns True
    on every rank once the checkpoint is committed; raises `CheckpointError` on every rank
    otherwise (the previous checkpoints stay intact)."""
    wanted = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    os.makedirs(save_dir, exist_ok=True)
    arrival = arrive(save_dir, "save")
    start = time.perf_counter()
    tags = gather_agreed(lambda: _check_call(wanted, client_state or {}), WHOLE_JOB)
    arrival.depart()
    members = gather_agreed(job_member, WHOLE_JOB)
    agreed = _agreed_tag(engine, tags)
    folder = os.path.join(save_dir, agreed)
    rank = engine.dims.rank
    staging = Staging(save_dir, agreed)
    try:
        opened = gather_agreed(
            lambda: _open_staging(staging, members) if rank == 0 else "", WHOLE_JOB
        )
        staged = opened[0]  # rank 0's staging folder: every writing rank writes its shard there
        written = gather_agreed(
            lambda: _write_shard(engine, staged, exclude_frozen_parameters), WHOLE_JOB
        )
        reports = sorted((r for r in written if r is not None), key=lambda r: r["rank"])
        manifest = (agreed, reports, client_state or {}, save_latest, exclude_frozen_parameters)
        gather_agreed(lambda: _commit(engine, staging, *manifest) if rank == 0 else None, WHOLE_JOB)
    finally:
        # Every rank has left the phase that failed (each phase ends in a collective), so
        # nobody writes into the staging folder any more.
        staging.close()
    if rank == 0:
        total = sum(r["bytes"] for r in reports if r["file"])
        logger.info(
            "saved checkpoint %s (%.1f MB in %d files) in %.2f s",
            folder,
            total / 1e6,
            sum(1 for r in reports if r["file"]),
            time.perf_counter() - start,
        )
    return True


def _check_call(tag: str, client_state: Any) -> str:
    if not _TAG_PATTERN.match(tag):
        raise CheckpointError(
            f"tag {tag!r}: use letters, digits and _ . = + - (no path separators, no leading "
            "dot: the tag is a folder name)"
        )
    check_client_state(client_state)
    return tag


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


def _commit(engine: CheckpointSubject, staging: Staging, tag: str, *manifest_args: Any) -> None:
    """Rank 0: the manifest into the staging folder, the folder in place, then `latest`."""
    manifest = _manifest(engine, tag, *manifest_args)
    write_atomic(os.path.join(staging.path, MANIFEST_NAME), _json_bytes(manifest))
    staging.commit()
    if manifest["save_latest"]:
        latest = os.path.join(staging.save_dir, LATEST_NAME)
        write_atomic(latest, tag.encode(), tmp=staging.latest_temp())


def _open_staging(staging: Staging, members: list[tuple[str, int]]) -> str:
    """Rank 0: removes dead saves' leftovers and stale call markers, opens `staging`."""
    remove_stale_markers(staging.save_dir, members)
    removed = remove_dead_saves(staging.save_dir)
    if removed:
        logger.info("removed leftovers of interrupted saves in %s: %s", staging.save_dir, removed)
    return staging.open()


def _shard_tensors(
    engine: CheckpointSubject, entries: list[Entry], exclude_frozen: bool
) -> tuple[dict[str, torch.Tensor], dict[str, list[list[int]]], set[str]]:
    """This rank's tensors: owned slices of every trainable parameter's master and optimizer
    state; frozen parameters and buffers on rank 0 only."""
    strategy, rank = engine.param_states, engine.dims.dp_rank
    writes_trainable = rank == 0 or not strategy.replicated
    keys = ["param", *strategy.optimizer_state_keys()]
    tensors: dict[str, torch.Tensor] = {}
    ranges: dict[str, list[list[int]]] = {}
    scalars: set[str] = set()
    for e in entries:
        if e.kind == "trainable" and writes_trainable:
            owned = [[int(o), int(n)] for o, n in strategy.owned_ranges(e.tensor) if n > 0]
            if not owned:
                continue
            ranges[e.name] = owned
            for what in keys:
                value = strategy.local_state(e.tensor, what)
                if value is not None:
                    tensors[state_key(what, e.name)] = value
                    if value.dim() == 0:
                        scalars.add(what)
        elif e.kind == "buffer" or (e.kind == "frozen" and not exclude_frozen):
            value = full_module_value(e)  # collective for stage-3 frozen parameters
            if rank == 0:
                tensors[MODULE_PREFIX + e.name] = value
    return tensors, ranges, scalars


def _write_shard(
    engine: CheckpointSubject, folder: str, exclude_frozen: bool
) -> dict[str, Any] | None:
    """This rank's shard file and its report, on the ranks of the first replica; None on the
    others (see [Note: checkpoints of replicas])."""
    dims = engine.dims
    if not dims.first_replica:
        return None
    rank, world = dims.dp_rank, dims.dp_world_size
    tensors, ranges, scalars = _shard_tensors(engine, inventory(engine), exclude_frozen)
    report: dict[str, Any] = {"rank": rank, "file": None, "bytes": 0, "sha256": None}
    if tensors:
        name = shard_file_name(rank, world)
        written = write_safetensors(
            os.path.join(folder, name), tensors, metadata={"format": "pt", "rank": str(rank)}
        )
        report.update(file=name, bytes=written.nbytes, sha256=written.sha256)
    report["ranges"] = ranges
    report["scalar_keys"] = sorted(scalars)
    report["state_dtypes"] = {
        key.partition("::")[2]: dtype_name(t.dtype)
        for key, t in tensors.items()
        if key.startswith("param::")
    }
    report["rng"] = rng_state()
    loader = engine.training_dataloader
    report["data_loader"] = (
        loader.state_dict() if loader is not None and hasattr(loader, "state_dict") else None
    )
    return report


def _tensor_table(
    engine: CheckpointSubject, exclude_frozen: bool, state_dtypes: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """Every tensor's kind, shape and dtype; with `state_dtypes` (only when the stored masters
    do not share one dtype), each trainable one's stored state dtype."""
    table = {}
    for e in inventory(engine):
        info: dict[str, Any] = {
            "kind": e.kind,
            "shape": list(e.tensor.shape),
            "dtype": dtype_name(e.tensor.dtype),
        }
        if e.alias_of is not None:
            info["alias_of"] = e.alias_of
        if e.kind == "frozen" and exclude_frozen:
            info["stored"] = False
        if e.name in state_dtypes:
            info["state_dtype"] = state_dtypes[e.name]
        table[e.name] = info
    return table


def _manifest(
    engine: CheckpointSubject,
    tag: str,
    reports: list[dict[str, Any]],
    client_state: dict[str, Any],
    save_latest: bool,
    exclude_frozen: bool,
) -> dict[str, Any]:
    from partita import __version__

    scheduler = engine.lr_scheduler
    stored = {n: d for r in reports for n, d in r["state_dtypes"].items()}
    # One dtype for all stored states (the usual case) is recorded once; else per tensor.
    common = set(stored.values())
    state_dtype = next(iter(common)) if len(common) == 1 else "float32"
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "partita_version": __version__,
        "torch_version": torch.__version__,
        "tag": tag,
        "saved_at": time.time(),
        "save_latest": save_latest,
        "world_size": engine.dims.dp_world_size,
        "zero_stage": engine.zero_optimization_stage(),
        "replicated": bool(engine.param_states.replicated),
        "param_dtype": dtype_name(engine.policy.param_dtype),
        "state_dtype": state_dtype,
        "sharding": "per file and trainable parameter: the (offset, length) ranges of the "
        "flattened parameter it holds, concatenated in order; padding is never stored",
        "checksum": CHECKSUM,
        "tensors": _tensor_table(engine, exclude_frozen, stored if len(common) > 1 else {}),
        "optimizer": torch_class_name(engine.optimizer),
        "optimizer_state_keys": engine.param_states.optimizer_state_keys(),
        "scalar_state_keys": sorted({k for r in reports for k in r["scalar_keys"]}),
        "optimizer_param_groups": optimizer_groups(engine.optimizer),
        "files": {
            r["file"]: {
                "rank": r["rank"],
                "bytes": r["bytes"],
                "sha256": r["sha256"],
                "ranges": r["ranges"],
            }
            for r in reports
            if r["file"]
        },
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
        "rng": [r["rng"] for r in reports],
        "data_loader": [r["data_loader"] for r in reports],
        "config": engine.config_dict(),
        "client_state": client_state,
        "exclude_frozen_parameters": exclude_frozen,
    }


def _json_bytes(data: Any) -> bytes:
    import json

    return json.dumps(data, indent=1).encode()


__all__ = ["save_checkpoint"]
