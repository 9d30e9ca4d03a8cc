"""``deepspeed.profiling.flops_profiler``: partita's FLOPs profiler under DeepSpeed's names."""

from partita.profiling.flops import FlopsProfiler, get_model_profile
from partita.profiling.units import duration_to_string, number_to_string

__all__ = ["FlopsProfiler", "duration_to_string", "get_model_profile", "number_to_string"]
