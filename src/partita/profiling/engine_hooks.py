"""The engine's FLOPs profile: the ``flops_profiler`` section run at its ``profile_step``.

As in DeepSpeed, rank 0 profiles the forward of optimizer step ``profile_step`` (counted from
0: the first micro-batch's forward of that step) and prints the report then, to stdout or
``output_file``. The hooks sit on the engine module itself, so the profiler's own hooks on the
model are in place before the model runs; they fire when the engine is called
(``engine(batch)``), as DeepSpeed's engine profiles in its ``forward``.
"""

from __future__ import annotations

from typing import Any

import torch

from partita.config.sections.profiling import FlopsProfilerConfig
from partita.profiling.flops import FlopsProfiler

__all__ = ["EngineFlopsProfile"]


class EngineFlopsProfile:
    """Starts the profiler before the engine's forward at the profile step, reports after it.

    Args:
        engine: the engine (an ``nn.Module`` with ``module``, ``global_steps``,
            ``global_rank``).
        config: its ``flops_profiler`` section (``enabled`` true).
    """

    def __init__(self, engine: Any, config: FlopsProfilerConfig) -> None:
        self.engine = engine
        self.config = config
        self.profiler = FlopsProfiler(engine.module, engine, config.recompute_fwd_factor)
        self.done = False
        """The profile step's report was written (the profiler runs once)."""
        self.flops = 0
        """Forward FLOPs of the profiled forward (0 until it ran)."""
        self.fwd_duration = 0.0
        """Seconds of the profiled forward."""
        engine.register_forward_pre_hook(self._before)
        engine.register_forward_hook(self._after)

    def _due(self) -> bool:
        engine = self.engine
        return (
            not self.done
            and engine.global_rank == 0
            and engine.global_steps == self.config.profile_step
        )

    def _before(self, module: torch.nn.Module, args: Any) -> None:
        if self._due() and not self.profiler.started:
            self.profiler.start_profile()

    def _after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self.profiler.started:
            return
        self.profiler.stop_profile()
        self.flops = int(self.profiler.get_total_flops())
        self.fwd_duration = float(self.profiler.get_total_duration())
        self.profiler.print_model_profile(
            profile_step=self.config.profile_step,
            module_depth=self.config.module_depth,
            top_modules=self.config.top_modules,
            detailed=self.config.detailed,
            output_file=self.config.output_file,
        )
        self.profiler.end_profile()
        self.done = True
