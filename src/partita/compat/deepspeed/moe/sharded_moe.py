"""``deepspeed.moe.sharded_moe``: DeepSpeed's gating functions with their signatures and
return shapes, over `partita.moe.gating`, and its gate, layer and dispatch helpers."""

from __future__ import annotations

from typing import Any

import torch

from partita import comm
from partita.compat.deepspeed import comm as dist
from partita.compat.deepspeed._missing import module_getattr
from partita.moe.dispatch import AllToAll as _AllToAll
from partita.moe.dispatch import decode as _sparse_decode
from partita.moe.dispatch import encode as _sparse_encode
from partita.moe.dispatch import route_slots as _route_slots
from partita.moe.gating import (
    Routing,
    dense_weights,
    gumbel_noise,
    multiplicative_jitter,
    top1_routing,
    top2_routing,
    topk_routing,
)
from partita.moe.layer import MOELayer, TopKGate


def _reduce_max(tensor: torch.Tensor, group: comm.ProcessGroup | None) -> None:
    """The dropless capacity's MAX all-reduce, through ``deepspeed.comm`` (``dist`` here), as
    DeepSpeed issues it (its unit tests count the calls)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)


def _out(routing: Routing, num_tokens: int, sparse_routes: bool) -> tuple[Any, ...]:
    """DeepSpeed's return shape: dense ``(l_aux, combine_weights, dispatch_mask,
    exp_counts)`` or sparse ``(l_aux, capacity, E, indices, locations, gates, exp_counts)``."""
    r = routing
    if sparse_routes:
        return (
            r.l_aux, torch.tensor(r.capacity), r.num_experts, r.indices.int(),
            r.locations.int(), r.gates, r.exp_counts,
        )  # fmt: skip
    combine, dispatch = dense_weights(r, num_tokens)
    return r.l_aux, combine, dispatch, r.exp_counts


def top1gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: torch.Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group: comm.ProcessGroup | None = None,
    sparse_routes: bool = False,
    use_tutel: bool = False,
) -> tuple[Any, ...]:
    """Top-1 gating (`partita.moe.gating.top1_routing`) in DeepSpeed's return shape."""
    del use_tutel
    routing = top1_routing(
        logits, capacity_factor, min_capacity, used_token, noisy_gate_policy, drop_tokens,
        use_rts, ep_group, _reduce_max,
    )  # fmt: skip
    return _out(routing, logits.shape[0], sparse_routes)


def top2gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: comm.ProcessGroup | None = None,
    top2_2nd_expert_sampling: bool = True,
    sparse_routes: bool = False,
) -> tuple[Any, ...]:
    """Top-2 gating (`partita.moe.gating.top2_routing`) in DeepSpeed's return shape."""
    routing = top2_routing(
        logits, capacity_factor, min_capacity, drop_tokens, ep_group, top2_2nd_expert_sampling,
        _reduce_max,
    )  # fmt: skip
    return _out(routing, logits.shape[0], sparse_routes)


def topkgating(
    logits: torch.Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: comm.ProcessGroup | None = None,
    drop_policy: str = "probs",
    sparse_routes: bool = False,
) -> tuple[Any, ...]:
    """Top-k gating (`partita.moe.gating.topk_routing`) in DeepSpeed's return shape."""
    routing = topk_routing(
        logits, k, capacity_factor, min_capacity, drop_tokens, ep_group, drop_policy, _reduce_max
    )
    return _out(routing, logits.shape[0], sparse_routes)


def gumbel_rsample(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Standard Gumbel samples of `shape`."""
    return gumbel_noise(torch.Size(shape), device)


__getattr__ = module_getattr("deepspeed.moe.sharded_moe")

__all__ = [
    "MOELayer",
    "TopKGate",
    "_AllToAll",
    "_route_slots",
    "_sparse_decode",
    "_sparse_encode",
    "dist",
    "gumbel_rsample",
    "multiplicative_jitter",
    "top1gating",
    "top2gating",
    "topkgating",
]
