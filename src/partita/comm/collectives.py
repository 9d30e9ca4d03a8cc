"""Collectives as plain functions: each records its payload in `COUNTERS` and can run async.

Every function takes ``async_op``; when true it returns the torch ``Work`` handle (call
``.wait()`` before reading the result), else None. ``tag`` labels the payload for accounting
("grad", "param", "overflow", "norm"...). With a single process and no process group, the
collectives are identities, so the engine runs unchanged without ``torch.distributed``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from partita.comm.counters import COUNTERS
from partita.comm.process_group import ProcessGroup, is_initialized

ReduceOp = dist.ReduceOp
Work = dist.Work

# Prefer the non-deprecated names where this torch has them.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _record(op: str, tag: str, tensor: torch.Tensor) -> None:
    COUNTERS.record(op, tag, tensor.numel() * tensor.element_size(), tensor.numel())


def _single_process(group: ProcessGroup | None) -> bool:
    return not is_initialized()


def all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    tag: str = "",
) -> Work | None:
    """In-place all-reduce of `tensor` over `group`."""
    _record("all_reduce", tag, tensor)
    if _single_process(group):
        return None
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    tag: str = "",
) -> Work | None:
    """Reduces `input` (world_size x output.numel() elements) and leaves this rank's chunk in
    `output`."""
    _record("reduce_scatter", tag, input)
    if _single_process(group):
        output.copy_(input.view(-1)[: output.numel()].view_as(output))
        return None
    return _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    tag: str = "",
) -> Work | None:
    """Gathers every rank's `input` into `output` (world_size x input.numel()), in rank order."""
    _record("all_gather", tag, output)
    if _single_process(group):
        if output.data_ptr() != input.data_ptr():
            output.view(-1)[: input.numel()].copy_(input.view(-1))
        return None
    return _all_gather_single(output, input, group=group, async_op=async_op)


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    tag: str = "",
) -> Work | None:
    """Broadcasts `tensor` from global rank `src` to every rank of `group`."""
    _record("broadcast", tag, tensor)
    if _single_process(group):
        return None
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather_object(obj: Any, group: ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable `obj`, in rank order (for small control data, not tensors)."""
    if _single_process(group):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0, group: ProcessGroup | None = None) -> Any:
    """`obj` from rank `src`, on every rank (small control data)."""
    if _single_process(group):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier(group: ProcessGroup | None = None) -> None:
    """Blocks until every rank of `group` arrives."""
    if not _single_process(group):
        dist.barrier(group=group)
