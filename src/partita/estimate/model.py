"""What the estimator needs to know about a model: its parameters grouped as ZeRO-3 would group
them into units, and (when shapes are known) its activation profile.

Three ways in: a parameter count (`ModelShape.from_count`), a module (`describe_module`: the
units are partita's, `partita.zero.stage3.strategy.default_unit_modules`), or a Hugging Face
config (`from_hf_config`: a folder with ``config.json`` or a config object; the model is built
on the meta device, so no weights are read or allocated).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch

from partita.estimate.activations import ActivationProfile, trace_activations
from partita.estimate.tiled import Tiling, shard_transient, tiled_loss, tiled_mlps
from partita.estimate.ulysses import check_sequence_parallel, rank_attention
from partita.estimate.units import EstimateError

__all__ = [
    "ModelShape",
    "describe_module",
    "from_hf_config",
    "load_hf_config",
    "meta_model",
    "trace_rank",
]

_DEFAULT_UNITS = 32
"""A parameter count alone says nothing about units: assume 32 equal blocks (Llama-7B and
-13B have 32 and 40) unless the largest unit is given."""


@dataclass(frozen=True)
class ModelShape:
    """Parameters by ZeRO-3 unit, and optionally the activations of one micro-batch."""

    name: str
    units: tuple[tuple[int, ...], ...]
    """Each unit's trainable parameter sizes (elements), in build order."""
    frozen: int = 0
    """Elements of parameters without gradients (no masters, gradients or optimizer state)."""
    activations: ActivationProfile | None = None
    """Saved activations at `micro_batch` x `seq_len`, None when only counts are known."""
    micro_batch: int = 0
    seq_len: int = 0
    order: tuple[int, ...] = ()
    """Trainable parameter sizes in the module's registration order (stage 1-2 buckets are
    cut from it, last first); empty when only counts are known (then the units' order)."""
    blocks: int = 0
    """Trainable elements inside the blocks activation checkpointing wraps (the transformer
    blocks: their forward runs again in backward); 0 when unknown."""
    head_unit: int | None = None
    """Trainable elements of the largest unit holding a parameter registered after the last
    block's (the head's: its gradients come first in backward, so ZeRO-3 makes its buffer
    first); 0 when there is none, None when unknown."""
    arrivals: tuple[int, ...] = ()
    """How many of `order`'s parameters, counted from its end, have their gradients after the
    backward of what follows the last block (the head) and then of each block, last block
    first (backward meets parameters about in reverse registration order); empty when
    unknown."""

    @classmethod
    def from_count(
        cls, params: int, largest_unit: int | None = None, name: str | None = None
    ) -> ModelShape:
        """A model known only by its parameter count (and, better, its largest unit)."""
        if params <= 0:
            raise EstimateError(f"parameter count {params} must be > 0")
        unit = largest_unit if largest_unit is not None else -(-params // _DEFAULT_UNITS)
        if not 0 < unit <= params:
            raise EstimateError(f"largest unit {unit} must be in (0, {params}] elements")
        full, rest = divmod(params, unit)
        units = tuple((unit,) for _ in range(full)) + (((rest,),) if rest else ())
        return cls(name or f"{params / 1e9:.3g}B parameters", units)

    @property
    def trainable(self) -> int:
        """Trainable elements."""
        return sum(sum(u) for u in self.units)

    @property
    def total(self) -> int:
        """All elements (trainable and frozen)."""
        return self.trainable + self.frozen

    @property
    def param_order(self) -> tuple[int, ...]:
        """Trainable parameter sizes in registration order (as best known)."""
        return self.order or tuple(n for u in self.units for n in u)

    @property
    def recomputed(self) -> int:
        """Elements whose forward runs again under activation checkpointing: the blocks' when
        known, else every trainable one (an upper bound)."""
        return self.blocks or self.trainable

    @property
    def largest_param(self) -> int:
        """The largest single parameter (a reduce bucket holds at least one)."""
        return max((n for u in self.units for n in u), default=0)

    def unit_sizes(self, persistence_threshold: int) -> tuple[list[int], int]:
        """(sizes of the sharded units, elements that stay gathered): parameters below
        ``stage3_param_persistence_threshold`` are persistent, as in partita's `plan_units`."""
        sizes, persistent = [], 0
        for unit in self.units:
            small = sum(n for n in unit if n < persistence_threshold)
            persistent += small
            if sum(unit) - small:
                sizes.append(sum(unit) - small)
        return sizes, persistent


def describe_module(
    module: torch.nn.Module, unit_modules: Sequence[torch.nn.Module] | None = None
) -> ModelShape:
    """The units partita's stage 3 would build for `module` (tied weights counted once)."""
    from partita.zero.stage3.strategy import default_unit_modules, plan_units

    blocks = list(unit_modules) if unit_modules is not None else default_unit_modules(module)
    plan, _ = plan_units(module, blocks, 0)  # threshold 0: every parameter lands in a unit
    units = []
    index = {id(p): i for i, p in enumerate(p for p in module.parameters() if p.requires_grad)}
    after = max((index.get(id(p), -1) for b in blocks for p in b.parameters()), default=-1)
    head = 0
    for _name, _m, params in plan:
        trainable = tuple(p.numel() for p in params if p.requires_grad)
        if trainable:
            units.append(trainable)
            if any(index.get(id(p), -1) > after for p in params):
                head = max(head, sum(trainable))
    frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    order = tuple(p.numel() for p in module.parameters() if p.requires_grad)
    inside = {id(p): p.numel() for b in blocks for p in b.parameters() if p.requires_grad}
    return ModelShape(
        type(module).__name__,
        tuple(units),
        frozen,
        order=order,
        blocks=sum(inside.values()),
        head_unit=head if blocks else None,
        arrivals=_arrivals(index, after, blocks),
    )


def _arrivals(
    index: dict[int, int], last: int, blocks: Sequence[torch.nn.Module]
) -> tuple[int, ...]:
    """`ModelShape.arrivals` from each trainable parameter's registration index (by id) and
    the last block parameter's: parameters after it (the head's), then after each block's
    first parameter, last block first; a block without trainable parameters adds nothing."""
    firsts = [
        min((index[id(p)] for p in b.parameters() if id(p) in index), default=None) for b in blocks
    ]
    known = [f for f in firsts if f is not None]
    if not known:
        return ()
    count = len(index)
    out = [count - 1 - last]
    for first in reversed(firsts):
        out.append(max(out[-1], count - first) if first is not None else out[-1])
    return tuple(out)


def load_hf_config(source: Any) -> Any:
    """A Hugging Face config from a folder (or its ``config.json``) or a config object."""
    if not isinstance(source, str | os.PathLike):
        if not hasattr(source, "to_dict"):
            raise EstimateError(f"model {source!r} is neither a folder nor a Hugging Face config")
        return source
    path = os.fspath(source)
    folder = os.path.dirname(path) if path.endswith(".json") else path
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise EstimateError(f"model folder {path!r} has no config.json")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder)
    except (ValueError, OSError) as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise EstimateError(f"model folder {path!r}: config.json not readable: {first}") from None


