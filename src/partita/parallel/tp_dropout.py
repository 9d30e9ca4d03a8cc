"""Dropout under tensor parallelism: the masks of a one-process run, on every tensor rank.

[Note: dropout under tensor parallelism]
Between the blocks' linears the activations are either replicated over the tensor group (the
residual stream: embeddings, a row-parallel output after its sum) or split (a column-parallel
output: this rank's attention heads or hidden units). A replicated activation must get the
same dropout mask on every tensor rank, or the ranks' copies drift apart and the gradients
are wrong with no error; a split one must get this rank's part of one mask of the whole tensor.

partita draws both from the one default generator, kept in lockstep over the tensor group:

- `sync_generators` gives every tensor rank tensor rank 0's CPU and device generator states
  when the model is split (a script seeding with ``seed + rank`` would otherwise give each
  tensor rank its own replicated masks). Data-parallel ranks keep the script's seeding: with
  one seed everywhere (Megatron's and DeepSpeed's convention) they draw equal masks for their
  different samples.
- A replicated dropout needs nothing more: equal states and equal shapes draw equal masks.
- A split dropout draws the mask of the WHOLE tensor (this rank's shape with the split
  dimension times the tensor size) and keeps this rank's slice (`_split_dropout`). That is
  bitwise the mask a one-process run draws, and every tensor rank advances its generator
  alike, so the lockstep holds for the next replicated dropout.

The alternative, Megatron's per-rank stream (`partita.activations.rng`'s tracker, seed + 2718 +
tensor rank) draws only this rank's numbers, but its masks exist in no one-process run (a
reference must replay per-slice streams), and every region must be wrapped in ``fork``.
Drawing the whole mask costs tp x the random numbers of the split dropouts (on CPU torch's
Bernoulli draws one seed per tensor: only the fill is repeated) and one whole-size mask at a
time; in exchange the reference is an untouched model and one stream serves both regions.
Activation checkpointing stays right with no extra state: torch's checkpoint (and
`partita.activations.checkpointing` on it) restores the default generators before recomputing,
so the recomputation draws the same whole masks and keeps the same slices.

Which dropout is split: a `TorchFunctionMode` is active during the forward of each module that
holds column-parallel linears (an attention, an MLP). It follows the region: a column-parallel
linear's output is split, a row-parallel linear's output (summed) replicated. A dropout on a
split activation (``nn.functional.dropout``, ``nn.Dropout``, ``torch.dropout``) is split along
the heads (dim 1 of a 4-D tensor whose dim 1 is this rank's head count: eager attention's
probabilities) or else along the features (the last dimension, as the last column-parallel
linear split them). Scaled-dot-product attention with dropout on split heads draws its mask
inside the kernel, which partita cannot slice: refused with the module named (use eager
attention). The mode is installed only when the model has dropout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from partita.comm import broadcast
from partita.comm.process_group import ProcessGroup

__all__ = ["has_dropout", "install_split_dropout", "sync_generators"]

_RATE_WORDS = ("dropout", "pdrop")
_ARG = {"train": "training"}
"""`torch.dropout`'s keyword names as `nn.functional.dropout`'s."""


def has_dropout(model: nn.Module) -> bool:
    """Whether `model` may draw a dropout mask in training: an ``nn.Dropout`` with p > 0, or a
    config rate above 0 (Llama's ``attention_dropout`` is a float read in the forward)."""
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    for key, value in vars(config).items() if config is not None else ():
        if any(w in key for w in _RATE_WORDS) and isinstance(value, float) and value > 0:
            return True
    return False


def sync_generators(group: ProcessGroup | None, src: int, device: torch.device) -> None:
    """Every rank of `group` takes global rank `src`'s CPU and compute-device generator states
    (collective over `group`; see [Note: dropout under tensor parallelism])."""
    from partita.activations.rng import get_rng_state, set_rng_state

    pairs: list[tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]]] = [
        (torch.get_rng_state, torch.set_rng_state)
    ]
    if device.type != "cpu":
        pairs.append((get_rng_state, set_rng_state))
    for get, put in pairs:
        state = get().to(device)
        broadcast(state, src=src, group=group, tag="init")
        put(state.cpu())


@dataclass(frozen=True)
class _Split:
    """This rank's columns (`ranges`) of a last dimension `width` wide; or, `sequence`, this
    rank's slice of the sequence (dim 1: a row-parallel output under sequence parallelism,
    [Note: sequence-parallel norms] in `partita.parallel.tp_sequence`)."""

    ranges: tuple[tuple[int, int], ...] = ()
    width: int = 0
    sequence: bool = False


