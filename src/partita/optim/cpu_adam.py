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

from collections.abc import Callable
from typing import Any

import torch

from partita.optim import adam_kernel
from partita.optim.adam_kernel import plain_fp32

__all__ = ["CPUAdam", "CPUAdamW", "torch_base", "torch_class_name"]


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
            beta1, beta2 = group["betas"]
            args = adam_kernel.AdamArgs(
                step=0.0, lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                eps=group["eps"], weight_decay=group["weight_decay"],
                decoupled=bool(group.get("decoupled_weight_decay", False)),
            )  # fmt: skip
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
