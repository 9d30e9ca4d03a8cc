"""Reading DeepSpeed ZeRO stage 1, 2 and 3 checkpoints (so DeepSpeed users can move over).

Layouts read (DeepSpeed's defaults, ``zero_optimization.elastic_checkpoint`` off), checked
against files DeepSpeed 0.19.8 writes (tests/test_deepspeed_checkpoints.py)::

    load_dir/latest                  # the tag
    stage 1/2: load_dir/<tag>/mp_rank_00_model_states.pt
        module (16-bit state_dict), param_shapes (per optimizer group: name -> shape, in flat
        order), buffer_names, shared_params, frozen_param_shapes / frozen_param_fragments
        (whole tensors), global_steps, global_samples, skipped_steps, lr_scheduler, ds_config,
        client keys
    stage 1/2: load_dir/<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt (per rank)
        optimizer_state_dict: zero_stage, partition_count, single_partition_of_fp32_groups
        (rank r's contiguous piece of each group's flat fp32 buffer, padding removed),
        base_optimizer_state (the torch optimizer's state_dict over those pieces), loss_scaler
    stage 3: load_dir/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt (per rank)
        as above, but module holds buffers only and frozen_param_fragments rank r's
        partition of each frozen parameter
    stage 3: load_dir/<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt (per rank)
        optimizer_state_dict: zero_stage 3, partition_count, fp32_flat_groups (rank r's flat
        fp32 sub-groups) and optimizer_state_dict (the torch optimizer's state over them)

In stage 3 every parameter is split by itself: rank r holds elements ``[r*k, (r+1)*k)`` of
it, ``k = ceil(numel / world)`` (the last pieces zero-padded), and a rank's sub-groups,
concatenated, are its pieces of the parameters in ``param_shapes`` order.

These files are pickles: unpickling can run arbitrary code, so reading them needs an explicit
``trust_pickle=True`` on the call that reads them (``engine.load_checkpoint(...,
trust_pickle=True)``, ``partita export --trust-pickle``); nothing process-wide (no environment
variable) turns it on, so trusting one checkpoint never trusts the next. DeepSpeed's own classes
inside them (loss scaler, enums, fragment addresses) are replaced by inert stand-ins, so
DeepSpeed need not be installed.
"""

from __future__ import annotations

import glob
import math
import os
import pickle
import re
import types
from typing import Any

import torch

from partita.checkpoint.manifest import CheckpointError
from partita.checkpoint.reader import Segment, StateSource
from partita.checkpoint.state import dtype_name

MODEL_STATES = "mp_rank_00_model_states.pt"
STAGE3_MODEL_STATES = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
_KNOWN_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "frozen_param_fragments", "shared_params", "lr_scheduler", "data_sampler",
    "random_ltd", "sparse_tensor_module_names", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version", "iteration",
    "checkpoint_parallel_dimensions",
}  # fmt: skip


def is_deepspeed_folder(folder: str) -> bool:
    """True when `folder` looks like one DeepSpeed checkpoint tag folder (any ZeRO stage)."""
    return os.path.isfile(os.path.join(folder, MODEL_STATES)) or os.path.isfile(
        os.path.join(folder, STAGE3_MODEL_STATES.format(0))
    )


class _Inert:
    """Stand-in for a class from DeepSpeed's pickles: keeps the attributes (and constructor
    arguments, in `args`), runs nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)


def _enum_value(value: Any) -> Any:
    """DeepSpeed's enums (``ZeroStageEnum``) pickle as ``Class(value)``: keep the value."""
    return value


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] == "deepspeed":
            if name.endswith("Enum"):
                return _enum_value
            return type(name, (_Inert,), {"__module__": module})
        return super().find_class(module, name)


_pickle_module = types.ModuleType("partita_deepspeed_pickle")
_pickle_module.Unpickler = _Unpickler  # type: ignore[attr-defined]
_pickle_module.load = pickle.load  # type: ignore[attr-defined]


def _load(path: str) -> Any:
    try:
        # Explicit opt-in checked by the caller: this file is trusted.
        return torch.load(  # nosec B614
            path, map_location="cpu", weights_only=False, pickle_module=_pickle_module
        )
    except Exception as e:
        raise CheckpointError(f"{path}: cannot be read as a DeepSpeed checkpoint ({e})") from e


def _natural(text: str) -> list[Any]:
    return [int(c) if c.isdigit() else c for c in re.split(r"(\d+)", text)]


def _stage(value: Any) -> int | None:
    """The saved ``zero_stage`` as an int (an enum's value, or an older stand-in's argument)."""
    args = getattr(value, "args", ()) if isinstance(value, _Inert) else ()
    if args:
        value = args[0]
    return int(value) if isinstance(value, int) else None


def _torch_states(base: Any, groups: int) -> list[dict[str, Any]]:
    """Per flat group, the torch optimizer's state over it (a state_dict or DeepSpeed's
    per-group list)."""
    if isinstance(base, dict) and "state" in base:
        return [base["state"].get(g, {}) for g in range(groups)]
    return list(base) if isinstance(base, list) else [{} for _ in range(groups)]


