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

__all__ = ["CPUAdam", "CPUAdamW", "torch_base", "torch_class_name"]


class _KernelStep:
    """The `step` shared by `CPUAdam` and `CPUAdamW` (mixed in before the torch class)."""

    param_groups: list[dict[str, Any]]
    state: Any

    def _kernel_applies(self) -> bool:
        scaler_set = (getattr(self, name, None) is not None for name in ("grad_scale", "found_inf"))
        if any(scaler_set):
            return False
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or group["capturable"]:
                return False
            if group["differentiable"] or torch.is_tensor(group["lr"]):
                return False
            tensors = [t for p in group["params"] if p.grad is not None for t in (p, p.grad)]
            if any(t.is_sparse for t in tensors) or not adam_kernel.supports(tensors):
                return False
        return adam_kernel.available()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter with a gradient (see the module docstring)."""
        if not self._kernel_applies():
            return super().step(closure)  # type: ignore[misc]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            exp_avgs: list[torch.Tensor] = []
            exp_avg_sqs: list[torch.Tensor] = []
            steps: list[torch.Tensor] = []
            # torch's own state initialisation, so the state is exactly torch's.
            self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, [], steps)  # type: ignore[attr-defined]
            if not params:
                continue
            torch._foreach_add_(steps, 1)
            # Parameters restored from different checkpoints may be at different steps.
            by_step: dict[float, list[int]] = {}
            for i, s in enumerate(steps):
                by_step.setdefault(float(s), []).append(i)
            beta1, beta2 = group["betas"]
            for step, idx in by_step.items():
                args = adam_kernel.AdamArgs(
                    step=step, lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                    eps=group["eps"], weight_decay=group["weight_decay"],
                    decoupled=bool(group.get("decoupled_weight_decay", False)),
                )  # fmt: skip
                adam_kernel.adam_step(
                    [params[i] for i in idx],
                    [grads[i] for i in idx],
                    [exp_avgs[i] for i in idx],
                    [exp_avg_sqs[i] for i in idx],
                    args,
                )
        return loss


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
