"""``deepspeed.runtime.lr_schedules``: DeepSpeed's five schedules, as partita implements them.

Accelerate hands a user's scheduler to ``initialize(lr_scheduler=...)`` only when its class name
is in `VALID_LR_SCHEDULES`, and steps any other scheduler itself.
"""

from partita.optim.schedulers import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

__all__ = [
    "VALID_LR_SCHEDULES",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
]
