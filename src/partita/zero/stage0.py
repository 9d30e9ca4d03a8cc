"""ZeRO stage 0: plain data parallelism with bucketed, overlapped gradient all-reduce.

Every rank holds the whole model, gradients and optimizer state. With a 16-bit module, fp32
master weights (and their gradients) are kept for the optimizer; with an fp32 module the
optimizer steps the module's parameters directly, so no copy of the weights exists.
"""

from __future__ import annotations

import math

import torch

from partita import comm
from partita.precision import PrecisionPolicy, full_dtype
from partita.zero.grad_buckets import GradientBuckets, ReduceScaling
from partita.zero.master import MasterWeights
from partita.zero.strategy import (
    OptimizerFactory,
    ParamGroups,
    StepOutcome,
    ensure_state,
    optimizer_state_bytes,
)


class DataParallel:
    """Stage 0 strategy (see `partita.zero.strategy.Strategy`)."""

    def __init__(
        self,
        groups: ParamGroups,
        policy: PrecisionPolicy,
        make_optimizer: OptimizerFactory,
        bucket_numel: int,
        scaling: ReduceScaling,
        group: comm.ProcessGroup | None = None,
    ) -> None:
        self.params = [p for g in groups for p in g]
        self.buckets = GradientBuckets(
            self.params, bucket_numel, scaling, policy.reduce_dtype, group
        )
        self.master = (
            MasterWeights(self.params, policy.master_dtype) if policy.needs_master else None
        )
        if self.master is not None:
            mapping = self.master.by_model_param
            self.optimizer = make_optimizer([[mapping[p] for p in g] for g in groups])
        else:
            self.optimizer = make_optimizer([list(g) for g in groups])

    def begin_backward(self, sync: bool) -> None:
        """Arms the all-reduce hooks for the boundary backward."""
        self.buckets.begin_backward(sync)

    def end_backward(self) -> None:
        """Waits for every bucket's all-reduce (launching stragglers first), if armed."""
        self.buckets.finish()

    def _stepped_params(self) -> list[torch.nn.Parameter]:
        """The tensors the optimizer steps, with this step's gradients in their `.grad`."""
        if self.master is None:
            return self.params
        self.master.restore_grad_views()
        self.master.load_grads([p.grad for p in self.params])  # type: ignore[misc]
        return self.master.params

    def step(self, clip: float, loss_scale: float) -> StepOutcome:
        """Unscale, norm and overflow check, clip, step; returns what happened."""
        stepped = self._stepped_params()
        grads: list[torch.Tensor] = [p.grad for p in stepped]  # type: ignore[misc]
        if loss_scale != 1.0 and grads:
            torch._foreach_mul_(grads, 1.0 / loss_scale)
        # The reduced gradients are identical on every rank, so the norm (and with it the
        # overflow decision) is too: no collective is needed to agree on skipping.
        norm = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros(())
        norm_value = float(norm)
        if not math.isfinite(norm_value):
            return StepOutcome(applied=False, grad_norm=norm_value)
        if clip > 0.0:
            torch.nn.utils.clip_grads_with_norm_(stepped, clip, norm)
        self.optimizer.step()
        if self.master is not None:
            self.master.copy_to_model()
        return StepOutcome(applied=True, grad_norm=norm_value)

    def zero_grad(self) -> None:
        """Zeroes the gradient buckets (the masters' gradients are overwritten each step)."""
        self.buckets.zero_()

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held per category on this rank."""
        param_bytes = sum(p.numel() * p.element_size() for p in self.params)
        master = self.master
        return {
            "params": param_bytes,
            "grads": self.buckets.buffer_bytes + (master.grad_nbytes if master else 0),
            "master_params": master.nbytes if master else 0,
            "optimizer_state": optimizer_state_bytes(self.optimizer),
            "comm_buffers": 0,
        }

    def close(self) -> None:
        """Removes the gradient hooks."""
        self.buckets.remove_hooks()

    # --- DeepSpeed's safe_get/set accessors (see partita.zero.accessors) ---------------------
    def owns(self, param: torch.Tensor) -> bool:
        """True for the parameters this strategy trains."""
        return any(param is p for p in self.params)

    def _stepped(self, param: torch.Tensor) -> torch.Tensor:
        if self.master is None:
            return param
        return self.master.by_model_param[param]  # type: ignore[index]

    def _state(self, param: torch.Tensor, what: str) -> torch.Tensor | None:
        stepped = self._stepped(param)
        if what == "param":
            return stepped.detach()
        if what == "grad":
            return param.grad
        return self.optimizer.state.get(stepped, {}).get(what)

    def full_state(self, param: torch.Tensor, what: str) -> torch.Tensor | None:
        """Parameter-shaped fp32 copy of the master value, gradient or optimizer state."""
        value = self._state(param, what)
        return None if value is None else value.detach().to(full_dtype(value)).clone()

    def local_state(self, param: torch.Tensor, what: str) -> torch.Tensor | None:
        """Stage 0 ranks hold everything: the full value, flattened."""
        value = self.full_state(param, what)
        if value is None or value.dim() == 0:
            return value
        return value.reshape(-1)

    shards_params = False
    """True when parameters themselves are sharded (stage 3)."""
    replicated = True
    """Every rank holds every parameter's whole state (checkpoints save it once)."""

    def owned_ranges(self, param: torch.Tensor) -> list[tuple[int, int]]:
        """(offset, length) ranges of the flattened parameter whose state this rank holds."""
        return [(0, param.numel())]

    def refresh_params(self) -> None:
        """Copies the masters into the module (after loading state into them)."""
        if self.master is not None:
            self.master.copy_to_model()

    def optimizer_state_keys(self) -> list[str]:
        """Names of the optimizer's per-parameter state entries."""
        return sorted({k for st in self.optimizer.state.values() for k in st})

    @torch.no_grad()
    def set_full_state(self, param: torch.Tensor, what: str, value: torch.Tensor) -> None:
        """Writes a master value (and the module weight), gradient or optimizer state (created
        if the optimizer has none yet)."""
        target = self._state(param, what)
        if target is None:
            if what in ("param", "grad"):
                raise ValueError(f"parameter has no {what!r} yet (run a backward first)")
            target = ensure_state(self.optimizer, self._stepped(param), what, value)
        target.copy_(value.view_as(target))
        if what == "param" and self.master is not None:
            param.copy_(value.view_as(param))

    def set_local_state(self, param: torch.Tensor, what: str, value: torch.Tensor) -> None:
        """Same as `set_full_state` (the local part is the whole parameter)."""
        self.set_full_state(param, what, value if value.dim() == 0 else value.reshape(param.shape))
