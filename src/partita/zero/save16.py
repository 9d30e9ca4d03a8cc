"""`engine.save_16bit_model`: the full model weights, in the module's dtype, as safetensors.

Stage 3 gathers one unit at a time, so no rank holds more than one unit plus the tensors of the
file shard being written; rank 0 writes. Files follow Hugging Face's layout: one
``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` shards with
``model.safetensors.index.json`` once `max_shard_bytes` is exceeded. Each file is written to a
temporary name and renamed, so a crash never leaves a truncated file under the final name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors.torch import save_file

from partita import comm
from partita.comm import p2p
from partita.zero.gather import GatheredParameters


def _param_batches(engine: Any, exclude_frozen: bool) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """(name, parameter) lists whose full values can be read together: one stage-3 unit at a
    time, or everything at once for stages 0-2 (parameters are whole there)."""
    named = [
        (n, p) for n, p in engine.module.named_parameters() if p.requires_grad or not exclude_frozen
    ]
    gatherer = engine.param_states.gatherer
    if gatherer is None:
        yield named
        return
    by_unit: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for n, p in named:
        unit = gatherer.unit_of(p)
        by_unit.setdefault(id(unit), []).append((n, p))
    yield from by_unit.values()


def consolidated_16bit_state_dict(
    engine: Any, exclude_frozen_parameters: bool = False, collector: int = 0
) -> dict[str, torch.Tensor] | None:
    """The full weights (module dtype, CPU copies) and persistent buffers, keyed like
    ``engine.module.state_dict()``, on global rank `collector`; None on the other ranks.
    Collective: every rank must call. Stage 3 gathers one unit at a time, so only the
    collector's host holds the whole model. With several replicas it is the first replica's
    model (see `partita.comm.ParallelDims`)."""
    rank = engine.dims.rank
    out: dict[str, torch.Tensor] = {}
    for batch in _param_batches(engine, exclude_frozen_parameters):
        with GatheredParameters([p for _, p in batch]):
            if rank == collector:
                for name, p in batch:
                    out[name] = p.detach().to("cpu").contiguous().clone()
    experts = _every_expert(engine, exclude_frozen_parameters, collector)
    if rank != collector:
        return None
    assert experts is not None
    out = _with_every_expert(out, experts, engine)
    persistent = set(engine.module.state_dict(keep_vars=True))
    for name, buf in engine.module.named_buffers():
        if name in persistent:
            out[name] = buf.detach().to("cpu").contiguous().clone()
    return out


def _expert_params(engine: Any, exclude_frozen: bool) -> list[tuple[str, torch.Tensor]]:
    """This rank's expert parameters (DeepSpeed-MoE experts and Hugging Face stacked expert
    weights), by local name, in module order: the same names on every expert-parallel rank."""
    from partita.checkpoint.experts import global_names, stacked_rows

    local = set(global_names(engine.module, engine.dims)) | set(stacked_rows(engine.module))
    return [
        (n, p)
        for n, p in engine.module.named_parameters()
        if n in local and (p.requires_grad or not exclude_frozen)
    ]


def _every_expert(
    engine: Any, exclude_frozen: bool, collector: int
) -> list[dict[str, torch.Tensor]] | None:
    """[Note: experts in the 16-bit model]
    Under expert parallelism a rank holds only its experts (DeepSpeed-MoE's local
    ``deepspeed_experts.<i>``, a Hugging Face weight's rows), so the collector's own state dict
    has only its expert-parallel group's first share. Every other rank of the collector's
    expert-parallel group sends its expert tensors (stage 3: each gathered over its
    expert-data-parallel group first, a collective every rank joins) in module order; the
    collector gets one dict per expert-parallel rank, in rank order (None elsewhere)."""
    dims = engine.dims
    if dims.ep_world_size == 1:
        return [] if dims.rank == collector else None
    params = _expert_params(engine, exclude_frozen)
    mine = dims.rank in dims.ep_ranks and collector in dims.ep_ranks  # the collector's group
    received: list[dict[str, torch.Tensor]] = [{} for _ in dims.ep_ranks] if mine else []
    device = params[0][1].device if params else torch.device("cpu")
    for name, p in params:
        with GatheredParameters([p]):
            if not mine:
                continue
            value = p.detach().contiguous()
            if dims.rank == collector:
                for j, peer in enumerate(dims.ep_ranks):
                    if peer == collector:
                        received[j][name] = value.to("cpu").clone()
                    else:
                        buf = torch.empty_like(value, device=device)
                        received[j][name] = p2p.recv(buf, peer, tag="save16").to("cpu")
            else:
                p2p.send(value.to(device), collector, tag="save16")
    return received if dims.rank == collector else None


def _with_every_expert(
    out: dict[str, torch.Tensor], experts: list[dict[str, torch.Tensor]], engine: Any
) -> dict[str, torch.Tensor]:
    """`out` with its expert tensors replaced by every expert-parallel rank's: DeepSpeed-MoE
    experts under their global index, Hugging Face stacked weights joined row-wise in rank order
    (the names a model holding every expert gives them)."""
    if not experts:
        return out
    from partita.checkpoint.experts import ExpertTensor, global_names, stacked_rows

    names = global_names(engine.module, engine.dims)
    stacked = set(stacked_rows(engine.module))
    merged = {n: t for n, t in out.items() if n not in names and n not in stacked}
    for name in experts[0]:
        if name in stacked:
            merged[name] = torch.cat([per_rank[name] for per_rank in experts])
            continue
        e = names[name]
        local = e.of // len(experts)
        for j, per_rank in enumerate(experts):  # rank j's expert i is global j * local + i
            index = j * local + e.index % local
            merged[ExpertTensor(e.prefix, index, e.key, e.of).name] = per_rank[name]
    return merged


def save_16bit_model(
    engine: Any,
    save_dir: str,
    save_filename: str = "model.safetensors",
    exclude_frozen_parameters: bool = False,
    max_shard_bytes: int = 5 * 1024**3,
) -> bool:
    """Writes the engine's ``consolidated_16bit_state_dict`` (collective: every rank must call;
    global rank 0, of the first replica, writes), split into files of at most
    `max_shard_bytes`. Returns True."""
    state = engine.consolidated_16bit_state_dict(exclude_frozen_parameters)
    if state is not None:
        os.makedirs(save_dir, exist_ok=True)
        _write(save_dir, save_filename, _split(state, max_shard_bytes))
    comm.barrier(group=None)  # every rank of the job returns once the files are in place
    return True


def _split(state: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """`state` in order, cut into consecutive files of at most `max_bytes` (a larger tensor gets
    a file of its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def _write(save_dir: str, filename: str, shards: list[dict[str, torch.Tensor]]) -> None:
    if len(shards) == 1:
        _atomic_save(shards[0], os.path.join(save_dir, filename))
        return
    stem = filename.removesuffix(".safetensors")
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards, start=1):
        name = f"{stem}-{k:05d}-of-{len(shards):05d}.safetensors"
        _atomic_save(shard, os.path.join(save_dir, name))
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    tmp = os.path.join(save_dir, f".{stem}.safetensors.index.json.tmp")
    with open(tmp, "w") as fh:
        json.dump(index, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(save_dir, f"{stem}.safetensors.index.json"))


def _atomic_save(tensors: dict[str, torch.Tensor], path: str) -> None:
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
