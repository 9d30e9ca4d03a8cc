"""DeepSpeed's ``deepspeed.utils`` names that training scripts import."""

from partita.compat.accessors import *  # noqa: F403 (its __all__ is this module's)
from partita.compat.accessors import __all__ as __all__
