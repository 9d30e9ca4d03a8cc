"""``deepspeed.moe.layer``: DeepSpeed's ``MoE`` layer over `partita.moe.MoE`."""

from __future__ import annotations

from typing import Any

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed.moe.experts import mark_expert_params
from partita.moe.layer import MoE as _MoE


class MoE(_MoE):
    """DeepSpeed's mixture-of-experts layer (see `partita.moe.MoE`); the experts' parameters
    carry DeepSpeed's marks (``allreduce=False``, ``group_name``) for ``is_moe_param`` and
    ``split_params_into_different_moe_groups_for_optimizer``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        mark_expert_params(self.deepspeed_moe.experts, self.expert_group_name)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Binds the job's expert-parallel group (``deepspeed.initialize`` does it already);
        partita's groups always put expert ranks first (consecutive ranks)."""
        if use_data_before_expert_parallel_:
            raise ValueError(
                "use_data_before_expert_parallel_=True (data-parallel ranks first) is not "
                "supported by partita; expert-parallel groups are consecutive ranks"
            )
        from partita.compat.deepspeed.utils import groups

        self.set_ep_group(groups._get_expert_parallel_group(self.expert_group_name))


__getattr__ = module_getattr("deepspeed.moe.layer")

__all__ = ["MoE"]
