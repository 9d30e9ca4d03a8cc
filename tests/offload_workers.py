"""Per-rank bodies for the NVMe offload tests: an injected disk-full error mid-run, and a model
whose states are several times the memory the run is allowed."""

from __future__ import annotations

import errno
import gc
from pathlib import Path
from typing import Any

import torch

import partita
from engine_workers import _full_params
from models import global_batches, make_model, rank_micro_batch
from partita import comm
from partita.offload import AsyncIOError
from partita.platform.accelerator import host_peak_rss, host_rss


def _train(engine: Any, batches: list[tuple[torch.Tensor, torch.Tensor]], micro: int) -> None:
    rank, world = comm.get_rank(), comm.get_world_size()
    for batch in batches:
        loss = engine(*rank_micro_batch(batch, rank, world, micro, 0))
        engine.backward(loss)
        engine.step()


def disk_full_mid_run(config: dict, folder: str) -> dict[str, Any]:
    """Trains 3 steps, saves a checkpoint, then makes every swap write fail with ENOSPC and
    trains on; returns the error and whether a fresh engine loads the checkpoint intact."""
    micro = config["train_micro_batch_size_per_gpu"]
    batches = global_batches(5, micro * comm.get_world_size())
    engine, _, _, _ = partita.initialize(model=make_model(), config=config)
    _train(engine, batches[:3], micro)
    engine.save_checkpoint(folder, tag="step3")
    saved = _full_params(engine)
    swap_dir = engine.strategy.swapped.space.directory

    def disk_full(fd: int, bufs: list[memoryview], offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    engine.strategy.swapped.space.aio.syscalls.pwritev = disk_full
    error: AsyncIOError | None = None
    try:
        _train(engine, batches[3:], micro)
    except AsyncIOError as exc:
        error = exc
    engine.destroy()
    fresh, _, _, _ = partita.initialize(model=make_model(seed=7), config=config)
    fresh.load_checkpoint(folder, tag="step3")
    loaded = _full_params(fresh)
    fresh.destroy()
    return {
        "error": None if error is None else str(error),
        "errno": None if error is None else error.errno,
        "filename": None if error is None else error.filename,
        "swap_dir": str(swap_dir),
        "intact": all(torch.equal(a, b) for a, b in zip(saved, loaded, strict=True)),
        "checkpoint_files": sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*")),
    }


def _reset_peak_rss() -> None:
    # Writing 5 to clear_refs resets the process's peak RSS (VmHWM) to its current RSS.
    Path("/proc/self/clear_refs").write_text("5")


def train_under_cap(config: dict, model_kwargs: dict, steps: int) -> dict[str, Any]:
    """Builds the model under ``zero.Init(remote_device="nvme")`` and trains `steps` steps;
    returns the model-state bytes (16 per parameter) and the process's peak RSS above its RSS
    before the model was built (the whole run: construction, set-up and training)."""
    micro = config["train_micro_batch_size_per_gpu"]
    batches = global_batches(steps, micro * comm.get_world_size())
    # Fixed costs of the process, the same for any model size, are taken before the baseline
    # so the cap measures the run: the first optimizer step imports torch's compiler stack
    # (~75 MB), the first forward/backward starts the intra-op thread pool (25-70 MB).
    warm = torch.zeros(4, requires_grad=True)
    warm.grad = torch.ones(4)
    torch.optim.AdamW([warm], fused=True).step()
    small = make_model(**{**model_kwargs, "layers": 2})
    small(*rank_micro_batch(batches[0], 0, 1, micro, 0)).backward()
    del small, warm
    gc.collect()
    baseline = host_rss()
    _reset_peak_rss()
    with partita.zero.Init(remote_device="nvme", config_dict_or_path=config) as init:
        model = make_model(**model_kwargs)
    numel = sum(p.numel() for p in model.parameters())  # placeholders keep the shapes
    engine, _, _, _ = partita.initialize(model=model, config=config)
    del model
    after_setup = host_rss() - baseline
    _train(engine, batches, micro)
    peak = host_peak_rss() - baseline
    memory = engine.memory_report()
    engine.destroy()
    return {
        "numel": numel,
        "model_state_bytes": 16 * numel,
        "after_setup": after_setup,
        "peak": peak,
        "init_peak_materialized": init.stats.peak_materialized_bytes,
        "memory": memory,
    }


def pinned_by_config(configs: list[dict]) -> list[dict[str, int]]:
    """Per config: how many host tensors the engine asked to page-lock over its set-up and one
    step (gradients are made in backward: [Note: released gradients]), and how many masters
    (fp32 tensors the optimizer steps) and stage-3 shard buffers it has (pinning is a no-op on
    CPU machines, so the accelerator's `pin_memory` is replaced by a recorder)."""
    from partita.platform.accelerator import get_accelerator

    accelerator = get_accelerator()
    pinned: list[torch.Tensor] = []

    def record(tensor: torch.Tensor) -> torch.Tensor:
        pinned.append(tensor)
        return tensor

    accelerator.pin_memory = record  # type: ignore[method-assign]
    out = []
    for config in configs:
        pinned.clear()
        model = make_model()
        engine, _, _, _ = partita.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        tokens, targets = global_batches(1, config["train_micro_batch_size_per_gpu"])[0]
        engine.backward(engine(tokens, targets))
        engine.step()
        optimizer = engine.strategy.optimizer
        masters = [p for g in optimizer.param_groups for p in g["params"]]
        units = getattr(engine.strategy, "all_units", [])
        out.append(
            {
                "pinned": len(pinned),
                "masters": len(masters),
                "pinned_masters": sum(
                    any(t is m.data or t.data_ptr() == m.data_ptr() for t in pinned)
                    for m in masters
                ),
                "shards": len(units),
            }
        )
        engine.destroy()
    return out