def _concat_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """Stage 3: one rank's sub-groups' states as one flat state (0-dim values from the first)."""
    out: dict[str, Any] = {}
    for key in states[0] if states else []:
        values = [st[key] for st in states]
        if isinstance(values[0], torch.Tensor) and values[0].dim() > 0:
            out[key] = torch.cat([v.reshape(-1) for v in values])
        else:
            out[key] = values[0]
    return out


class DeepSpeedSource(StateSource):
    """A DeepSpeed ZeRO 1/2/3 checkpoint folder as a `StateSource` (see the module docstring).

    Each rank's flat fp32 groups and their optimizer state are held as ``flats[rank][group]``
    (stage 3: one group per rank, its sub-groups concatenated); segments point into them."""

    def __init__(self, folder: str, trust_pickle: bool) -> None:
        if not trust_pickle:
            raise CheckpointError(
                f"{folder} is a DeepSpeed checkpoint: its .pt files are pickles, and loading a "
                "pickle can run arbitrary code from the file. Load it only if you trust its "
                "origin: pass trust_pickle=True to this call (engine.load_checkpoint(..., "
                "trust_pickle=True); partita export --trust-pickle)"
            )
        pattern = os.path.join(folder, "*_optim_states.pt")
        files = sorted(glob.glob(pattern), key=_natural)
        if not files:
            raise CheckpointError(f"{pattern}: no optimizer state files (ZeRO partitions)")
        self.optim = [_load(f)["optimizer_state_dict"] for f in files]
        stage = _stage(self.optim[0].get("zero_stage"))
        if stage not in (1, 2, 3):
            raise CheckpointError(
                f"{files[0]}: zero_stage={stage!r}; partita reads DeepSpeed ZeRO stage 1, 2 and "
                "3 checkpoints"
            )
        count = self.optim[0]["partition_count"]
        world = max(count) if isinstance(count, list) else int(count)
        if world != len(files):
            raise CheckpointError(
                f"{folder}: partition_count={world} but {len(files)} *_optim_states.pt files"
            )
        self.stage = stage
        if stage == 3:
            self.models = [
                _load(os.path.join(folder, STAGE3_MODEL_STATES.format(r))) for r in range(world)
            ]
        else:
            self.models = [_load(os.path.join(folder, MODEL_STATES))]
        self.model = self.models[0]
        self.flats = [self._flat_groups(o) for o in self.optim]
        super().__init__(folder, self._meta(world, stage))
        if stage == 3:
            self._index_stage3(world)
        else:
            self._index_segments()

    def _flat_groups(self, osd: dict[str, Any]) -> list[dict[str, Any]]:
        if self.stage == 3:
            params = osd["fp32_flat_groups"]
            states = _torch_states(osd.get("optimizer_state_dict", {}), len(params))
            flat = _concat_states(states)
            flat["param"] = torch.cat([p.reshape(-1) for p in params])
            return [flat]
        params = osd["single_partition_of_fp32_groups"]
        states = _torch_states(osd.get("base_optimizer_state", {}), len(params))
        return [{**st, "param": p} for st, p in zip(states, params, strict=True)]

    def _index_segments(self) -> None:
        """Stages 1/2: each group's flat buffer is cut into contiguous per-rank pieces."""
        for g, shapes in enumerate(self.model["param_shapes"]):
            parts = [flats[g]["param"].numel() for flats in self.flats]
            starts = [sum(parts[:r]) for r in range(len(parts))]
            offset = 0
            for name, shape in shapes.items():
                n = int(torch.Size(shape).numel())
                for r, (s, size) in enumerate(zip(starts, parts, strict=True)):
                    lo, hi = max(offset, s), min(offset + n, s + size)
                    if lo < hi:
                        seg = Segment(lo - offset, hi - lo, f"{r}:{g}", lo - s)
                        self.segments.setdefault(name, []).append(seg)
                offset += n

    def _index_stage3(self, world: int) -> None:
        """Stage 3: every parameter cut into `world` pieces of ceil(numel / world)."""
        position = 0
        for shapes in self.model["param_shapes"]:
            for name, shape in shapes.items():
                n = int(torch.Size(shape).numel())
                k = math.ceil(n / world)
                for r in range(world):
                    lo, hi = r * k, min(n, (r + 1) * k)
                    if lo < hi:
                        seg = Segment(lo, hi - lo, f"{r}:0", position)
                        self.segments.setdefault(name, []).append(seg)
                position += k
        for r, flats in enumerate(self.flats):
            if flats[0]["param"].numel() < position:
                raise CheckpointError(
                    f"{self.folder}: rank {r}'s fp32_flat_groups hold "
                    f"{flats[0]['param'].numel()} elements, param_shapes need {position}"
                )

    def _meta(self, world: int, stage: int) -> dict[str, Any]:
        module = self.model.get("module") or {}
        tensors: dict[str, dict[str, Any]] = {}
        for shapes in self.model["param_shapes"]:
            for name, shape in shapes.items():
                dt = module[name].dtype if name in module else torch.float32
                tensors[name] = {"kind": "trainable", "shape": list(shape), "dtype": dtype_name(dt)}
        fragments = self.model.get("frozen_param_fragments") or {}
        for name, shape in (self.model.get("frozen_param_shapes") or {}).items():
            dt = fragments[name].dtype if name in fragments else torch.float32
            tensors[name] = {"kind": "frozen", "shape": list(shape), "dtype": dtype_name(dt)}
        for name in self.model.get("buffer_names") or []:
            if name in module:
                t = module[name]
                tensors[name] = {
                    "kind": "buffer",
                    "shape": list(t.shape),
                    "dtype": dtype_name(t.dtype),
                }
        for alias, target in (self.model.get("shared_params") or {}).items():
            tensors[alias] = {
                "kind": "alias",
                "alias_of": target,
                "shape": tensors.get(target, {}).get("shape", []),
            }
        first = self.flats[0]
        keys = sorted({k for st in first for k in st} - {"param"})
        scalar = [k for k in keys
                  if not isinstance(first[0].get(k), torch.Tensor)
                  or first[0][k].dim() == 0]  # fmt: skip
        cfg = self.model.get("ds_config") or {}
        gas = int(cfg.get("gradient_accumulation_steps", 1)) if isinstance(cfg, dict) else 1
        steps = int(self.model.get("global_steps", 0))
        return {
            "format": "deepspeed", "world_size": world, "zero_stage": stage,
            "tensors": tensors, "optimizer_state_keys": keys, "scalar_state_keys": scalar,
            "optimizer": None, "optimizer_param_groups": None,
            "counters": {
                "global_steps": steps,
                "global_samples": int(self.model.get("global_samples", 0)),
                "skipped_steps": int(self.model.get("skipped_steps", 0)),
                "micro_steps": steps * gas,
            },
            "loss_scaler": self._loss_scaler(),
            "lr_scheduler": self.model.get("lr_scheduler"),
            "rng": None, "data_loader": None,
            "client_state": {k: v for k, v in self.model.items() if k not in _KNOWN_KEYS},
        }  # fmt: skip

    def _loss_scaler(self) -> dict[str, Any] | None:
        scaler = self.optim[0].get("loss_scaler")
        attrs = getattr(scaler, "__dict__", {})
        if "cur_scale" not in attrs:
            return None
        if not self.optim[0].get("dynamic_loss_scale", False):
            return {"kind": "static", "scale": float(attrs["cur_scale"])}
        return {
            "kind": "dynamic",
            "cur_scale": float(attrs["cur_scale"]),
            "cur_iter": int(attrs.get("cur_iter", 0)),
            "last_overflow_iter": int(attrs.get("last_overflow_iter", -1)),
            "cur_hysteresis": int(attrs.get("cur_hysteresis", attrs.get("delayed_shift", 1))),
        }

    def _value(self, source: str, what: str) -> Any:
        r, g = (int(x) for x in source.split(":"))
        return self.flats[r][g].get(what)

    def has_state(self, source: str, name: str, what: str) -> bool:
        """True when partition `source` ("rank:group") holds `what`."""
        return self._value(source, what) is not None

    def _fetch(self, source: str, name: str, what: str, start: int, stop: int) -> torch.Tensor:
        value = self._value(source, what)
        if not isinstance(value, torch.Tensor):
            return torch.tensor(float(value), dtype=torch.float32)
        if value.dim() == 0:
            return value.float()
        return value.reshape(-1)[start:stop].float()

    def read_module(self, name: str) -> torch.Tensor:
        """A buffer (from ``module``) or frozen parameter (from ``frozen_param_fragments``;
        stage 3: every rank's piece, joined)."""
        fragments = self.model.get("frozen_param_fragments") or {}
        if name in fragments:
            if self.stage != 3:
                return fragments[name]
            shape = torch.Size(self.model["frozen_param_shapes"][name])
            pieces = [m["frozen_param_fragments"][name].reshape(-1) for m in self.models]
            return torch.cat(pieces)[: shape.numel()].view(shape)
        module = self.model.get("module") or {}
        if name in module:
            return module[name]
        raise CheckpointError(f"{self.folder}/{MODEL_STATES}: no tensor {name!r}")


__all__ = ["MODEL_STATES", "STAGE3_MODEL_STATES", "DeepSpeedSource", "is_deepspeed_folder"]


def load_deepspeed_pickle(path: str) -> Any:
    """One DeepSpeed checkpoint file, unpickled on the CPU with DeepSpeed's own classes replaced
    by inert stand-ins (DeepSpeed need not be installed). The caller must already trust the
    file: for the ``deepspeed.checkpoint`` inspection API, naming the folder is that opt-in, as
    it is in DeepSpeed. Unreadable files raise `CheckpointError` naming the path."""
    return _load(path)
