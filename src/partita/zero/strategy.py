"""The contract between the engine and a ZeRO stage implementation.

The engine owns the training loop bookkeeping (micro steps, accumulation boundary, loss scale,
scheduler, monitors); a strategy owns where gradients, master weights and optimizer state live
and how they are communicated. Every stage implements the same interface, so the engine never
branches on the stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from partita.zero.state_access import ParamStates

OptimizerFactory = Callable[[list[list[torch.Tensor]]], torch.optim.Optimizer]
"""Builds the optimizer given, for each parameter group (in the order of `ParamGroups`), the
tensors the optimizer steps for it: the parameters themselves, their masters, or one flat
shard. The factory keeps each group's hyperparameters (config optimizer, client instance or
callable)."""

ParamGroups = list[list[torch.nn.Parameter]]
"""The trainable parameters of each optimizer parameter group, in order."""


@dataclass(frozen=True)
class StepOutcome:
    """What happened at an accumulation boundary."""

    applied: bool
    """False when the step was skipped (non-finite gradients)."""
    grad_norm: float
    """Global L2 norm of the unscaled gradients before clipping (inf/nan on overflow)."""


class Strategy(Protocol):
    """A ZeRO stage as the engine drives it: the training lifecycle (one call per point of the
    step) plus `state`, the state-access interface everything else goes through."""

    optimizer: torch.optim.Optimizer
    state: ParamStates
    """Per-parameter master weights, gradients and optimizer state, for the accessors,
    checkpoints and `GatheredParameters` (see `partita.zero.state_access`)."""

    def begin_backward(self, sync: bool) -> None:
        """Called before each backward; `sync` is true at the accumulation boundary."""
        ...

    def end_backward(self) -> None:
        """Called after every backward: completes whatever reduction `begin_backward` armed."""
        ...

    def absorb_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Takes in gradients written to ``.grad`` outside autograd's accumulation, which fires
        no hook (torch's zero-bubble weight step assigns them), as the hook would have; call
        before `end_backward`. Parameters it does not train, or without a gradient, are
        skipped."""
        ...

    def step(self, clip: float, loss_scale: float) -> StepOutcome:
        """Unscale, overflow check, clip, optimizer step, weights back to the module."""
        ...

    def zero_grad(self) -> None:
        """Releases accumulated gradients: the next backward starts from zero ([Note: released
        gradients])."""
        ...

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held per category: params, grads (while they exist), grads_held (now),
        master_params, optimizer_state, comm_buffers (at their most), comm_buffers_held (now,
        where a strategy pools them)."""
        ...

    def close(self) -> None:
        """Removes hooks and frees buffers."""
        ...


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of memory held by the optimizer's state tensors (moments, step counters...);
    state swapped out to NVMe (storage resized to zero) holds none."""
    total = 0
    seen: set[int] = set()
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                storage = v.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
    return total


@dataclass(frozen=True)
class ExpertFamily:
    """The expert parameters of a job with mixture-of-experts layers and their groups
    ([Note: expert parallelism] in `partita.comm.dims`): their gradients are summed, and at
    stages 1-2 their shards cut, over `group` (the expert-data-parallel group), while the
    average still divides by the whole data-parallel size; `ep_group` holds the other
    experts, across which a replicated (stage 0) norm sums their squares."""

    params: frozenset[torch.nn.Parameter]
    group: Any
    """The expert-data-parallel process group."""
    ep_group: Any
    """The expert-parallel process group."""
    frozen: frozenset[torch.nn.Parameter] = frozenset()
    """Expert parameters that do not train: no gradient, but stage 3 cuts them over `group`
    too (they differ across expert-parallel ranks)."""

    @property
    def all_params(self) -> frozenset[torch.nn.Parameter]:
        """Every expert parameter, trainable or frozen."""
        return self.params | self.frozen

    def split(self, params: list[torch.nn.Parameter]) -> tuple[list[int], list[int]]:
        """Indices into `params` of the dense parameters and of the expert ones."""
        dense = [i for i, p in enumerate(params) if p not in self.params]
        expert = [i for i, p in enumerate(params) if p in self.params]
        return dense, expert
