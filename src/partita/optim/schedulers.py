"""DeepSpeed's learning-rate schedules, with DeepSpeed's exact numbers.

``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle`` and ``LRRangeTest`` take the
same arguments as the classes of ``deepspeed/runtime/lr_schedules.py`` and produce the same
learning rate (and, for ``OneCycle``, momentum) at every step, so a ``scheduler`` section of a
``ds_config.json`` trains the same here. The formulas follow DeepSpeed's (as of Aug 2026,
including the step-aligned ``OneCycle`` stair counts), evaluated in the same float order.

[Note: step semantics] A schedule is a function of ``last_batch_iteration``: the number of
``step()`` calls so far minus one. Construction with the default ``last_batch_iteration=-1``
writes the step "-1" value into the optimizer's param groups right away (DeepSpeed does the
same; for ``WarmupCosineLR`` that value is 0), and each ``step()`` advances the counter and
writes the value for the new counter. The engine calls ``step()`` after each optimizer step, so
the k-th optimizer step (k from 0) runs with the value for ``last_batch_iteration = k - 1``.

Departures from DeepSpeed, each deliberate:
- Invalid arguments (a per-group list of the wrong length, a non-numeric value) raise
  ``SchedulerConfigError`` instead of failing later. An unknown ``warmup_type`` passed to a
  class warns and falls back to "log", as DeepSpeed does; in a config file it is refused.
- ``load_state_dict`` also writes the restored step's value into the optimizer (DeepSpeed
  waits for the next ``step()``), so a resume that skips optimizer state still trains with
  the right learning rate; with optimizer state restored both agree.
- ``get_last_lr`` returns the computed python floats; tensor learning rates in param groups
  are updated in place (``fill_``) as DeepSpeed does, but the schedule itself is computed in
  python floats.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from partita.optim.errors import SchedulerConfigError, check_call_params, did_you_mean

__all__ = [
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_scheduler",
    "check_scheduler_config",
    "update_lr",
]

logger = logging.getLogger(__name__)

WARMUP_TYPES = ("log", "linear")


class OptimizerLike(Protocol):
    """What a schedule needs of an optimizer: its param groups (and defaults, for momentum)."""

    param_groups: list[dict[str, Any]]


def update_lr(param_groups: Sequence[dict[str, Any]], lrs: Sequence[float]) -> list[float]:
    """Write ``lrs`` into ``param_groups`` (tensor lrs in place) and return them as a list."""
    for group, lr in zip(param_groups, lrs, strict=True):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return list(lrs)


class _Schedule:
    """Common protocol of the DeepSpeed schedules: a counter and a pure ``get_lr``."""

    optimizer: OptimizerLike
    last_batch_iteration: int
    _last_lr: list[float] | None

    def _attach(self, optimizer: Any, last_batch_iteration: int) -> None:
        # Subclasses apply the value for this counter right away: [Note: step semantics].
        self.optimizer = _resolve_optimizer(optimizer)
        self.last_batch_iteration = _int(last_batch_iteration, "last_batch_iteration", -1)
        self._last_lr = None

    def get_lr(self) -> list[float]:
        """Learning rate of each param group for the current ``last_batch_iteration``."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """The learning rates last written into the optimizer by this schedule."""
        if self._last_lr is None:
            raise RuntimeError(
                f"{type(self).__name__}.get_last_lr(): no learning rate applied yet; "
                "call step() first (the schedule was built with last_batch_iteration != -1)"
            )
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: one past the current) and apply it
        (see [Note: step semantics])."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = _int(last_batch_iteration, "last_batch_iteration", -1)
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        """``{"last_batch_iteration": n}``, the same layout DeepSpeed checkpoints hold."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the counter and write its learning rate into the optimizer."""
        if "last_batch_iteration" not in state_dict:
            raise KeyError(
                f"{type(self).__name__}.load_state_dict: missing 'last_batch_iteration' "
                f"(got keys {sorted(state_dict)})"
            )
        self.last_batch_iteration = _int(
            state_dict["last_batch_iteration"], "last_batch_iteration", -1
        )
        self._apply()

    def _apply(self) -> None:
        self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())


