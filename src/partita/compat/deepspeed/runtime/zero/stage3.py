"""``deepspeed.runtime.zero.stage3``: DeepSpeed's ZeRO-3 memory estimators, answering with
partita's figures (`partita.compat.estimator_names`)."""

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed._placeholder import NotInPartitaPlaceholder
from partita.compat.estimator_names import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
    model_to_params,
)


class DeepSpeedZeroOptimizer_Stage3(NotInPartitaPlaceholder):
    """DeepSpeed's ZeRO-3 optimizer class, importable; constructing it raises: partita's engine
    builds its ZeRO-3 optimizer from ``zero_optimization`` in the config."""

    _deepspeed_name = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
    _feature = "DeepSpeed's ZeRO-3 optimizer class (partita.zero builds its own from the config)"


__getattr__ = module_getattr("deepspeed.runtime.zero.stage3")

__all__ = [
    "DeepSpeedZeroOptimizer_Stage3",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "model_to_params",
]
