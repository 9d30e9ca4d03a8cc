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
    exchange = _ExpertExchange(engine, collector)
    for batch in _param_batches(engine, exclude_frozen_parameters):
        with GatheredParameters([p for _, p in batch]):
            if rank == collector:
                for name, p in batch:
                    out[name] = p.detach().to("cpu").contiguous().clone()
            exchange.add(batch)  # while the unit is gathered: no second gather
    if rank != collector:
        return None
    out = _with_every_expert(out, exchange.received, engine)
    persistent = set(engine.module.state_dict(keep_vars=True))
    for name, buf in engine.module.named_buffers():
        if name in persistent:
            out[name] = buf.detach().to("cpu").contiguous().clone()
    return out


class _ExpertExchange:
    """[Note: experts in the 16-bit model]
    Under expert parallelism a rank holds only its experts (DeepSpeed-MoE's local
    ``deepspeed_experts.<i>``, a Hugging Face weight's rows), so the collector's own values
    are only its expert-parallel group's first share. While each unit is gathered for the
    state dict, every other rank of the collector's expert-parallel group sends it the unit's
    expert tensors (the same local names, in the same order, on every one of them); `received`
    holds one dict per expert-parallel rank, in rank order (empty without experts)."""

    def __init__(self, engine: Any, collector: int) -> None:
        from partita.checkpoint.experts import global_names, stacked_rows

        dims = engine.dims
        self.collector, self.rank = collector, dims.rank
        self.peers = dims.ep_ranks if collector in dims.ep_ranks else ()
        self.names: set[str] = set()
        if dims.ep_world_size > 1 and self.rank in self.peers:
            self.names = set(global_names(engine.module, dims)) | set(stacked_rows(engine.module))
        self.received: list[dict[str, torch.Tensor]] = (
            [{} for _ in self.peers] if self.names and self.rank == collector else []
        )

    def add(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        """Sends (a peer) or receives (the collector) the expert tensors of a gathered batch."""
        for name, p in batch:
            if name not in self.names:
                continue
            value = p.detach().contiguous()
            if self.rank != self.collector:
                p2p.send(value, self.collector, tag="save16")
                continue
            for j, peer in enumerate(self.peers):
                if peer == self.collector:
                    self.received[j][name] = value.to("cpu").clone()
                else:
                    got = p2p.recv(torch.empty_like(value), peer, tag="save16")
                    self.received[j][name] = got.to("cpu")


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
