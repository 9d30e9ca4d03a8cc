"""The engine's state as checkpoint entries: which tensors exist, plain-data state, RNG.

Tensors are named by the module's ``state_dict()`` keys. A parameter the strategy trains is
"trainable" (its fp32 master and optimizer state are sharded over ranks); other parameters are
"frozen" and buffers "buffer" (both replicated, saved once by rank 0 in the module's dtype); a
key whose tensor already appeared under another name (tied weights) is an "alias".
"""

from __future__ import annotations

import base64
import random
from dataclasses import dataclass
from typing import Any

import torch

from partita.accelerator import get_accelerator
from partita.checkpoint.manifest import CheckpointError


@dataclass(frozen=True)
class Entry:
    """One ``state_dict`` key of the module."""

    name: str
    tensor: torch.Tensor
    kind: str
    """"trainable", "frozen", "buffer" or "alias"."""
    alias_of: str | None = None


def inventory(engine: Any) -> list[Entry]:
    """The module's state entries in ``state_dict`` order (see the module docstring)."""
    strategy = engine.strategy
    seen: dict[int, str] = {}
    entries = []
    param_ids = {id(p) for p in engine.module.parameters()}
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            continue  # `_extra_state` objects are not tensors; modules re-create them
        if id(t) in seen:
            entries.append(Entry(name, t, "alias", seen[id(t)]))
            continue
        seen[id(t)] = name
        kind = ("trainable" if strategy.owns(t) else "frozen") if id(t) in param_ids else "buffer"
        entries.append(Entry(name, t, kind))
    return entries


def full_module_value(entry: Entry) -> torch.Tensor:
    """A copy of a frozen parameter's or buffer's full value. Stage 3 shards frozen parameters
    too, so they are gathered first (a collective: every rank calls this, in the same order;
    a no-op gather for other stages)."""
    from partita.zero.gather import GatheredParameters

    if entry.kind != "frozen":
        return entry.tensor.detach().clone()
    with GatheredParameters([entry.tensor]):
        return entry.tensor.detach().clone()


@torch.no_grad()
def set_module_value(entry: Entry, value: torch.Tensor) -> None:
    """Writes a frozen parameter's or buffer's full value (the same on every rank). Under
    stage 3 the new value becomes every rank's shard (collective, like `full_module_value`)."""
    from partita.zero.gather import GatheredParameters

    if entry.kind != "frozen":
        entry.tensor.copy_(value.reshape(entry.tensor.shape))
        return
    with GatheredParameters([entry.tensor], modifier_rank=0):
        entry.tensor.copy_(value.reshape(entry.tensor.shape))


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """Inverse of `dtype_name`."""
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in manifest")
    return value


def to_plain(value: Any, where: str) -> Any:
    """`value` as JSON data (tuples become lists, 0-dim tensors numbers); raises
    `CheckpointError` naming the first key path that is not plain data."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value  # inf/nan round-trip through Python's json (Infinity/NaN)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return to_plain(value.item(), where)
    if isinstance(value, list | tuple):
        return [to_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str | int):
                raise CheckpointError(f"{where}: key {k!r} is a {type(k).__name__}, not str")
            out[str(k)] = to_plain(v, f"{where}[{k!r}]")
        return out
    raise CheckpointError(
        f"{where} is a {type(value).__name__}; checkpoints store plain JSON data only "
        "(dict, list, str, int, float, bool, None)"
    )


def check_client_state(client_state: Any) -> Any:
    """`client_state` itself, checked to be JSON data; a value that is not raises
    `CheckpointError` naming its key path."""
    if not isinstance(client_state, dict):
        raise CheckpointError(f"client_state must be a dict, got {type(client_state).__name__}")
    _refuse_non_json(client_state, "client_state")
    return client_state


def _refuse_non_json(value: Any, where: str) -> None:
    if value is None or isinstance(value, bool | int | float | str):
        return
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _refuse_non_json(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise CheckpointError(f"{where}: key {k!r} is a {type(k).__name__}, not str")
            _refuse_non_json(v, f"{where}[{k!r}]")
        return
    raise CheckpointError(
        f"{where} is a {type(value).__name__}, not JSON data; client_state must hold plain "
        "data (dict, list, str, int, float, bool, None); save tensors in the model or as lists"
    )


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    """This process's RNG states (Python, NumPy, torch CPU, CUDA devices) as JSON data."""
    version, internal, gauss = random.getstate()
    out: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "torch_cpu": _b64(torch.get_rng_state()),
    }
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        out["numpy"] = [kind, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    if get_accelerator().is_cuda:
        out["cuda"] = [_b64(s) for s in get_accelerator().get_rng_states()]
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Restores `rng_state` output."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(_unb64(state["torch_cpu"]))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and get_accelerator().is_cuda:
        get_accelerator().set_rng_states([_unb64(s) for s in state["cuda"]])


def optimizer_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's hyperparameters (everything but the tensors) as JSON data."""
    return [
        to_plain({k: v for k, v in g.items() if k != "params"}, f"optimizer.param_groups[{i}]")
        for i, g in enumerate(optimizer.param_groups)
    ]


def restore_optimizer_groups(optimizer: torch.optim.Optimizer, saved: list[dict]) -> None:
    """Writes saved hyperparameters back (only keys both sides have; groups by position)."""
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint has {len(saved)} optimizer parameter groups, the optimizer has "
            f"{len(optimizer.param_groups)}"
        )
    for group, values in zip(optimizer.param_groups, saved, strict=True):
        for k, v in values.items():
            if k not in group or k == "params":
                continue
            current = group[k]
            if isinstance(current, torch.Tensor):
                current.fill_(v)
            elif isinstance(current, tuple) and isinstance(v, list):
                group[k] = tuple(v)
            else:
                group[k] = v


__all__ = [
    "Entry",
    "check_client_state",
    "dtype_name",
    "full_module_value",
    "inventory",
    "optimizer_groups",
    "parse_dtype",
    "restore_optimizer_groups",
    "rng_state",
    "set_module_value",
    "set_rng_state",
    "to_plain",
]
