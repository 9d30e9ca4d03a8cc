"""``deepspeed.module_inject``: of DeepSpeed's AutoTP and kernel injection, partita implements
only the shard-size arithmetic (`tp_shard`); every other name raises naming what partita offers
instead (tensor-parallel inference through ``deepspeed.init_inference``)."""

from partita.compat.deepspeed._missing import module_getattr

__getattr__ = module_getattr("deepspeed.module_inject")
