"""The experts one rank holds: ``num_local_experts`` copies of the user's expert module."""

from __future__ import annotations

import copy

import torch
from torch import nn


class Experts(nn.Module):
    """``num_local_experts`` independent copies of `expert`, each run on its own slice of the
    dispatched tokens. The attribute name ``deepspeed_experts`` is DeepSpeed's, so that state
    dicts move between the two unchanged."""

    def __init__(
        self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None
    ) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(
            [copy.deepcopy(expert) for _ in range(num_local_experts)]
        )
        self.num_local_experts = num_local_experts
        self.expert_group_name = expert_group_name

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """`inputs` [ep, L, C, M] -> outputs of the same shape, expert i on ``inputs[:, i]``
        (an expert returning a tuple contributes its first element)."""
        outputs = []
        for chunk, expert in zip(
            inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts, strict=True
        ):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outputs, dim=1)
