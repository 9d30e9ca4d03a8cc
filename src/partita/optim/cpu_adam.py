"""``torch.optim.Adam``/``AdamW`` (fused) whose step on fp32 CPU tensors runs partita's kernel.

`CPUAdam` and `CPUAdamW` are the torch classes with ``fused=True``: same constructor, same
param groups, same state (``step``, ``exp_avg``, ``exp_avg_sq``) and state dicts, loadable
into each other. Their `step` hands fp32 CPU tensors to `partita.optim.adam_kernel.adam_step`,
which computes bitwise what torch's fused kernel computes (checked when the kernel loads);
anything else (amsgrad, maximize, a gradient scaler's ``grad_scale``/``found_inf``, other
dtypes or devices, the kernel unavailable) takes torch's own fused step. `build_optimizer`
uses them for Adam/AdamW when every parameter is an fp32 CPU tensor: the masters of CPU
offload, and CPU training.

`step_slices` is the step the ZeRO stages run on host masters: the same update, in slices
(sub-groups), each slice's updated values also written to the module's weights (bf16, fp16 or
fp32) by the kernel in the same pass, and handed to a `SliceSink` (`partita.offload.CopyBack`)
that moves them to the device while the next slice steps.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from partita.optim import adam_kernel
from partita.optim.adam_kernel import plain_fp32

__all__ = [
    "CPUAdam",
    "CPUAdamW",
    "Slice",
    "SliceSink",
    "copy_after_step",
    "torch_base",
    "torch_class_name",
]


@dataclass(frozen=True)
class Slice:
    """Elements ``[start, stop)`` of one (flattened) parameter the optimizer steps."""

    param: torch.Tensor
    start: int
    stop: int


class SliceSink(Protocol):
    """Where `CPUAdamW.step_slices` also writes each sub-group's updated parameters."""

    def outs(self, k: int) -> Sequence[torch.Tensor | None]:
        """One tensor per slice of sub-group ``k`` (its size; None: no copy) to receive the
        updated values, converted to its dtype. Called just before the sub-group is stepped
        (it may wait for a buffer to be free)."""
        ...

    def done(self, k: int) -> None:
        """Sub-group ``k`` is updated and written to its `outs` (start moving them on)."""
        ...


_Work = tuple[dict[str, Any], list[torch.Tensor], list[torch.Tensor], list[dict[str, Any]]]


class _KernelStep:
    """The `step` shared by `CPUAdam` and `CPUAdamW` (mixed in before the torch class)."""

    param_groups: list[dict[str, Any]]
    state: Any

    def _collect(self, only: set[int] | None = None) -> list[_Work] | None:
        """Per group: (group, params with a gradient, their gradients, their states, created
        as torch creates them), or None when the kernel does not apply to every one. With
        ``only`` (ids of parameters), the others are left out (and not looked at)."""
        if (
            getattr(self, "grad_scale", None) is not None
            or getattr(self, "found_inf", None) is not None
        ):
            return None
        if not adam_kernel.available():
            return None
        work: list[_Work] = []
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or group["capturable"]:
                return None
            if group["differentiable"] or torch.is_tensor(group["lr"]):
                return None
            params, grads, states = [], [], []
            for p in group["params"]:
                grad = p.grad
                if grad is None or (only is not None and id(p) not in only):
                    continue
                if not plain_fp32(p) or not plain_fp32(grad) or grad.numel() != p.numel():
                    return None
                state = self.state[p]
                if not state:  # what torch's fused path creates
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif not _step_counter(state["step"]) or not _moments(state, p.numel()):
                    return None
                params.append(p)
                grads.append(grad)
                states.append(state)
            if params:
                work.append((group, params, grads, states))
        return work

    _slices: tuple[Sequence[Sequence[Slice]], SliceSink, list[_Work] | None] | None = None
    """The plan and sink of a `step_slices` or `step_planned` call in progress, and (for the
    latter) the work `_collect` found for the planned parameters."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter with a gradient (see the module docstring)."""
        pending, self._slices = self._slices, None
        work = self._collect() if pending is None or pending[2] is None else pending[2]
        if work is None:
            loss = self._torch_step(closure)
            if pending is not None:
                copy_after_step(pending[0], pending[1])
            return loss
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if pending is not None:
            self._step_slices(work, pending[0], pending[1])
            return loss
        for group, params, grads, states in work:
            # The kernel adds one to each step counter and uses its value (parameters restored
            # from different checkpoints may be at different steps).
            rows = adam_kernel.Rows(_kernel_args(group, 0.0))
            for p, grad, state in zip(params, grads, states, strict=True):
                rows.add(p, grad, state["exp_avg"], state["exp_avg_sq"], counter=state["step"])
            rows.run()
        return loss

    def _torch_step(self, closure: Callable[[], Any] | None) -> Any:
        """torch's own step. Without the hook wrapper torch.optim puts around every class's
        ``step`` once an instance exists: this ``step`` is wrapped already, and its hooks have
        run (they would run twice)."""
        step = torch_base(type(self)).step  # type: ignore[attr-defined]
        if getattr(step, "hooked", False):  # torch.optim marks the wrappers it installs
            step = step.__wrapped__
        return step(self, closure)

    def step_slices(self, plan: Sequence[Sequence[Slice]], sink: SliceSink) -> None:
        """The same update as `step`, sub-group by sub-group: the slices of ``plan[k]`` are
        stepped (their updated values written to ``sink.outs(k)`` in the same pass), then
        ``sink.done(k)`` runs, so the caller can move sub-group k on while k+1 is stepped.
        The slices must cover every parameter with a gradient exactly once (the update is
        elementwise, so the result is bitwise `step`'s). It runs inside `step` (so step hooks
        and profiler ranges behave as for `step`); where the kernel does not apply, torch's
        step runs and `copy_after_step` writes the sink."""
        self._slices = (plan, sink, None)
        try:
            self.step()
        finally:
            self._slices = None

    def step_planned(self, plan: Sequence[Sequence[Slice]], sink: SliceSink) -> bool:
        """`step_slices` for the parameters in ``plan`` only (whole ones); the others are not
        touched, gradients or not (NVMe offload steps one resident sub-group at a time). Returns
        False, doing nothing, where the kernel does not apply to them."""
        work = self._collect({id(sl.param) for slices in plan for sl in slices})
        if work is None:
            return False
        self._slices = (plan, sink, work)
        try:
            self.step()
        finally:
            self._slices = None
        return True

    def _step_slices(
        self, work: list[_Work], plan: Sequence[Sequence[Slice]], sink: SliceSink
    ) -> None:
        where = {
            id(p): (g, grad, s)
            for g, ps, grads, ss in work
            for p, grad, s in zip(ps, grads, ss, strict=True)
        }
        covered = dict.fromkeys(where, 0)
        for sl in (sl for slices in plan for sl in slices if id(sl.param) in where):
            covered[id(sl.param)] += sl.stop - sl.start
        if any(covered[i] != p.numel() for _, ps, _, _ in work for p in ps if (i := id(p))):
            raise ValueError("step_slices: the slices must cover each stepped parameter once")
        steps = {i: _bump(state["step"]) for i, (_, _, state) in where.items()}  # once per update
        for k, slices in enumerate(plan):
            outs = sink.outs(k)
            batches: dict[tuple[int, float], adam_kernel.Rows] = {}
            for sl, out in zip(slices, outs, strict=True):
                found = where.get(id(sl.param))
                if found is None:  # no gradient: unchanged, still copied
                    if out is not None:
                        out.copy_(sl.param.detach().view(-1)[sl.start : sl.stop])
                    continue
                group, grad, state = found
                key = (id(group), steps[id(sl.param)])
                rows = batches.get(key)
                if rows is None:
                    rows = batches[key] = adam_kernel.Rows(_kernel_args(group, key[1]))
                m, v = state["exp_avg"], state["exp_avg_sq"]
                rows.add(sl.param, grad, m, v, sl.start, sl.stop, out=out)
            for batch in batches.values():
                batch.run()
            sink.done(k)


