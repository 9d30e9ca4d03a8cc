"""Disk held by ``zero.Init(remote_device="nvme")`` chunks once a stage-3 engine takes over.

A model built under Init on NVMe has every chunk in a swap file; the engine copies each chunk
into its own shard, master and optimizer files. The Init files must not stay allocated beside
them: at 3B parameters they are another 2-4 bytes per parameter of a disk the model states
already nearly fill (issue 21, item 3).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from partita.testing import run_distributed


def init_files_after_takeover(nvme_path: str) -> dict[str, Any]:
    """Builds a small model under Init on NVMe, hands it to a stage-3 NVMe engine, and reports
    the Init swap space's registered bytes and files before and after, then trains one step."""
    import partita

    nvme = {"device": "nvme", "nvme_path": nvme_path}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_optimizer": nvme, "offload_param": nvme},
    }
    with partita.zero.Init(remote_device="nvme", config_dict_or_path=config) as init:
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)
        )
    space = init.space
    assert space is not None
    before = (space.file_bytes, len(list(space.directory.glob("*.swp"))))
    engine, _, _, _ = partita.initialize(model=model, config=config)
    after = (space.file_bytes, len(list(space.directory.glob("*.swp"))))
    loss = engine(torch.ones(1, 64)).square().mean()
    engine.backward(loss)
    engine.step()
    engine.destroy()
    return {"before": before, "after": after, "loss": float(loss)}


def test_init_swap_files_are_released_when_the_engine_takes_over(tmp_path: Path) -> None:
    """Init's swap files (bytes and files) are gone once the engine holds the model."""
    out = run_distributed(init_files_after_takeover, 1, str(tmp_path), timeout=120)[0]
    assert out["before"][0] > 0 and out["before"][1] == 4  # 2 weights, 2 biases
    assert out["after"] == (0, 0), out
    assert torch.isfinite(torch.tensor(out["loss"]))