class LRRangeTest(_Schedule):
    """Learning-rate range test: grow the lr from ``lr_range_test_min_lr`` without bound.

    ``lr = min_lr * (1 + step_rate * interval)`` with ``interval = (last_batch_iteration + 1)
    / step_size``, floored when ``lr_range_test_staircase``. Run it briefly and watch the loss
    to find the largest learning rate that still trains (Smith, arXiv:1803.09820).
    ``lr_range_test_min_lr`` may be a list, one value per param group.
    """

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        self._attach(optimizer, last_batch_iteration)
        n = len(self.optimizer.param_groups)
        self.min_lr = _per_group(lr_range_test_min_lr, "lr_range_test_min_lr", n)
        self.step_size = _int(lr_range_test_step_size, "lr_range_test_step_size", 1)
        self.step_rate = _number(lr_range_test_step_rate, "lr_range_test_step_rate")
        self.staircase = _bool(lr_range_test_staircase, "lr_range_test_staircase")
        if self.last_batch_iteration == -1:
            self._last_lr = update_lr(self.optimizer.param_groups, self.min_lr)

    def _interval(self) -> float:
        ratio = float(self.last_batch_iteration + 1) / self.step_size
        return float(math.floor(ratio)) if self.staircase else ratio

    def get_lr(self) -> list[float]:
        """``min_lr * (1 + step_rate * interval)`` for each param group."""
        increase = 1 + self.step_rate * self._interval()
        return [min_lr * increase for min_lr in self.min_lr]


