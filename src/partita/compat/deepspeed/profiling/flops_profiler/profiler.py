"""``deepspeed.profiling.flops_profiler.profiler``: see the package."""

from partita.compat.deepspeed.profiling.flops_profiler import (
    FlopsProfiler,
    duration_to_string,
    get_model_profile,
    number_to_string,
)

__all__ = ["FlopsProfiler", "duration_to_string", "get_model_profile", "number_to_string"]
