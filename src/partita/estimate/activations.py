"""Activation memory, traced once on the meta device: the bytes autograd saves for backward.

Every tensor saved by forward passes through a `saved_tensors_hooks` pack hook; each storage is
counted once (a tensor saved by several ops, or views of it, cost one allocation) and parameters
are left out (they are the model states' item). Forward hooks on the blocks attribute saved bytes
to each block, which gives the figure under activation checkpointing: only each block's input
is kept, and one block's activations are rebuilt at a time in backward. No memory is allocated
and no arithmetic runs, so a 70B model traces in seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ActivationProfile", "trace_activations"]


@dataclass(frozen=True)
class ActivationProfile:
    """What one micro-batch's forward saves for backward (bytes, one rank)."""

    saved: int
    """All saved activations (each storage once)."""
    block_saved: tuple[int, ...]
    """Of those, saved while each block ran."""
    block_inputs: tuple[int, ...]
    """Bytes of each block's input (what checkpointing keeps)."""
    largest: int
    """The largest saved tensor: backward holds its gradient (and a temporary) beside it."""
    storages: tuple[tuple[int, int], ...] = ()
    """Each saved storage as (index of the block saving it or -1 outside blocks, bytes), in
    the order first saved: what `partita.estimate.longest` fits over sequence lengths."""
    recompute: int = 0
    """What a sequence-tiled backward holds at once (``tiled.py``), 0 without tiling."""

    def peak(self, checkpointing: bool) -> int:
        """Peak activation bytes: saved ones plus two of the largest for backward's gradients
        (or a tiled backward's `recompute` when larger); with checkpointing, the block inputs
        and one block's activations instead of all."""
        transient = max(2 * self.largest, self.recompute)
        if not checkpointing or not self.block_saved:
            return self.saved + transient
        outside = self.saved - sum(self.block_saved)
        return outside + sum(self.block_inputs) + max(self.block_saved) + transient


def _is_param(t: torch.Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


def trace_activations(
    module: torch.nn.Module,
    run: Callable[[torch.nn.Module], Any],
    blocks: Sequence[torch.nn.Module] = (),
) -> ActivationProfile:
    """Runs ``run(module)`` (one forward, typically on meta tensors) recording saved tensors;
    `blocks` are the modules checkpointing would wrap (transformer blocks)."""
    seen: dict[int, int] = {}
    where: list[int] = []  # the block (or -1) of each storage, in `seen`'s order
    keep: list[torch.Tensor] = []  # keeps storages alive so their ids are not reused
    current: list[int] = []
    per_block = [0] * len(blocks)
    inputs = [0] * len(blocks)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if _is_param(t):
            return t
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in seen:
            seen[key] = storage.nbytes()
            where.append(current[-1] if current else -1)
            keep.append(t)
            if current:
                per_block[current[-1]] += storage.nbytes()
        return t

    def enter(index: int) -> Callable[..., None]:
        def hook(_m: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            current.append(index)
            given = [*args, kwargs.get("hidden_states")]
            first = next((a for a in given if isinstance(a, torch.Tensor)), None)
            if first is not None:
                inputs[index] = first.numel() * first.element_size()

        return hook

    def leave(_m: torch.nn.Module, _args: Any, _out: Any) -> None:
        current.pop()

    handles = [
        b.register_forward_pre_hook(enter(i), with_kwargs=True) for i, b in enumerate(blocks)
    ]
    handles += [b.register_forward_hook(leave) for b in blocks]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run(module)
    finally:
        for h in handles:
            h.remove()
    largest = max(seen.values(), default=0)
    storages = tuple(zip(where, seen.values(), strict=True))
    return ActivationProfile(sum(seen.values()), tuple(per_block), tuple(inputs), largest, storages)
