"""Checkpoints at disk speed with integrity kept (issue 21 item 1): the mechanisms, not timings
(those are in ``benchmarks/bench_checkpoint.py``).

- Save: the disk writes while the file is produced (``sync_file_range`` windows, see [Note:
  streaming writeback] in `partita.checkpoint.stfile`); a file spanning many windows reads
  back bitwise, with the digest (XXH3-128) the writer recorded, and the ranges went out before the
  final fsync.
- Load: each rank's file is read once, hashed as it arrives and loaded from the same bytes
  (see [Note: verified bytes] in `partita.checkpoint.memfile`): a file changed on disk after
  its check cannot reach the engine.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import pytest
import torch
import xxhash
from safetensors.torch import load_file

import partita
from models import global_batches, make_model, rank_micro_batch
from partita.checkpoint import stfile
from partita.checkpoint.manifest import CheckpointError
from partita.checkpoint.memfile import MemoryShard
from partita.testing import run_distributed


def test_file_across_writeback_windows_reads_back_bitwise(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stfile, "_WRITEBACK_WINDOW", 1 << 20)
    monkeypatch.setattr(stfile, "_WRITE_CHUNK", 300_000)  # pieces straddle the windows
    events: list[tuple[str, int, int]] = []
    real_sync = stfile._range_sync

    def record_sync(fd: int, offset: int, nbytes: int, flags: int) -> None:
        events.append(("range", offset, nbytes))
        real_sync(fd, offset, nbytes, flags)

    real_fsync = os.fsync

    def record_fsync(fd: int) -> None:
        events.append(("fsync", fd, 0))
        real_fsync(fd)

    monkeypatch.setattr(stfile, "_range_sync", record_sync)
    monkeypatch.setattr(os, "fsync", record_fsync)
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(700_000, generator=gen),
        "b": torch.randint(0, 100, (3, 123_457), generator=gen, dtype=torch.int64),
        "c": torch.randn(5, dtype=torch.float64, generator=gen),
    }
    path = str(tmp_path / "x.safetensors")
    written = stfile.write_safetensors(path, tensors)
    with open(path, "rb") as f:
        data = f.read()
    assert written.nbytes == len(data) and written.digest == xxhash.xxh3_128(data).hexdigest()
    back = load_file(path)
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    ranges = [e for e in events if e[0] == "range"]
    first_fsync = next(i for i, e in enumerate(events) if e[0] == "fsync")
    # Every window but the last went out before the final fsync, in order, without gaps.
    assert ranges and events.index(ranges[-1]) < first_fsync
    starts = sorted({(o, n) for _, o, n in ranges})
    assert starts[0][0] == 0
    assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(starts))
    assert starts[-1][0] + starts[-1][1] > len(data) - 2 * (1 << 20)


def _train_and_save(root: str) -> dict[str, torch.Tensor]:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**6,
    }
    engine, *_ = partita.initialize(model=make_model(seed=2), config=cfg)
    for batch in global_batches(2, 2, seed=3):
        tokens, targets = rank_micro_batch(batch, 0, 1, 2, 0)
        engine.backward(engine(tokens, targets))
        engine.step()
    engine.save_checkpoint(root, tag="t")
    saved = {n: engine.param_states.local_state(p, "exp_avg") for n, p in
             engine.module.named_parameters()}  # fmt: skip
    engine.destroy()
    return saved


def changed_after_check_worker(root: str) -> dict[str, Any]:
    """Saves, then loads with the shard file overwritten right after its check (a change on
    disk between the check and the read); returns whether the loaded state is the saved."""
    from partita.checkpoint.reader import PartitaSource

    saved = _train_and_save(root)
    checked = PartitaSource.verify

    def verify_then_change(self: Any, rank: int, world: int) -> None:
        checked(self, rank, world)
        for fname in self.meta["files"]:
            path = os.path.join(self.folder, fname)
            size = os.path.getsize(path)
            with open(path, "r+b") as f:  # garbage over the second half (tensor data)
                f.seek(size // 2)
                f.write(b"\x7f" * (size - size // 2))

    PartitaSource.verify = verify_then_change  # type: ignore[method-assign]
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**6,
    }
    engine, *_ = partita.initialize(model=make_model(seed=9), config=cfg)
    engine.load_checkpoint(root, tag="t")
    loaded = {n: engine.param_states.local_state(p, "exp_avg") for n, p in
              engine.module.named_parameters()}  # fmt: skip
    return {"same": all(torch.equal(saved[n], loaded[n]) for n in saved)}


def test_load_uses_the_bytes_it_verified(tmp_path: Any) -> None:
    (result,) = run_distributed(changed_after_check_worker, 1, str(tmp_path), timeout=180)
    assert result["same"] is True


@pytest.mark.parametrize(
    "header",
    [
        b'{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,64]}}',  # past the end
        b'{"x":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}}',  # size mismatch
        b'{"x":{"dtype":"Q8","shape":[4],"data_offsets":[0,16]}}',  # unknown dtype
        b'{"x":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}}',  # negative shape
        b"[1, 2]",
        b"not json",
    ],
)
def test_memory_shard_rejects_bad_headers_naming_the_file(header: bytes) -> None:
    raw = len(header).to_bytes(8, "little") + header + bytes(16)
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    with pytest.raises(CheckpointError, match=r"/ckpt/rank0\.safetensors: not a valid"):
        MemoryShard("/ckpt/rank0.safetensors", buf)


def test_streamed_tensors_nobody_else_holds_are_hashed_before_they_are_freed(
    tmp_path: Any,
) -> None:
    # A producer that keeps no reference (as a synchronous save's lazy states and a background
    # save's one-use copies): each tensor lives only in the writer's pending list, so it must
    # stay there until its hash is done, else the hash reads freed memory.
    gen = torch.Generator().manual_seed(1)
    sizes = [32, 7, 1, 4096, 32, 129, 1, 32] * 8
    specs = [(f"t{i}", torch.float32, (n,)) for i, n in enumerate(sizes)]
    path = str(tmp_path / "s.safetensors")
    written = stfile.write_safetensors_stream(
        path, specs, lambda name: torch.randn(sizes[int(name[1:])], generator=gen)
    )
    with open(path, "rb") as f:
        assert written.digest == xxhash.xxh3_128(f.read()).hexdigest()


def test_a_producer_may_reuse_its_memory_for_the_next_tensor(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A synchronous save hands the writer views of the engine's own state; making the next
    # tensor may reuse that memory (a swapped-in optimizer state). The writer must be done
    # hashing a tensor before it asks for the next (a hash lagging on a helper thread would
    # not be). Here hashing waits (up to half a second) for a second `produce` call to have
    # overwritten the one shared buffer: a writer that asks early records the digest of the
    # wrong bytes; one that waits just hashes a little later.
    import threading

    from partita.checkpoint import digest

    overwritten = threading.Event()
    calls: list[str] = []

    class Lagging:
        def __init__(self) -> None:
            self.inner = xxhash.xxh3_128()

        def update(self, data: Any) -> None:
            overwritten.wait(timeout=0.5)
            self.inner.update(data)

        def hexdigest(self) -> str:
            return str(self.inner.hexdigest())

    monkeypatch.setattr(digest, "new_hasher", lambda algorithm=digest.ALGORITHM: Lagging())
    shared = torch.empty(1000)

    def produce(name: str) -> torch.Tensor:
        calls.append(name)
        shared.fill_(float(int(name[1:]) + 1))
        if len(calls) > 1:
            overwritten.set()
        return shared

    specs = [(f"t{i}", torch.float32, (1000,)) for i in range(3)]
    path = str(tmp_path / "reused.safetensors")
    written = stfile.write_safetensors_stream(path, specs, produce)
    with open(path, "rb") as f:
        assert written.digest == xxhash.xxh3_128(f.read()).hexdigest()
    back = load_file(path)
    assert [float(back[f"t{i}"][0]) for i in range(3)] == [1.0, 2.0, 3.0]


def borrowed_state_worker(root: str) -> dict[str, Any]:
    """Stage 3, one rank: a synchronous save's views of the engine's state and a load's
    borrowed reads of the verified bytes (no copies), then a corrupted shard refused."""
    from partita.checkpoint.locate import locate, open_source

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**6,
    }
    engine, *_ = partita.initialize(model=make_model(seed=2), config=cfg)
    for batch in global_batches(2, 2, seed=3):
        tokens, targets = rank_micro_batch(batch, 0, 1, 2, 0)
        engine.backward(engine(tokens, targets))
        engine.step()
    states, params = engine.param_states, list(engine.module.named_parameters())
    views = [states.local_state_view(p, "exp_avg") for _, p in params]
    copies = [states.local_state(p, "exp_avg") for _, p in params]
    out: dict[str, Any] = {
        "views_equal": all(
            v is not None and torch.equal(v, c) for v, c in zip(views, copies, strict=True)
        ),
        # Stage 3 keeps a unit's masters (and their state) flat: views share that storage.
        "view_storages": len({v.untyped_storage().data_ptr() for v in views if v is not None}),
        "copy_storages": len({c.untyped_storage().data_ptr() for c in copies}),
    }
    engine.save_checkpoint(root, tag="t")
    found = locate(root, "t")
    assert found is not None
    source = open_source(*found)
    source.verify(0, 1)
    borrowed = [source.read(n, "exp_avg", [(0, q.numel())], borrow=True) for n, q in params]
    owned = [source.read(n, "exp_avg", [(0, q.numel())]) for n, q in params]
    out["borrowed_equal"] = all(
        b is not None and o is not None and torch.equal(b, o) and torch.equal(b, c)
        for b, o, c in zip(borrowed, owned, copies, strict=True)
    )
    out["borrowed_storages"] = len(
        {b.untyped_storage().data_ptr() for b in borrowed if b is not None}
    )
    out["owned_storages"] = len({o.untyped_storage().data_ptr() for o in owned if o is not None})
    source.close()
    shard = os.path.join(found[0], "rank00000-of-00001.safetensors")
    with open(shard, "r+b") as f:  # one byte of tensor data flipped
        f.seek(os.path.getsize(shard) - 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    try:
        engine.load_checkpoint(root, tag="t")
        out["error"] = None
    except CheckpointError as e:
        out["error"] = str(e)
    out["still_trained"] = all(
        torch.equal(states.local_state(p, "exp_avg"), c)
        for (_, p), c in zip(params, copies, strict=True)
    )
    engine.destroy()
    return out


def test_saves_and_loads_borrow_the_state_and_still_refuse_corruption(tmp_path: Any) -> None:
    (result,) = run_distributed(borrowed_state_worker, 1, str(tmp_path), timeout=180)
    assert result["views_equal"] is True
    assert result["view_storages"] < result["copy_storages"]
    assert result["borrowed_equal"] is True
    assert result["borrowed_storages"] == 1 < result["owned_storages"]
    assert result["error"] is not None
    assert "rank00000-of-00001.safetensors: checksum check failed" in result["error"]
    assert result["still_trained"] is True
