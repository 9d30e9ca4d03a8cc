"""``optimizer`` and ``scheduler``: a type name and its keyword arguments.

For the types partita builds itself the params are checked against a typed model
(``optim_params``) when the config is loaded, so ``"lr": "fast"`` fails with
``optimizer.params.lr`` before any process group exists, not inside torch after it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, Field, StrictStr, ValidationError, model_validator

from ..errors import ConfigError, Problem, did_you_mean, join_path
from .base import Section
from .optim_params import OPTIMIZER_PARAMS, SCHEDULER_PARAMS

__all__ = ["OptimizerConfig", "SchedulerConfig", "params_problems"]


def _problem(model: type[BaseModel], prefix: str, error: Any) -> Problem:
    path = prefix
    for part in error["loc"]:
        path = join_path(path, part)
    kind = error["type"]
    if kind == "extra_forbidden":
        hint = did_you_mean(str(error["loc"][-1]), model.model_fields)
        accepted = ", ".join(sorted(model.model_fields))
        return Problem(path, f"unknown key{hint} (accepted: {accepted})")
    if kind == "missing":
        return Problem(path, "required key is missing")
    message = error["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
    if "got" not in message:
        message = f"{message} (got {error.get('input')!r})"
    return Problem(path, message)


def params_problems(
    models: Mapping[str, type[BaseModel]], type_name: str, params: Mapping[str, Any], prefix: str
) -> list[Problem]:
    """Problems of ``params`` for ``type_name`` (matched ignoring case); none for a type
    without a model here (checked by ``partita.optim`` before the process group)."""
    model = models.get(type_name.lower())
    if model is None:
        return []
    try:
        model.model_validate(dict(params))
    except ValidationError as error:
        return [_problem(model, prefix, e) for e in error.errors(include_url=False)]
    return []


class _NamedType(Section):
    """A section naming a type and its keyword arguments: the arguments are checked against
    the type's model in `param_models` when there is one (problems at `params_path`)."""

    param_models: ClassVar[Mapping[str, type[BaseModel]]]
    params_path: ClassVar[str]

    # Each subclass declares both again with its own descriptions; pydantic keeps this order.
    type: StrictStr
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _typed_params(self) -> _NamedType:
        problems = params_problems(self.param_models, self.type, self.params, self.params_path)
        if problems:
            raise ConfigError(problems)
        return self


class OptimizerConfig(_NamedType):
    """``optimizer``: the optimizer the engine builds when the script passes none."""

    param_models = OPTIMIZER_PARAMS
    params_path = "optimizer.params"

    type: StrictStr = Field(
        description="Optimizer name as DeepSpeed spells it (e.g. 'Adam', 'AdamW', 'SGD'); "
        "matched case-insensitively by the engine."
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the optimizer (lr, betas, eps, weight_decay, ...).",
    )


class SchedulerConfig(_NamedType):
    """``scheduler``: the learning rate schedule the engine builds when the script passes none."""

    param_models = SCHEDULER_PARAMS
    params_path = "scheduler.params"

    type: StrictStr = Field(
        description="Scheduler name as DeepSpeed spells it (e.g. 'WarmupLR', 'WarmupDecayLR', "
        "'WarmupCosineLR', 'OneCycle', 'LRRangeTest')."
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the scheduler (warmup_num_steps, total_num_steps, ...).",
    )
