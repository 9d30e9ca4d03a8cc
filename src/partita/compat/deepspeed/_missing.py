"""Errors for DeepSpeed names the stand-in does not implement: each names what was asked for
and the feature behind it, so a caller deep inside another library reads why, not a bare
AttributeError or ModuleNotFoundError."""

from __future__ import annotations

from partita.env import AS_DEEPSPEED

# DeepSpeed modules (dotted, without the leading "deepspeed.") -> the feature they belong to.
FEATURES: dict[str, str] = {
    "sequence": "sequence parallelism (Ulysses)",
    "runtime.sequence_parallel": "sequence parallelism (Ulysses)",
    "pipe": "pipeline parallelism",
    "runtime.pipe": "pipeline parallelism",
    "moe": "DeepSpeed-MoE expert parallelism",
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
}


def _feature(dotted: str) -> str | None:
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        feature = FEATURES.get(".".join(parts[:n]))
        if feature is not None:
            return feature
    return None


def missing_module_message(fullname: str) -> str:
    """The message for ``import deepspeed.X`` where partita has no ``X``."""
    dotted = fullname.split(".", 1)[1] if "." in fullname else ""
    feature = _feature(dotted)
    what = f" ({feature} is not implemented by partita)" if feature else ""
    return (
        f"No module named {fullname!r}: partita stands in for deepspeed in this process "
        f"({AS_DEEPSPEED.name} / partita.as_deepspeed) and has no {fullname}{what}"
    )


class NotInPartita(AttributeError, NotImplementedError):
    """A DeepSpeed name partita does not implement. An AttributeError, so ``hasattr`` and
    ``getattr(x, name, default)`` probes keep working; a NotImplementedError in meaning."""


def missing_attribute(owner: str, name: str, feature: str | None = None) -> NotInPartita:
    """The error for ``owner.name`` where partita has no such name."""
    what = f": {feature} is not implemented by partita" if feature else ""
    return NotInPartita(
        f"{owner}.{name} does not exist in partita's deepspeed stand-in{what} "
        "(partita.compat.deepspeed; see docs/huggingface.md)"
    )