class OneCycle(_Schedule):
    """1Cycle: lr up from ``cycle_min_lr`` to ``cycle_max_lr`` and back, then optional decay.

    The first ``cycle_first_step_size`` steps raise the lr linearly, the next
    ``cycle_second_step_size`` (default: the first) lower it; ``cycle_*_stair_count > 0`` moves
    in that many flat stairs instead. After the cycle the lr is ``cycle_min_lr / (1 +
    decay_lr_rate * k / decay_step_size)`` at post-cycle step k (no decay while either is 0).
    With ``cycle_momentum`` and an optimizer with ``betas``, beta1 moves inversely between
    ``cycle_max_mom`` and ``cycle_min_mom`` and decays as ``cycle_max_mom * (1 +
    decay_mom_rate * k / decay_step_size)``. lr and momentum bounds may be per-group lists.

    DeepSpeed quirks kept for identical training: while momentum cycles, beta2 is set to 0.99
    (not kept at the optimizer's value), and construction writes ``cycle_min_mom`` although
    the formula's value at step -1 is ``cycle_max_mom``. Optimizers without ``betas`` (SGD)
    get no momentum cycling (with a warning), as in DeepSpeed.
    """

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        self._attach(optimizer, last_batch_iteration)
        self._init_cycle(
            cycle_first_step_size,
            cycle_second_step_size,
            cycle_first_stair_count,
            cycle_second_stair_count,
            decay_step_size,
        )
        n = len(self.optimizer.param_groups)
        self.min_lrs = _per_group(cycle_min_lr, "cycle_min_lr", n)
        self.max_lrs = _per_group(cycle_max_lr, "cycle_max_lr", n)
        self.decay_lr_rate = _number(decay_lr_rate, "decay_lr_rate")
        self.skip_lr_decay = math.isclose(self.decay_step_size, 0) or math.isclose(
            self.decay_lr_rate, 0
        )
        self.cycle_momentum = _bool(cycle_momentum, "cycle_momentum")
        self.decay_mom_rate = _number(decay_mom_rate, "decay_mom_rate")
        self.skip_mom_decay = math.isclose(self.decay_step_size, 0) or math.isclose(
            self.decay_mom_rate, 0
        )
        # (beta1, beta2) per group; beta2 fixed at 0.99 as DeepSpeed does.
        self.min_moms = [(m, 0.99) for m in _per_group(cycle_min_mom, "cycle_min_mom", n)]
        self.max_moms = [(m, 0.99) for m in _per_group(cycle_max_mom, "cycle_max_mom", n)]
        if self.cycle_momentum and "betas" not in getattr(self.optimizer, "defaults", {}):
            logger.warning(
                "OneCycle: cycle_momentum disabled: optimizer %s has no 'betas' to cycle",
                type(self.optimizer).__name__,
            )
            self.cycle_momentum = False
        if self.last_batch_iteration == -1:
            self._last_lr = update_lr(self.optimizer.param_groups, self.min_lrs)
            if self.cycle_momentum:
                for group, betas in zip(self.optimizer.param_groups, self.min_moms, strict=True):
                    group["betas"] = betas

    def _init_cycle(
        self,
        first_step_size: Any,
        second_step_size: Any,
        first_stair_count: Any,
        second_stair_count: Any,
        decay_step_size: Any,
    ) -> None:
        first = _number(first_step_size, "cycle_first_step_size")
        second = (
            first
            if second_step_size is None
            else _number(second_step_size, "cycle_second_step_size")
        )
        if first <= 0:
            raise SchedulerConfigError(
                f"cycle_first_step_size: must be > 0, got {first_step_size!r}",
                key="cycle_first_step_size",
            )
        if second < 0:
            raise SchedulerConfigError(
                f"cycle_second_step_size: must be >= 0, got {second_step_size!r}",
                key="cycle_second_step_size",
            )
        self.first_step_size = float(first)
        self.second_step_size = float(second)
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        # A count <= 0 disables stairs (DeepSpeed's command-line default is -1).
        self.first_stair_count = _int(first_stair_count, "cycle_first_stair_count", None)
        self.second_stair_count = (
            self.first_stair_count
            if second_stair_count is None
            else _int(second_stair_count, "cycle_second_stair_count", None)
        )
        self.decay_step_size = _number(decay_step_size, "decay_step_size")
        if self.decay_step_size < 0:
            raise SchedulerConfigError(
                f"decay_step_size: must be >= 0 (0 disables decay), got {decay_step_size!r}",
                key="decay_step_size",
            )

    def _scale_factor(self) -> float:
        """Position in the cycle as a fraction of the way from min to max (0..1)."""
        batch_iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale = x / self.step_ratio
            stair_count = self.first_stair_count
        else:
            scale = (x - 1) / (self.step_ratio - 1)
            stair_count = self.second_stair_count
        if stair_count > 0:
            # Quantise from the integer offset in the cycle, not from `scale`: at a half-cycle
            # boundary the float scale can sit an ulp under a stair and floor a whole stair off.
            offset = batch_iteration % self.total_size
            if offset <= self.first_step_size:
                position = offset * stair_count / self.first_step_size
            else:
                position = (self.total_size - offset) * stair_count / self.second_step_size
            scale = math.floor(position) / stair_count
        return scale

    def get_lr(self) -> list[float]:
        """Cycle lr while ``last_batch_iteration < total cycle size``, decayed lr after."""
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [
                lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)
            ]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * (self._decay_steps() / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """``(beta1, beta2)`` per group for the current step, or None without momentum cycling."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [
                (hi[0] - (hi[0] - lo[0]) * scale, lo[1])
                for lo, hi in zip(self.min_moms, self.max_moms, strict=True)
            ]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * (self._decay_steps() / self.decay_step_size)
        return [(beta1 * factor, beta2) for beta1, beta2 in self.max_moms]

    def _decay_steps(self) -> float:
        return self.last_batch_iteration - self.total_size + 1

    def _apply(self) -> None:
        super()._apply()
        moms = self.get_mom()
        if moms is not None:
            for group, betas in zip(self.optimizer.param_groups, moms, strict=True):
                group["betas"] = betas


class WarmupLR(_Schedule):
    """Warm the lr up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold it.

    Over the first ``warmup_num_steps`` (at least 2) steps the lr is ``min + (max - min) *
    gamma`` with ``gamma = log(i + 1) / log(warmup_num_steps)`` (``warmup_type`` "log") or
    ``i / warmup_num_steps`` ("linear") at ``i = last_batch_iteration``; from then on ``max``.
    ``warmup_max_lr`` defaults to each group's current lr; both bounds may be per-group lists.
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self._attach(optimizer, last_batch_iteration)
        groups = self.optimizer.param_groups
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in groups]
        self.min_lrs = _per_group(warmup_min_lr, "warmup_min_lr", len(groups))
        self.max_lrs = _per_group(warmup_max_lr, "warmup_max_lr", len(groups))
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs, strict=True)]
        self.warmup_num_steps = max(2, _int(warmup_num_steps, "warmup_num_steps", 1))
        self.warmup_type = _warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self._post_init()
        if self.last_batch_iteration == -1:
            self._apply()

    def _post_init(self) -> None:
        """Hook for subclasses to finish set-up before the initial lr is applied."""

    def get_lr(self) -> list[float]:
        """``min + delta * gamma`` per group; ``min`` before the first step."""
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._get_gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs, strict=True)]

    def _warmup_gamma(self) -> float:
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return 1.0


