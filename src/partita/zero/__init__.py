"""ZeRO: sharded data parallelism (stages 0-3) and its user-facing helpers."""

from partita.zero.gather import GatheredParameters
from partita.zero.init import Init

__all__ = ["GatheredParameters", "Init"]
