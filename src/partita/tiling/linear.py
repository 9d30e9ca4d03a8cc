"""`TiledLinear`: one linear layer stored as a grid of smaller linear layers (tiles).

Why it lowers the peak under ZeRO-3: partita's stage 3 makes one gathering unit of every module
that owns parameters directly (`partita.zero.stage3.strategy.plan_units`), so each tile is its
own unit. A plain ``nn.Linear(in, out)`` must be all-gathered whole (``in * out`` elements on
every rank at once) before its forward; a ``TiledLinear`` with ``in_splits * out_splits`` tiles
gathers one tile, uses it, releases it and moves on, so the full-weight buffer the layer needs
at a time is about ``in * out / (in_splits * out_splits)`` elements (plus whatever the
prefetch and ``stage3_max_live_parameters`` let run ahead). The same holds in backward, where
each tile is gathered again for its own gradient and its gradient reduce-scattered on its own.
Tiles smaller than ``stage3_param_persistence_threshold`` stay gathered like any small
parameter, so that threshold must be below the tile size for tiling to change anything.

The arithmetic: the input is split along its last dimension at ``in_parts``, the output rows
at ``out_parts`` (`uniform_parts`: the first ``n % k`` parts one larger, DeepSpeed's
``partition_uniform``); output part ``o`` is the sum over ``i`` of tile ``(o, i)`` applied to
input part ``i``, summed in order of ``i``, and the parts are concatenated. Only the last tile
of each row carries a bias, so the bias is added once. The sum over input parts is a different
order of additions than one matrix product, so outputs match ``nn.Linear`` to rounding, not
bitwise, when ``in_splits > 1``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "TileList",
    "TiledLinear",
    "TiledLinearReturnBias",
    "split_tensor_along_last_dim",
    "uniform_parts",
]


def uniform_parts(num_items: int, num_parts: int) -> list[int]:
    """Boundaries (``num_parts + 1`` offsets from 0 to `num_items`) of `num_parts` contiguous
    parts whose sizes differ by at most one, the larger ones first. With fewer items than
    parts, the trailing parts are empty."""
    if num_parts < 1:
        raise ValueError(f"uniform_parts: num_parts={num_parts}, expected at least 1")
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    base, extra = divmod(num_items, num_parts)
    bounds = [0]
    for p in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if p < extra else 0))
    return bounds


def split_tensor_along_last_dim(
    tensor: torch.Tensor, partitions: Sequence[int] | int, contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """`tensor` split along its last dimension (`torch.split`'s `partitions`: a list of sizes
    or one size), each part made contiguous when `contiguous_split_chunks`."""
    parts = torch.split(tensor, partitions, dim=-1)  # type: ignore[arg-type]
    return tuple(p.contiguous() for p in parts) if contiguous_split_chunks else tuple(parts)


class TileList(torch.nn.Module):
    """An indexable list of modules (``linears[out_id][in_id]``, with ModuleList's state-dict
    keys) that is deliberately not an `nn.ModuleList`: partita's ZeRO-3 makes each child of a
    model's outermost ModuleList one gathering unit, which would gather a row of tiles (or
    all of them) at once; tiles in this list stay units of their own."""

    def __init__(self, modules: Sequence[torch.nn.Module]) -> None:
        super().__init__()
        for i, m in enumerate(modules):
            self.add_module(str(i), m)

    def __getitem__(self, index: int) -> Any:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"TileList: index {index} out of range for {n} entries")
        return self._modules[str(index % n)]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Any:
        return iter(self._modules.values())


def _check_splits(name: str, splits: int, features: int, features_name: str) -> None:
    # DeepSpeed raises RuntimeError here; so do we, with the values named.
    if not 1 <= splits <= features:
        raise RuntimeError(
            f"TiledLinear: {name}={splits} must be in the range [1, {features_name}={features}]"
        )


class TiledLinear(torch.nn.Module):
    """A drop-in for ``torch.nn.Linear(in_features, out_features, bias)`` made of
    ``out_splits x in_splits`` tiles (``self.linears[out_id][in_id]``, each a `linear_cls`),
    so that ZeRO-3 gathers one tile at a time (see the module docstring for why that lowers the
    peak). `input_is_already_split`: `forward` takes a sequence of `in_splits` input parts
    instead of one tensor. `combine_out_splits`: False returns the list of output parts
    instead of their concatenation. `init_linear`: a linear layer whose weight (and bias) the
    tiles copy (`copy_params_from`). `kwargs` go to each `linear_cls` call (device, dtype).

    Raises RuntimeError when a split count is outside ``[1, features]``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        in_splits: int = 1,
        out_splits: int = 1,
        input_is_already_split: bool = False,
        combine_out_splits: bool = True,
        linear_cls: type[torch.nn.Module] = torch.nn.Linear,
        init_linear: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        _check_splits("in_splits", in_splits, in_features, "in_features")
        _check_splits("out_splits", out_splits, out_features, "out_features")
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bias
        self.in_splits = in_splits
        self.out_splits = out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = uniform_parts(in_features, in_splits)
        self.out_parts = uniform_parts(out_features, out_splits)
        grid = []
        for o in range(out_splits):
            rows = self.out_parts[o + 1] - self.out_parts[o]
            row = []
            for i in range(in_splits):
                cols = self.in_parts[i + 1] - self.in_parts[i]
                # One bias per output row: on the row's last tile, added once to the sum.
                row.append(linear_cls(cols, rows, bias=bias and i == in_splits - 1, **kwargs))
            grid.append(TileList(row))
        self.linears = TileList(grid)
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_: Any) -> Any:
        """The linear map of `input_` (a tensor, or its `in_splits` parts when
        `input_is_already_split`): one tensor, or the output parts when not
        `combine_out_splits`."""
        inputs = self._input_parts(input_)
        outputs: list[Any] = []
        for o in range(self.out_splits):
            acc: Any = None
            for i in range(self.in_splits):
                acc = self._reduce_local_output(i, o, acc, self.linears[o][i](inputs[i]))
            outputs.append(acc)
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    def _input_parts(self, input_: Any) -> Sequence[Any]:
        if self.in_splits == 1:
            return [input_]
        if self.input_is_already_split:
            if len(input_) != self.in_splits:
                raise ValueError(
                    f"TiledLinear: input_is_already_split with in_splits={self.in_splits}, "
                    f"but forward got {len(input_)} input parts"
                )
            return input_
        width = input_.shape[-1]
        if width != self.in_features:
            raise ValueError(
                f"TiledLinear: input's last dimension is {width}, in_features={self.in_features}"
            )
        return self._split_global_input(input_, self._sizes(self.in_parts))

    @staticmethod
    def _sizes(bounds: list[int]) -> list[int]:
        return [b - a for a, b in itertools.pairwise(bounds)]

    def _split_global_input(self, input: torch.Tensor, split_sizes: list[int]) -> Sequence[Any]:
        """`input` split along its last dimension into parts of `split_sizes` (views).
        Subclasses with other input types override this."""
        return split_tensor_along_last_dim(input, split_sizes)

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        """Adds tile ``(out_id, in_id)``'s output to the running sum of its row (the first
        tile's output is copied, so the sum never aliases a tile's output). Subclasses with
        other output types override this."""
        del in_id, out_id
        return new_out.clone() if current_out is None else current_out + new_out

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        """The output parts concatenated along the last dimension."""
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: torch.nn.Module) -> None:
        """Copies `other`'s weight (``[out_features, in_features]``) and bias into the tiles.
        Under ZeRO-3 this is collective: each tile is gathered, written with rank 0's values
        and re-sharded (`partita.zero.GatheredParameters` with ``modifier_rank=0``).
        Raises ValueError naming the shape or bias that does not match."""
        from partita.zero.gather import GatheredParameters  # zero/ only when copying

        weight = getattr(other, "weight", None)
        if weight is None or tuple(weight.shape) != (self.out_features, self.in_features):
            have = None if weight is None else tuple(weight.shape)
            raise ValueError(
                f"TiledLinear.copy_params_from: weight of shape {have}, expected "
                f"{(self.out_features, self.in_features)}"
            )
        bias = getattr(other, "bias", None)
        if self.use_bias != (bias is not None):
            raise ValueError(
                f"TiledLinear.copy_params_from: bias={self.use_bias} here, but the source "
                f"{'has' if bias is not None else 'has no'} bias"
            )
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(
                f"TiledLinear.copy_params_from: bias of shape {tuple(bias.shape)}, expected "
                f"{(self.out_features,)}"
            )
        for o in range(self.out_splits):
            r0, r1 = self.out_parts[o], self.out_parts[o + 1]
            for i in range(self.in_splits):
                c0, c1 = self.in_parts[i], self.in_parts[i + 1]
                tile = self.linears[o][i]
                with GatheredParameters(tile.weight, modifier_rank=0):
                    tile.weight.copy_(weight[r0:r1, c0:c1])
                if tile.bias is not None:
                    with GatheredParameters(tile.bias, modifier_rank=0):
                        tile.bias.copy_(bias[r0:r1])  # type: ignore[index]


class TiledLinearReturnBias(TiledLinear):
    """`TiledLinear` over tiles that return ``(output, bias)`` instead of adding their bias
    (Megatron-LM's linear layers, which leave the bias to a later fused kernel); `forward`
    returns ``(output, bias)``, the bias being the output parts' biases concatenated, or None
    when no tile has one."""

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        if not (isinstance(new_out, tuple) and len(new_out) == 2):
            raise TypeError(
                "TiledLinearReturnBias: each tile must return (output, bias), got "
                f"{type(new_out).__name__}"
            )
        old_tensor, old_bias = (None, None) if current_out is None else current_out
        tensor, bias = new_out
        summed = super()._reduce_local_output(in_id, out_id, old_tensor, tensor)
        return summed, old_bias if bias is None else bias

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        tensor = super()._combine_output_splits([o[0] for o in outputs])
        biases = [o[1] for o in outputs if o[1] is not None]
        return tensor, (super()._combine_output_splits(biases) if biases else None)
