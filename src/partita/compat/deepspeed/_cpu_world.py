"""Naming the fix when Accelerate counted one process on a CPU-only torch.

On a torch without CUDA, Accelerate's ``PartialState`` builds no process group unless it is
told to run on CPU (``TrainingArguments(use_cpu=True)``, ``PartialState(cpu=True)``): it finds
no device backend for the launcher's ``LOCAL_RANK`` and settles on "no distributed training",
one process (``accelerate/state.py``, ``_prepare_backend``). The Trainer then fills the config's
``"auto"`` batch sizes for a world of 1 while partita, started by the launcher, trains on every
rank, and the batch identity breaks with a message that names neither Accelerate nor the flag.
This module recognises exactly that situation and adds the flag to the message.
"""

from __future__ import annotations

import sys

from partita.config.errors import ConfigError, Problem

__all__ = ["accelerate_processes", "cpu_world_hint", "with_cpu_world_hint"]

_BATCH_KEY = "train_batch_size"


def accelerate_processes() -> int | None:
    """How many processes Accelerate's ``PartialState`` counted in this process; None when
    Accelerate was never imported or its state not built (nothing it decided to report)."""
    state = sys.modules.get("accelerate.state")
    partial = getattr(state, "PartialState", None)
    # Read the shared state rather than calling PartialState(), which would build one.
    shared = getattr(partial, "_shared_state", None)
    if not shared:
        return None
    processes = shared.get("num_processes")
    return processes if isinstance(processes, int) else None


def _world_size() -> int:
    """The data-parallel world partita runs on: the process group's, else the launcher's."""
    from partita.comm import get_world_size, is_initialized
    from partita.platform import cluster_env

    if is_initialized():
        return get_world_size()
    return cluster_env.detect().world_size


def cpu_world_hint() -> str | None:
    """What to pass, when this is a CPU-only torch, the launcher started more than one rank and
    Accelerate counted one process; None otherwise."""
    from partita.platform.accelerator import get_accelerator

    if get_accelerator().is_cuda or accelerate_processes() != 1:
        return None
    world = _world_size()
    if world <= 1:
        return None
    return (
        f"the launcher started {world} ranks but Accelerate counted 1 process (on a CPU-only "
        "torch it builds no gloo group unless told to run on CPU), so the Hugging Face Trainer "
        "filled the batch sizes for one: pass TrainingArguments(use_cpu=True) (--use_cpu on "
        "the command line); in a plain Accelerate loop, PartialState(cpu=True) before "
        "Accelerator()"
    )


def with_cpu_world_hint(error: ConfigError) -> ConfigError | None:
    """`error` with `cpu_world_hint` added to its batch-size problem, when it has one and the
    hint applies; None when there is nothing to add."""
    if not any(p.path == _BATCH_KEY for p in error.problems):
        return None
    hint = cpu_world_hint()
    if hint is None:
        return None
    problems = [
        Problem(p.path, f"{p.message}. Cause: {hint}") if p.path == _BATCH_KEY else p
        for p in error.problems
    ]
    return ConfigError(problems, error.source)
