"""The CPU Adam/AdamW step of offloaded optimizer state: torch's fused CPU kernel.

Measured on this project's 2-core CPU host (benchmarks/bench_offload.py; torch 2.13, flat fp32
tensors of 1M-50M elements): ``torch.optim.AdamW(fused=True)`` updates ~1e9 parameters/s at 10M+
elements, about 10x the foreach and per-tensor implementations, and DeepSpeed's
``DeepSpeedCPUAdam`` is compared in the same benchmark: with one division per element instead
of two it is 1.12-1.17x faster at 10M+ elements there. `cpu_adam_step` still calls torch's fused
kernel (directly, without torch.optim's per-call bookkeeping), because that keeps an offloaded
step bitwise equal to the in-memory ``torch.optim.AdamW(fused=True)`` step of the same run; an
own kernel would have to replace torch's in every CPU path to keep that.

Why a functional step and not an optimizer object: with sub-groups (``sub_group_size``) and NVMe,
the moments of tile k live in swap buffers only while tile k is being updated; the caller owns
them and the step count, and hands them in per call. The kernel is elementwise, so updating a
flat tensor tile by tile gives bitwise the same result as updating it whole (tested).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

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
    """A ``torch.optim`` Adam/AdamW on the fused CPU kernel, for state that stays in CPU memory
    as ordinary tensors (CPU offload of stages 1-2). Same arithmetic as `cpu_adam_step`."""
    cls = torch.optim.AdamW if hyper.decoupled else torch.optim.Adam
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
