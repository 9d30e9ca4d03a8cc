"""Expert parallelism for Hugging Face MoE models, by their expert plan.

[Note: Hugging Face expert plan]
Transformers' MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, ...) keep a layer's experts in one
module holding stacked weights (``gate_up_proj`` [E, 2F, H], ``down_proj`` [E, H, F]) whose
forward takes the layer's tokens with their router's top-k choices; the config's
``base_model_ep_plan`` names those modules (``layers.*.mlp.experts``). `expert_parallel` cuts
each such module's stacked weights along the expert dimension, rank r of an expert-parallel
group of ep ranks keeping experts [r E/ep, (r+1) E/ep), and replaces its forward with a dropless
dispatch: each route (token, choice) is sent to the rank holding its expert by one all-to-all
with uneven chunks, the local experts run on what arrives (grouped matmuls), the
results come back by the reverse all-to-all and are weighted and summed per token in expert
order, as the model's own loop sums them. The router, attention and everything else stay
replicated and train as dense parameters. The model is changed in place and keeps its module
names; the engine finds the cut modules (`hf_expert_layers`) as it finds DeepSpeed-MoE layers
and binds their group ([Note: expert parallelism] in `partita.comm.dims`).
"""

from __future__ import annotations

import fnmatch
import types
import weakref
from typing import Any

import torch
from torch import nn

from partita import comm
from partita.moe import load_stats


class AllToAllV(torch.autograd.Function):
    """Differentiable uneven all-to-all over an expert-parallel group."""

    @staticmethod
    def forward(
        ctx: Any,
        group: comm.ProcessGroup | None,
        input: torch.Tensor,
        send: list[int],
        recv: list[int],
    ) -> torch.Tensor:
        ctx.group, ctx.send, ctx.recv = group, send, recv
        out = input.new_empty((sum(recv), *input.shape[1:]))
        comm.all_to_all_v(out, input.contiguous(), recv, send, group=group, tag="moe")
        return out

    @staticmethod
    def backward(ctx: Any, *grad: torch.Tensor) -> tuple[Any, ...]:
        back = AllToAllV.apply(ctx.group, grad[0].contiguous(), ctx.recv, ctx.send)
        return None, back, None, None


class ExpertShard:
    """The expert-parallel state of one cut experts module (what the engine binds)."""

    def __init__(self, module: nn.Module, ep_size: int, ep_rank: int, num_experts: int) -> None:
        self.module = weakref.ref(module)
        self.ep_size = ep_size
        self.ep_rank = ep_rank
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.ep_group: comm.ProcessGroup | None = None
        self.ep_group_bound = ep_size == 1

    def set_ep_group(self, group: comm.ProcessGroup | None) -> None:
        """Binds the expert-parallel group (the engine does it from the job's dimensions)."""
        self.ep_group, self.ep_group_bound = group, True


_SHARDS: weakref.WeakKeyDictionary[nn.Module, ExpertShard] = weakref.WeakKeyDictionary()
"""Every experts module `expert_parallel` cut, with its state."""


def hf_expert_layers(model: nn.Module) -> list[ExpertShard]:
    """The cut experts modules inside `model`, in registration order."""
    return [_SHARDS[m] for m in model.modules() if m in _SHARDS]


def hf_expert_modules(model: nn.Module) -> list[tuple[str, nn.Module, ExpertShard]]:
    """Every cut experts module inside `model` with its name and state, in registration
    order."""
    return [(name, m, _SHARDS[m]) for name, m in model.named_modules() if m in _SHARDS]


def hf_expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The stacked expert weights of every cut experts module of `model`."""
    return [p for m in model.modules() if m in _SHARDS for p in m.parameters()]


def _plan_patterns(model: nn.Module) -> list[str]:
    """The module-name patterns of the experts modules (``base_model_ep_plan`` entries that
    name a module, not a weight), relative to the whole model."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_ep_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    found = [k for k, v in plan.items() if v == "ep_dispatch_experts"]
    if not found:
        name = type(model).__name__
        raise ValueError(
            f"expert_parallel: {name} has no base_model_ep_plan naming its experts modules "
            "(Transformers' Mixtral, Qwen2-MoE and Qwen3-MoE have one)"
        )
    return [p for k in found for p in (k, f"{prefix}.{k}")]


def expert_parallel(model: nn.Module, ep_size: int, ep_rank: int | None = None) -> nn.Module:
    """Cuts `model`'s experts over `ep_size` ranks in place ([Note: Hugging Face expert plan]);
    rank `ep_rank` (default: this rank's place in blocks of `ep_size` consecutive ranks, the
    engine's layout) keeps its experts. Every rank must build the same model first (same
    seed). Returns `model`."""
    patterns = _plan_patterns(model)
    if ep_rank is None:
        ep_rank = comm.get_rank() % ep_size if comm.is_initialized() else 0
    cut = 0
    for name, module in model.named_modules():
        if any(fnmatch.fnmatchcase(name, p) for p in patterns) and module not in _SHARDS:
            _cut(module, name, ep_size, ep_rank)
            cut += 1
    if not cut:
        raise ValueError(f"expert_parallel: no module of {type(model).__name__} matches {patterns}")
    return model


