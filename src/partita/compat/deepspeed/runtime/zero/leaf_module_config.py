"""``deepspeed.runtime.zero.leaf_module_config``: the ``zero_optimization.leaf_module`` section
(partita's `LeafModuleConfig`) and its defaults under DeepSpeed's names."""

from __future__ import annotations

from partita.compat.deepspeed._missing import module_getattr
from partita.config.sections.zero import LEAF_MODULE_CLASSES
from partita.config.sections.zero import LeafModuleConfig as DeepSpeedZeroLeafModuleConfig

DEFAULT_LEAF_MODULE_CLASSES: list[str] = list(LEAF_MODULE_CLASSES)
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []

__getattr__ = module_getattr("deepspeed.runtime.zero.leaf_module_config")

__all__ = [
    "DEFAULT_LEAF_MODULE_CLASSES",
    "DEFAULT_LEAF_MODULE_NAMES",
    "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
    "DeepSpeedZeroLeafModuleConfig",
]
