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
resharding, see [Note: resharding]); a load at degree 1 (the whole model) joins the slices
along ``partition_dim`` (`WholeModelSource`). Other degrees are refused, naming both.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    if here != 1:
        raise CheckpointError(
            f"{folder}: saved at tensor-parallel degree {saved}, this engine runs at degree "
            f"{here}; a checkpoint loads at its own degree, or at degree 1 (the whole model, "
            "slices joined); other degrees are not supported yet"
        )
    unknown = [n for n, i in manifest["tensors"].items()
               if _sliced(i) and i["tp"].get("partition_dim") is None]  # fmt: skip
    if unknown:
        raise CheckpointError(
            f"{folder}: saved at tensor-parallel degree {saved}, loading at degree {here} "
            f"joins the slices, but {unknown[:10]} are marked tensor_model_parallel / "
            "model_parallel without a partition_dim (along which dimension they were cut is "
            f"unknown); load at degree {saved}, or set partition_dim on those parameters "
            "when saving"
        )


def _sliced(info: dict[str, Any]) -> bool:
    return isinstance(info.get("tp"), dict) and info["tp"].get("layout") == "sliced"


def _with_shape(info: dict[str, Any], shape: list[int]) -> dict[str, Any]:
    return {**info, "shape": list(shape)}


def _whole_shape(info: dict[str, Any]) -> list[int]:
    """The unsplit shape of a sliced tensor: its slices' sizes along the dimension summed."""
    shapes = info["tp"]["shapes"]
    dim = info["tp"]["partition_dim"]
    whole = list(shapes[0])
    whole[dim] = sum(int(s[dim]) for s in shapes)
    return whole


def join(pieces: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """The whole tensor from the tensor ranks' slices (Megatron's split inverted: with a
    stride ``s`` the whole is cut into ``s * ranks`` chunks and rank ``r`` holds chunks
    ``r, r + ranks, ...``, concatenated)."""
    if stride == 1:
        return torch.cat(pieces, dim)
    chunks = [p.split(p.shape[dim] // stride, dim) for p in pieces]
    return torch.cat([chunks[r][j] for j in range(stride) for r in range(len(pieces))], dim)


class WholeModelSource(StateSource):
    """A tensor-parallel checkpoint read as the whole model (degree 1): sliced tensors are
    joined along their ``partition_dim``, replicated ones read from tensor rank 0's files."""

    def __init__(self, folder: str, manifest: dict[str, Any]) -> None:
        check_degree(manifest, folder, 1)
        self.parts = [
            PartitaSource(folder, slice_meta(manifest, t)) for t in range(saved_degree(manifest))
        ]
        meta = dict(self.parts[0].meta)
        meta["tensors"] = {
            name: _with_shape(info, _whole_shape(info)) if _sliced(info) else info
            for name, info in manifest["tensors"].items()
        }
        super().__init__(folder, meta)
        self.segments = self.parts[0].segments

    def _layout(self, name: str) -> dict[str, Any] | None:
        info = self.tensors.get(name) or {}
        return info["tp"] if _sliced(info) else None

    def _join(self, name: str, pieces: list[torch.Tensor | None]) -> torch.Tensor | None:
        layout = self._layout(name)
        assert layout is not None
        if any(p is None for p in pieces):
            return None
        shaped = [p.reshape(s) for p, s in zip(pieces, layout["shapes"], strict=True)]  # type: ignore[union-attr]
        return join(shaped, int(layout["partition_dim"]), int(layout["partition_stride"]))

    def read(
        self,
        name: str,
        what: str,
        ranges: Sequence[tuple[int, int]],
        *,
        borrow: bool = False,
    ) -> torch.Tensor | None:
        """As `StateSource.read`, over the whole tensor (each slice read whole, joined)."""
        layout = self._layout(name)
        if layout is None:
            return self.parts[0].read(name, what, ranges, borrow=borrow)
        pieces = [
            part.read(name, what, [(0, _numel(shape))])
            for part, shape in zip(self.parts, layout["shapes"], strict=True)
        ]
        whole = self._join(name, pieces)
        if whole is None:
            return None
        flat = whole.reshape(-1)
        return torch.cat([flat[o : o + n] for o, n in ranges]) if ranges else flat[:0]

    def scalar(self, name: str, what: str) -> torch.Tensor | None:
        return self.parts[0].scalar(name, what)

    def has_state(self, source: str, name: str, what: str) -> bool:
        return self.parts[0].has_state(source, name, what)

    def read_module(self, name: str) -> torch.Tensor:
        if self._layout(name) is None:
            return self.parts[0].read_module(name)
        whole = self._join(name, [part.read_module(name) for part in self.parts])
        assert whole is not None
        return whole

    def verify(self, rank: int, world: int) -> None:
        for part in self.parts:
            part.verify(rank, world)

    def close(self) -> None:
        for part in self.parts:
            part.close()


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


__all__ = [
    "WholeModelSource",
    "check_degree",
    "join",
    "saved_degree",
    "slice_file_name",
    "slice_meta",
    "tensor_layout",
]
