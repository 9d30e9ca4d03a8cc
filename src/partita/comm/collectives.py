"""Collectives as plain functions: each records its payload in `COUNTERS` and can run async.

Every function takes ``async_op``; when true it returns a ``Work``-like handle (call
``.wait()`` before reading the result), else None. ``tag`` labels the payload for accounting
("grad", "param", "overflow", "norm"...). With a single process and no process group, the
collectives are identities, so the engine runs unchanged without ``torch.distributed``.
With a process group, each collective also records itself in `LAST_COLLECTIVE` and marks the
time this rank spends blocked in it, for the launcher's hang watchdog (see
[Note: hang watchdog] in `partita.comm.heartbeat`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from partita.comm.counters import COUNTERS, group_name
from partita.comm.heartbeat import LAST_COLLECTIVE
from partita.comm.pairwise import pair_all_gather, pair_all_reduce, pair_reduce_scatter
from partita.comm.pins import hold as _pin
from partita.comm.process_group import ProcessGroup, is_initialized
from partita.platform import env

ReduceOp = dist.ReduceOp
Work = dist.Work

# Prefer the non-deprecated names where this torch has them.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _record(op: str, tag: str, tensor: torch.Tensor, group: ProcessGroup | None) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    COUNTERS.record(op, tag, nbytes, tensor.numel(), group_name(group), link_of(group))


_LINKS: dict[int, tuple[Any, str]] = {}
"""`link_of`'s answers by group id (the group kept with it, so that an id is not reused while
its entry lives)."""


def link_of(group: ProcessGroup | None) -> str:
    """The link `group`'s collectives use (None: the default group): "intra" when all its
    ranks are on one node, else "inter" ([Note: links] in `partita.comm.counters`)."""
    entry = _LINKS.get(id(group))
    if entry is not None and entry[0] is group:
        return entry[1]
    if not is_initialized():
        return "intra"
    from partita.platform import cluster_env

    node = max(1, cluster_env.detect().local_world_size)
    if group is None:
        ranks = list(range(dist.get_world_size()))
    else:
        ranks = dist.get_process_group_ranks(group)
    link = "intra" if len({r // node for r in ranks}) == 1 else "inter"
    _LINKS[id(group)] = (group, link)
    return link


def _single_process(group: ProcessGroup | None) -> bool:
    return not is_initialized()


def _gloo_mode(group: ProcessGroup | None) -> str:
    """How reduce-scatter and all-gather run: "native", "pair" or "all_reduce".

    [Note: gloo collectives]
    gloo's all-reduce is far better tuned than its reduce-scatter and all-gather: on 2 CPU
    ranks, 32 MB took 22 ms to all-reduce but 44 ms to reduce-scatter and 44 ms to all-gather
    (torch 2.13). So on gloo partita runs them, with two ranks, as one exchange of halves
    (`partita.comm.pairwise`, faster still; counted as what they are), a small sum-all-reduce
    as one swap of the whole tensor (lower latency, same bytes), and with more ranks as
    all-reduces: reduce-scatter by all-reducing and keeping its chunk, all-gather by
    all-reducing a buffer that is zero outside this rank's chunk (counted as all-reduces, the
    bytes they move). ``PARTITA_COLLECTIVES=native`` uses gloo's own collectives (tests of the
    algorithms' communication volume do), ``=all_reduce`` the all-reduce form at any size;
    NCCL always uses its native ones.
    """
    mode = env.collectives()
    if mode == "native" or dist.get_backend(group) != "gloo":
        return "native"
    if mode != "all_reduce" and dist.get_world_size(group) == 2:
        return "pair"
    return "all_reduce"


class _Then:
    """A `Work` handle that runs `then` once the underlying collective has finished."""

    def __init__(self, work: Work | None, then: Callable[[], None]) -> None:
        self.work = work
        self.then = then

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        self.then()
        return True


class _Waited:
    """A handle whose ``wait`` counts as time blocked in a collective (for the watchdog) and
    reports the collective's latency, issue to first completed wait (for the comms logger)."""

    def __init__(self, work: Any, op: str, issued_at: float) -> None:
        self.work = work
        self.op = op
        self.issued_at: float | None = issued_at

    def wait(self) -> bool:
        with LAST_COLLECTIVE.waiting():
            done = bool(self.work.wait())
        if self.issued_at is not None:
            COUNTERS.finished(self.op, time.perf_counter() - self.issued_at)
            self.issued_at = None
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def _tracked(op: str, tag: str, async_op: bool, run: Callable[[bool], Any]) -> Work | None:
    """Runs ``run(async_op)``, a collective named `op`, recorded in `LAST_COLLECTIVE`."""
    LAST_COLLECTIVE.issued(op, tag)
    issued_at = time.perf_counter()
    if not async_op:
        with LAST_COLLECTIVE.waiting():
            run(False)
        COUNTERS.finished(op, time.perf_counter() - issued_at)
        return None
    handle = run(True)
    if handle is None:
        COUNTERS.finished(op, time.perf_counter() - issued_at)
        return None
    return _Waited(handle, op, issued_at)  # type: ignore[return-value]


