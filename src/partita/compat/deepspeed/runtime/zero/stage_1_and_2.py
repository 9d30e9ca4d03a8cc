"""``deepspeed.runtime.zero.stage_1_and_2``: DeepSpeed's ZeRO-1/2 memory estimators, answering with
partita's figures (`partita.compat.estimator_names`)."""

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed._placeholder import NotInPartitaPlaceholder
from partita.compat.estimator_names import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    model_to_params,
)


class DeepSpeedZeroOptimizer(NotInPartitaPlaceholder):
    """DeepSpeed's ZeRO-1/2 optimizer class, importable; constructing it raises: partita's
    engine builds its sharded optimizer from ``zero_optimization`` in the config."""

    _deepspeed_name = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"
    _feature = "DeepSpeed's ZeRO-1/2 optimizer class (partita.zero builds its own from the config)"


__getattr__ = module_getattr("deepspeed.runtime.zero.stage_1_and_2")

__all__ = [
    "DeepSpeedZeroOptimizer",
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "model_to_params",
]
