"""Reading DeepSpeed ZeRO stage 1 and 2 checkpoints (so DeepSpeed users can move over).

Layout read (DeepSpeed's default, ``zero_optimization.elastic_checkpoint`` off)::

    load_dir/latest                  # the tag
    load_dir/<tag>/mp_rank_00_model_states.pt
        module (16-bit state_dict), param_shapes (per optimizer group: name -> shape, in flat
        order), buffer_names, shared_params, frozen_param_shapes / frozen_param_fragments,
        global_steps, global_samples, skipped_steps, lr_scheduler, ds_config, client keys
    load_dir/<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt   (one per data-parallel rank)
        optimizer_state_dict: zero_stage, partition_count, single_partition_of_fp32_groups
        (rank r's fp32 partition of each group's flat buffer), base_optimizer_state (the torch
        optimizer's state_dict over those partitions), loss_scaler

Stage 3 checkpoints (``fp32_flat_groups``, per-rank model states) are refused with a clear
error. These files are pickles: unpickling can run arbitrary code, so reading them needs an
explicit ``trust_pickle=True`` (``partita export --trust-pickle``, or ``PARTITA_TRUST_PICKLE=1``
for ``engine.load_checkpoint``). DeepSpeed's own classes inside them (its loss scaler) are
replaced by inert stand-ins, so DeepSpeed need not be installed.
"""

from __future__ import annotations

import glob
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
TRUST_ENV = "PARTITA_TRUST_PICKLE"
_KNOWN_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "frozen_param_fragments", "shared_params", "lr_scheduler", "data_sampler",
    "random_ltd", "sparse_tensor_module_names", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version", "iteration",
}  # fmt: skip


def is_deepspeed_folder(folder: str) -> bool:
    """True when `folder` looks like one DeepSpeed checkpoint tag folder."""
    return os.path.isfile(os.path.join(folder, MODEL_STATES))


def pickle_trusted(trust_pickle: bool) -> bool:
    """The opt-in: the argument or ``PARTITA_TRUST_PICKLE=1``."""
    return trust_pickle or os.environ.get(TRUST_ENV, "") in ("1", "true", "yes")


class _Inert:
    """Stand-in for a class from DeepSpeed's pickles: keeps the attributes, runs nothing."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] == "deepspeed":
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


class DeepSpeedSource(StateSource):
    """A DeepSpeed ZeRO 1/2 checkpoint folder as a `StateSource` (see the module docstring)."""

    def __init__(self, folder: str, trust_pickle: bool) -> None:
        if not pickle_trusted(trust_pickle):
            raise CheckpointError(
                f"{folder} is a DeepSpeed checkpoint: its .pt files are pickles, and loading a "
                "pickle can run arbitrary code from the file. Load it only if you trust its "
                "origin: pass trust_pickle=True (partita export --trust-pickle; for "
                f"engine.load_checkpoint set {TRUST_ENV}=1)"
            )
        self.model = _load(os.path.join(folder, MODEL_STATES))
        pattern = os.path.join(folder, "*_optim_states.pt")
        files = sorted(glob.glob(pattern), key=_natural)
        if not files:
            raise CheckpointError(f"{pattern}: no optimizer state files (ZeRO partitions)")
        self.optim = [_load(f)["optimizer_state_dict"] for f in files]
        stage = self.optim[0].get("zero_stage")
        if stage not in (1, 2):
            raise CheckpointError(
                f"{files[0]}: zero_stage={stage!r}; partita reads DeepSpeed ZeRO stage 1 and 2 "
                "checkpoints"
            )
        count = self.optim[0]["partition_count"]
        world = max(count) if isinstance(count, list) else int(count)
        if world != len(files):
            raise CheckpointError(
                f"{folder}: partition_count={world} but {len(files)} *_optim_states.pt files"
            )
        self.states = [self._group_states(o) for o in self.optim]
        super().__init__(folder, self._meta(world, stage))
        self._index_segments()

    @staticmethod
    def _group_states(osd: dict[str, Any]) -> list[dict[str, Any]]:
        base = osd.get("base_optimizer_state", {})
        if isinstance(base, dict) and "state" in base:
            return [
                base["state"].get(g, {}) for g in range(len(osd["single_partition_of_fp32_groups"]))
            ]
        return list(base) if isinstance(base, list) else []

    def _index_segments(self) -> None:
        for g, shapes in enumerate(self.model["param_shapes"]):
            parts = [o["single_partition_of_fp32_groups"][g].numel() for o in self.optim]
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

    def _meta(self, world: int, stage: int) -> dict[str, Any]:
        module = self.model.get("module") or {}
        tensors: dict[str, dict[str, Any]] = {}
        for shapes in self.model["param_shapes"]:
            for name, shape in shapes.items():
                dt = module[name].dtype if name in module else torch.float32
                tensors[name] = {"kind": "trainable", "shape": list(shape), "dtype": dtype_name(dt)}
        for name, shape in (self.model.get("frozen_param_shapes") or {}).items():
            tensors[name] = {"kind": "frozen", "shape": list(shape), "dtype": "float32"}
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
        keys = sorted({k for st in self.states[0] for k in st})
        scalar = [k for k in keys
                  if not isinstance(self.states[0][0].get(k), torch.Tensor)
                  or self.states[0][0][k].dim() == 0]  # fmt: skip
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
        if what == "param":
            return self.optim[r]["single_partition_of_fp32_groups"][g]
        return self.states[r][g].get(what)

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
        """A buffer (from ``module``) or frozen parameter (from ``frozen_param_fragments``)."""
        fragments = self.model.get("frozen_param_fragments") or {}
        if name in fragments:
            return fragments[name]
        module = self.model.get("module") or {}
        if name in module:
            return module[name]
        raise CheckpointError(f"{self.folder}/{MODEL_STATES}: no tensor {name!r}")


__all__ = ["MODEL_STATES", "TRUST_ENV", "DeepSpeedSource", "is_deepspeed_folder",
           "pickle_trusted"]  # fmt: skip
