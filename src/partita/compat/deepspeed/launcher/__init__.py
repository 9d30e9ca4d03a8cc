"""``deepspeed.launcher``: constants Accelerate's launcher reads (``launcher.runner``)."""

from partita.compat.deepspeed.launcher import runner

__all__ = ["runner"]
