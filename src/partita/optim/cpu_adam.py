"""``torch.optim.Adam``/``AdamW`` (fused) whose step on fp32 CPU tensors runs partita's kernel.

`CPUAdam` and `CPUAdamW` are the torch classes with ``fused=True``: same constructor, same
param groups, same state (``step``, ``exp_avg``, ``exp_avg_sq``) and state dicts, loadable
into each other. Their `step` hands fp32 CPU tensors to `partita.optim.adam_kernel.adam_step`,
which computes bitwise what torch's fused kernel computes (checked when the kernel loads);
anything else (amsgrad, maximize, a gradient scaler's ``grad_scale``/``found_inf``, other
dtypes or devices, the kernel unavailable) takes torch's own fused step. `build_optimizer`
uses them for Adam/AdamW when every parameter is an fp32 CPU tensor: the masters of CPU
offload, and CPU training.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from partita.optim import adam_kernel
from partita.optim.adam_kernel import plain_fp32

__all__ = ["CPUAdam", "CPUAdamW", "Slice", "SliceSink", "torch_base", "torch_class_name"]


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

    def _collect(self) -> list[_Work] | None:
        """Per group: (group, params with a gradient, their gradients, their states, created
        as torch creates them), or None when the kernel does not apply to every one."""
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
                if grad is None:
                    continue
                if not plain_fp32(p) or not plain_fp32(grad):
                    return None
                state = self.state[p]
                if not state:  # what torch's fused path creates
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif not _step_counter(state["step"]):
                    return None
                params.append(p)
                grads.append(grad)
                states.append(state)
            if params:
                work.append((group, params, grads, states))
        return work

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter with a gradient (see the module docstring)."""
        work = self._collect()
        if work is None:
            return super().step(closure)  # type: ignore[misc]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, params, grads, states in work:
            args = _kernel_args(group, 0.0)
            # The kernel adds one to each step counter and uses its value (parameters restored
            # from different checkpoints may be at different steps).
            adam_kernel.adam_step(
                params,
                grads,
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                args,
                [s["step"] for s in states],
            )
        return loss

    @torch.no_grad()
    def step_slices(self, plan: Sequence[Sequence[Slice]], sink: SliceSink) -> bool:
        """The same update as `step`, sub-group by sub-group: the slices of ``plan[k]`` are
        stepped (their updated values written to ``sink.outs(k)`` in the same pass), then
        ``sink.done(k)`` runs, so the caller can move sub-group k on while k+1 is stepped.
        The slices must cover every parameter with a gradient exactly once (the update is
        elementwise, so the result is bitwise `step`'s). Returns False without doing anything
        when the kernel does not apply (see `step`); the caller then steps and copies itself."""
        work = self._collect()
        if work is None:
            return False
        where = {id(p): (g, s) for g, ps, _, ss in work for p, s in zip(ps, ss, strict=True)}
        covered = dict.fromkeys(where, 0)
        for sl in (sl for slices in plan for sl in slices if id(sl.param) in where):
            covered[id(sl.param)] += sl.stop - sl.start
        if any(covered[i] != p.numel() for _, ps, _, _ in work for p in ps if (i := id(p))):
            raise ValueError("step_slices: the slices must cover each stepped parameter once")
        for _, state in where.values():
            state["step"] += 1  # once per update, whatever the number of slices
        for k, slices in enumerate(plan):
            outs = sink.outs(k)
            batches: dict[tuple[int, float], _Batch] = {}
            for sl, out in zip(slices, outs, strict=True):
                found = where.get(id(sl.param))
                if found is None:  # no gradient: unchanged, still copied
                    if out is not None:
                        out.copy_(sl.param.detach().view(-1)[sl.start : sl.stop])
                    continue
                group, state = found
                key = (id(group), float(state["step"]))
                batches.setdefault(key, _Batch(group, key[1])).add(sl, state, out)
            for batch in batches.values():
                batch.run()
            sink.done(k)
        return True


class _Batch:
    """Slices of one parameter group at one step, stepped in one kernel call."""

    def __init__(self, group: dict[str, Any], step: float) -> None:
        self.args = _kernel_args(group, step)
        # params, grads, exp_avgs, exp_avg_sqs
        self.tensors: tuple[
            list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]
        ] = ([], [], [], [])
        self.outs: list[torch.Tensor | None] = []
        self.tails: list[int] = []
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, sl: Slice, state: dict[str, Any], out: torch.Tensor | None) -> None:
        """Adds ``sl`` of a parameter whose state is ``state``; ``out`` receives its values."""
        span = slice(sl.start, sl.stop)
        p, grad = sl.param.detach().view(-1), sl.param.grad
        assert grad is not None
        sources = (p, grad.view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1))
        for dst, t in zip(self.tensors, sources, strict=True):
            dst.append(t[span])
        # The kernel writes host tensors of its types; anything else is copied after it.
        direct = out is not None and out.device.type == "cpu" and out.is_contiguous()
        direct = direct and out.dtype in adam_kernel.OUT_DTYPES  # type: ignore[union-attr]
        self.outs.append(out if direct else None)
        if out is not None and not direct:
            self.copies.append((out, p[span]))
        # Where torch's scalar tail of the whole parameter falls in this slice.
        self.tails.append(adam_kernel.vector_body(p.numel()) - sl.start)

    def run(self) -> None:
        """One kernel call for every slice added, then the copies the kernel could not make."""
        p, g, m, v = self.tensors
        adam_kernel.adam_step(p, g, m, v, self.args, outs=self.outs, tails=self.tails)
        for out, src in self.copies:
            out.copy_(src)


def _kernel_args(group: dict[str, Any], step: float) -> adam_kernel.AdamArgs:
    """The kernel's arguments for one parameter group (``step``: see `AdamArgs`)."""
    beta1, beta2 = group["betas"]
    return adam_kernel.AdamArgs(
        step=step, lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
        eps=group["eps"], weight_decay=group["weight_decay"],
        decoupled=bool(group.get("decoupled_weight_decay", False)),
    )  # fmt: skip


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