def meta_model(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """`config`'s model (a causal LM when it is one) on the meta device, in training mode."""
    from transformers import AutoModel, AutoModelForCausalLM

    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except ValueError:  # not a causal LM: the bare model
            model = AutoModel.from_config(config, dtype=dtype)
    model.train()
    if getattr(model.config, "use_cache", None):
        model.config.use_cache = False
    return model


def from_hf_config(
    source: Any,
    micro_batch: int,
    seq_len: int,
    dtype: torch.dtype = torch.bfloat16,
    sp: int = 1,
    attention: str = "traced",
    tiling: Tiling | None = None,
) -> ModelShape:
    """The shape of a Hugging Face model with one rank's activations traced at ``micro_batch x
    seq_len`` in `dtype` (built on the meta device: nothing is downloaded or allocated); with
    ``sequence_parallel_size`` `sp`, those of one Ulysses rank holding ``seq_len / sp`` tokens
    ([Note: a rank's activations under Ulysses] in ``ulysses.py``); `attention`: how attention's
    memory is counted (`partita.estimate.ulysses.ATTENTION`); `tiling`: sequence-tiled MLP and
    loss ([Note: tiled compute in the estimate] in ``tiled.py``)."""
    if micro_batch <= 0 or seq_len <= 0:
        raise EstimateError(f"micro_batch {micro_batch} and seq_len {seq_len} must be > 0")
    config = load_hf_config(source)
    check_sequence_parallel(config, sp)
    if seq_len % sp:
        raise EstimateError(
            f"seq_len {seq_len} does not divide by sequence_parallel_size {sp} (each rank "
            "holds seq_len / sp tokens)"
        )
    model = meta_model(config, dtype)
    shape = describe_module(model)
    profile = trace_rank(model, micro_batch, seq_len // sp, sp, attention, tiling)
    name = getattr(config, "_name_or_path", "") or getattr(config, "model_type", "model")
    return replace(
        shape, name=str(name), activations=profile, micro_batch=micro_batch, seq_len=seq_len
    )


def trace_rank(
    model: torch.nn.Module,
    micro_batch: int,
    local_len: int,
    sp: int = 1,
    attention: str = "traced",
    tiling: Tiling | None = None,
) -> ActivationProfile:
    """The activations one rank saves running `model` (built by `meta_model`) on
    ``micro_batch x local_len`` tokens as one of `sp` Ulysses ranks (sp 1: plainly), attention
    counted as `attention` says, MLP and loss tiled as `tiling` says."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from partita.zero.stage3.strategy import default_unit_modules

    tiles = tiling or Tiling()
    blocks = default_unit_modules(model)

    def run(m: torch.nn.Module) -> Any:
        # Fake inputs: Transformers skips its value checks (packed sequences, all-ones masks)
        # for fake tensors, which meta tensors alone would fail (they have no values).
        with FakeTensorMode(allow_non_fake_inputs=True):
            ids = torch.zeros((micro_batch, local_len), dtype=torch.long, device="meta")
            if tiles.loss_tokens is not None:
                return tiled_loss(m, ids, tiles.loss_tokens)
            return m(input_ids=ids, labels=ids) if _has_labels(m) else m(input_ids=ids)

    mlps = tiled_mlps(blocks, tiles.mlp_tokens) if tiles.mlp_tokens else nullcontext()
    with rank_attention(model, sp, attention), mlps:
        profile = trace_activations(model, run, blocks)
    if not tiles.any:
        return profile
    config: Any = model.config
    hidden = int(getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0) or 0)
    recompute = shard_transient(model, blocks, tiles, micro_batch, local_len, hidden)
    return replace(profile, recompute=recompute)


def _has_labels(model: torch.nn.Module) -> bool:
    import inspect

    return "labels" in inspect.signature(model.forward).parameters
