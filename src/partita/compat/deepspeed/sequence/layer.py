"""``deepspeed.sequence.layer``: DeepSpeed's ``DistributedAttention`` is partita's Ulysses
attention (`partita.parallel.ulysses.DistributedAttention`)."""

from __future__ import annotations

from partita.compat.deepspeed._missing import module_getattr
from partita.parallel.ulysses import DistributedAttention

__getattr__ = module_getattr("deepspeed.sequence.layer")

__all__ = ["DistributedAttention"]
