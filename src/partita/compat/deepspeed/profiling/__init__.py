"""``deepspeed.profiling``: the FLOPs profiler (`flops_profiler`)."""
