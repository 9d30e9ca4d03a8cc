"""``deepspeed.moe.experts``: the experts container, with DeepSpeed's parameter marks."""

from __future__ import annotations

from torch import nn

from partita.moe.experts import Experts as _Experts


class Experts(_Experts):
    """`partita.moe.Experts` whose parameters carry DeepSpeed's marks (``allreduce=False``,
    ``group_name``) that scripts read through ``is_moe_param``; partita's engine finds
    experts by module, not by these marks."""

    def __init__(
        self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None
    ) -> None:
        super().__init__(expert, num_local_experts, expert_group_name)
        mark_expert_params(self, expert_group_name)


def mark_expert_params(experts: nn.Module, group_name: str | None) -> None:
    """Sets DeepSpeed's expert marks on the parameters of `experts`."""
    for param in experts.parameters():
        param.allreduce = False  # type: ignore[attr-defined]
        param.group_name = group_name  # type: ignore[attr-defined]


__all__ = ["Experts"]
