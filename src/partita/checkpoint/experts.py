"""Checkpoints of mixture-of-experts layers: every expert saved once, by its global index.

[Note: expert slices]
Under expert parallelism ([Note: expert parallelism] in `partita.comm.dims`) expert-parallel
rank ``r`` of ``ep`` holds experts ``r * L .. r * L + L - 1`` of an MoE layer's ``E`` (``L = E /
ep``), under the local names ``...deepspeed_experts.{i}.*`` of its module, ``i < L``. A
checkpoint names each expert tensor by its global index ``g = r * L + i`` instead
(`global_names`), which is the name the one-process model (ep 1, every expert) gives it: a
checkpoint of expert-parallel training reads as a checkpoint of that model. So:

- saving, each rank writes the ranges its strategy owns of its own experts under their global
  names, as it writes any parameter (ZeRO stages 1-2 cut an expert over its
  expert-data-parallel group, whose ranks' ranges cover it once; at stage 0, and for frozen
  expert parameters and expert buffers (module tensors), one rank of that group writes it
  whole, `writers`); rank 0's manifest lists every expert of every layer
  (`every_expert`), not only its own, each with ``"expert": {"index": g, "of": E}``, and the
  job's ``ep_world_size``;
- loading, a rank asks for the ranges it owns of its experts' global names, at whatever ep,
  world size and stage it runs: the usual resharding by range ([Note: resharding] in
  `partita.checkpoint.reader`) re-splits the experts, master weights and optimizer state alike;
- a plain module with every expert loads the consolidated state dict
  (`get_fp32_state_dict_from_zero_checkpoint`), and ``partita export`` writes each expert under
  its usual module name, with nothing expert-specific in either.

Module tensors are read from rank 0's file when it holds them, else from the file that does
(`PartitaSource.read_module`): an expert's frozen parameters are in its writer's.

[Note: stacked expert rows]
Hugging Face MoE models keep a layer's experts in stacked weights (``gate_up_proj`` [E, 2F, H],
``down_proj`` [E, H, F]); `partita.moe.expert_parallel` leaves expert-parallel rank ``r`` the
rows ``r * L .. r * L + L - 1`` under the module's own names ([Note: Hugging Face expert plan]
in `partita.moe.hf_experts`). Those rows are one contiguous block of the flattened full tensor,
starting at element ``r * numel(local)``. A checkpoint therefore records the full tensor (its
shape [E, ...], the one-process model's) and every range a rank writes shifted by that offset
(`stacked_rows`), so the usual resharding by range loads it at any ep, world size and stage,
and into a model holding every expert. A frozen stacked weight (experts a LoRA run leaves
as they are) is a module tensor, but no rank holds it whole: each expert-parallel group's writer
stores its rows under their own key (`rows_key`: ``module::<name>@rows<first>+<count>``), and a
reader joins every file's rows into the whole tensor (`join_rows`), of which a loading rank
keeps its own rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from partita.comm import ParallelDims
from partita.moe.experts import Experts


@dataclass(frozen=True)
class ExpertTensor:
    """One tensor of one expert, as the checkpoint names it: ``{prefix}.{index}.{key}``."""

    prefix: str
    """The state-dict prefix of the layer's experts (``...deepspeed_experts``)."""
    index: int
    """The expert's global index in its layer."""
    key: str
    """The tensor's name inside the expert module."""
    of: int
    """The layer's number of experts."""

    @property
    def name(self) -> str:
        """The global state-dict name, the one-process model's."""
        return f"{self.prefix}.{self.index}.{self.key}"


@dataclass(frozen=True)
class StackedRows:
    """Where this rank's rows of a stacked expert weight sit in the full tensor ([Note:
    stacked expert rows])."""

    offset: int
    """Flat offset of this rank's block in the flattened full tensor."""
    shape: tuple[int, ...]
    """The full tensor's shape (every expert)."""
    writer: int
    """The expert-parallel rank (`ExpertShard.ep_rank`) whose rows these are."""


def stacked_rows(module: torch.nn.Module) -> dict[str, StackedRows]:
    """State-dict name -> `StackedRows` of every stacked expert weight of a Hugging Face
    experts module cut by `partita.moe.expert_parallel` (empty for any other model)."""
    from partita.moe.hf_experts import hf_expert_modules

    out = {}
    for name, experts, shard in hf_expert_modules(module):
        for key, p in experts.named_parameters(recurse=False):
            full = (shard.num_experts, *p.shape[1:])
            out[f"{name}.{key}" if name else key] = StackedRows(
                shard.ep_rank * p.numel(), full, shard.ep_rank
            )
    return out


ROWS = "@rows"
"""Marks the key of a block of rows of a stacked expert weight ([Note: stacked expert rows])."""


def rows_key(name: str, tensor: torch.Tensor, offset: int) -> str:
    """The key of `tensor`, this rank's rows of stacked weight `name` starting at flat element
    `offset` of the whole: ``name@rows<first>+<count>``."""
    per_row = max(tensor[0].numel(), 1) if tensor.dim() else 1
    return f"{name}{ROWS}{offset // per_row}+{tensor.shape[0]}"


