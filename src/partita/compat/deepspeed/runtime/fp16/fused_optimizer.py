"""``deepspeed.runtime.fp16.fused_optimizer``: DeepSpeed's fp16 optimizer wrapper, importable;
constructing it raises: partita's engine does loss scaling from the ``"fp16"`` config section."""

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed._placeholder import NotInPartitaPlaceholder


class FP16_Optimizer(NotInPartitaPlaceholder):
    """DeepSpeed's fused fp16 optimizer class (constructing it raises `FeatureNotInPartita`)."""

    _deepspeed_name = "deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer"
    _feature = 'DeepSpeed\'s fp16 optimizer class (use the "fp16" config section)'


__getattr__ = module_getattr("deepspeed.runtime.fp16.fused_optimizer")

__all__ = ["FP16_Optimizer"]