@torch.no_grad()
def copy_after_step(plan: Sequence[Sequence[Slice]], sink: SliceSink) -> None:
    """Writes every slice of ``plan`` (already stepped) to ``sink``, sub-group by sub-group:
    what `CPUAdamW.step_slices` does in its step, for any other optimizer."""
    for k, slices in enumerate(plan):
        for sl, out in zip(slices, sink.outs(k), strict=True):
            if out is not None:
                out.copy_(sl.param.detach().view(-1)[sl.start : sl.stop])
        sink.done(k)


def _bump(counter: torch.Tensor) -> float:
    """Adds one to a float32 0-dim CPU step counter in place and returns the new value
    (through its address: a tensor op costs microseconds per parameter per step; the float32
    rounding of the sum is that of torch's add)."""
    cell = ctypes.c_float.from_address(counter.data_ptr())
    cell.value += 1.0
    return float(cell.value)


def _kernel_args(group: dict[str, Any], step: float) -> adam_kernel.AdamArgs:
    """The kernel's arguments for one parameter group (``step``: see `AdamArgs`)."""
    beta1, beta2 = group["betas"]
    return adam_kernel.AdamArgs(
        step=step, lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
        eps=group["eps"], weight_decay=group["weight_decay"],
        decoupled=bool(group.get("decoupled_weight_decay", False)),
    )  # fmt: skip


def _moments(state: dict[str, Any], numel: int) -> bool:
    """Whether the moments are tensors the kernel takes, as large as their parameter."""
    return all(
        torch.is_tensor(t := state.get(key)) and plain_fp32(t) and t.numel() == numel
        for key in ("exp_avg", "exp_avg_sq")
    )


def _step_counter(step: Any) -> bool:
    """Whether ``step`` is the float32 CPU scalar the kernel increments in place."""
    return torch.is_tensor(step) and step.dim() == 0 and plain_fp32(step)


class CPUAdam(_KernelStep, torch.optim.Adam):
    """``torch.optim.Adam(fused=True)`` with partita's CPU kernel (see the module docstring)."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        kwargs.setdefault("fused", True)
        super().__init__(params, **kwargs)


class CPUAdamW(_KernelStep, torch.optim.AdamW):
    """``torch.optim.AdamW(fused=True)`` with partita's CPU kernel (see the module docstring)."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        kwargs.setdefault("fused", True)
        super().__init__(params, **kwargs)


def torch_class_name(optimizer: torch.optim.Optimizer) -> str:
    """The name of the torch class whose state ``optimizer`` keeps (``AdamW`` for `CPUAdamW`):
    what checkpoints record, so they load whichever of the two computes the step."""
    return torch_base(type(optimizer)).__name__


def torch_base(cls: type) -> type:
    """The ``torch.optim`` class ``cls`` is or extends (``cls`` itself when none)."""
    return next((c for c in cls.__mro__ if c.__module__.startswith("torch.optim")), cls)
