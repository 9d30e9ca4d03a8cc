"""Errors for DeepSpeed names the stand-in does not implement: each names what was asked for,
the feature behind it and what partita offers instead, so a caller deep inside another library
reads why, not a bare AttributeError or ModuleNotFoundError."""

from __future__ import annotations

import dis
import importlib
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

from partita.platform.env import AS_DEEPSPEED

# DeepSpeed modules (dotted, without the leading "deepspeed.") -> the feature they belong to.
FEATURES: dict[str, str] = {
    "sequence": "sequence parallelism beyond Ulysses attention (FPDT, AutoSP, vocab-parallel loss)",
    "runtime.sequence_parallel": "ALST's debugging helpers (AutogradComputeMLP)",
    "pipe": "pipeline parallelism",
    "runtime.pipe": "pipeline parallelism",
    "moe": "DeepSpeed-MoE's AutoEP (ep_*) and tensor-parallel experts (mappings)",
    "inference": "DeepSpeed inference kernels (kernel injection)",
    "module_inject": "AutoTP training and kernel injection",
    "runtime.tensor_parallel": "AutoTP training (tensor_parallel config)",
    "compression": "DeepSpeed compression",
    "autotuning": "the DeepSpeed autotuner",
    "elasticity": "DeepSpeed elasticity (use torchrun's elastic agent with the partita launcher)",
    "nvme": "DeepSpeed's NVMe benchmark tools",
    "ops.transformer": "DeepSpeed's fused transformer kernels",
    "ops.sparse_attention": "DeepSpeed sparse attention",
    "runtime.domino": "Domino tensor-parallel training",
    "runtime.hybrid_engine": "the RLHF hybrid engine",
    "runtime.data_pipeline": "DeepSpeed data efficiency (curriculum learning, data routing)",
    "runtime.superoffload": "SuperOffload",
    "runtime.zenflow": "ZenFlow",
    "runtime.zero.mics": "MiCS (hierarchical ZeRO-3)",
    "runtime.fp16.onebit": "1-bit optimizers",
    "runtime.comm": "compressed communication (1-bit)",
    "compile": "DeepCompile",
    "linear": "DeepSpeed's optimized linear (LoRA/quantized)",
    "model_implementations": "DeepSpeed inference kernels (kernel injection)",
    "ops.aio": "DeepSpeed's async I/O op",
    "ops.deepspeed4science": "DeepSpeed4Science kernels",
    "ops.fp_quantizer": "DeepSpeed's FP quantizer",
    "ops.quantizer": "DeepSpeed's quantizer kernels",
    "ops.transformer.inference": "DeepSpeed inference kernels (kernel injection)",
    "io": "DeepSpeed's fast file writer",
    "datastates": "DataStates checkpointing",
    "utils.groups": "DeepSpeed's process-group registry (tensor-parallel groups)",
}

# DeepSpeed modules -> what partita offers in their place (the longest matching prefix wins).
INSTEAD: dict[str, str] = {
    "inference": "deepspeed.init_inference (partita.inference: tensor-parallel inference)",
    "module_inject": "deepspeed.init_inference (partita.inference: tensor-parallel inference)",
    "model_implementations": "deepspeed.init_inference (partita.inference)",
    "runtime": "partita's engine (deepspeed.initialize, deepspeed.runtime.engine.DeepSpeedEngine)",
    "runtime.zero": "deepspeed.zero.Init / GatheredParameters and the zero_optimization config",
    "runtime.fp16": 'the "fp16" / "bf16" config sections (loss scaling inside the engine)',
    "runtime.swap_tensor": 'zero_optimization.offload_param/offload_optimizer with "device": "nvme"',
    "runtime.checkpoint_engine": "engine.save_checkpoint / load_checkpoint (partita.checkpoint)",
    "checkpoint": "engine.save_checkpoint / load_checkpoint and partita.checkpoint.export",
    "monitor": 'the "tensorboard" / "csv_monitor" / "wandb" config sections (partita.monitor)',
    "comm": "deepspeed.comm (partita.comm)",
    "accelerator": "deepspeed.accelerator.get_accelerator()",
    "ops": "torch.optim and deepspeed.ops.adam / adagrad / lion",
    "launcher": "the partita launcher (python -m partita.launcher.cli)",
    "elasticity": "torchrun's elastic agent under the partita launcher",
    "compile": "engine.compile() (torch.compile)",
    "nvme": 'zero_optimization.offload_* with "device": "nvme"',
    "io": 'zero_optimization.offload_* with "device": "nvme"',
    "utils": "deepspeed.utils (the safe_get_* / safe_set_* accessors, set_z3_leaf_modules)",
    "profiling": "deepspeed.profiling.flops_profiler",
    "sequence": "deepspeed.sequence.layer.DistributedAttention (partita.parallel.ulysses)",
    "utils.groups": "partita.comm (groups over one device mesh); the data and sequence "
    "getters are here",
}


