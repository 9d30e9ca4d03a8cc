"""``deepspeed.launcher``: constants Accelerate's launcher reads (``launcher.runner``)."""

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed.launcher import runner

__getattr__ = module_getattr("deepspeed.launcher")

__all__ = ["runner"]
