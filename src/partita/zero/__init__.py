"""ZeRO: sharded data parallelism (stages 0-3) and its user-facing helpers."""

from partita.zero.gather import GatheredParameters

__all__ = ["GatheredParameters"]
