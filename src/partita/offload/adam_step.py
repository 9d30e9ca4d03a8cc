"""The CPU Adam/AdamW step of offloaded optimizer state.

`cpu_adam_step` runs partita's CPU kernel (`partita.optim.adam_kernel`: bitwise the update of
torch's fused kernel, with one division per element instead of two) on fp32 tensors, and
torch's fused kernel itself otherwise (other dtypes, amsgrad, maximize, a gradient scale, or
the kernel unavailable: see ``adam_kernel.why_not()``). Either way an offloaded step is
bitwise equal to the in-memory ``torch.optim.AdamW(fused=True)`` step of the same run.
`make_cpu_adam` returns the optimizer object the engine builds for fp32 CPU masters
(`partita.optim.CPUAdamW`/`CPUAdam`). Throughput against torch's and DeepSpeed's CPU Adam:
benchmarks/bench_offload.py.

Why a functional step and not an optimizer object: with sub-groups (``sub_group_size``) and NVMe,
the moments of tile k live in swap buffers only while tile k is being updated; the caller owns
them and the step count, and hands them in per call. The update is elementwise, so updating a
flat tensor in tiles cut at multiples of 16 elements gives bitwise the same result as updating
it whole (tested). Other cuts move elements into torch's scalar tail loop, whose rounding can
differ in the last bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from partita.optim import adam_kernel
from partita.optim.cpu_adam import CPUAdam, CPUAdamW

__all__ = ["AdamHyper", "cpu_adam_step", "make_cpu_adam"]


@dataclass(frozen=True)
class AdamHyper:
    """Hyper-parameters of one Adam/AdamW update.

    ``decoupled`` selects AdamW (weight decay applied to the parameter, scaled by lr) over Adam
    (weight decay added to the gradient); the rest mean what they mean in ``torch.optim.Adam``.
    """

    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = True
    amsgrad: bool = False
    maximize: bool = False


def cpu_adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    step: int,
    hyper: AdamHyper,
    *,
    max_exp_avg_sqs: Sequence[torch.Tensor] | None = None,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """Apply update number ``step`` (1-based) to ``params`` in place, on the CPU.

    All tensors are CPU floating-point tensors; ``grads``/``exp_avgs``/``exp_avg_sqs`` (and
    ``max_exp_avg_sqs`` with amsgrad) match ``params`` one to one in shape and dtype. The moments
    are updated in place. ``grad_scale`` (a 0-dim float tensor) divides the gradients inside
    the kernel; with ``found_inf`` (0-dim float, nonzero = overflow) the update is skipped, and
    the caller should not advance its step count.
    """
    if step < 1:
        raise ValueError(f"step is the 1-based number of this update, got {step}")
    if hyper.amsgrad and max_exp_avg_sqs is None:
        raise ValueError("amsgrad needs max_exp_avg_sqs")
    for tensor in params:
        if tensor.device.type != "cpu":
            raise ValueError(f"cpu_adam_step needs CPU tensors, got one on {tensor.device}")
    plain = not (hyper.amsgrad or hyper.maximize) and grad_scale is None and found_inf is None
    tensors = [*params, *grads, *exp_avgs, *exp_avg_sqs]
    if plain and adam_kernel.supports(tensors) and adam_kernel.available():
        args = adam_kernel.AdamArgs(
            step=float(step), lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2,
            eps=hyper.eps, weight_decay=hyper.weight_decay, decoupled=hyper.decoupled,
        )  # fmt: skip
        adam_kernel.adam_step(params, grads, exp_avgs, exp_avg_sqs, args)
        return
    # torch's fused kernel itself, without torch.optim's functional wrapper: that wrapper
    # groups the lists by device and dtype and increments a step tensor per parameter, about
    # 0.1 ms per call, a fifth of the kernel's time on 1M elements. The kernel reads the
    # (1-based) step from a float tensor; one tensor serves every parameter. A nonzero
    # found_inf makes the kernel leave everything untouched.
    step_tensor = torch.tensor(float(step))
    kernel = torch._fused_adamw_ if hyper.decoupled else torch._fused_adam_
    kernel(
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        list(max_exp_avg_sqs or []),
        [step_tensor] * len(params),
        lr=hyper.lr,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        weight_decay=hyper.weight_decay,
        eps=hyper.eps,
        amsgrad=hyper.amsgrad,
        maximize=hyper.maximize,
        grad_scale=grad_scale,
        found_inf=found_inf,
    )


def make_cpu_adam(params: Iterable[torch.Tensor], hyper: AdamHyper) -> torch.optim.Optimizer:
    """A fused ``torch.optim`` Adam/AdamW stepping with partita's CPU kernel (`CPUAdamW` or
    `CPUAdam`), for state that stays in CPU memory as ordinary tensors. Same arithmetic as
    `cpu_adam_step`."""
    cls = CPUAdamW if hyper.decoupled else CPUAdam
    return cls(
        params,
        lr=hyper.lr,
        betas=(hyper.beta1, hyper.beta2),
        eps=hyper.eps,
        weight_decay=hyper.weight_decay,
        amsgrad=hyper.amsgrad,
        maximize=hyper.maximize,
        fused=True,
    )