def _longest(table: dict[str, str], dotted: str) -> str | None:
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        found = table.get(".".join(parts[:n]))
        if found is not None:
            return found
    return None


def feature_of(dotted: str) -> str | None:
    """The unimplemented feature DeepSpeed module `dotted` (without ``deepspeed.``) belongs to."""
    return _longest(FEATURES, dotted)


def instead_of(dotted: str) -> str | None:
    """What partita offers in place of DeepSpeed module `dotted` (without ``deepspeed.``)."""
    return _longest(INSTEAD, dotted)


def missing_module_message(fullname: str) -> str:
    """The message for ``import deepspeed.X`` where partita has no ``X``."""
    dotted = fullname.split(".", 1)[1] if "." in fullname else ""
    feature = feature_of(dotted)
    what = f" ({feature} is not implemented by partita)" if feature else ""
    return (
        f"No module named {fullname!r}: partita stands in for deepspeed in this process "
        f"({AS_DEEPSPEED.name} / partita.as_deepspeed) and has no {fullname}{what}"
    )


class NotInPartita(AttributeError, NotImplementedError):
    """A DeepSpeed name partita does not implement. An AttributeError, so ``hasattr`` and
    ``getattr(x, name, default)`` probes keep working; a NotImplementedError in meaning."""


class NotInPartitaImport(ImportError):
    """`NotInPartita` met by ``from X import name``: Python would replace an AttributeError
    there with a bare "cannot import name", losing what partita says about the name."""


_IMPORT_FROM = dis.opmap["IMPORT_FROM"]


def _from_import() -> bool:
    """Whether the nearest caller outside this tree is executing ``from X import name``."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_TREE):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None or frame.f_lasti < 0:
        return False
    return frame.f_code.co_code[frame.f_lasti] == _IMPORT_FROM


_TREE = "partita.compat.deepspeed"


def missing_attribute(
    owner: str, name: str, feature: str | None = None, instead: str | None = None
) -> NotInPartita | NotInPartitaImport:
    """The error for ``owner.name`` where partita has no such name: `NotInPartita`, or
    `NotInPartitaImport` when the caller is importing the name (``from owner import name``)."""
    what = f": {feature} is not implemented by partita" if feature else ""
    offer = f"; partita offers {instead}" if instead else ""
    message = (
        f"{owner}.{name} does not exist in partita's deepspeed stand-in{what}{offer} "
        "(partita.compat.deepspeed; see docs/huggingface.md)"
    )
    if _from_import():
        return NotInPartitaImport(message, name=owner)
    return NotInPartita(message)


def module_getattr(
    owner: str, feature: str | None = None, instead: str | None = None
) -> Callable[[str], Any]:
    """A module ``__getattr__`` for `owner` (``deepspeed.X``): every name the module lacks raises
    `missing_attribute` naming it, `feature` and what partita offers `instead` (by default,
    what `instead_of` says for the module)."""
    dotted = owner.split(".", 1)[1] if "." in owner else ""
    offer = instead if instead is not None else instead_of(dotted)

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):  # module protocol probes (__path__, __all__...)
            raise AttributeError(name)
        # A submodule the stand-in has but nobody imported yet (``deepspeed.moe.layer.MoE``
        # right after ``import deepspeed``): imported, as DeepSpeed's package imports it.
        module = f"partita.compat.{owner}.{name}"
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # `owner` is a module, not a package
            found = False
        if found:
            return importlib.import_module(module)
        raise missing_attribute(owner, name, feature or feature_of(dotted), offer)

    return __getattr__
