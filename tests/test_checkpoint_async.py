"""Asynchronous checkpoint saves (``save_checkpoint(..., async_save=True)``, issue 21 item 2).

Training goes on once the states are copied to host memory; the shard files are written,
fsynced and committed by a background thread. These tests hold the background writer inside
`partita.checkpoint.stfile.write_safetensors_stream` (a patched copy that waits on an event,
fails or SIGKILLs its own process) to show that:

- steps run while the write is in flight, and the files written are bitwise those of a
  synchronous save at the same point (and the steps bitwise those of an unsaved run);
- a process killed during the background write leaves the previous checkpoint loadable and
  `latest` naming it;
- a failed background write is reported on every rank, at the same step, naming the file.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import Any

import pytest
import torch

import partita
from models import global_batches, make_model, rank_micro_batch
from partita.checkpoint import CheckpointError
from partita.testing import DistributedTestError, run_distributed

WORLD = 2
MICRO = 2
HANG_GUARD_S = 120.0


def _config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
    }


def _engine(stage: int) -> Any:
    engine, *_ = partita.initialize(model=make_model(seed=3), config=_config(stage))
    return engine


def _train(engine: Any, steps: range) -> list[float]:
    batches = global_batches(max(steps.stop, 1), MICRO * WORLD, seed=5)
    rank = engine.dims.dp_rank
    losses = []
    for i in steps:
        tokens, targets = rank_micro_batch(batches[i], rank, WORLD, MICRO, 0)
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _hold_writer(hook: Any) -> Any:
    """Patches the stream writer so `hook(path, produced_count)` runs before each tensor is
    produced (in the writing thread); returns the original."""
    from partita.checkpoint import stfile

    original = stfile.write_safetensors_stream

    def patched(path: str, specs: Any, produce: Any, metadata: Any = None) -> Any:
        count = [0]

        def held(name: str) -> torch.Tensor:
            hook(path, count[0])
            count[0] += 1
            return produce(name)

        return original(path, specs, held, metadata)

    stfile.write_safetensors_stream = patched
    return original


def _release_writer(original: Any) -> None:
    from partita.checkpoint import stfile

    stfile.write_safetensors_stream = original


def _folder_files(folder: str) -> dict[str, Any]:
    """Shard bytes and the manifest (without its time stamp) of a checkpoint folder."""
    out: dict[str, Any] = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            data = f.read()
        if name == "manifest.json":
            manifest = json.loads(data)
            manifest.pop("saved_at")
            out[name] = manifest
        else:
            out[name] = data
    return out


def in_flight_worker(root: str, stage: int) -> dict[str, Any]:
    """Async save with the writer held while 3 steps run; then a synchronous reference."""
    rank = torch.distributed.get_rank()
    engine = _engine(stage)
    _train(engine, range(2))
    entered, release = threading.Event(), threading.Event()

    def hold(path: str, produced: int) -> None:
        entered.set()
        if not release.wait(HANG_GUARD_S):
            raise RuntimeError("hang guard: the test never released the writer")

    original = _hold_writer(hold)
    async_dir = os.path.join(root, "async")
    try:
        assert engine.save_checkpoint(async_dir, tag="a", async_save=True) is True
        during = _train(engine, range(2, 5))
        # The writer was running (it reached the hook) and could not have finished. At
        # stage 0 (replicated state) rank 0 alone writes a file; rank 1's writer waits for it.
        if stage > 0 or rank == 0:
            assert entered.wait(HANG_GUARD_S)
        committed_during = os.path.exists(os.path.join(async_dir, "a"))
        latest_during = os.path.exists(os.path.join(async_dir, "latest"))
    finally:
        release.set()
        _release_writer(original)
    engine.save_checkpoint(async_dir, tag="b")  # waits for "a" first
    engine.destroy()
    reference = _engine(stage)
    _train(reference, range(2))
    sync_dir = os.path.join(root, "sync")
    reference.save_checkpoint(sync_dir, tag="a")
    ref_during = _train(reference, range(2, 5))
    reference.destroy()
    torch.distributed.barrier()
    same = None
    if rank == 0:
        same = _folder_files(os.path.join(async_dir, "a")) == _folder_files(
            os.path.join(sync_dir, "a")
        )
    with open(os.path.join(async_dir, "latest"), encoding="utf-8") as f:
        latest = f.read()
    return {
        "committed_during": committed_during,
        "latest_during": latest_during,
        "losses": during,
        "ref_losses": ref_during,
        "same_files": same,
        "latest": latest,
    }


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_steps_run_while_the_write_is_in_flight_and_files_are_bitwise_sync(
    tmp_path: Any, stage: int
) -> None:
    results = run_distributed(in_flight_worker, WORLD, str(tmp_path), stage, timeout=240)
    for rank, r in enumerate(results):
        assert r["committed_during"] is False and r["latest_during"] is False, rank
        assert r["losses"] == r["ref_losses"], rank
        assert r["latest"] == "b", rank
    assert results[0]["same_files"] is True


def killed_worker(root: str) -> None:
    """Saves global_step2 synchronously, records the loss step 3's batch gives from it, then
    trains, saves global_step3 asynchronously and SIGKILLs itself halfway through that write
    while training goes on."""
    rank = torch.distributed.get_rank()
    engine = _engine(3)
    _train(engine, range(2))
    engine.save_checkpoint(root)  # global_step2
    tokens, targets = rank_micro_batch(global_batches(4, MICRO * WORLD, seed=5)[3], rank,
                                       WORLD, MICRO, 0)  # fmt: skip
    with torch.no_grad():
        expected = engine(tokens, targets).item()
    with open(os.path.join(root, f"expected{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f)
    _train(engine, range(2, 3))
    stepped = threading.Event()

    def die(path: str, produced: int) -> None:
        if produced == 2:  # the header and a tensor are out: a half-written file
            stepped.wait(HANG_GUARD_S)
            os.kill(os.getpid(), signal.SIGKILL)

    _hold_writer(die)
    engine.save_checkpoint(root, async_save=True)  # global_step3
    _train(engine, range(3, 4))
    stepped.set()
    threading.Event().wait(HANG_GUARD_S)  # the writer kills this process meanwhile


def load_worker(root: str) -> dict[str, Any]:
    """Loads the latest checkpoint; the loss of step 3's batch from it."""
    rank = torch.distributed.get_rank()
    engine = _engine(3)
    path, _ = engine.load_checkpoint(root)
    tokens, targets = rank_micro_batch(global_batches(4, MICRO * WORLD, seed=5)[3], rank,
                                       WORLD, MICRO, 0)  # fmt: skip
    with torch.no_grad():
        loss = engine(tokens, targets).item()
    return {"path": path, "steps": engine.global_steps, "loss": loss}


