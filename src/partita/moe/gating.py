"""Top-1, top-2 and top-k gating with DeepSpeed-MoE's semantics, as routes.

[Note: routes]
A gate decides, for each of the S tokens of a micro-batch and each of its k routes, the expert
it goes to, its place in that expert's buffer of `capacity` slots, and the weight its expert's
output gets in the combination. `Routing` holds these as three [k, S] tensors (a dropped route
has expert -1 and weight 0) with the load-balancing loss ``l_aux`` and the tokens routed to each
expert (``exp_counts``, before drops). Capacity is ``ceil(S / E * capacity_factor)`` (times k for
top-2 and top-k), at least ``min_capacity``; dropless (``drop_tokens=False``) makes it the largest
count of any expert on any rank of the expert-parallel group (one all-reduce of a scalar), so
every rank's buffers have one shape for the all-to-all and nothing is dropped. Tokens keep their
order inside an expert's buffer (a cumulative sum over the tokens); with capacity drops, top-1
keeps the tokens Random Token Selection (``use_rts``) or token order picks, top-k the highest
gate values (``drop_policy="probs"``) or the first tokens (``"position"``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from partita import comm

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
"""The values of ``noisy_gate_policy`` DeepSpeed accepts ("None" is the same as None)."""


@dataclass
class Routing:
    """Where each token's routes go ([Note: routes])."""

    l_aux: torch.Tensor
    """The auxiliary load-balancing loss (a differentiable scalar)."""
    capacity: int
    """Slots per expert in the dispatch buffers."""
    num_experts: int
    indices: torch.Tensor
    """[k, S] expert of each route (int64), -1 where the route was dropped."""
    locations: torch.Tensor
    """[k, S] slot in the expert's buffer (int64), 0 where dropped."""
    gates: torch.Tensor
    """[k, S] fp32 weight of each route's expert output (0 where dropped)."""
    exp_counts: torch.Tensor
    """[E] routes each expert was chosen for on this rank, before capacity drops."""


def capacity_for(num_tokens: int, num_experts: int, factor: float, min_capacity: int) -> int:
    """``ceil(num_tokens / num_experts * factor)``, at least `min_capacity` (the product in
    fp32, as DeepSpeed computes it)."""
    product = torch.tensor(factor, dtype=torch.float32) * (num_tokens / num_experts)
    return max(int(torch.ceil(product)), int(min_capacity))


ReduceMax = Callable[[torch.Tensor, Any], None]
"""In-place MAX all-reduce of a tensor over a group (`all_reduce_max` unless a caller routes
it elsewhere: DeepSpeed's API goes through ``deepspeed.comm``, which its tests watch)."""


def all_reduce_max(tensor: torch.Tensor, group: comm.ProcessGroup | None) -> None:
    """`tensor` replaced by its maximum over `group`."""
    comm.all_reduce(tensor, op=comm.ReduceOp.MAX, group=group, tag="moe_capacity")


def dropless_capacity(
    exp_counts: torch.Tensor,
    ep_group: comm.ProcessGroup | None,
    reduce_max: ReduceMax | None = None,
) -> int:
    """The largest expert count on any rank of `ep_group` (a MAX all-reduce of one scalar when
    the group has more than one rank)."""
    most = exp_counts.max().clone()
    if ep_group is not None and comm.is_initialized() and comm.get_world_size(ep_group) > 1:
        (reduce_max or all_reduce_max)(most, ep_group)
    return int(most)