class _Region(TorchFunctionMode):
    """The activations flowing through one module holding column-parallel linears: split or
    replicated now; its dropouts drawn accordingly."""

    def __init__(self, name: str, size: int, rank: int, heads: int) -> None:
        super().__init__()
        self.name, self.size, self.rank, self.heads = name, size, rank, heads
        self.split: _Split | None = None

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.split is not None:
            if func is nn.functional.dropout:
                return self._dropout(*args, **kwargs)
            if func is torch.dropout:  # (input, p, train), as some models call it
                return self._dropout(*args, **{_ARG.get(k, k): v for k, v in kwargs.items()})
            if func is nn.functional.scaled_dot_product_attention:
                p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
                if p > 0:
                    raise ValueError(
                        f"{self.name}: scaled_dot_product_attention with dropout_p={p} on this "
                        "tensor rank's heads draws a mask partita cannot match to one process; "
                        "load the model with attn_implementation='eager' for attention dropout "
                        "under tensor parallelism"
                    )
        return func(*args, **kwargs)

    def _dropout(
        self, x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
    ) -> torch.Tensor:
        if not training or p == 0.0:
            return nn.functional.dropout(x, p, training, inplace)
        dim, pieces, full = self._where(x)
        keep = _split_mask(x, p, dim, pieces, full)
        return x.mul_(keep) if inplace else x * keep

    def _where(self, x: torch.Tensor) -> tuple[int, tuple[tuple[int, int], ...], int]:
        """(split dimension, this rank's ranges along it, its whole size) for `x`."""
        if x.dim() == 4 and x.shape[1] == self.heads:
            h = self.heads
            return 1, ((self.rank * h, (self.rank + 1) * h),), h * self.size
        split = self.split
        assert split is not None
        if split.sequence:
            n = x.shape[1]
            return 1, ((self.rank * n, (self.rank + 1) * n),), n * self.size
        if x.shape[-1] == sum(b - a for a, b in split.ranges):
            return x.dim() - 1, split.ranges, split.width
        raise ValueError(
            f"{self.name}: dropout on a tensor-parallel split activation of shape "
            f"{tuple(x.shape)}: neither this rank's {self.heads} heads at dim 1 nor its "
            f"{split.width // self.size} features last, so partita cannot tell which part "
            "of the one-process mask is this rank's"
        )


def _split_mask(
    x: torch.Tensor, p: float, dim: int, pieces: tuple[tuple[int, int], ...], full: int
) -> torch.Tensor:
    """This rank's `pieces` along `dim` of the scaled mask of the whole tensor: what
    ``dropout(whole, p)`` multiplies the whole by (``dropout`` of ones is that mask,
    bitwise), in `x`'s dtype and device."""
    shape = list(x.shape)
    shape[dim] = full
    with torch.no_grad():
        mask = nn.functional.dropout(x.new_ones(shape), p, True)
    parts = [mask.narrow(dim, a, b - a) for a, b in pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def install_split_dropout(
    model: nn.Module,
    columns: dict[str, tuple[tuple[tuple[int, int], ...], int]],
    rows: list[str],
    size: int,
    rank: int,
    sequence: bool = False,
) -> list[str]:
    """Installs a `_Region` on each parent module of the column-parallel linears `columns`
    (name -> this rank's output ranges and the whole width); `rows` are the row-parallel
    linears, whose outputs are replicated, or with `sequence` split by sequence. Returns the
    parents' names. See [Note: dropout under tensor parallelism]."""
    config = getattr(model, "config", None)
    heads = int(getattr(config, "num_attention_heads", 0) or 0) // size
    regions: dict[str, _Region] = {}
    for name in columns:
        parent = name.rpartition(".")[0]
        if parent not in regions:
            regions[parent] = _Region(parent, size, rank, heads)
            _hook_parent(model.get_submodule(parent), regions[parent])
    for name, (ranges, width) in columns.items():
        region = regions[name.rpartition(".")[0]]
        model.get_submodule(name).register_forward_hook(_set_split(region, _Split(ranges, width)))
    after_rows = _Split(sequence=True) if sequence else None
    for name in rows:
        region_of = regions.get(name.rpartition(".")[0])
        if region_of is not None:
            model.get_submodule(name).register_forward_hook(_set_split(region_of, after_rows))
    return sorted(regions)


def _set_split(region: _Region, split: _Split | None) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        region.split = split

    return hook


def _hook_parent(parent: nn.Module, region: _Region) -> None:
    """Enters `region` for `parent`'s forward in training (replicated at entry), leaves it
    after, exception or not."""
    entered: list[bool] = []

    def enter(module: nn.Module, args: Any) -> None:
        if module.training and not entered:
            region.split = None
            region.__enter__()
            entered.append(True)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if entered:
            entered.clear()
            region.split = None
            region.__exit__(None, None, None)

    parent.register_forward_pre_hook(enter)
    parent.register_forward_hook(leave, always_call=True)
