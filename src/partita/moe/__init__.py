"""Mixture of experts with expert parallelism: gating (`partita.moe.gating`), dispatch by
all-to-all over the expert-parallel group (`partita.moe.dispatch`), the experts one rank holds
(`partita.moe.experts`) and the layer (`partita.moe.layer`), DeepSpeed-MoE's semantics.
The groups are the job's ([Note: expert parallelism] in `partita.comm.dims`); the engine
reduces and shards expert parameters over the expert-data-parallel group."""

from partita.moe.experts import Experts
from partita.moe.gating import Routing, top1_routing, top2_routing, topk_routing
from partita.moe.hf_experts import expert_parallel
from partita.moe.layer import MoE, MOELayer, TopKGate, expert_parameters, moe_layers

__all__ = [
    "Experts",
    "MOELayer",
    "MoE",
    "Routing",
    "TopKGate",
    "expert_parallel",
    "expert_parameters",
    "moe_layers",
    "top1_routing",
    "top2_routing",
    "topk_routing",
]
