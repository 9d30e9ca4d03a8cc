"""``deepspeed.runtime.sequence_parallel``: Ulysses for Hugging Face models (ALST's
``ulysses_sp``) and its groups (``parallel_state_sp``), over `partita.parallel.ulysses`."""

from __future__ import annotations

from partita.compat.deepspeed._missing import module_getattr

__getattr__ = module_getattr("deepspeed.runtime.sequence_parallel")
