"""Profiling: the FLOPs profiler (`FlopsProfiler`, `get_model_profile`) and the comms logger
(`comms`). A side package: reads the config, the accelerator and the comm counters, never
changes training."""

from partita.profiling.flops import FlopsProfiler, ModuleProfile, get_model_profile
from partita.profiling.peaks import PEAK_TFLOPS, peak_flops

__all__ = ["PEAK_TFLOPS", "FlopsProfiler", "ModuleProfile", "get_model_profile", "peak_flops"]
