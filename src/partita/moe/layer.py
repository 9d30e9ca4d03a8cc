"""The mixture-of-experts layer: gate, dispatch over the expert-parallel group, experts.

Module and attribute names follow DeepSpeed-MoE (``deepspeed_moe.gate.wg``,
``deepspeed_moe.experts.deepspeed_experts.N``, ``mlp``, ``coefficient``) so that checkpoints
and scripts that address them work unchanged; the parameters are created in DeepSpeed's order,
so a seeded model starts from the same weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from partita import comm
from partita.moe import load_stats
from partita.moe.dispatch import all_to_all, decode, encode, route_slots
from partita.moe.experts import Experts
from partita.moe.gating import (
    NOISY_GATE_POLICIES,
    Routing,
    dense_weights,
    multiplicative_jitter,
    top1_routing,
    top2_routing,
    topk_routing,
)


class TopKGate(nn.Module):
    """A linear router (``wg``, no bias, run in fp32) and top-k gating over its logits
    ([Note: routes] in `partita.moe.gating`)."""

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        ep_group: comm.ProcessGroup | None = None,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        check_gate(num_experts, k, noisy_gate_policy)
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def _set_ep_group(self, ep_group: comm.ProcessGroup | None) -> None:
        self.ep_group = ep_group

    def route(self, tokens: torch.Tensor, used_token: torch.Tensor | None = None) -> Routing:
        """The routing of `tokens` [S, M]."""
        x = tokens.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            policy = self.noisy_gate_policy if self.training else None
            return top1_routing(
                logits, factor, self.min_capacity, used_token, policy, self.drop_tokens,
                self.use_rts, self.ep_group,
            )  # fmt: skip
        if self.k == 2:
            return top2_routing(
                logits, factor, self.min_capacity, self.drop_tokens, self.ep_group,
                self.top2_2nd_expert_sampling,
            )  # fmt: skip
        return topk_routing(
            logits, self.k, factor, self.min_capacity, self.drop_tokens, self.ep_group
        )

    def forward(
        self,
        input: torch.Tensor,
        used_token: torch.Tensor | None = None,
        sparse_routes: bool = False,
        use_tutel: bool = False,
    ) -> tuple[Any, ...]:
        """DeepSpeed's gate output: ``(l_aux, combine_weights, dispatch_mask, exp_counts)``,
        or with `sparse_routes` ``(l_aux, capacity, E, indices, locations, gates,
        exp_counts)`` (indices and locations int32)."""
        del use_tutel  # Tutel's kernels are not used; the result is the same
        r = self.route(input, used_token)
        if sparse_routes:
            return (
                r.l_aux, r.capacity, r.num_experts, r.indices.int(), r.locations.int(),
                r.gates, r.exp_counts,
            )  # fmt: skip
        combine, dispatch = dense_weights(r, input.shape[0])
        return r.l_aux, combine, dispatch, r.exp_counts


class MOELayer(nn.Module):
    """Gate, dispatch, experts, combine ([Note: expert dispatch] in `partita.moe.dispatch`).
    After a forward, ``l_aux`` and ``exp_counts`` hold the gate's loss and counts."""

    def __init__(
        self,
        gate: TopKGate,
        experts: Experts,
        ep_group_name: str,
        ep_size: int,
        num_local_experts: int,
        use_tutel: bool = False,
    ) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group: comm.ProcessGroup | None = None
        self.ep_group_bound = False
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.use_tutel = False  # Tutel's kernels are not used (use_tutel is accepted)
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None
        self.capacity = 0
        """Slots per expert in the last forward's dispatch buffers."""

    def _set_ep_group(self, ep_group: comm.ProcessGroup | None) -> None:
        self.ep_group = ep_group
        self.ep_group_bound = True
        self.gate._set_ep_group(ep_group)

    def forward(self, *input: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """``input[0]`` [..., M] (optionally ``input[1]``, the used-token mask) -> the
        combined expert outputs, of the same shape."""
        if self.ep_size > 1 and not self.ep_group_bound:
            raise RuntimeError(
                f"MoE layer with ep_size {self.ep_size}: its expert-parallel group is made by "
                "deepspeed.initialize (partita.initialize); call it before the forward"
            )
        hidden = input[0]
        width = hidden.shape[-1]
        tokens = hidden.reshape(-1, width)
        routing = self.gate.route(tokens, input[1] if len(input) > 1 else None)
        self.l_aux, self.exp_counts = routing.l_aux, routing.exp_counts
        kept = routing.indices.ge(0).sum()
        load_stats.record(self, routing.exp_counts, kept, routing.l_aux)
        experts, capacity = routing.num_experts, routing.capacity
        self.capacity = capacity
        slots = route_slots(routing.indices, routing.locations, experts, capacity)
        dispatched = encode(tokens, slots, experts, capacity)
        if self.ep_size > 1:
            dispatched = all_to_all(self.ep_group, dispatched)
        dispatched = dispatched.reshape(self.ep_size, self.num_local_experts, -1, width)
        out = self.experts(dispatched).reshape(experts, -1, width)
        if self.ep_size > 1:
            out = all_to_all(self.ep_group, out)
        combined = decode(out.reshape(experts * capacity, width), slots, routing.gates, len(tokens))
        return combined.reshape(hidden.shape)


class MoE(nn.Module):
    """DeepSpeed's ``MoE`` layer: `num_experts` copies of `expert` split over `ep_size`
    expert-parallel ranks, top-`k` gating; ``forward`` returns ``(output, l_aux,
    exp_counts)``. `use_residual` makes it a residual MoE (PR-MoE): the dense `expert` runs
    beside the experts and a learned softmax mixes the two outputs. Bad sizes raise here,
    before any collective."""

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        check_layer(num_experts, ep_size, k, noisy_gate_policy, enable_expert_tensor_parallelism)
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(
            hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
            noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling,
        )  # fmt: skip
        self.deepspeed_moe = MOELayer(
            gate, experts, self.expert_group_name, ep_size, self.num_local_experts, use_tutel
        )
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_ep_group(self, group: comm.ProcessGroup | None) -> None:
        """Binds the expert-parallel group the layer's all-to-alls run over (the engine does
        it from the job's dimensions)."""
        self.deepspeed_moe._set_ep_group(group)

    def forward(
        self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(output, l_aux, exp_counts)`` for `hidden_states` [..., hidden_size]."""
        args = (hidden_states,) if used_token is None else (hidden_states, used_token)
        output = self.deepspeed_moe(*args)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense
            mix = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * mix[..., 0:1] + dense * mix[..., 1:]
        moe = self.deepspeed_moe
        assert moe.l_aux is not None and moe.exp_counts is not None
        return output, moe.l_aux, moe.exp_counts


def check_gate(num_experts: int, k: int, noisy_gate_policy: str | None) -> None:
    """Raises ValueError naming the argument when the gate's settings cannot work."""
    if num_experts < 1:
        raise ValueError(f"num_experts: {num_experts} must be at least 1")
    if not 1 <= k <= num_experts:
        raise ValueError(f"k: {k} must be between 1 and num_experts ({num_experts})")
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        raise ValueError(
            f"noisy_gate_policy: {noisy_gate_policy!r} must be one of None, 'Jitter', 'RSample'"
        )


def check_layer(
    num_experts: int, ep_size: int, k: int, noisy_gate_policy: str | None, expert_tp: bool
) -> None:
    """Raises ValueError naming the argument when the layer's sizes do not fit together."""
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size: {ep_size!r} must be a positive integer")
    if num_experts % ep_size:
        raise ValueError(
            f"num_experts: {num_experts} is not divisible by ep_size {ep_size} (each "
            "expert-parallel rank holds num_experts / ep_size experts)"
        )
    if expert_tp:
        raise ValueError(
            "enable_expert_tensor_parallelism: tensor-parallel experts are not supported by "
            "partita yet; use False"
        )
    check_gate(num_experts, k, noisy_gate_policy)


def moe_layers(module: nn.Module) -> list[Any]:
    """The expert-parallel layers inside `module`, in registration order: its `MoE` layers,
    then the Hugging Face experts modules `expert_parallel` cut (their `ExpertShard`s); each
    has ``ep_size`` and ``set_ep_group``."""
    from partita.moe.hf_experts import hf_expert_layers

    return [m for m in module.modules() if isinstance(m, MoE)] + hf_expert_layers(module)


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of every `Experts` container in `module` (what each expert-parallel rank
    holds its own of), in registration order."""
    from partita.moe.hf_experts import hf_expert_parameters

    seen: dict[nn.Parameter, None] = {}
    for m in module.modules():
        if isinstance(m, Experts):
            seen.update(dict.fromkeys(m.parameters()))
    seen.update(dict.fromkeys(hf_expert_parameters(module)))  # stacked Hugging Face experts
    return list(seen)
