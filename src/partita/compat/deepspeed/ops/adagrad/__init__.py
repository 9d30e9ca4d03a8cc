"""``deepspeed.ops.adagrad``: ``DeepSpeedCPUAdagrad`` is torch's Adagrad."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from partita.compat.deepspeed._missing import module_getattr


class DeepSpeedCPUAdagrad:
    """``DeepSpeedCPUAdagrad(model_params, lr, eps, weight_decay, amsgrad,
    fp32_optimizer_states)``: returns ``torch.optim.Adagrad``."""

    def __new__(  # type: ignore[misc]
        cls,
        model_params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ) -> torch.optim.Optimizer:
        del amsgrad, fp32_optimizer_states
        return torch.optim.Adagrad(model_params, lr=lr, eps=eps, weight_decay=weight_decay)


__getattr__ = module_getattr("deepspeed.ops.adagrad")

__all__ = ["DeepSpeedCPUAdagrad"]
