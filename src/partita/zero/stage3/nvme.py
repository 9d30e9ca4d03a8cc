"""NVMe offload for ZeRO-3: optimizer state, gradients and parameter shards in swap files.

[Note: swapped sub-groups]
Each master tensor (one per unit and optimizer group) is a sub-group. Between steps its fp32
values and its element-wise optimizer state (Adam's moments) live only in this rank's swap
files; their host storage is resized to zero. A step walks the sub-groups in order: the read of
sub-group k+1 is in flight while k is stepped, and k's write-back is started before moving on, so
at most three sub-groups are resident. Reading a master outside a step (accessors, checkpoints)
swaps it in first; it stays resident until the next step writes it back.

[Note: swapped gradients]
A sub-group's fp32 gradient is either zero (after ``zero_grad``; nothing stored) or held in its
swap file. A finished reduce-scatter is added in write-through (`add_grad`: read or zero, add,
write, free), so backward never keeps more than one sub-group's gradient in memory. The step
reads the gradients twice: once for the global norm (the overflow and clipping decision needs
every sub-group before any is stepped), once, pipelined with the masters, for the update. The
arithmetic is the same as without offload (unscale, norm per tensor, clip coefficient, fused
update), so the parameters come out bitwise equal.

[Note: swapped shards]
With ``offload_param`` on NVMe a unit's module-dtype shard lives in a swap file too
(`partita.offload.SwappedTensor`): read before the unit is gathered (started ahead of time by the scheduler's
prefetch), freed once the gather is done (the file still holds it), and written back after the
step changed it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future

import torch

from partita import comm
from partita.offload import SwapSpace, has_storage, release_storage, restore_storage
from partita.zero.shard_step import global_norm
from partita.zero.strategy import StepOutcome


class SwappedOptimizerState:
    """Swaps masters, their gradients and optimizer state in and out of `space`. Masters are
    `add`-ed as their units are built (each unit's go out before the next unit is built, so
    set-up never holds more than one unit's masters); the optimizer is `bind`-ed after."""

    def __init__(self, space: SwapSpace) -> None:
        self.optimizer: torch.optim.Optimizer | None = None
        self.masters: list[torch.nn.Parameter] = []
        self.space = space
        self.resident: list[bool] = []
        self.grad_zero: list[bool] = []
        self._writes: dict[int, list[Future[int]]] = {}

    def add(self, masters: list[torch.nn.Parameter]) -> None:
        """Takes `masters` (with zero gradients) out to the swap files."""
        first = len(self.masters)
        for m in masters:
            i = len(self.masters)
            self.masters.append(m)
            self.resident.append(True)
            self.grad_zero.append(True)
            assert m.grad is not None
            self.space.register(f"{i}.grad", m.numel(), m.grad.dtype)
            release_storage(m.grad)
            self._evict(i)
        self.space.wait()
        for i in range(first, len(self.masters)):
            self._release(i)

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer stepping the masters (its state is swapped with them)."""
        self.optimizer = optimizer

    def _tensors(self, i: int) -> dict[str, torch.Tensor]:
        m = self.masters[i]
        out = {"param": m.data}
        state = {} if self.optimizer is None else self.optimizer.state.get(m, {})
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.numel() == m.numel() and value.dim() > 0:
                out[key] = value
        return out

    def _evict(self, i: int) -> None:
        """Starts writing sub-group i out (its memory is released by `_release`)."""
        futures = []
        for name, t in self._tensors(i).items():
            key = f"{i}.{name}"
            if key not in self.space.slots:
                self.space.register(key, t.numel(), t.dtype)
            futures.append(self.space.swap_out(key, t))
        self._writes[i] = futures

    def _release(self, i: int) -> None:
        for f in self._writes.pop(i, []):
            f.result()  # raises the I/O error naming the file
        for t in self._tensors(i).values():
            release_storage(t)
        self.drop_grad(i)
        self.resident[i] = False

    def _fetch(self, i: int, grads: bool = True) -> list[Future[int]]:
        futures = []
        if not self.resident[i]:
            for name, t in self._tensors(i).items():
                restore_storage(t)
                futures.append(self.space.swap_in(f"{i}.{name}", t))
            self.resident[i] = True
        if grads:
            futures.extend(self._fetch_grad(i))
        return futures

    # --- gradients ([Note: swapped gradients]) --------------------------------------------------
    def _fetch_grad(self, i: int) -> list[Future[int]]:
        grad = self.masters[i].grad
        assert grad is not None
        if has_storage(grad):
            return []
        restore_storage(grad)
        if self.grad_zero[i]:
            grad.zero_()
            return []
        return [self.space.swap_in(f"{i}.grad", grad)]

    def ensure_grad(self, i: int) -> torch.Tensor:
        """Sub-group i's gradient, read in (blocking); freed again by `drop_grad`."""
        for f in self._fetch_grad(i):
            f.result()
        grad = self.masters[i].grad
        assert grad is not None
        return grad

    def drop_grad(self, i: int) -> None:
        """Frees sub-group i's gradient memory (the file, or zero, still holds its value)."""
        grad = self.masters[i].grad
        if grad is not None:
            release_storage(grad)

    def add_grad(self, i: int, value: torch.Tensor) -> None:
        """Adds `value` into sub-group i's gradient, written through to its file."""
        grad = self.ensure_grad(i)
        grad.add_(value.to(grad.device, non_blocking=True))
        self.store_grad(i)

    def store_grad(self, i: int) -> None:
        """Writes sub-group i's resident gradient to its file and frees it."""
        grad = self.masters[i].grad
        assert grad is not None
        self.space.swap_out(f"{i}.grad", grad).result()
        self.grad_zero[i] = False
        self.drop_grad(i)

    def zero_grads(self) -> None:
        """Every gradient becomes zero (no I/O: zero is a state, not file contents)."""
        for i in range(len(self.masters)):
            self.drop_grad(i)
            self.grad_zero[i] = True

    def ensure_resident(self, i: int) -> None:
        """Swaps sub-group i's master and optimizer state in (blocking) if they are out."""
        for f in self._fetch(i, grads=False):
            f.result()

    # --- the step -------------------------------------------------------------------------------
    def _norms(self, loss_scale: float) -> list[torch.Tensor]:
        """Each sub-group's unscaled gradient norm (pipelined reads), as `sharded_step` takes
        them: the same kernel per tensor, so the global norm is bitwise the same."""
        n = len(self.masters)
        norms = []
        pending = self._fetch_grad(0) if n else []
        for i in range(n):
            for f in pending:
                f.result()
            pending = self._fetch_grad(i + 1) if i + 1 < n else []
            grad = self.masters[i].grad
            assert grad is not None
            unscaled = grad if loss_scale == 1.0 else grad * (1.0 / loss_scale)
            norms.append(torch._foreach_norm([unscaled], 2.0)[0])
            self.drop_grad(i)
        return norms

    def step(
        self,
        step_one: Callable[[int], None],
        clip: float,
        loss_scale: float,
        group: comm.ProcessGroup | None,
        comm_device: torch.device,
    ) -> StepOutcome:
        """The sharded step (`partita.zero.shard_step.sharded_step`) over swapped sub-groups: global
        norm, overflow check, then `step_one(i)` per sub-group with it resident and its
        gradient unscaled and clipped, pipelining the I/O."""
        norm, norm_value = global_norm(self._norms(loss_scale), group, comm_device)
        if not math.isfinite(norm_value):
            return StepOutcome(applied=False, grad_norm=norm_value)
        n = len(self.masters)
        pending = self._fetch(0) if n else []
        for i in range(n):
            for f in pending:
                f.result()
            pending = self._fetch(i + 1) if i + 1 < n else []
            master = self.masters[i]
            assert master.grad is not None
            if loss_scale != 1.0:
                torch._foreach_mul_([master.grad], 1.0 / loss_scale)
            if clip > 0.0:
                torch.nn.utils.clip_grads_with_norm_([master], clip, norm.to(master.device))
            step_one(i)
            self._evict(i)
            if i >= 1 and (i - 1) in self._writes:
                self._release(i - 1)
        for i in list(self._writes):
            self._release(i)
        self.space.wait()
        return StepOutcome(applied=True, grad_norm=norm_value)
