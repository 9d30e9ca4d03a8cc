"""``deepspeed.runtime.bf16_optimizer``: DeepSpeed's bf16 optimizer wrapper. partita has no such
class: its engine keeps fp32 masters for bf16 at every ZeRO stage (``"bf16": {"enabled":
true}``), so constructing one says so."""

from __future__ import annotations

from typing import Any

from partita.compat.deepspeed._missing import missing_attribute


class BF16_Optimizer:
    """Not implemented by partita (raises when constructed): use ``"bf16": {"enabled": true}``
    in the config, and `partita.initialize` wraps the optimizer with fp32 masters."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "deepspeed.runtime.bf16_optimizer.BF16_Optimizer is not implemented by partita: "
            'set "bf16": {"enabled": true} in the config; partita\'s engine keeps fp32 master '
            "weights for bf16 at every ZeRO stage"
        )


def __getattr__(name: str) -> Any:
    raise missing_attribute("deepspeed.runtime.bf16_optimizer", name, "DeepSpeed's bf16 optimizer")


__all__ = ["BF16_Optimizer"]
