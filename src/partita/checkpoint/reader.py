"""Reading saved state by parameter name and element range, whatever the saving world size.

[Note: resharding]
A saved trainable parameter is a list of `Segment`s: (offset, length) ranges of its flattened
fp32 state, each stored somewhere in a source (a shard file for partita checkpoints, a rank's
flat partition for DeepSpeed ones). A loading rank asks for the ranges *it* owns under its own
world size and stage (`ParamStates.owned_ranges`); `StateSource.read` intersects them with the
saved segments and copies the overlaps. Padding is never saved, so any world size and stage can
load any other: nothing is converted offline.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from partita.checkpoint.digest import digest_mismatch, expected_digest, file_digest
from partita.checkpoint.experts import join_rows, parse_rows_key
from partita.checkpoint.manifest import (
    MANIFEST_NAME,
    MODULE_PREFIX,
    CheckpointError,
    check_file_name,
    inside,
    state_key,
)
from partita.checkpoint.memfile import MemoryShard, in_memory_limit, read_verified

_ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
"""safetensors dtype codes -> the dtype names manifests use."""


@dataclass(frozen=True)
class Segment:
    """Elements ``[offset, offset + length)`` of a flattened parameter, stored in `source`
    starting at element `position` of that source's tensor for the parameter."""

    offset: int
    length: int
    source: str
    position: int