def _staging_device(
    group: ProcessGroup | None, tensors: tuple[torch.Tensor, ...]
) -> torch.device | None:
    """The device to run a collective on when `group`'s backend cannot reach `tensors`.

    [Note: staged collectives]
    NCCL reaches CUDA tensors only, while partita keeps some states on the CPU (offloaded fp32
    masters and optimizer shards read by `safe_get_full_fp32_param` or a checkpoint, a host
    shard's norm): such a collective ("No backend type associated with device type cpu" from
    torch) runs on copies on this rank's device, and the result is copied back. The bytes
    and the order of collectives are the same, so every rank stays in step whatever its
    tensors' devices."""
    if not any(t.device.type == "cpu" for t in tensors) or dist.get_backend(group) != "nccl":
        return None
    return torch.device("cuda", torch.cuda.current_device())


def _staged(
    group: ProcessGroup | None, *tensors: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], Callable[[], None] | None]:
    """`tensors`, or copies of them on the staging device with a function that copies the
    first (the collective's output) back; see [Note: staged collectives]."""
    device = _staging_device(group, tensors)
    if device is None:
        return tensors, None
    copies = tuple(t.to(device, copy=True) for t in tensors)

    def copy_back() -> None:
        tensors[0].copy_(copies[0])

    return copies, copy_back


def _copied_back(work: Work | None, copy_back: Callable[[], None] | None) -> Work | None:
    """`work` whose completion also copies a staged result back (see `_staged`)."""
    if copy_back is None:
        return work
    if work is None:  # the collective ran synchronously
        copy_back()
        return None
    return _Then(work, copy_back)  # type: ignore[return-value]


def _issued(
    op: str,
    tag: str,
    group: ProcessGroup | None,
    async_op: bool,
    tensors: tuple[torch.Tensor, ...],
    run: Callable[[tuple[torch.Tensor, ...], bool], Any],
) -> Work | None:
    """Runs ``run(tensors, async_op)``, collective `op` over `tensors` (its output first):
    staged where the backend cannot reach them (see `_staged`), pinned until it completes
    ([Note: exit abort] in partita.comm.pins) and tracked (see `_tracked`)."""
    staged, back = _staged(group, *tensors)
    _pin(*staged)
    work = _tracked(op, tag, async_op, lambda a: run(staged, a))
    return _copied_back(work, back)


def all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    tag: str = "",
) -> Work | None:
    """In-place all-reduce of `tensor` over `group`."""
    _record("all_reduce", tag, tensor, group)
    if _single_process(group):
        return None
    return _issued(
        "all_reduce", tag, group, async_op, (tensor,), lambda t, a: _all_reduce(t[0], op, group, a)
    )


PAIR_ALL_REDUCE_BYTES = 256 * 1024
"""Largest all-reduce run as a two-rank swap on gloo (see [Note: two-rank exchange])."""


def _all_reduce(
    tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, group: ProcessGroup | None, async_op: bool
) -> Work | None:
    small = tensor.numel() * tensor.element_size() <= PAIR_ALL_REDUCE_BYTES
    summable = op == ReduceOp.SUM and tensor.dtype != torch.bool and tensor.is_contiguous()
    if small and summable and _gloo_mode(group) == "pair":
        return pair_all_reduce(tensor, group, async_op)  # type: ignore[return-value]
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
    if _single_process(group):
        _record("reduce_scatter", tag, input, group)
        output.copy_(input.view(-1)[: output.numel()].view_as(output))
        return None
    return _issued(
        "reduce_scatter",
        tag,
        group,
        async_op,
        (output, input),
        lambda t, a: _reduce_scatter(t[0], t[1], op, group, a, tag),
    )


