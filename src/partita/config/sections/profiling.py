"""Profiling sections: ``flops_profiler`` and ``comms_logger``; defaults as in DeepSpeed."""

from __future__ import annotations

from pydantic import Field, StrictStr

from .base import Bool, Int, NonNegFloat, NonNegInt, PositiveInt, Section

__all__ = ["CommsLoggerConfig", "FlopsProfilerConfig"]


class FlopsProfilerConfig(Section):
    """``flops_profiler``: profile one training step's forward (FLOPs, params, latency, MFU)."""

    enabled: Bool = Field(default=False, description="Profile the forward at profile_step.")
    recompute_fwd_factor: NonNegFloat = Field(
        default=0.0,
        description="Share of the forward recomputed in backward (activation checkpointing), "
        "reported with the profile.",
    )
    profile_step: NonNegInt = Field(
        default=1, description="The optimizer step (counted from 0) whose forward is profiled."
    )
    module_depth: Int = Field(
        default=-1, description="Deepest module level printed; -1 prints every level."
    )
    top_modules: PositiveInt = Field(
        default=1, description="Modules listed per depth in the aggregated profile."
    )
    detailed: Bool = Field(default=True, description="Print the per-module tree.")
    output_file: StrictStr | None = Field(
        default=None, description="File the profile is written to; None prints to stdout."
    )


class CommsLoggerConfig(Section):
    """``comms_logger``: record every collective (size, latency) for ``comm.log_summary()``."""

    enabled: Bool = Field(default=False, description="Record collectives.")
    verbose: Bool = Field(default=False, description="Log every collective as it is recorded.")
    prof_all: Bool = Field(default=True, description="Record every op; false: only prof_ops.")
    debug: Bool = Field(
        default=False,
        description="Name each record with its tag (what the collective carries: grad, param, "
        "...), where DeepSpeed appends the calling function.",
    )
    prof_ops: list[StrictStr] = Field(
        default_factory=list, description="Ops recorded when prof_all is false ('all_reduce', ...)."
    )