class WarmupDecayLR(WarmupLR):
    """``WarmupLR``, then a linear decay to 0 at ``total_num_steps``.

    After warmup ``gamma = max(0, (total_num_steps - i) / max(1, total_num_steps -
    warmup_num_steps))``. Unlike ``WarmupLR``, ``warmup_max_lr`` defaults to 0.001 (DeepSpeed's
    default for this class).
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = _int(total_num_steps, "total_num_steps", 0)
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )

    def _post_init(self) -> None:
        _warn_short_total(type(self).__name__, self.total_num_steps, self.warmup_num_steps)

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Schedule):
    """Scale each group's lr by a ratio that warms up, then follows a half cosine.

    The ratio goes from ``warmup_min_ratio`` to 1 over ``warmup_num_steps`` (at least 2) steps
    ("log" or "linear" as in ``WarmupLR``), then ``max(0, cos_min_ratio + (1 - cos_min_ratio)
    * (1 + cos(pi * p)) / 2)`` with ``p = min(1, (i - warmup_num_steps + 1) /
    max(1, total_num_steps - warmup_num_steps))``. The base lrs are the groups' lrs at
    construction; construction itself sets the lr to 0 (the step -1 value), as DeepSpeed does.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self._attach(optimizer, last_batch_iteration)
        self.total_num_steps = _int(total_num_steps, "total_num_steps", 0)
        self.warmup_min_ratio = _number(warmup_min_ratio, "warmup_min_ratio")
        self.cos_min_ratio = _number(cos_min_ratio, "cos_min_ratio")
        self.warmup_num_steps = max(2, _int(warmup_num_steps, "warmup_num_steps", 1))
        self.warmup_type = _warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        _warn_short_total(type(self).__name__, self.total_num_steps, self.warmup_num_steps)
        self.org_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        if self.last_batch_iteration == -1:
            self._apply()

    def get_lr_ratio(self) -> float:
        """The multiplier of the base lrs at the current ``last_batch_iteration``."""
        i = self.last_batch_iteration
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            if self.warmup_type == "log":
                ratio = self.inverse_log_warm_up * math.log(i + 1)
            else:
                ratio = i / self.warmup_num_steps
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        real_last_step = i - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, real_last_step / real_total_steps)
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

    def get_lr(self) -> list[float]:
        """``base_lr * ratio`` per group; 0 before the first step."""
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [base * ratio for base in self.org_lrs]


