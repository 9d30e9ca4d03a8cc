"""``deepspeed.sequence``: Ulysses sequence parallelism (`partita.parallel.ulysses`)."""

from __future__ import annotations

from partita.compat.deepspeed._missing import module_getattr

__getattr__ = module_getattr("deepspeed.sequence")
