"""ZeRO stage 3: fully sharded parameters, gathered just in time (see `strategy`)."""

from partita.zero.stage3.settings import Stage3Settings
from partita.zero.stage3.strategy import FullySharded, default_unit_modules
from partita.zero.stage3.unit import ShardedUnit, UnitState

__all__ = ["FullySharded", "ShardedUnit", "Stage3Settings", "UnitState", "default_unit_modules"]