class StateSource:
    """A saved checkpoint, read by name and range. `meta` has the layout of a partita
    manifest (see `partita.checkpoint.manifest`); formats differ only in `_fetch`,
    `read_module` and `verify`."""

    def __init__(self, folder: str, meta: dict[str, Any]) -> None:
        self.folder = folder
        self.meta = meta
        self.segments: dict[str, list[Segment]] = {}

    @property
    def tensors(self) -> dict[str, dict[str, Any]]:
        """Saved tensor table: name -> kind, shape, dtype (see the manifest)."""
        return self.meta["tensors"]

    def _fetch(self, source: str, name: str, what: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of `source`'s tensor `what` of parameter `name`."""
        raise NotImplementedError

    def has_state(self, source: str, name: str, what: str) -> bool:
        """True when `source` holds state `what` of parameter `name`."""
        raise NotImplementedError

    def read_module(self, name: str) -> torch.Tensor:
        """A frozen parameter or buffer, whole, in its saved dtype."""
        raise NotImplementedError

    def verify(self, rank: int, world: int) -> None:
        """Checks the files this rank is responsible for; raises `CheckpointError`."""

    def check_split(self, name: str, tensor: torch.Tensor) -> None:
        """Raises `CheckpointError` when `tensor`, the loading engine's `name`, is split over
        tensor-parallel ranks otherwise than the source cuts it (a re-cut at another degree,
        see [Note: re-cutting slices]); nothing to check elsewhere."""

    def close(self) -> None:
        """Releases open files."""

    def scalar(self, name: str, what: str) -> torch.Tensor | None:
        """A 0-dim state (Adam's ``step``) of `name`, from any source that holds it."""
        for seg in self.segments.get(name, []):
            if self.has_state(seg.source, name, what):
                return self._fetch(seg.source, name, what, 0, 0)
        return None

    def read(
        self,
        name: str,
        what: str,
        ranges: Sequence[tuple[int, int]],
        *,
        borrow: bool = False,
    ) -> torch.Tensor | None:
        """The saved elements of `ranges` (concatenated, fp32) of state `what` of `name`;
        None when the checkpoint has no such state for the parameter. Overlaps of saved
        segments and asked ranges: see [Note: resharding].

        With `borrow` the result may be a view of the source's own bytes (no copy when one
        saved fp32 segment holds the whole request): read it before `close` and never write
        to it. Without it the result is a fresh tensor the caller owns."""
        segments = self.segments.get(name)
        if not segments:
            raise CheckpointError(f"{self.folder}: no saved state for parameter {name!r}")
        if not any(self.has_state(s.source, name, what) for s in segments):
            return None
        whole = self._whole_piece(name, what, ranges, segments) if borrow else None
        if whole is not None:
            return whole
        total = sum(n for _, n in ranges)
        out = torch.empty(total, dtype=torch.float32)
        filled = 0
        at = 0
        for offset, length in ranges:
            end = offset + length
            for seg in segments:
                lo, hi = max(offset, seg.offset), min(end, seg.offset + seg.length)
                if lo >= hi:
                    continue
                if not self.has_state(seg.source, name, what):
                    raise CheckpointError(
                        f"{os.path.join(self.folder, seg.source)}: no {what!r} state for "
                        f"{name!r} although other files have it"
                    )
                start = seg.position + lo - seg.offset
                piece = self._fetch(seg.source, name, what, start, start + hi - lo)
                out[at + lo - offset : at + hi - offset].copy_(piece.reshape(-1))
                filled += hi - lo
            at += length
        if filled != total:
            raise CheckpointError(
                f"{self.folder}: saved {what!r} of {name!r} covers {filled} of the {total} "
                "requested elements (overlapping or missing shards)"
            )
        return out

    def _whole_piece(
        self, name: str, what: str, ranges: Sequence[tuple[int, int]], segments: list[Segment]
    ) -> torch.Tensor | None:
        """The common case without a copy: one asked range lying inside one saved segment
        (a load at the saving world size and stage) whose stored values are fp32 already.
        The result is then a view of the source's bytes (for a verified file, the checked
        buffer, see [Note: verified bytes]), which the caller copies into its state once;
        None when the general path must assemble the result."""
        if len(ranges) != 1:
            return None
        offset, length = ranges[0]
        for seg in segments:
            if seg.offset <= offset and offset + length <= seg.offset + seg.length:
                if not self.has_state(seg.source, name, what):
                    return None  # the general path names the file lacking it
                start = seg.position + offset - seg.offset
                piece = self._fetch(seg.source, name, what, start, start + length).reshape(-1)
                return piece if piece.dtype == torch.float32 else piece.float()
        return None


class PartitaSource(StateSource):
    """A partita checkpoint folder (safetensors shards + manifest)."""

    def __init__(self, folder: str, manifest: dict[str, Any]) -> None:
        super().__init__(folder, manifest)
        self._open: dict[str, Any] = {}
        self._keys: dict[str, set[str]] = {}
        self._verified: dict[str, torch.Tensor] = {}
        """Files this rank checked and holds in memory (see [Note: verified bytes])."""
        for fname, info in manifest["files"].items():
            check_file_name(fname, os.path.join(folder, MANIFEST_NAME))
            for name, ranges in info["ranges"].items():
                position = 0  # each parameter is its own tensor in the file
                for offset, length in ranges:
                    seg = Segment(int(offset), int(length), fname, position)
                    self.segments.setdefault(name, []).append(seg)
                    position += int(length)

    def _path(self, fname: str) -> str:
        """Path of listed file `fname`, refused if a symbolic link leads it out of the folder."""
        path = os.path.join(self.folder, fname)
        return inside(self.folder, path, path)

    def _file(self, fname: str) -> Any:
        handle = self._open.get(fname)
        if handle is None:
            from safetensors import safe_open

            path = self._path(fname)
            try:
                if fname in self._verified:
                    handle = MemoryShard(path, self._verified.pop(fname))
                else:
                    handle = safe_open(path, framework="pt")
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"{path}: cannot be opened as safetensors ({e})") from e
            self._check_header(fname, handle)
            self._open[fname] = handle
            self._keys[fname] = set(handle.keys())
        return handle

    def _expected(self, fname: str, key: str) -> tuple[str | None, list[int]] | None:
        """(dtype name or None for any, shape) the manifest implies for tensor `key` of
        `fname`; None when the manifest does not describe such a tensor."""
        if key.startswith(MODULE_PREFIX):
            stored = key[len(MODULE_PREFIX) :]
            rows = parse_rows_key(stored)  # a block of a stacked expert weight's rows
            info = self.tensors.get(stored if rows is None else rows[0])
            if info is None:
                return None
            shape = list(info["shape"])
            return info.get("dtype"), shape if rows is None else [rows[2], *shape[1:]]
        what, _, name = key.partition("::")
        ranges = self.meta["files"][fname]["ranges"].get(name)
        if ranges is None:
            return None
        if what in (self.meta.get("scalar_state_keys") or []):
            return None, []
        info = self.tensors.get(name) or {}
        dtype = info.get("state_dtype", self.meta.get("state_dtype", "float32"))
        return dtype, [sum(int(n) for _, n in ranges)]

    def _check_header(self, fname: str, handle: Any) -> None:
        """Every stored tensor's dtype and shape against the manifest, before any value is
        read (a copy into the fp32 result would otherwise cast or truncate silently)."""
        path = os.path.join(self.folder, fname)
        for key in handle.keys():  # noqa: SIM118 - a safe_open handle is not iterable
            want = self._expected(fname, key)
            if want is None:
                raise CheckpointError(f"{path}: holds tensor {key!r}, which the manifest does "
                                      "not describe for this file")  # fmt: skip
            sl = handle.get_slice(key)
            dtype, shape = _ST_DTYPES.get(sl.get_dtype(), sl.get_dtype()), list(sl.get_shape())
            if (want[0] is not None and dtype != want[0]) or shape != want[1]:
                raise CheckpointError(
                    f"{path}: tensor {key!r} is stored as {dtype} of shape {shape}, the "
                    f"manifest says {want[0] or 'any dtype'} of shape {want[1]}"
                )

    def has_state(self, source: str, name: str, what: str) -> bool:
        """True when shard `source` stores `what` of `name`."""
        self._file(source)
        return state_key(what, name) in self._keys[source]

    def _fetch(self, source: str, name: str, what: str, start: int, stop: int) -> torch.Tensor:
        sl = self._file(source).get_slice(state_key(what, name))
        if len(sl.get_shape()) == 0:
            return self._file(source).get_tensor(state_key(what, name))
        return sl[start:stop]

    def read_module(self, name: str) -> torch.Tensor:
        """A frozen parameter or buffer from rank 0's file, or from the file that holds it
        (an expert's, written by a rank holding it: [Note: expert slices] in
        `partita.checkpoint.experts`)."""
        key = MODULE_PREFIX + name
        files = sorted(self.meta["files"].items(), key=lambda item: item[1]["rank"] != 0)
        blocks = []
        for fname, _ in files:
            handle = self._file(fname)
            if key in self._keys[fname]:
                return handle.get_tensor(key)
            for stored in self._keys[fname]:
                rows = parse_rows_key(stored[len(MODULE_PREFIX) :])
                if stored.startswith(MODULE_PREFIX) and rows is not None and rows[0] == name:
                    blocks.append((rows[1], handle.get_tensor(stored)))
        if blocks:  # a frozen stacked expert weight: every group's rows ([Note: stacked expert
            # rows] in `partita.checkpoint.experts`)
            return join_rows(blocks, list(self.tensors[name]["shape"]), f"{self.folder}: {name}")
        raise CheckpointError(f"{self.folder}: no saved tensor {name!r} in any file")

    def verify(self, rank: int, world: int) -> None:
        """Size and digest of files ``i`` with ``i % world == rank`` (every rank a share)."""
        for i, (fname, info) in enumerate(sorted(self.meta["files"].items())):
            if i % world != rank:
                continue
            path = self._path(fname)
            if not os.path.isfile(path):
                raise CheckpointError(
                    f"{path}: missing (the manifest lists it: rank {info['rank']}'s shard)"
                )
            size = os.path.getsize(path)
            if size != info["bytes"]:
                raise CheckpointError(
                    f"{path}: size check failed: {size} bytes, manifest says {info['bytes']} "
                    "(truncated or overwritten)"
                )
            algorithm, expected = expected_digest(info, path)
            if size <= in_memory_limit():
                # One read: hashed as it arrives, then loaded from the same bytes.
                self._verified[fname] = read_verified(path, size, algorithm, expected)
                continue
            got = file_digest(path, algorithm)
            if got != expected:
                raise digest_mismatch(path, algorithm, got, expected)

    def close(self) -> None:
        """Drops the memory maps and the files held in memory."""
        self._open.clear()
        self._verified.clear()


__all__ = ["PartitaSource", "Segment", "StateSource"]
