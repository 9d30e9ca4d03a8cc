"""``deepspeed.runtime.zero.stage_1_and_2``: DeepSpeed's ZeRO-1/2 memory estimators, answering with
partita's figures (`partita.estimate.deepspeed_api`)."""

from partita.compat.deepspeed._missing import module_getattr
from partita.estimate.deepspeed_api import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    model_to_params,
)

__getattr__ = module_getattr("deepspeed.runtime.zero.stage_1_and_2")

__all__ = [
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "model_to_params",
]
