"""``deepspeed.ops.op_builder``: DeepSpeed's builders of compiled ops (``CPUAdamBuilder``,
``FusedAdamBuilder``, ``AsyncIOBuilder``...). partita compiles its few C++ helpers itself
(`partita.platform.native`) and ships no DeepSpeed op: every ``*Builder`` name resolves to a
builder that answers ``is_compatible() == False`` (so probes skip the op) and whose ``load()`` raises naming
what partita offers instead. Any other name is an error naming it."""

from __future__ import annotations

from typing import Any

from partita.compat.deepspeed._missing import missing_attribute

# What partita offers in place of an op, by builder name.
INSTEAD = {
    "CPUAdamBuilder": "partita.optim.CPUAdamW (or deepspeed.ops.adam.DeepSpeedCPUAdam)",
    "FusedAdamBuilder": "torch.optim.AdamW (or deepspeed.ops.adam.FusedAdam)",
    "CPUAdagradBuilder": "torch.optim.Adagrad (or deepspeed.ops.adagrad.DeepSpeedCPUAdagrad)",
    "AsyncIOBuilder": "partita's NVMe offload (zero_optimization.offload_*: device nvme)",
    "GDSBuilder": "partita's NVMe offload (zero_optimization.offload_*: device nvme)",
}


class OpBuilder:
    """A DeepSpeed op builder partita does not build (see the module docstring)."""

    NAME = "op"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def is_compatible(self, verbose: bool = False) -> bool:
        """False: partita builds none of DeepSpeed's ops."""
        del verbose
        return False

    def absolute_name(self) -> str:
        """DeepSpeed's module path of the op."""
        return f"deepspeed.ops.{self.NAME}_op"

    def load(self, verbose: bool = True) -> Any:
        """Raises: the op does not exist in partita."""
        del verbose
        name = type(self).__name__
        instead = INSTEAD.get(name)
        hint = f"; use {instead}" if instead else ""
        raise NotImplementedError(
            f"deepspeed.ops.op_builder.{name}: partita builds no DeepSpeed ops{hint}"
        )


def _builder(name: str) -> type[OpBuilder]:
    stem = name[: -len("Builder")]
    return type(name, (OpBuilder,), {"NAME": stem.lower(), "__doc__": OpBuilder.__doc__})


_BUILDERS: dict[str, type[OpBuilder]] = {}


def __getattr__(name: str) -> Any:
    if name.endswith("Builder") and name != "Builder" and not name.startswith("_"):
        if name not in _BUILDERS:
            _BUILDERS[name] = _builder(name)
        return _BUILDERS[name]
    raise missing_attribute("deepspeed.ops.op_builder", name, "DeepSpeed's compiled ops")


__all__ = ["INSTEAD", "OpBuilder"]
