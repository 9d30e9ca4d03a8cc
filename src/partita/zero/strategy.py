"""The contract between the engine and a ZeRO stage implementation.

The engine owns the training loop bookkeeping (micro steps, accumulation boundary, loss scale,
scheduler, monitors); a strategy owns where gradients, master weights and optimizer state live
and how they are communicated. Stage 0 (data parallel) and stages 1-2 implement the same
interface, so the engine never branches on the stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

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
    """A ZeRO stage: gradient reduction, optimizer step and the state they own."""

    optimizer: torch.optim.Optimizer

    def begin_backward(self, sync: bool) -> None:
        """Called before each backward; `sync` is true at the accumulation boundary."""
        ...

    def end_backward(self) -> None:
        """Called after every backward: completes whatever reduction `begin_backward` armed."""
        ...

    def step(self, clip: float, loss_scale: float) -> StepOutcome:
        """Unscale, overflow check, clip, optimizer step, weights back to the module."""
        ...

    def zero_grad(self) -> None:
        """Zeroes accumulated gradients."""
        ...

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held per category: params, grads, master_params, optimizer_state, comm_buffers."""
        ...

    def close(self) -> None:
        """Removes hooks and frees buffers."""
        ...

    # State access, for accessors and checkpoints. `what` is "param" (fp32 master), "grad"
    # (reduced gradient) or an optimizer state key; values are fp32.
    replicated: bool
    shards_params: bool
    """True when the module's parameters themselves are sharded (stage 3)."""
    """True when every rank holds every parameter's whole state (stage 0)."""

    def owned_ranges(self, param: torch.Tensor) -> list[tuple[int, int]]:
        """(offset, length) ranges of the flattened `param` whose state this rank holds."""
        ...

    def optimizer_state_keys(self) -> list[str]:
        """Names of the optimizer's per-parameter state entries (e.g. exp_avg, step)."""
        ...

    def local_state(self, param: torch.Tensor, what: str) -> torch.Tensor | None:
        """This rank's owned elements (1-D, `owned_ranges` order); scalars as 0-dim tensors."""
        ...

    def set_local_state(self, param: torch.Tensor, what: str, value: torch.Tensor) -> None:
        """Writes this rank's owned elements (creates missing optimizer state)."""
        ...

    def refresh_params(self) -> None:
        """Brings the module's weights in line with the masters (after loading)."""
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


def ensure_state(
    optimizer: torch.optim.Optimizer, stepped: torch.Tensor, what: str, value: torch.Tensor
) -> torch.Tensor:
    """The optimizer's state tensor `what` for `stepped`, created when absent (a checkpoint
    loaded into a fresh optimizer): element-wise keys get zeros shaped like `stepped`, scalar
    keys (such as Adam's ``step``) a 0-dim tensor of `value`'s dtype."""
    state = optimizer.state[stepped]
    if what not in state:
        if value.dim() == 0:
            state[what] = torch.zeros((), dtype=value.dtype, device=stepped.device)
        else:
            state[what] = torch.zeros_like(stepped, memory_format=torch.contiguous_format)
    return state[what]