def _cut(module: nn.Module, name: str, ep_size: int, ep_rank: int) -> None:
    experts = int(getattr(module, "num_experts", 0))
    if ep_size < 1 or experts % ep_size:
        raise ValueError(
            f"expert_parallel: {name} has {experts} experts, not divisible by ep_size {ep_size}"
        )
    _check_layout(module, name, experts)
    local = experts // ep_size
    for weight in ("gate_up_proj", "down_proj"):
        full = getattr(module, weight)
        keep = full.detach()[ep_rank * local : (ep_rank + 1) * local].clone()
        setattr(module, weight, nn.Parameter(keep, requires_grad=full.requires_grad))
    _SHARDS[module] = ExpertShard(module, ep_size, ep_rank, experts)
    module.forward = types.MethodType(_dispatch_forward, module)


def _check_layout(module: nn.Module, name: str, experts: int) -> None:
    """Refuses, naming the module, an experts module whose weights are not the layout the
    dispatch computes with (``gate_up_proj`` [E, 2F, H], ``down_proj`` [E, H, F], no biases:
    GPT-OSS's transposed, biased experts are not)."""
    names = sorted(n for n, _ in module.named_parameters())
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    fits = (
        names == ["down_proj", "gate_up_proj"]
        and gate_up is not None
        and down is not None
        and gate_up.dim() == down.dim() == 3
        and gate_up.shape[0] == down.shape[0] == experts
        and gate_up.shape[1] == 2 * down.shape[2]
        and gate_up.shape[2] == down.shape[1]
        and callable(getattr(module, "act_fn", None))
    )
    if not fits:
        raise ValueError(
            f"expert_parallel: {name} ({type(module).__name__}, parameters {names}) is not laid "
            "out as gate_up_proj [E, 2F, H] and down_proj [E, H, F]; partita cannot split it"
        )


def _dispatch_forward(
    self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts module's forward with its experts split over ranks (dropless)."""
    shard = _SHARDS[self]
    if not shard.ep_group_bound:
        raise RuntimeError(
            f"expert-parallel experts (ep_size {shard.ep_size}): the group is made by "
            "partita.initialize; call it before the forward"
        )
    k = top_k_index.shape[-1]
    expert = top_k_index.reshape(-1)
    token = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(k)
    # By expert, so by destination rank, in order; an index of E is a route the model masked
    # (its own loop skips it): dropped.
    order = torch.argsort(expert, stable=True)
    order = order[expert[order] < shard.num_experts]
    expert, token = expert[order], token[order]
    load_stats.record(self, torch.bincount(expert, minlength=shard.num_experts), len(expert), None)
    weight = top_k_weights.reshape(-1)[order]
    local = shard.num_local_experts
    send = torch.bincount(expert // local, minlength=shard.ep_size)
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group=shard.ep_group, tag="moe_counts")
    send_l, recv_l = send.tolist(), recv.tolist()
    x = AllToAllV.apply(shard.ep_group, hidden[token], send_l, recv_l)
    which = expert.new_empty(sum(recv_l))
    comm.all_to_all_v(which, expert % local, recv_l, send_l, group=shard.ep_group, tag="moe")
    y = _local_experts(self, x, which)
    y = AllToAllV.apply(shard.ep_group, y, recv_l, send_l)
    out = torch.zeros_like(hidden)
    return out.index_add(0, token, (y * weight[:, None]).to(out.dtype))


def _local_experts(module: Any, x: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
    """Each row of `x` through its local expert `which[row]` (the model's own expert math):
    one grouped matmul per projection where torch has one for these tensors, else one matmul
    pair per expert ([Note: grouped expert matmuls])."""
    if grouped_mm_supported(x):
        return _grouped_experts(module, x, which)
    out = x.new_zeros(x.shape)
    for j in range(module.gate_up_proj.shape[0]):
        rows = torch.nonzero(which == j).squeeze(-1)
        if rows.numel() == 0:
            continue
        gate, up = nn.functional.linear(x[rows], module.gate_up_proj[j]).chunk(2, dim=-1)
        h = nn.functional.linear(module.act_fn(gate) * up, module.down_proj[j])
        out = out.index_copy(0, rows, h.to(out.dtype))
    return out


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """Whether torch's grouped matmul runs for `x`: on the CPU (any float dtype), on CUDA for
    bf16 on compute capability 9.0 and newer (what its kernel requires)."""
    if not hasattr(nn.functional, "grouped_mm") or not x.is_floating_point():
        return False
    if x.device.type == "cpu":
        return True
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    return False


def _grouped_experts(module: Any, x: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
    """[Note: grouped expert matmuls]
    The rows arriving from the all-to-all are grouped by expert only within each source rank,
    so they are sorted by expert (stably) first; ``grouped_mm`` then multiplies each expert's
    run of rows by that expert's matrix, given the runs' ends, and the results go back to the
    rows' places. Row by row this is the per-expert loop's arithmetic (on the CPU the results
    are bitwise the same, forward and backward: tests/test_hf_moe.py), in two kernel calls
    instead of two per expert, and an expert with no rows costs nothing."""
    experts = module.gate_up_proj.shape[0]
    order = torch.argsort(which, stable=True)
    ends = torch.cumsum(torch.bincount(which, minlength=experts), 0).to(torch.int32)
    rows = x[order]
    gate_up = nn.functional.grouped_mm(rows, module.gate_up_proj.transpose(-2, -1), offs=ends)
    gate, up = gate_up.chunk(2, dim=-1)
    h = nn.functional.grouped_mm(
        module.act_fn(gate) * up, module.down_proj.transpose(-2, -1), offs=ends
    )
    return x.new_zeros(x.shape).index_copy(0, order, h.to(x.dtype))


__all__ = [
    "AllToAllV",
    "ExpertShard",
    "expert_parallel",
    "hf_expert_layers",
    "hf_expert_modules",
    "hf_expert_parameters",
]