def _reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp.RedOpType,
    group: ProcessGroup | None,
    async_op: bool,
    tag: str,
) -> Work | None:
    mode = _gloo_mode(group)
    if mode == "pair" and op == ReduceOp.SUM:  # see [Note: gloo collectives]
        _record("reduce_scatter", tag, input, group)
        return pair_reduce_scatter(output, input, group, async_op)  # type: ignore[return-value]
    if mode != "native":  # see [Note: gloo collectives]; `input` is overwritten
        _record("all_reduce", tag, input, group)
        chunk = input.view(-1)[dist.get_rank(group) * output.numel() :][: output.numel()]
        work = dist.all_reduce(input, op=op, group=group, async_op=True)

        def keep_chunk() -> None:
            if output.data_ptr() != chunk.data_ptr():
                output.view(-1).copy_(chunk)

        done = _Then(work, keep_chunk)
        if not async_op:
            done.wait()
            return None
        return done  # type: ignore[return-value]
    _record("reduce_scatter", tag, input, group)
    return _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    tag: str = "",
) -> Work | None:
    """Gathers every rank's `input` into `output` (world_size x input.numel()), in rank order."""
    if _single_process(group):
        _record("all_gather", tag, output, group)
        if output.data_ptr() != input.data_ptr():
            output.view(-1)[: input.numel()].copy_(input.view(-1))
        return None
    return _issued(
        "all_gather",
        tag,
        group,
        async_op,
        (output, input),
        lambda t, a: _all_gather(t[0], t[1], group, a, tag),
    )


def _all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup | None,
    async_op: bool,
    tag: str,
) -> Work | None:
    mode = _gloo_mode(group)
    if mode == "pair":  # see [Note: gloo collectives]
        _record("all_gather", tag, output, group)
        return pair_all_gather(output, input, group, async_op)  # type: ignore[return-value]
    if mode != "native":  # see [Note: gloo collectives]
        _record("all_reduce", tag, output, group)
        flat, n = output.view(-1), input.numel()
        start = dist.get_rank(group) * n
        if flat[start:].data_ptr() != input.data_ptr():
            flat[start : start + n].copy_(input.view(-1))
        flat[:start].zero_()
        flat[start + n :].zero_()
        work = dist.all_reduce(output, group=group, async_op=async_op)
        return work if async_op else None
    _record("all_gather", tag, output, group)
    return _all_gather_single(output, input, group=group, async_op=async_op)


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    tag: str = "",
) -> Work | None:
    """Broadcasts `tensor` from global rank `src` to every rank of `group`."""
    _record("broadcast", tag, tensor, group)
    if _single_process(group):
        return None
    return _issued(
        "broadcast",
        tag,
        group,
        async_op,
        (tensor,),
        lambda t, a: dist.broadcast(t[0], src=src, group=group, async_op=a),
    )


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    tag: str = "",
) -> Work | None:
    """Splits `input` along its first dimension into one equal chunk per rank of `group` and
    sends chunk j to rank j; `output` (the shape of `input`) receives rank i's chunk at place
    i. Counts `input`, the payload each rank sends (its own chunk included, as with the other
    collectives' full-tensor convention)."""
    _record("all_to_all", tag, input, group)
    if _single_process(group):
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return None
    return _issued(
        "all_to_all",
        tag,
        group,
        async_op,
        (output, input),
        lambda t, a: dist.all_to_all_single(t[0], t[1], group=group, async_op=a),
    )


def all_to_all_v(
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: ProcessGroup | None = None,
    tag: str = "",
) -> None:
    """`all_to_all` with uneven chunks: rank j gets `input_splits[j]` rows of `input` (first
    dimension), and `output` holds `output_splits[i]` rows from rank i, in rank order (dropless
    expert dispatch). Synchronous. Counts `input`."""
    _record("all_to_all", tag, input, group)
    if _single_process(group):
        output.copy_(input)
        return
    _issued(
        "all_to_all",
        tag,
        group,
        False,
        (output, input),
        lambda t, a: dist.all_to_all_single(
            t[0], t[1], output_splits, input_splits, group=group, async_op=a
        ),
    )


def all_gather_object(obj: Any, group: ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable `obj`, in rank order (for small control data, not tensors)."""
    if _single_process(group):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    _tracked("all_gather_object", "", False, lambda a: dist.all_gather_object(out, obj, group))
    return out


def broadcast_object(obj: Any, src: int = 0, group: ProcessGroup | None = None) -> Any:
    """`obj` from rank `src`, on every rank (small control data)."""
    if _single_process(group):
        return obj
    box = [obj]
    _tracked("broadcast_object", "", False, lambda a: dist.broadcast_object_list(box, src, group))
    return box[0]


def barrier(group: ProcessGroup | None = None) -> None:
    """Blocks until every rank of `group` arrives."""
    if not _single_process(group):
        _tracked("barrier", "", False, lambda a: dist.barrier(group=group))
