"""The batch-size triple, resolved exactly as DeepSpeed does.

``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world``
where ``world`` is the data-parallel world size. Any two of the three determine the third,
with DeepSpeed's floor divisions; one alone is taken with ``gradient_accumulation_steps = 1``;
then the identity is checked. DeepSpeed reference: ``runtime/config.py``,
``_set_batch_related_parameters`` and ``_batch_assertion``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError, Problem

__all__ = ["BATCH_KEYS", "BatchSizes", "resolve_batch_sizes"]

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass(frozen=True)
class BatchSizes:
    """A consistent batch triple for one data-parallel world size."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int


def _describe(train: int | None, micro: int | None, gas: int | None, world_size: int) -> str:
    return (
        f"train_batch_size={train}, train_micro_batch_size_per_gpu={micro}, "
        f"gradient_accumulation_steps={gas}, data-parallel world_size={world_size}"
    )


def _derive(
    train: int | None, micro: int | None, gas: int | None, world_size: int
) -> tuple[int, int, int]:
    """Fill in the missing members with DeepSpeed's arithmetic (floor divisions included)."""
    if train is not None and micro is not None and gas is not None:
        return train, micro, gas
    if train is not None and micro is not None:
        return train, micro, train // micro // world_size
    if train is not None and gas is not None:
        return train, train // world_size // gas, gas
    if micro is not None and gas is not None:
        return micro * gas * world_size, micro, gas
    if train is not None:
        return train, train // world_size, 1
    if micro is not None:
        return micro * world_size, micro, 1
    raise ConfigError(
        [
            Problem(
                "train_batch_size",
                "set train_batch_size or train_micro_batch_size_per_gpu (or both); "
                f"got {_describe(train, micro, gas, world_size)}",
            )
        ]
    )


def resolve_batch_sizes(
    train_batch_size: int | None,
    train_micro_batch_size_per_gpu: int | None,
    gradient_accumulation_steps: int | None,
    *,
    world_size: int,
) -> BatchSizes:
    """Resolve the batch triple from the members given (``None`` = absent) and the world size.

    Raises:
        ConfigError: none of ``train_batch_size`` / ``train_micro_batch_size_per_gpu`` given, a
            member not positive (given or derived), or the identity broken (e.g. a
            ``train_batch_size`` not divisible by ``micro * world_size``). The message names
            the three values as given and the world size.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    given = (train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)
    bad = [f"{k}={v}" for k, v in zip(BATCH_KEYS, given, strict=True) if v is not None and v <= 0]
    if bad:
        raise ConfigError(
            [
                Problem(
                    "train_batch_size",
                    f"batch sizes must be > 0 ({', '.join(bad)}); "
                    f"got {_describe(*given, world_size)}",
                )
            ]
        )
    train, micro, gas = _derive(*given, world_size)
    derived_bad = [
        f"{k}={v}" for k, v in zip(BATCH_KEYS, (train, micro, gas), strict=True) if v <= 0
    ]
    if derived_bad or train != micro * gas * world_size:
        why = (
            f"derived {', '.join(derived_bad)}"
            if derived_bad
            else f"{train} != {micro} * {gas} * {world_size}"
        )
        raise ConfigError(
            [
                Problem(
                    "train_batch_size",
                    "train_batch_size must equal train_micro_batch_size_per_gpu * "
                    f"gradient_accumulation_steps * world_size ({why}); "
                    f"got {_describe(*given, world_size)}",
                )
            ]
        )
    return BatchSizes(train, micro, gas)
