"""`CheckpointSubject`: what saving and loading read from, and restore into, an engine.

Checkpoints never reach into a strategy or the engine's private config: they go through the
state-access interface (`partita.zero.state_access.ParamStates`) for per-parameter state, the
``checkpoint`` config section for their own settings, and the counters and objects listed here.
`partita.engine.Engine` is the implementation; anything with these names can be checkpointed.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from partita.comm import ParallelDims
from partita.config.sections.runtime import CheckpointConfig
from partita.precision import LossScaler, PrecisionPolicy
from partita.zero.state_access import ParamStates


class CheckpointSubject(Protocol):
    """An engine as `save_checkpoint` and `load_checkpoint` see it."""

    module: torch.nn.Module
    dims: ParallelDims
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    loss_scaler: LossScaler
    policy: PrecisionPolicy
    training_dataloader: Any
    global_steps: int
    global_samples: int
    skipped_steps: int
    micro_steps: int

    @property
    def param_states(self) -> ParamStates:
        """Master weights, gradients and optimizer state of the trained parameters."""
        ...

    @property
    def checkpoint_config(self) -> CheckpointConfig:
        """The ``checkpoint`` config section."""
        ...

    def config_dict(self) -> dict[str, Any]:
        """The resolved config, JSON-ready (saved in the manifest)."""
        ...

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage (saved in the manifest)."""
        ...

    def gradient_accumulation_steps(self) -> int:
        """Micro steps per optimizer step."""
        ...

    def pipeline_place(self) -> tuple[int, int] | None:
        """``(stage, stages)`` of a pipeline engine; None outside a pipeline ([Note: pipeline
        stage checkpoints] in `partita.checkpoint.stages`)."""
        ...

    def pipeline_tied_copies(self) -> list[torch.Tensor]:
        """This stage's copies of tied parameters that an earlier stage saves."""
        ...
