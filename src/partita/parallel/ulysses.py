"""Ulysses sequence parallelism: attention over a sequence split across ranks.

[Note: Ulysses attention]
Each rank of a sequence group (``sequence_parallel_size`` = sp consecutive ranks, see
[Note: sequence parallelism] in `partita.comm.dims`) holds 1/sp of every sequence, all heads.
Attention needs the whole sequence, but each head is independent of the others, so one
all-to-all over the group trades the split: before the local attention, query, key and value go
from sequence-sharded ``[b, s/sp, h, d]`` to head-sharded ``[b, s, h/sp, d]`` (each rank sends
head block j of its slice to rank j and concatenates the slices it receives in rank order);
after it, the output goes back the other way. The backward of an all-to-all is the inverse
all-to-all, so autograd needs nothing else. Each all-to-all takes a rank's ``b * s * h * d /
sp`` elements (the byte counters record that much, under ``all_to_all``/``ulysses``; the
block a rank keeps does not cross a link).

Grouped-query attention: key and value have ``kv`` heads, fewer than the ``h`` query heads.
Query head i reads key/value head ``i // (h / kv)``; rank j receives query heads
``[j h/sp, (j+1) h/sp)``, which read key/value heads ``[j kv/sp, (j+1) kv/sp)`` when sp divides
kv. When kv < sp and kv divides sp, each key/value head is repeated sp / kv times first (so rank
j gets the one head its query heads read; the backward sums the copies' gradients); any other
count is refused. The local attention then sees ``h/sp`` query heads and ``max(kv/sp, 1)``
key/value heads, and does the grouping itself (as SDPA's ``enable_gqa`` or the model's own
``repeat_kv`` do).

The loss: a rank's loss may be the mean over its slice (Megatron-DeepSpeed's convention), or
the loss of the whole sequence, the same on every rank of the group, through a differentiable
sum (`sequence_loss`) or all-gather (Transformers' Trainer); the engine averages the
gradients over every rank, which gives one process's gradient for both ([Note: sequence
parallelism] in `partita.comm.dims`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist  # the all-to-all; to move into partita.comm.collectives
from torch import nn

from partita.comm.counters import COUNTERS, group_name
from partita.comm.process_group import ProcessGroup, is_initialized

__all__ = [
    "DistributedAttention",
    "SequenceShardingLoader",
    "UlyssesHFAttention",
    "check_heads",
    "seq_all_to_all",
    "sequence_loss",
    "shard_sequence",
]


def _group_size(group: ProcessGroup | None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def _group_rank(group: ProcessGroup | None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def _all_to_all(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup | None
) -> torch.Tensor:
    """Splits `x` into the group's size blocks along `scatter_dim`, sends block j to rank j,
    and concatenates the blocks received along `gather_dim`, in rank order."""
    world = _group_size(group)
    if world == 1:
        return x
    blocks = torch.stack(torch.tensor_split(x, world, dim=scatter_dim)).contiguous()
    received = torch.empty_like(blocks)
    COUNTERS.record(
        "all_to_all", "ulysses", blocks.numel() * blocks.element_size(), blocks.numel(),
        group_name(group),
    )  # fmt: skip
    dist.all_to_all_single(received, blocks, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _SeqAllToAll(torch.autograd.Function):
    """`_all_to_all` whose backward is the inverse all-to-all."""

    @staticmethod
    def forward(
        ctx: Any, group: ProcessGroup | None, x: torch.Tensor, scatter_dim: int, gather_dim: int
    ) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        scatter_dim, gather_dim = ctx.dims
        return None, _all_to_all(grad.contiguous(), gather_dim, scatter_dim, ctx.group), None, None


def seq_all_to_all(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup | None = None
) -> torch.Tensor:
    """The differentiable all-to-all of [Note: Ulysses attention]: scatter `scatter_dim`
    over the group, gather `gather_dim` from it. `scatter_dim` must divide by the group's
    size (ValueError naming the sizes, before any collective)."""
    world = _group_size(group)
    if x.shape[scatter_dim] % world:
        raise ValueError(
            f"sequence all-to-all: dimension {scatter_dim} of a {tuple(x.shape)} tensor "
            f"({x.shape[scatter_dim]}) does not divide by the sequence-parallel size {world}"
        )
    return _SeqAllToAll.apply(group, x, scatter_dim, gather_dim)


def check_heads(heads: int, kv_heads: int, sp: int) -> int:
    """How many times each key/value head is repeated before the all-to-all (1: none);
    ValueError naming the sizes when `heads` query heads and `kv_heads` key/value heads cannot
    be split over `sp` ranks ([Note: Ulysses attention])."""
    if heads % sp:
        raise ValueError(
            f"Ulysses attention: {heads} query heads do not divide by the sequence-parallel "
            f"size {sp}; use a sequence_parallel_size that divides the head count"
        )
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"Ulysses attention: {kv_heads} key/value heads do not divide the {heads} query heads"
        )
    if kv_heads % sp == 0:
        return 1
    if kv_heads < sp and sp % kv_heads == 0:
        return sp // kv_heads
    raise ValueError(
        f"Ulysses attention: {kv_heads} key/value heads cannot be split over the "
        f"sequence-parallel size {sp} (they must be a multiple of it, or divide it to be "
        "repeated)"
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _apply_rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on the leading ``cos.shape[-1]`` features of `t`."""
    width = cos.shape[-1]
    head, rest = t[..., :width], t[..., width:]
    rotated = head * cos + _rotate_half(head) * sin
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated


class DistributedAttention(nn.Module):
    """DeepSpeed's ``deepspeed.sequence.layer.DistributedAttention``: `local_attention` on the
    whole sequence and 1/sp of the heads, between two all-to-alls over
    `sequence_process_group` ([Note: Ulysses attention]).

    Args:
        local_attention: called as ``local_attention(q, k, v, *args, **kwargs)`` on
            head-sharded tensors of the same layout as the inputs; returns the context in that
            layout.
        sequence_process_group: the sequence-parallel group (None: every rank).
        scatter_idx: the head dimension of the ``[b, s, h, d]`` / ``[s, b, h, d]`` inputs (2).
        gather_idx: kept for DeepSpeed's signature; the sequence dimension is the one that
            `forward`'s ``batch_dim_idx`` does not name.
        sp_stream: DeepSpeed's side stream for overlap; accepted, not used (the all-to-alls run
            on the current stream).
        num_kv_heads: key/value heads of the model (read off the key tensor when None).
    """

    def __init__(
        self,
        local_attention: nn.Module | Any,
        sequence_process_group: ProcessGroup | None,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: Any = None,
        num_kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        if scatter_idx != 2:
            raise ValueError(
                f"DistributedAttention: scatter_idx={scatter_idx}; partita's Ulysses attention "
                "takes sequence-sharded [b, s, h, d] or [s, b, h, d] inputs (heads at 2)"
            )
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.sp_stream = sp_stream
        self.num_kv_heads = num_kv_heads

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        batch_dim_idx: int = 0,
        rotary_pos_emb: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Attention of this rank's sequence slice over the whole sequence; inputs and output
        are ``[b, s/sp, h, d]`` (``batch_dim_idx`` 0) or ``[s/sp, b, h, d]`` (1)."""
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"DistributedAttention: batch_dim_idx={batch_dim_idx}, not 0 or 1")
        seq_dim, heads_dim = 1 - batch_dim_idx, self.scatter_idx
        sp = _group_size(self.spg)
        kv_heads = self.num_kv_heads if self.num_kv_heads is not None else key.shape[heads_dim]
        repeat = check_heads(query.shape[heads_dim], kv_heads, sp)
        if repeat > 1:
            key = key.repeat_interleave(repeat, dim=heads_dim)
            value = value.repeat_interleave(repeat, dim=heads_dim)
        q, k, v = (seq_all_to_all(t, heads_dim, seq_dim, self.spg) for t in (query, key, value))
        if rotary_pos_emb is not None:
            # DeepSpeed's layout: (cos, sin) of [s, b, 1, d], applied on the whole sequence.
            cos, sin = (f.permute(1, 0, 2, 3) for f in rotary_pos_emb)
            q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return seq_all_to_all(context, seq_dim, heads_dim, self.spg)


def shard_sequence(
    tensor: torch.Tensor, group: ProcessGroup | None = None, dim: int = 1
) -> torch.Tensor:
    """This rank's slice of `tensor` along the sequence dimension `dim` (rank j of the
    sequence group takes the j-th of sp equal blocks). ValueError naming the length when it
    does not divide by sp (partita does not pad), before any collective."""
    sp, rank = _group_size(group), _group_rank(group)
    length = tensor.shape[dim]
    if length % sp:
        raise ValueError(
            f"sequence length {length} does not divide by the sequence-parallel size {sp}; "
            f"pad or cut the sequences to a multiple of {sp} (partita does not pad)"
        )
    return tensor.narrow(dim, rank * (length // sp), length // sp)


class _GroupSum(torch.autograd.Function):
    """Sum over the group, differentiable: the backward sums the incoming gradients over the
    group too (each rank's share feeds every rank's copy of the sum)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        out = x.detach().clone()
        if _group_size(group) > 1:
            dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad = grad.contiguous().clone()
        if _group_size(ctx.group) > 1:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sequence_loss(share: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """The sum of the ranks' `share` (their slices' parts of the loss of the whole sequence:
    for a mean over tokens, the slice's sum over the whole sequence's token count) over the
    sequence group, the same on every rank, differentiable ([Note: Ulysses attention])."""
    return _GroupSum.apply(share, group)


class UlyssesHFAttention:
    """Ulysses around a Hugging Face attention function (``ALL_ATTENTION_FUNCTIONS``'
    signature: ``fn(module, query, key, value, attention_mask, *args, **kwargs)`` with
    ``[b, h, s, d]`` inputs, returning ``([b, s, h, d] output, weights)``): the same
    all-to-alls as `DistributedAttention` around `core`, on this layout
    ([Note: Ulysses attention]).

    The attention mask is dropped (Hugging Face builds it for the local slice; the core
    attention must then be causal by itself, as SDPA and flash attention are without a mask),
    and ``position_ids`` in `kwargs`, when given, are gathered over the group so that the core
    sees the whole sequence's (flash attention reads them for packed sequences). With key/value
    heads repeated, ``module.num_key_value_groups`` is set to the local ratio, as DeepSpeed
    does. ``disable_in_eval``: a module in eval mode runs `core` alone."""

    def __init__(
        self, core: Any, group: ProcessGroup | None, disable_in_eval: bool = False
    ) -> None:
        self.core = core
        self.group = group
        self.disable_in_eval = disable_in_eval

    def __call__(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        if self.disable_in_eval and not module.training:
            return self.core(module, query, key, value, attention_mask, *args, **kwargs)
        sp = _group_size(self.group)
        repeat = check_heads(query.shape[1], key.shape[1], sp)
        if repeat > 1:
            key = key.repeat_interleave(repeat, dim=1)
            value = value.repeat_interleave(repeat, dim=1)
        q, k, v = (seq_all_to_all(t, 1, 2, self.group) for t in (query, key, value))
        if hasattr(module, "num_key_value_groups"):
            setattr(module, "num_key_value_groups", q.shape[1] // k.shape[1])  # noqa: B010
        if kwargs.get("position_ids") is not None and sp > 1:
            kwargs["position_ids"] = _gather_sequence(kwargs["position_ids"], self.group)
        out, weights = self.core(module, q, k, v, None, *args, **kwargs)  # [b, s, h/sp, d]
        return seq_all_to_all(out, 1, 2, self.group), weights


def _gather_sequence(t: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """The group's slices of `t` (not differentiable), concatenated along dimension 1."""
    parts = [torch.empty_like(t) for _ in range(_group_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=1)


class SequenceShardingLoader:
    """DeepSpeed's ``UlyssesSPDataLoaderAdapter``: each rank of a sequence group reads its own
    batches from `loader` (split over every rank, as plain data parallelism splits them); each
    batch is shared with the group and every rank takes its slice of the sequence, so the
    group trains on its ranks' batches one after another, sp micro-batches per sp batches read.
    Tensors (``[b, s, ...]``) are cut along dimension 1 (a length that does not divide by sp
    raises, naming it); ``labels`` are shifted first and returned as ``shift_labels`` (the last
    position gets -100), as DeepSpeed does, since a slice's last token predicts the next
    slice's first; other values are copied to every rank. ``position_ids`` must be in the
    batch."""

    def __init__(
        self, loader: Any, sp_rank: int, sp_group: ProcessGroup | None, sp_world_size: int,
        device: Any,
    ) -> None:  # fmt: skip
        self.dl = loader
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = device
        self.iter = iter(loader)
        self.micro_batches: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> SequenceShardingLoader:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.pop(0)

    def refill(self) -> None:
        """Reads this rank's next batch, shares it with the group, queues this rank's slices
        of every rank's batch (StopIteration at the end; the next pass starts over)."""
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)
            raise
        if "position_ids" not in batch:
            raise ValueError(
                "Ulysses sequence parallelism needs position_ids in every batch (each token's "
                "position in the whole sequence; torch.arange(seq_len) for unpacked sequences)"
            )
        shared: list[Any] = [None] * self.sp_world_size
        local = {k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()}
        dist.all_gather_object(shared, local, group=self.sp_group)
        for whole in shared:
            self.micro_batches.append(self._slice(dict(whole)))

    def _slice(self, batch: dict[str, Any]) -> dict[str, Any]:
        length = int(batch["input_ids"].shape[1])
        if length % self.sp_world_size:
            raise ValueError(
                f"sequence length {length} does not divide by the sequence-parallel size "
                f"{self.sp_world_size}; pad the batches to a multiple of it"
            )
        if "labels" in batch:
            labels = batch.pop("labels")
            batch["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        chunk = length // self.sp_world_size
        return {
            k: v[:, chunk * self.sp_rank : chunk * (self.sp_rank + 1)].contiguous().to(self.device)
            if torch.is_tensor(v)
            else v
            for k, v in batch.items()
        }
