"""Checkpoints of a model split over tensor-parallel ranks: one set of shard files per slice.

[Note: tensor-parallel slices]
With a tensor-parallel ``mpu`` (`partita.comm.ParallelDims` with ``tp_world_size > 1``) each
tensor rank's data-parallel group trains a different slice of the model, so each group writes
its own shard files (`slice_file_name`), cut by data-parallel rank as without tensor
parallelism. The manifest records the degree (``tp_world_size``), every file's ``tp_rank``,
and per tensor how it is split (`tensor_layout`, read from the attributes Megatron sets):

- ``{"layout": "replicated"}``: every tensor rank holds it whole (no attribute); tensor rank
  0's files are read;
- ``{"layout": "sliced", "partition_dim": d, "partition_stride": s, "shapes": [...]}``: each
  tensor rank holds a slice (its shape in ``shapes``); ``partition_dim`` is None when the
  parameter says it is split (``tensor_model_parallel`` / ``model_parallel``) but not along
  which dimension: such a checkpoint loads at its own degree only.

Per-rank RNG and data loader states are kept per slice (``tp_rank_state``; ``rng`` and
``data_loader`` are tensor rank 0's, as a tp-1 reader expects). A load at the saving degree
reads its own slice's files (`slice_meta`), at any data-parallel size and stage (the usual
resharding, see [Note: resharding]). A load at another degree (1 being the whole model, the
slices joined) re-cuts every split tensor, master weights and optimizer state, from the saved
slices along ``partition_dim`` (`RecutSource`, [Note: re-cutting slices]), then reshards it
over the data-parallel ranks as usual; its RNG and data loader states are tensor rank 0's. A
tp-1 checkpoint records no split, and loads at degree 1 only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from partita.checkpoint.manifest import CheckpointError
from partita.checkpoint.reader import PartitaSource, StateSource

REPLICATED = {"layout": "replicated"}


def saved_degree(meta: dict[str, Any] | None) -> int:
    """The tensor-parallel degree a manifest was saved at (1 for older or tp-1 manifests)."""
    return int((meta or {}).get("tp_world_size", 1))


def slice_file_name(tp_rank: int, tp_world: int, rank: int, world: int) -> str:
    """Name of data-parallel rank `rank`'s file of tensor slice `tp_rank`."""
    return f"tp{tp_rank:02d}-of-{tp_world:02d}-rank{rank:05d}-of-{world:05d}.safetensors"


def tensor_layout(tensor: torch.Tensor) -> dict[str, Any]:
    """How `tensor` is split over the tensor ranks, from the attributes Megatron's layers set
    (``tensor_model_parallel``, or DeepSpeed's older ``model_parallel``, with
    ``partition_dim`` and ``partition_stride``); replicated without them."""
    if not (
        getattr(tensor, "tensor_model_parallel", False) or getattr(tensor, "model_parallel", False)
    ):
        return dict(REPLICATED)
    dim = getattr(tensor, "partition_dim", None)
    if dim is not None:
        dim = int(dim) % max(tensor.dim(), 1)  # Megatron allows -1
    stride = int(getattr(tensor, "partition_stride", 1) or 1)
    return {"layout": "sliced", "partition_dim": dim, "partition_stride": stride}


def slice_meta(manifest: dict[str, Any], tp_rank: int) -> dict[str, Any]:
    """`manifest` as tensor slice `tp_rank` sees it: its files only, its tensors' shapes, its
    ranks' RNG and data loader states. A tp-1 manifest is returned as it is."""
    if saved_degree(manifest) == 1:
        return manifest
    meta = dict(manifest)
    meta["files"] = {
        name: info for name, info in manifest["files"].items() if info.get("tp_rank") == tp_rank
    }
    meta["tensors"] = {
        name: _with_shape(info, info["tp"]["shapes"][tp_rank]) if _sliced(info) else info
        for name, info in manifest["tensors"].items()
    }
    state = (manifest.get("tp_rank_state") or [{}] * (tp_rank + 1))[tp_rank]
    meta.update({k: state[k] for k in ("rng", "data_loader") if k in state})
    return meta


