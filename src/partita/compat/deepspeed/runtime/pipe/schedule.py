"""``deepspeed.runtime.pipe.schedule``: DeepSpeed's pipeline instruction generator
(`partita.parallel.pipe_schedule`). The schedules yield the same instruction sequences as
DeepSpeed's; nothing in partita executes them yet (pipeline parallelism is not implemented),
and ``DualPipeVSchedule`` is not here."""

from partita.compat.deepspeed._missing import module_getattr
from partita.parallel.pipe_schedule import *  # noqa: F403 (every name it exports is DeepSpeed's)
from partita.parallel.pipe_schedule import __all__ as __all__

__getattr__ = module_getattr("deepspeed.runtime.pipe.schedule")