def parse_rows_key(key: str) -> tuple[str, int, int] | None:
    """(name, first row, row count) of a `rows_key`; None for any other key."""
    name, marker, rows = key.rpartition(ROWS)
    if not marker:
        return None
    first, _, count = rows.partition("+")
    return name, int(first), int(count)


def join_rows(
    blocks: Iterable[tuple[int, torch.Tensor]], shape: list[int], where: str
) -> torch.Tensor:
    """The whole stacked weight of `shape` from its blocks of rows (first row, rows); raises
    `CheckpointError` naming `where` unless they cover every row exactly once."""
    from partita.checkpoint.manifest import CheckpointError

    parts = sorted(blocks, key=lambda b: b[0])
    covered = [row for first, t in parts for row in range(first, first + t.shape[0])]
    if covered != list(range(shape[0])):
        raise CheckpointError(f"{where}: the saved rows {covered} do not cover the {shape[0]} "
                              "rows of the stacked weight once each")  # fmt: skip
    return torch.cat([t for _, t in parts]).reshape(shape)


def ep_place(dims: ParallelDims) -> tuple[int, int]:
    """This rank's ``(expert-parallel rank, ep size)``; ``(0, 1)`` without experts."""
    if not dims.ep_ranks:
        return 0, 1
    return dims.ep_ranks.index(dims.rank), len(dims.ep_ranks)


def _containers(module: torch.nn.Module) -> Iterable[tuple[str, Experts]]:
    """Every `Experts` container of `module` with the state-dict prefix of its experts."""
    for name, m in module.named_modules():
        if isinstance(m, Experts):
            yield (f"{name}." if name else "") + "deepspeed_experts", m


def global_names(module: torch.nn.Module, dims: ParallelDims) -> dict[str, ExpertTensor]:
    """Local state-dict name -> `ExpertTensor` of every expert tensor this rank holds (see
    [Note: expert slices])."""
    rank, ep = ep_place(dims)
    out = {}
    for prefix, container in _containers(module):
        local = container.num_local_experts
        for i, expert in enumerate(container.deepspeed_experts):
            for key in expert.state_dict(keep_vars=True):
                out[f"{prefix}.{i}.{key}"] = ExpertTensor(prefix, rank * local + i, key, local * ep)
    return out


def every_expert(module: torch.nn.Module, dims: ParallelDims) -> dict[str, ExpertTensor]:
    """Global name -> `ExpertTensor` of every expert tensor of every layer, this rank's and
    the other expert-parallel ranks' (the experts are copies of one module, so the first
    one's tensors name every expert's), in the one-process model's order."""
    _, ep = ep_place(dims)
    out = {}
    for prefix, container in _containers(module):
        total = container.num_local_experts * ep
        keys = list(container.deepspeed_experts[0].state_dict(keep_vars=True))
        for g in range(total):
            for key in keys:
                e = ExpertTensor(prefix, g, key, total)
                out[e.name] = e
    return out


def table(
    tensors: dict[str, dict[str, Any]], module: torch.nn.Module, dims: ParallelDims
) -> dict[str, dict[str, Any]]:
    """The manifest's tensor table `tensors` (rank 0's, global names: its own experts, expert
    0 among them) with every expert of every layer, each marked with its index and the
    layer's number of experts, in the one-process model's order."""
    experts = every_expert(module, dims)
    out: dict[str, dict[str, Any]] = {}
    done = set()
    for name, info in tensors.items():
        first = experts.get(name)
        if first is None:
            out[name] = info
        elif first.prefix not in done:  # the layer's experts, all at once
            done.add(first.prefix)
            for n, e in experts.items():
                if e.prefix == first.prefix:
                    like = dict(tensors[ExpertTensor(e.prefix, 0, e.key, e.of).name])
                    if like.get("alias_of") in experts:  # tied inside the expert: its own
                        key = experts[like["alias_of"]].key
                        like["alias_of"] = ExpertTensor(e.prefix, e.index, key, e.of).name
                    out[n] = {**like, "expert": {"index": e.index, "of": e.of}}
    return out


def writers(module: torch.nn.Module, dims: ParallelDims) -> dict[str, int]:
    """Which file rank writes each of this rank's expert tensors (global name -> rank) where
    one rank writes a tensor whole (stage-0 state, frozen parameters, buffers): one rank of
    its expert-data-parallel group, taking turns by expert index (the other expert-parallel
    ranks do not hold it; see [Note: expert slices])."""
    edp = dims.edp_ranks or (dims.rank,)
    files = dims.grad_ranks or (dims.rank,)  # file ranks (`state.file_place`)
    mine = global_names(module, dims).values()
    out = {e.name: files.index(edp[e.index % len(edp)]) for e in mine}
    # Stacked expert rows: one rank of the group holding these rows writes them.
    stacked = stacked_rows(module)
    out.update({n: files.index(edp[i % len(edp)]) for i, n in enumerate(stacked)})
    return out


__all__ = [
    "ROWS",
    "ExpertTensor",
    "StackedRows",
    "ep_place",
    "every_expert",
    "global_names",
    "join_rows",
    "parse_rows_key",
    "rows_key",
    "stacked_rows",
    "table",
    "writers",
]
