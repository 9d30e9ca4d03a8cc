"""``deepspeed.runtime.lr_schedules``: DeepSpeed's five schedules, as partita implements them.

Accelerate hands a user's scheduler to ``initialize(lr_scheduler=...)`` only when its class name
is in `VALID_LR_SCHEDULES`, and steps any other scheduler itself.
"""

from partita.compat.deepspeed._missing import module_getattr
from partita.optim.schedulers import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

# The schedules' parameter names (keys of the config's ``scheduler.params``), as DeepSpeed names
# them for scripts and tests that build configs from constants.
LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"
EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"
CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"
CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"
WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"

__getattr__ = module_getattr("deepspeed.runtime.lr_schedules")

__all__ = [
    "LR_RANGE_TEST_MIN_LR",
    "TOTAL_NUM_STEPS",
    "VALID_LR_SCHEDULES",
    "WARMUP_MAX_LR",
    "WARMUP_MIN_LR",
    "WARMUP_NUM_STEPS",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
]