def test_kill_during_background_write_leaves_previous_checkpoint_loadable(tmp_path: Any) -> None:
    root = str(tmp_path)
    with pytest.raises(DistributedTestError) as info:
        run_distributed(killed_worker, WORLD, root, timeout=240)
    assert "SIGKILL" in str(info.value), str(info.value)[:2000]
    # The killed save left only its staging leftovers: no global_step3, `latest` unchanged.
    assert not os.path.exists(os.path.join(root, "global_step3"))
    with open(os.path.join(root, "latest"), encoding="utf-8") as f:
        assert f.read() == "global_step2"
    results = run_distributed(load_worker, WORLD, root, timeout=240)
    for rank, r in enumerate(results):
        with open(os.path.join(root, f"expected{rank}.json"), encoding="utf-8") as f:
            expected = json.load(f)
        assert r["path"].endswith("/global_step2") and r["steps"] == 2, (rank, r)
        assert r["loss"] == expected, rank


def failing_worker(root: str) -> dict[str, Any]:
    """Rank 1's background write fails (disk full); every rank trains on until it hears; then
    the same with the next save as the next call."""
    rank = torch.distributed.get_rank()
    engine = _engine(3)
    _train(engine, range(1))
    engine.save_checkpoint(root, tag="good")

    def full(path: str, produced: int) -> None:
        if rank == 1 and produced == 1:
            raise OSError(28, "No space left on device", path)

    original = _hold_writer(full)
    outcome: dict[str, Any] = {}
    engine.save_checkpoint(root, tag="bad", async_save=True)
    for step in range(1, 40):
        try:
            _train(engine, range(step, step + 1))
        except CheckpointError as e:
            outcome["step"] = (engine.micro_steps, str(e))
            break
    engine.save_checkpoint(root, tag="bad2", async_save=True)
    try:
        engine.save_checkpoint(root, tag="after")
    except CheckpointError as e:
        outcome["save"] = str(e)
    _release_writer(original)
    with open(os.path.join(root, "latest"), encoding="utf-8") as f:
        outcome["latest"] = f.read()
    outcome["tags"] = sorted(n for n in os.listdir(root) if not n.startswith("."))
    return outcome


def test_background_failure_is_reported_on_every_rank_naming_the_file(tmp_path: Any) -> None:
    results = run_distributed(failing_worker, WORLD, str(tmp_path), timeout=240)
    assert "step" in results[0] and "step" in results[1], results
    # Both ranks raise at the same step (no rank is left waiting in that step's collectives).
    assert results[0]["step"][0] == results[1]["step"][0]
    for rank, r in enumerate(results):
        for message in (r["step"][1], r["save"]):
            assert "rank00001-of-00002.safetensors" in message, (rank, message)
            assert "No space left on device" in message, (rank, message)
        assert r["latest"] == "good", rank
        assert r["tags"] == ["good", "latest"], (rank, r["tags"])
