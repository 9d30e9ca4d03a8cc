"""Loss scaling for fp16 training, with DeepSpeed's semantics.

Dynamic scaling starts at ``2**initial_scale_power``. On an overflow the scale halves once
``hysteresis`` overflows have been seen (each overflow before that only spends one unit of
hysteresis); after ``loss_scale_window`` overflow-free steps it doubles. With
``consecutive_hysteresis`` the hysteresis budget refills after every clean step, so only
*consecutive* overflows halve the scale. At ``min_loss_scale`` a further overflow raises
`LossScaleAtMinimumError` when ``raise_error_at_min_scale`` is set (DeepSpeed's default), since
training cannot make progress; otherwise the scale stays at the minimum and steps keep skipping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class LossScaleAtMinimumError(RuntimeError):
    """Gradients overflowed although the loss scale is already at its configured minimum."""


class LossScaler(Protocol):
    """What the engine needs from a loss scaler."""

    @property
    def scale(self) -> float:
        """The factor the loss is multiplied by before backward."""
        ...

    def update(self, overflow: bool, step: int) -> None:
        """Adjusts the scale after a step that did (or did not) overflow."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state for checkpoints."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores `state_dict` output."""
        ...


@dataclass
class StaticLossScaler:
    """A fixed scale (fp16 ``loss_scale`` > 0, or 1.0 for bf16/fp32: no scaling)."""

    value: float = 1.0

    @property
    def scale(self) -> float:
        """The fixed factor."""
        return self.value

    def update(self, overflow: bool, step: int) -> None:
        """A static scale never changes; overflowed steps are still skipped by the engine."""

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state."""
        return {"kind": "static", "scale": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the scale."""
        self.value = float(state["scale"])


class DynamicLossScaler:
    """DeepSpeed-compatible dynamic loss scaler (see the module docstring)."""

    def __init__(
        self,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_loss_scale: float = 1.0,
        scale_factor: float = 2.0,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        self.cur_scale = float(2**initial_scale_power)
        self.scale_window = loss_scale_window
        self.delayed_shift = hysteresis
        self.cur_hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_loss_scale)
        self.scale_factor = scale_factor
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @property
    def scale(self) -> float:
        """The current scale."""
        return self.cur_scale

    def update(self, overflow: bool, step: int) -> None:
        """Applies one step's outcome (the engine calls it on every rank with the same flag)."""
        if overflow:
            self._on_overflow(step)
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def _on_overflow(self, step: int) -> None:
        if self.delayed_shift == 1 or self.cur_hysteresis == 1:
            if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                raise LossScaleAtMinimumError(
                    f"step {step}: gradients overflowed with the loss scale already at "
                    f"fp16.min_loss_scale={self.min_scale:g}; training cannot proceed. Lower "
                    "fp16.min_loss_scale, use bf16, or find the source of the inf/nan."
                )
            self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
        else:
            self.cur_hysteresis -= 1

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state."""
        return {
            "kind": "dynamic",
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores `state_dict` output."""
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
