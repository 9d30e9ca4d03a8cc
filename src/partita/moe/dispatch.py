"""Moving tokens to their experts' slots and ranks, and the experts' outputs back.

[Note: expert dispatch]
`encode` writes each kept route's token into its expert's buffer: one [E, C, M] tensor, expert
e's C slots in row e (empty slots zero). Under expert parallelism the E rows are in expert
order and expert-parallel rank j holds experts j*L .. j*L+L-1 (L local experts), so an
all-to-all over the expert-parallel group that splits the buffer into ep equal chunks sends
each rank exactly its experts' slots; what comes back is [ep, L, C, M], the tokens of every
source rank for this rank's experts. The experts run, the reverse all-to-all returns each
source rank its slots, and `decode` sums each token's routes weighted by their gates. The
all-to-all's backward is the same exchange of the gradients.
"""

from __future__ import annotations

from typing import Any

import torch

from partita import comm


def route_slots(
    indices: torch.Tensor, locations: torch.Tensor, num_experts: int, capacity: int
) -> torch.Tensor:
    """Each route's flat slot in the [E * C] buffer; dropped routes (expert -1) point at one
    extra slot, E * C, that is discarded."""
    flat = indices.long() * capacity + locations.long()
    return torch.where(indices >= 0, flat, torch.full_like(flat, num_experts * capacity))


def encode(
    tokens: torch.Tensor, slots: torch.Tensor, num_experts: int, capacity: int
) -> torch.Tensor:
    """The [E, C, M] dispatch buffer of `tokens` [S, M] placed at `slots` [k, S]."""
    width = tokens.shape[1]
    routes = slots.shape[0]
    buffer = tokens.new_zeros(num_experts * capacity + 1, width)
    # A token is copied once per route; only the discard slot can receive several rows.
    buffer = buffer.index_copy(0, slots.reshape(-1), tokens.repeat(routes, 1))
    return buffer[:-1].view(num_experts, capacity, width)


def decode(
    expert_output: torch.Tensor, slots: torch.Tensor, gates: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Each token's output: its routes' expert outputs ([E * C, M]) weighted by `gates`
    ([k, S], fp32, so the sum accumulates in fp32), in the experts' dtype."""
    width = expert_output.shape[-1]
    padded = torch.cat([expert_output, expert_output.new_zeros(1, width)])
    routed = padded.index_select(0, slots.reshape(-1)).view(slots.shape[0], num_tokens, width)
    return (routed * gates.unsqueeze(-1)).sum(dim=0).to(expert_output.dtype)


class AllToAll(torch.autograd.Function):
    """Differentiable all-to-all over an expert-parallel group ([Note: expert dispatch])."""

    @staticmethod
    def forward(ctx: Any, group: comm.ProcessGroup | None, input: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        input = input.contiguous()
        output = torch.empty_like(input)
        comm.all_to_all(output, input, group=group, tag="moe")
        return output

    @staticmethod
    def backward(ctx: Any, *grad_output: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, AllToAll.apply(ctx.group, *grad_output)


def all_to_all(group: comm.ProcessGroup | None, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` exchanged over `group` by `AllToAll` (differentiable)."""
    return AllToAll.apply(group, tensor)
