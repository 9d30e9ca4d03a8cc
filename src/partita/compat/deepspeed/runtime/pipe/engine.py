"""``deepspeed.runtime.pipe.engine``: DeepSpeed's ``PipelineEngine``, partita's own
(`partita.parallel.pipe_engine`); ``deepspeed.initialize`` returns one for a
``PipelineModule``."""

from partita.compat.deepspeed._missing import module_getattr
from partita.parallel.pipe_engine import PipelineEngine
from partita.parallel.pipe_module import PipelineError

__getattr__ = module_getattr("deepspeed.runtime.pipe.engine")

__all__ = ["PipelineEngine", "PipelineError"]