def gumbel_noise(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Standard Gumbel samples, ``-log(-log(u))`` with u uniform in [tiny, 1 - eps)."""
    tiny, eps = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).eps
    u = tiny + torch.rand(shape, device=device) * ((1.0 - eps) - tiny)
    return -torch.log(-torch.log(u))


def multiplicative_jitter(x: torch.Tensor, epsilon: float = 1e-2) -> torch.Tensor:
    """`x` times uniform noise in [1 - epsilon, 1 + epsilon) (the 'Jitter' policy)."""
    if epsilon == 0:
        return x
    low = torch.tensor(1.0 - epsilon, device=x.device)
    return x * (low + torch.rand(x.shape, device=x.device) * ((1.0 + epsilon) - low))


def _balance(gates: torch.Tensor, first_choice: torch.Tensor) -> torch.Tensor:
    """Per expert, (mean gate) x (fraction of first choices): GShard's balance terms."""
    return gates.mean(dim=0) * first_choice.float().mean(dim=0)


def _routes(
    choices: list[torch.Tensor], masks: list[torch.Tensor], locations: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """[k, S] expert indices (-1 where dropped) and slots from per-route one-hot masks."""
    idx = [torch.where(m.sum(dim=1) > 0, c, -1) for c, m in zip(choices, masks, strict=True)]
    loc = [(l * m).sum(dim=1) for l, m in zip(locations, masks, strict=True)]  # noqa: E741
    return torch.stack(idx).long(), torch.stack(loc).long()


def top1_routing(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: torch.Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group: comm.ProcessGroup | None = None,
    reduce_max: ReduceMax | None = None,
) -> Routing:
    """Top-1 gating ([Note: routes]); ``RSample`` picks the expert by logits plus Gumbel noise."""
    num_tokens, num_experts = logits.shape
    if num_tokens < min_capacity:
        raise ValueError(
            f"top-1 gating: {num_tokens} tokens is fewer than min_capacity {min_capacity}; "
            "set min_capacity to 0 or use a larger batch"
        )
    noisy = (
        logits + gumbel_noise(logits.shape, logits.device)
        if noisy_gate_policy == "RSample"
        else None
    )
    gates = F.softmax(logits, dim=1)
    capacity = capacity_for(num_tokens, num_experts, capacity_factor, min_capacity)
    choice = torch.argmax(noisy if noisy is not None else gates, dim=1)
    mask = F.one_hot(choice, num_classes=num_experts)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    exp_counts = mask.sum(dim=0).detach()
    if not drop_tokens:
        capacity = min(dropless_capacity(exp_counts, ep_group, reduce_max), num_tokens)
    l_aux = torch.sum(_balance(gates, mask)) * num_experts
    ranked = mask * torch.rand(mask.shape, device=logits.device) if use_rts else mask
    chosen = torch.topk(ranked, k=min(capacity, num_tokens), dim=0)[1]
    mask = mask * torch.zeros_like(mask).scatter_(0, chosen, 1)
    indices, locations = _routes([choice], [mask], [torch.cumsum(mask, dim=0) - 1])
    gate = (gates * mask).sum(dim=1, keepdim=True).t()
    return Routing(l_aux, capacity, num_experts, indices, locations, gate, exp_counts)


def top2_routing(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: comm.ProcessGroup | None = None,
    second_expert_sampling: bool = True,
    reduce_max: ReduceMax | None = None,
) -> Routing:
    """Top-2 gating ([Note: routes]): the best expert, and the best other one by logits (plus
    Gumbel noise with `second_expert_sampling`); the two weights renormalised to sum to 1."""
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=num_experts)
    if second_expert_sampling:
        logits = logits + gumbel_noise(logits.shape, logits.device)
    second = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=num_experts)
    loc1 = torch.cumsum(mask1, dim=0) - 1
    loc2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    l_aux = torch.mean(_balance(gates, mask1)) * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    if drop_tokens:
        capacity = capacity_for(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * torch.lt(loc1, capacity)
        mask2 = mask2 * torch.lt(loc2, capacity)
    else:
        capacity = dropless_capacity(exp_counts, ep_group, reduce_max)
    g1 = (gates * mask1.float()).sum(dim=1)
    g2 = (gates * mask2.float()).sum(dim=1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
    indices, locations = _routes([first, second], [mask1, mask2], [loc1, loc2])
    weights = torch.stack([g1 / denom, g2 / denom])
    return Routing(l_aux, capacity, num_experts, indices, locations, weights, exp_counts)


def topk_routing(
    logits: torch.Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: comm.ProcessGroup | None = None,
    drop_policy: str = "probs",
    reduce_max: ReduceMax | None = None,
) -> Routing:
    """Top-k gating ([Note: routes]): the k largest gates, renormalised over the kept routes."""
    num_tokens, num_experts = logits.shape
    if not 1 <= k <= num_experts:
        raise ValueError(f"top-k gating: k={k} must be between 1 and num_experts={num_experts}")
    gates = F.softmax(logits, dim=1)
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.mean(_balance(gates, mask)) * num_experts * num_experts / k
    if drop_tokens:
        capacity = capacity_for(num_tokens, num_experts, capacity_factor * k, min_capacity)
        mask = _drop(mask, gates, top_gate, top_idx, capacity, drop_policy)
    else:
        capacity = dropless_capacity(exp_counts, ep_group, reduce_max)
    locations = torch.cumsum(mask, dim=0) - 1
    masked = gates * mask
    masked = masked / torch.clamp(
        masked.sum(dim=-1, keepdim=True), min=torch.finfo(gates.dtype).eps
    )
    kept = mask.gather(1, top_idx)
    indices = torch.where(kept, top_idx, torch.full_like(top_idx, -1)).t()
    slots = (locations.gather(1, top_idx) * kept).t()
    weights = masked.gather(1, top_idx).t()
    return Routing(l_aux, capacity, num_experts, indices.long(), slots.long(), weights, exp_counts)


def _drop(
    mask: torch.Tensor,
    gates: torch.Tensor,
    top_gate: torch.Tensor,
    top_idx: torch.Tensor,
    capacity: int,
    policy: str,
) -> torch.Tensor:
    """`mask` with each expert's routes beyond `capacity` dropped: those with the smallest gate
    values (``"probs"``) or the last tokens (``"position"``)."""
    if policy == "probs":
        scores = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
        keep = torch.topk(scores, k=min(capacity, gates.shape[0]), dim=0, sorted=False)[1]
        return mask & torch.zeros_like(mask).scatter_(0, keep, True)
    if policy == "position":
        return mask & torch.lt(torch.cumsum(mask, dim=0) - 1, capacity)
    raise ValueError(f"drop_policy: {policy!r} must be 'probs' or 'position'")


def dense_weights(routing: Routing, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GShard's dense form of `routing`: combine weights [S, E, C] (fp32, differentiable in
    the gates) and the boolean dispatch mask."""
    shape = (num_tokens, routing.num_experts, routing.capacity)
    combine = routing.gates.new_zeros(shape)
    tokens = torch.arange(num_tokens, device=routing.indices.device)
    for r in range(routing.indices.shape[0]):
        kept = routing.indices[r] >= 0
        where = (tokens[kept], routing.indices[r][kept], routing.locations[r][kept])
        combine = combine.index_put(where, routing.gates[r][kept], accumulate=True)
    return combine, combine.bool()
