"""DeepSpeed's ``safe_get_full_*`` / ``safe_set_*`` accessors for master weights, gradients and
optimizer state, whatever the ZeRO stage.

"Full" functions return a parameter-shaped fp32 tensor on every rank and are collective under
ZeRO 1-2 (every rank must call them, in the same order). "Local" functions return the 1-D part
this rank owns (the whole flattened parameter in stage 0; possibly empty). Gradients are
available between the boundary backward and `engine.step()`, as in DeepSpeed.
"""

from __future__ import annotations

import torch

from partita.zero.registry import owner as _owner


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The full fp32 master value of `param` (collective under ZeRO)."""
    return _owner(param).full_state(param, "param")


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Sets the fp32 master (and the module weight) of `param` from a full value."""
    _owner(param).set_full_state(param, "param", value)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The full reduced fp32 gradient of `param` (collective under ZeRO)."""
    return _owner(param).full_state(param, "grad")


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replaces the reduced gradient of `param` (before `engine.step()`)."""
    _owner(param).set_full_state(param, "grad", value)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The full optimizer state `optim_state_key` (e.g. "exp_avg") of `param`."""
    return _owner(param).full_state(param, optim_state_key)


def safe_set_full_optimizer_state(
    param: torch.Tensor, value: torch.Tensor, optim_state_key: str
) -> None:
    """Sets optimizer state `optim_state_key` of `param` from a full value."""
    _owner(param).set_full_state(param, optim_state_key, value)


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of the fp32 master of `param` (1-D)."""
    return _owner(param).local_state(param, "param")


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Sets this rank's part of the fp32 master of `param` (the module weight follows at the
    next step's all-gather)."""
    _owner(param).set_local_state(param, "param", value)


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of the reduced gradient of `param` (1-D)."""
    return _owner(param).local_state(param, "grad")


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Sets this rank's part of the reduced gradient of `param`."""
    _owner(param).set_local_state(param, "grad", value)


def safe_get_local_optimizer_state(
    param: torch.Tensor, optim_state_key: str
) -> torch.Tensor | None:
    """This rank's part of optimizer state `optim_state_key` of `param` (1-D)."""
    return _owner(param).local_state(param, optim_state_key)


def safe_set_local_optimizer_state(
    param: torch.Tensor, value: torch.Tensor, optim_state_key: str
) -> None:
    """Sets this rank's part of optimizer state `optim_state_key` of `param`."""
    _owner(param).set_local_state(param, optim_state_key, value)


__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
]
