"""NVMe offload for ZeRO-3: optimizer state, gradients and parameter shards in swap files.

[Note: swapped sub-groups]
Each master tensor (one per unit and optimizer group) is a sub-group. Between steps its fp32
values and its element-wise optimizer state (Adam's moments) live only in this rank's swap
files; their host storage is resized to zero. A step walks the sub-groups in order. As in
DeepSpeed, ``offload_optimizer.pipeline_read`` has the read of sub-group k+1 in flight while k
is stepped, and ``pipeline_write`` lets k's write-back run while k+1 is stepped; without them
(the default) one sub-group is resident at a time. Each resident sub-group holds four state
tensors (master, gradient, two moments), which ``buffer_count`` must cover: 4 for one, 8 or 12
with pipelining (a smaller count drops pipelining with a warning; see `optimizer_pipeline`).
Reading a master outside a step (accessors, checkpoints) swaps it in first; it stays resident
until the next step writes it back.

[Note: swapped gradients]
A sub-group's fp32 gradient is either zero (after ``zero_grad``; nothing stored) or held in its
swap file. A finished reduce-scatter is added in write-through (`add_grad`: read or zero, add,
start the write): backward goes on while up to `GRAD_WRITES_IN_FLIGHT` writes run, each
keeping its gradient in memory until it is done, so backward holds at most that many plus one
sub-group gradients. A gradient whose write is still running is used from memory (the next
micro-batch's add, the step), after waiting for the write. The step needs the global norm
before any sub-group is stepped (the overflow and clipping decision), so each gradient's norm
is taken when it is stored, while it is in memory anyway (`grad_norms`); the step then reads
the gradients once, pipelined with the masters, for the update. A norm is used only without
loss scaling (the unscaled gradient is then the stored one); with a loss scale, or a gradient
stored without a norm, the step reads it twice as before. The arithmetic is the same as
without offload (unscale, norm per tensor, clip coefficient, fused update), so the
parameters come out bitwise equal.

[Note: swapped shards]
With ``offload_param`` on NVMe a unit's module-dtype shard lives in a swap file too
(`partita.offload.SwappedTensor`): read before the unit is gathered (the scheduler reads up to
``offload_param.buffer_count`` shards ahead in the recorded order), freed once the gather is
done (the file still holds it), and written back after the step changed it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from torch.profiler import record_function

from partita import comm
from partita.offload import SwapSpace, has_storage, release_storage, restore_storage
from partita.platform.accelerator import add_into
from partita.zero.shard_step import TensorParallelNorm, global_norm, tensor_norms
from partita.zero.stage3.unit import trace
from partita.zero.strategy import StepOutcome

logger = logging.getLogger("partita")

GRAD_WRITES_IN_FLIGHT = 2
"""Gradient writes backward leaves running ([Note: swapped gradients])."""

_STATES = 4
"""State tensors per resident sub-group: master, gradient and Adam's two moments (DeepSpeed's
rule for ``offload_optimizer.buffer_count``)."""


def optimizer_pipeline(block: Any) -> tuple[bool, bool]:
    """(read ahead, write behind) for the ``offload_optimizer`` section `block`: its
    ``pipeline_read``/``pipeline_write`` as far as ``buffer_count`` covers four state tensors
    per resident sub-group ([Note: swapped sub-groups]); what does not fit is dropped with a
    warning naming the keys. No block (no optimizer offload): neither."""
    if block is None:
        return False, False
    read, write = bool(block.pipeline_read), bool(block.pipeline_write)
    fits = int(block.buffer_count) // _STATES
    if 1 + read + write > fits:
        wanted = 1 + read + write
        kept_read = read and fits >= 2
        kept_write = write and fits >= 2 + kept_read
        logger.warning(
            "zero_optimization.offload_optimizer.buffer_count=%d holds %d sub-group(s) of %d "
            "state tensors; pipeline_read/pipeline_write need %d: running with "
            "pipeline_read=%s, pipeline_write=%s (raise buffer_count to %d)",
            block.buffer_count, max(fits, 1), _STATES, wanted, kept_read, kept_write,
            wanted * _STATES,
        )  # fmt: skip
        read, write = kept_read, kept_write
    return read, write


class SwappedOptimizerState:
    """Swaps masters, their gradients and optimizer state in and out of `space`. Masters are
    `add`-ed as their units are built (each unit's go out before the next unit is built, so
    set-up never holds more than one unit's masters); the optimizer is `bind`-ed after."""

    def __init__(self, space: SwapSpace, pipeline: tuple[bool, bool] = (False, False)) -> None:
        self.read_ahead, self.write_behind = pipeline
        self.optimizer: torch.optim.Optimizer | None = None
        self.masters: list[torch.nn.Parameter] = []
        self.space = space
        self.resident: list[bool] = []
        self.grad_zero: list[bool] = []
        self._writes: dict[int, list[Future[int]]] = {}
        self._grad_writes: dict[int, Future[int]] = {}
        self.grad_norms: dict[int, torch.Tensor] = {}
        """Sub-group -> 2-norm of the gradient its file holds (taken when it was stored)."""
        self._resident_count = 0
        self.peak_resident = 0
        """Most sub-groups resident at once during steps (instrumentation for tests)."""

    def add(self, masters: list[torch.nn.Parameter]) -> None:
        """Takes `masters` (with zero gradients) out to the swap files."""
        first = len(self.masters)
        for m in masters:
            i = len(self.masters)
            self.masters.append(m)
            self.resident.append(True)
            self._resident_count += 1
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
        with trace("nvme_write", f"sub_group.{i}"):
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
        self._resident_count -= 1

    def _fetch(self, i: int, grads: bool = True) -> list[Future[int]]:
        futures = []
        if not self.resident[i]:
            with trace("nvme_read", f"sub_group.{i}"):
                for name, t in self._tensors(i).items():
                    restore_storage(t)
                    futures.append(self.space.swap_in(f"{i}.{name}", t))
            self.resident[i] = True
            self._resident_count += 1
            self.peak_resident = max(self.peak_resident, self._resident_count)
        if grads:
            futures.extend(self._fetch_grad(i))
        return futures

    # --- gradients ([Note: swapped gradients]) --------------------------------------------------
    def _settle_grad(self, i: int) -> None:
        """Waits for a running write of sub-group i's gradient (which stays in memory)."""
        write = self._grad_writes.pop(i, None)
        if write is not None:
            write.result()  # raises the I/O error naming the file

    def _fetch_grad(self, i: int) -> list[Future[int]]:
        self._settle_grad(i)
        grad = self.masters[i].grad
        assert grad is not None
        if has_storage(grad):
            return []
        restore_storage(grad)
        if self.grad_zero[i]:
            grad.zero_()
            return []
        with trace("nvme_read", f"grad.{i}"):
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
        self._settle_grad(i)
        grad = self.masters[i].grad
        if grad is not None:
            release_storage(grad)

    def add_grad(self, i: int, value: torch.Tensor) -> None:
        """Adds `value` into sub-group i's gradient, written through to its file."""
        grad = self.ensure_grad(i)
        add_into(grad, value)
        self.store_grad(i)

    def store_grad(self, i: int) -> None:
        """Starts writing sub-group i's resident gradient to its file; its memory is freed when
        the write is done, waited for once more than `GRAD_WRITES_IN_FLIGHT` are running."""
        grad = self.masters[i].grad
        assert grad is not None
        self._settle_grad(i)  # writes of one file stay in order
        # The step's global norm needs every gradient before any update: taken now, it saves
        # reading the file back once per step (12 GB at 3B parameters).
        self.grad_norms[i] = torch._foreach_norm([grad], 2.0)[0]
        with trace("nvme_write", f"grad.{i}"):
            self._grad_writes[i] = self.space.swap_out(f"{i}.grad", grad)
        self.grad_zero[i] = False
        while len(self._grad_writes) > GRAD_WRITES_IN_FLIGHT:
            self.drop_grad(next(iter(self._grad_writes)))

    def zero_grads(self) -> None:
        """Every gradient becomes zero (no I/O: zero is a state, not file contents)."""
        for i in range(len(self.masters)):
            self.drop_grad(i)
            self.grad_zero[i] = True
        self.grad_norms.clear()

    def ensure_resident(self, i: int) -> None:
        """Swaps sub-group i's master and optimizer state in (blocking) if they are out."""
        for f in self._fetch(i, grads=False):
            f.result()

    # --- the step -------------------------------------------------------------------------------
    def _norms(
        self, loss_scale: float, tensor: TensorParallelNorm | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each sub-group's unscaled gradient norm (pipelined reads), as `sharded_step` takes
        them: the same kernel per tensor, so the global norm is bitwise the same. With
        `tensor`, the norms of the split and of the replicated elements, apart ([Note: norms
        over tensor ranks]); otherwise the second list is empty."""
        n = len(self.masters)
        norms: list[torch.Tensor] = []
        replicated: list[torch.Tensor] = []
        pending: list[Future[int]] = []
        for i in range(n):
            # A norm stored whole serves unless the sub-group holds replicated elements.
            whole = tensor is None or not tensor.runs.get(self.masters[i])
            if loss_scale == 1.0 and (self.grad_zero[i] or (whole and i in self.grad_norms)):
                # Zero or stored with its norm: the same value the read would give, no I/O.
                for f in pending:
                    f.result()
                pending = []
                norms.append(self._known_norm(i))
                continue
            for f in pending or self._fetch_grad(i):
                f.result()
            pending = self._fetch_grad(i + 1) if self.read_ahead and i + 1 < n else []
            grad = self.masters[i].grad
            assert grad is not None
            unscaled = grad if loss_scale == 1.0 else grad * (1.0 / loss_scale)
            if tensor is None:
                norms.append(torch._foreach_norm([unscaled], 2.0)[0])
            else:
                split, shared = tensor.cut(self.masters[i], unscaled)
                norms += tensor_norms(split)
                replicated += tensor_norms(shared)
            self.drop_grad(i)
        return norms, replicated

    def _known_norm(self, i: int) -> torch.Tensor:
        """Sub-group i's gradient norm without reading its file (zero, or taken when stored);
        a resident gradient is dropped as the reading path would."""
        norm = self.grad_norms.get(i)
        if norm is None:  # zero gradient: its norm is exactly zero
            grad = self.masters[i].grad
            assert grad is not None
            norm = torch.zeros((), dtype=grad.dtype, device=grad.device)
        self.drop_grad(i)
        return norm

    @record_function("partita::step")
    def step(
        self,
        step_one: Callable[[int], None],
        clip: float,
        loss_scale: float,
        group: comm.ProcessGroup | None,
        comm_device: torch.device,
        tensor: TensorParallelNorm | None = None,
    ) -> StepOutcome:
        """The sharded step (`partita.zero.shard_step.sharded_step`) over swapped sub-groups: global
        norm (also over the tensor ranks with `tensor`), overflow check, then `step_one(i)` per
        sub-group with it resident and its gradient unscaled and clipped, pipelining the I/O."""
        norms, replicated = self._norms(loss_scale, tensor)
        norm, norm_value = global_norm(norms, group, comm_device, tensor, replicated)
        if not math.isfinite(norm_value):
            return StepOutcome(applied=False, grad_norm=norm_value)
        n = len(self.masters)
        pending: list[Future[int]] = []
        for i in range(n):
            for f in pending or self._fetch(i):
                f.result()
            pending = self._fetch(i + 1) if self.read_ahead and i + 1 < n else []
            master = self.masters[i]
            assert master.grad is not None
            if loss_scale != 1.0:
                torch._foreach_mul_([master.grad], 1.0 / loss_scale)
            if clip > 0.0:
                torch.nn.utils.clip_grads_with_norm_([master], clip, norm.to(master.device))
            step_one(i)
            self._evict(i)
            if not self.write_behind:
                self._release(i)
            elif i >= 1 and (i - 1) in self._writes:
                self._release(i - 1)
        for i in list(self._writes):
            self._release(i)
        self.space.wait()
        return StepOutcome(applied=True, grad_norm=norm_value)