# --- argument checks ------------------------------------------------------------------------


def _resolve_optimizer(optimizer: Any) -> OptimizerLike:
    """The object whose ``param_groups`` the schedule drives.

    A ``torch.optim.Optimizer``; a wrapper exposing one as ``.optimizer`` (DeepSpeed's rule);
    or any object with a ``param_groups`` list (partita's sharded optimizers).
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    if isinstance(getattr(optimizer, "param_groups", None), list):
        return optimizer
    raise TypeError(
        f"expected a torch.optim.Optimizer or an object with a param_groups list, "
        f"got {type(optimizer).__name__}"
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(value: Any, key: str) -> float:
    if not _is_number(value) or not math.isfinite(value):
        raise SchedulerConfigError(f"{key}: expected a number, got {value!r}", key=key)
    return float(value)


def _int(value: Any, key: str, minimum: int | None) -> int:
    """An integer (an integral float such as ``1e5`` from JSON counts) >= ``minimum``."""
    if _is_number(value) and math.isfinite(value) and float(value).is_integer():
        value = int(value)
        if minimum is None or value >= minimum:
            return int(value)
    bound = "an integer" if minimum is None else f"an integer >= {minimum}"
    raise SchedulerConfigError(f"{key}: expected {bound}, got {value!r}", key=key)


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise SchedulerConfigError(f"{key}: expected true or false, got {value!r}", key=key)
    return value


def _per_group(value: Any, key: str, n_groups: int) -> list[float]:
    """One number for every param group, or a list with exactly one per group."""
    if isinstance(value, list | tuple):
        if len(value) != n_groups:
            raise SchedulerConfigError(
                f"{key}: expected one value per param group ({n_groups}), "
                f"got a list of {len(value)}",
                key=key,
            )
        return [_number(v, key) for v in value]
    return [_number(value, key)] * n_groups


def _warmup_type(value: Any) -> str:
    """`value` when it is a known warmup type; else "log", with a warning naming the value (as
    DeepSpeed's WarmupLR and WarmupCosineLR do; a config file's unknown value is refused earlier,
    by the config's validation)."""
    if value not in WARMUP_TYPES:
        hint = did_you_mean(value, WARMUP_TYPES) if isinstance(value, str) else ""
        logger.warning(
            "Using unknown warmup_type: %r%s. The increasing function is set to the default "
            "'log' (expected 'log' or 'linear').",
            value,
            hint,
        )
        return "log"
    return str(value)


def _warn_short_total(name: str, total_num_steps: int, warmup_num_steps: int) -> None:
    if total_num_steps < warmup_num_steps:
        logger.warning(
            "%s: total_num_steps %d is less than warmup_num_steps %d",
            name,
            total_num_steps,
            warmup_num_steps,
        )


# --- factory --------------------------------------------------------------------------------

_PREFIX = "scheduler.params"

_DEEPSPEED_SCHEDULES: dict[str, type[_Schedule]] = {
    cls.__name__.lower(): cls
    for cls in (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR)
}

# torch.optim.lr_scheduler classes whose required arguments are Python objects.
_NOT_FROM_CONFIG: dict[str, str] = {
    "lambdalr": "needs an lr_lambda function",
    "multiplicativelr": "needs an lr_lambda function",
    "sequentiallr": "needs scheduler objects",
    "chainedscheduler": "needs scheduler objects",
}


def build_scheduler(sched_type: str, params: dict[str, Any] | None, optimizer: Any) -> Any:
    """Build the scheduler named by a DeepSpeed config's ``scheduler.type``.

    DeepSpeed's schedules (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle``,
    ``LRRangeTest``) come first, then any ``torch.optim.lr_scheduler`` class; names match
    ignoring case. ``params`` (``scheduler.params``; ``None`` means ``{}``) are the keyword
    arguments after the optimizer. Raises ``SchedulerConfigError`` (a ``ValueError``) naming
    ``scheduler.type`` or ``scheduler.params.<key>`` with the value and what was expected.
    """
    kwargs = dict(params or {})
    cls = _checked_class(sched_type, kwargs)
    try:
        return cls(optimizer, **kwargs)
    except SchedulerConfigError as exc:
        raise SchedulerConfigError(f"{_PREFIX}.{exc}", key=f"{_PREFIX}.{exc.key}") from None
    except (ValueError, TypeError) as exc:
        if sched_type.lower() in _DEEPSPEED_SCHEDULES:
            raise
        raise SchedulerConfigError(
            f"{_PREFIX}: torch.optim.lr_scheduler.{cls.__name__} rejected {kwargs!r}: {exc}",
            key=_PREFIX,
        ) from exc


def check_scheduler_config(sched_type: str, params: dict[str, Any] | None) -> None:
    """The checks of `build_scheduler` that need no optimizer (the name, the params' names
    and required params), run before the process group exists. Value types of DeepSpeed's
    schedules are checked by ``partita.config`` at load. Raises ``SchedulerConfigError``."""
    _checked_class(sched_type, dict(params or {}))


def _checked_class(sched_type: str, kwargs: dict[str, Any]) -> Any:
    """The scheduler class for ``sched_type`` after checking the name and the params' names."""
    if not isinstance(sched_type, str) or not sched_type:
        raise SchedulerConfigError(
            f"scheduler.type: expected a scheduler name such as 'WarmupLR', got {sched_type!r}",
            key="scheduler.type",
        )
    name = sched_type.lower()
    torch_schedulers = _torch_schedulers()
    cls: Any = _DEEPSPEED_SCHEDULES.get(name) or torch_schedulers.get(name)
    if cls is None:
        known = [c.__name__ for c in (*_DEEPSPEED_SCHEDULES.values(), *torch_schedulers.values())]
        raise SchedulerConfigError(
            f"scheduler.type: unknown scheduler {sched_type!r}{did_you_mean(sched_type, known)}; "
            f"expected one of {', '.join(known)}",
            key="scheduler.type",
        )
    if name in _NOT_FROM_CONFIG:
        raise SchedulerConfigError(
            f"scheduler.type: {cls.__name__} {_NOT_FROM_CONFIG[name]}, which a JSON config "
            "cannot hold; build it in your script and pass it as lr_scheduler=",
            key="scheduler.type",
        )
    check_call_params(cls, kwargs, prefix=_PREFIX, skip=1, error=SchedulerConfigError)
    if name in _DEEPSPEED_SCHEDULES and "warmup_type" in kwargs:
        _config_warmup_type(kwargs["warmup_type"])
    return cls


def _config_warmup_type(value: Any) -> None:
    """Refuses a config's unknown ``warmup_type`` (the classes themselves warn and use "log")."""
    if value not in WARMUP_TYPES:
        hint = did_you_mean(value, WARMUP_TYPES) if isinstance(value, str) else ""
        raise SchedulerConfigError(
            f"{_PREFIX}.warmup_type: expected 'log' or 'linear', got {value!r}{hint}",
            key=f"{_PREFIX}.warmup_type",
        )


def _torch_schedulers() -> dict[str, type]:
    """Lower-case name -> public scheduler class of ``torch.optim.lr_scheduler``."""
    module = torch.optim.lr_scheduler
    # ReduceLROnPlateau is not an LRScheduler subclass in every torch release.
    bases: tuple[type, ...] = (module.LRScheduler, module.ReduceLROnPlateau)
    found: dict[str, type] = {}
    for attr in dir(module):
        obj: Any = getattr(module, attr)
        if attr.startswith("_") or not isinstance(obj, type) or obj is module.LRScheduler:
            continue
        if issubclass(obj, bases):
            found[attr.lower()] = obj
    return found
