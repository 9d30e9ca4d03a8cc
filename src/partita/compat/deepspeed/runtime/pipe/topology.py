"""``deepspeed.runtime.pipe.topology``: process topologies and the pipeline grid, under
DeepSpeed's names (`partita.parallel.topology`)."""

from partita.compat.deepspeed._missing import module_getattr
from partita.parallel.topology import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
)
from partita.parallel.topology import prime_factors as _prime_factors

__getattr__ = module_getattr("deepspeed.runtime.pipe.topology")

__all__ = [
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineParallelGrid",
    "ProcessTopology",
    "_prime_factors",
]