def check_degree(manifest: dict[str, Any], folder: str, here: int) -> None:
    """Raises unless a checkpoint saved at `manifest`'s degree can load at degree `here`."""
    saved = saved_degree(manifest)
    if saved == here:
        return
    if saved == 1:
        raise CheckpointError(
            f"{folder}: saved at tensor-parallel degree 1, this engine runs at degree {here}; "
            "a tp-1 checkpoint records no split to cut its tensors by: load it at degree 1"
        )
    unknown = [n for n, i in manifest["tensors"].items()
               if _sliced(i) and i["tp"].get("partition_dim") is None]  # fmt: skip
    if unknown:
        raise CheckpointError(
            f"{folder}: saved at tensor-parallel degree {saved}, loading at degree {here} "
            f"re-cuts the slices, but {unknown[:10]} are marked tensor_model_parallel / "
            "model_parallel without a partition_dim (along which dimension they were cut is "
            f"unknown); load at degree {saved}, or set partition_dim on those parameters "
            "when saving"
        )


def _sliced(info: dict[str, Any]) -> bool:
    return isinstance(info.get("tp"), dict) and info["tp"].get("layout") == "sliced"


def _with_shape(info: dict[str, Any], shape: list[int]) -> dict[str, Any]:
    return {**info, "shape": list(shape)}


