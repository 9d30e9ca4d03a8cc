"""``deepspeed.moe``: DeepSpeed-MoE over partita's experts (`partita.moe`): ``layer.MoE``,
``sharded_moe``'s gating functions and layers, ``experts.Experts`` and ``utils``' parameter
helpers. DeepSpeed's AutoEP modules (``ep_*``) and ``mappings`` (tensor-parallel experts)
resolve to stubs whose names raise naming the feature."""

from partita.compat.deepspeed._missing import module_getattr

__getattr__ = module_getattr("deepspeed.moe")
