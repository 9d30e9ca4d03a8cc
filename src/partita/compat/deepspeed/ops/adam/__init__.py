"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam`` and ``FusedAdam`` as torch optimizers.

Accelerate swaps a user's torch AdamW for ``DeepSpeedCPUAdam(param_groups, lr=,
weight_decay=, adamw_mode=)`` when the optimizer is offloaded. partita's CPU Adam is torch's
Adam/AdamW class stepping with partita's kernel (`partita.optim.CPUAdamW`), so these construct it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from partita.compat.deepspeed._missing import module_getattr
from partita.optim.cpu_adam import CPUAdam, CPUAdamW


def _adam(
    params: Iterable[Any],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    amsgrad: bool,
    cpu: bool,
) -> torch.optim.Optimizer:
    if amsgrad:
        raise ValueError("DeepSpeed's Adam classes do not support amsgrad (neither does partita)")
    beta1, beta2 = betas
    cls: type[torch.optim.Optimizer]
    if cpu:
        cls = CPUAdamW if adamw_mode else CPUAdam
    else:
        cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    return cls(params, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)


class DeepSpeedCPUAdam:
    """``DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
    adamw_mode, fp32_optimizer_states)``: returns partita's `CPUAdamW` (or `CPUAdam` with
    ``adamw_mode=False``), a torch optimizer."""

    def __new__(  # type: ignore[misc]
        cls,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> torch.optim.Optimizer:
        if not bias_correction or not fp32_optimizer_states:
            raise ValueError(
                "DeepSpeedCPUAdam(bias_correction=False / fp32_optimizer_states=False) is not "
                "supported by partita"
            )
        return _adam(model_params, lr, betas, eps, weight_decay, adamw_mode, amsgrad, cpu=True)


class FusedAdam:
    """``FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay,
    amsgrad)``: torch's AdamW (or Adam with ``adam_w_mode=False``)."""

    def __new__(  # type: ignore[misc]
        cls,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> torch.optim.Optimizer:
        del set_grad_none
        if not bias_correction:
            raise ValueError("FusedAdam(bias_correction=False) is not supported by partita")
        return _adam(params, lr, betas, eps, weight_decay, adam_w_mode, amsgrad, cpu=False)


__getattr__ = module_getattr("deepspeed.ops.adam")

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