def _pieces(
    layout: dict[str, Any], degree: int, rank: int, name: str
) -> list[tuple[int, int, int]]:
    """Where rank `rank` of `degree` finds its slice of a tensor saved with `layout`: ``(saved
    tensor rank, start, length)`` along ``partition_dim`` in that rank's saved slice, in
    order (see [Note: re-cutting slices])."""
    dim, stride = int(layout["partition_dim"]), int(layout["partition_stride"])
    sizes = [int(shape[dim]) for shape in layout["shapes"]]
    if any(size % stride for size in sizes):
        raise CheckpointError(
            f"{name!r}: saved slices of sizes {sizes} along dimension {dim} do not hold "
            f"{stride} equal parts each (partition_stride {stride})"
        )
    chunks = [size // stride for size in sizes]  # each saved rank's part of one stride group
    group = sum(chunks)
    if group % degree:
        raise CheckpointError(
            f"{name!r}: each of its {stride} parts along dimension {dim} is {group} wide, "
            f"which does not split evenly over tensor-parallel degree {degree}"
        )
    lo, hi = rank * group // degree, (rank + 1) * group // degree
    out = []
    for part in range(stride):
        at = 0
        for saved, chunk in enumerate(chunks):
            a, b = max(lo, at), min(hi, at + chunk)
            if a < b:
                out.append((saved, part * chunk + a - at, b - a))
            at += chunk
    return out


def recut(
    read: Callable[[int], torch.Tensor],
    layout: dict[str, Any],
    degree: int,
    rank: int,
    name: str,
) -> torch.Tensor:
    """[Note: re-cutting slices]
    Rank `rank`'s slice at tensor-parallel `degree` of a tensor saved with `layout` (sliced:
    ``partition_dim``, ``partition_stride``, the saved ranks' ``shapes``); `read(t)` gives
    saved tensor rank ``t``'s slice, shaped, and is called only for the slices that overlap.

    Megatron's strided split: with stride ``s`` the whole tensor is ``s`` parts along the
    dimension (a fused [q | k | v] has three, a packed [gate | up] two) and each rank holds
    its share of every part, concatenated. A re-cut so takes, part by part, the range of the
    new rank's share from the saved ranks whose shares overlap it; degree 1 joins the slices.
    The training planner cuts every fused, grouped-head and vocabulary split this way (it
    marks a parameter with ``partition_dim`` only then), so the slice equals what the planner
    gives the new rank. Only elements move: a re-cut of a re-cut is bitwise the original."""
    dim = int(layout["partition_dim"])
    saved: dict[int, torch.Tensor] = {}
    parts = []
    for t, start, length in _pieces(layout, degree, rank, name):
        if t not in saved:
            saved[t] = read(t)
        parts.append(saved[t].narrow(dim, start, length))
    return torch.cat(parts, dim) if len(parts) > 1 else parts[0].clone()


def cut_shape(layout: dict[str, Any], degree: int, rank: int, name: str) -> list[int]:
    """The shape of rank `rank`'s slice at `degree` of a tensor saved with `layout`."""
    dim = int(layout["partition_dim"])
    shape = list(layout["shapes"][0])
    shape[dim] = sum(n for _, _, n in _pieces(layout, degree, rank, name))
    return shape


class RecutSource(StateSource):
    """A tensor-parallel checkpoint read as rank `rank` of another tensor degree `degree`
    (degree 1: the whole model): sliced tensors re-cut from the saved slices (see [Note:
    re-cutting slices]), master weights and optimizer state alike; replicated ones, scalar
    state, RNG and data loader states from tensor rank 0's files, as at degree 1."""

    def __init__(
        self, folder: str, manifest: dict[str, Any], degree: int = 1, rank: int = 0
    ) -> None:
        check_degree(manifest, folder, degree)
        self.degree, self.rank = degree, rank
        self.parts = [
            PartitaSource(folder, slice_meta(manifest, t)) for t in range(saved_degree(manifest))
        ]
        meta = dict(self.parts[0].meta)
        meta["tensors"] = {
            name: _with_shape(info, cut_shape(info["tp"], degree, rank, name))
            if _sliced(info)
            else info
            for name, info in manifest["tensors"].items()
        }
        super().__init__(folder, meta)
        self.segments = self.parts[0].segments

    def _layout(self, name: str) -> dict[str, Any] | None:
        info = self.tensors.get(name) or {}
        return info["tp"] if _sliced(info) else None

    def _cut(self, name: str, layout: dict[str, Any], what: str | None) -> torch.Tensor | None:
        """This rank's slice of state `what` of `name` (None: the module tensor)."""
        shapes = layout["shapes"]

        def read(t: int) -> torch.Tensor:
            part = self.parts[t]
            if what is None:
                return part.read_module(name)
            piece = part.read(name, what, [(0, _numel(shapes[t]))])
            if piece is None:
                raise _Absent
            return piece.reshape(shapes[t])

        try:
            return recut(read, layout, self.degree, self.rank, name)
        except _Absent:
            return None

    def read(
        self,
        name: str,
        what: str,
        ranges: Sequence[tuple[int, int]],
        *,
        borrow: bool = False,
    ) -> torch.Tensor | None:
        """As `StateSource.read`, over this rank's re-cut slice of the tensor."""
        layout = self._layout(name)
        if layout is None:
            return self.parts[0].read(name, what, ranges, borrow=borrow)
        mine = self._cut(name, layout, what)
        if mine is None:
            return None
        flat = mine.reshape(-1)
        return torch.cat([flat[o : o + n] for o, n in ranges]) if ranges else flat[:0]

    def scalar(self, name: str, what: str) -> torch.Tensor | None:
        return self.parts[0].scalar(name, what)

    def has_state(self, source: str, name: str, what: str) -> bool:
        return self.parts[0].has_state(source, name, what)

    def read_module(self, name: str) -> torch.Tensor:
        layout = self._layout(name)
        if layout is None:
            return self.parts[0].read_module(name)
        mine = self._cut(name, layout, None)
        assert mine is not None
        return mine

    def check_split(self, name: str, tensor: torch.Tensor) -> None:
        """Raises unless `tensor` (this engine's slice of `name`) is split as the saved slices
        were, along the same ``partition_dim`` with the same ``partition_stride``: the re-cut
        is then the engine's own cut. At degree 1 the shapes say enough."""
        if self.degree == 1:
            return
        saved, here = self._layout(name), tensor_layout(tensor)
        if saved is None and here == REPLICATED:
            return
        keys = ("partition_dim", "partition_stride")
        if saved is None or here == REPLICATED or any(saved[k] != here[k] for k in keys):
            raise CheckpointError(
                f"{self.folder}: {name!r} is saved {_describe(saved)} but "
                f"{_describe(None if here == REPLICATED else here)} in this engine; a "
                "re-cut needs the same split at both degrees"
            )

    def verify(self, rank: int, world: int) -> None:
        for part in self.parts:
            part.verify(rank, world)

    def close(self) -> None:
        for part in self.parts:
            part.close()


class _Absent(Exception):
    """A saved slice without the state asked for (`RecutSource._cut` returns None)."""


def _describe(layout: dict[str, Any] | None) -> str:
    if layout is None:
        return "replicated"
    return (
        f"split along dimension {layout.get('partition_dim')} with partition_stride "
        f"{layout.get('partition_stride')}"
    )


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


__all__ = [
    "RecutSource",
    "check_degree",
    "cut_shape",
    "recut",
    "saved_degree",
    "slice_file_name",
    "slice_meta",
    "tensor_layout",
]
