"""Checkpoints of a tensor-parallel model: one set of shard files per tensor slice (issue 36).

Four ranks run the Megatron-style block of tests/tp_mpu_workers.py as tensor parallel 2 x data
parallel 2 through an ``mpu`` (see tests/checkpoint_tp_workers.py). Each tensor rank holds
different slices of the split weights, so a checkpoint must keep every slice: after a save, a
fresh engine that loads it has every rank's own slices and optimizer state back, bitwise, and
trains on with bitwise the losses of the engine that saved. A one-process engine of the whole
block loads a tp-2 checkpoint by concatenating the slices along Megatron's ``partition_dim``;
a checkpoint whose split parameters have no ``partition_dim`` is refused at another degree,
naming them. Tensor parallel 2 x data parallel 1 at stage 2 loads the tp 2 x dp 2 stage-1
slices (resharding over data-parallel ranks) and refuses the one-process (tp 1) checkpoint.

All four-rank cases run in one spawn (then one spawn of 1 rank, one of 2).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from checkpoint_tp_workers import PARTITION_DIMS, full_loader, narrow_loader, tp_checkpoint_worker
from partita.testing import run_distributed

CASES = [{"stage": s, "partition_dims": True} for s in (0, 1, 2, 3)] + [
    {"stage": 1, "partition_dims": False}
]
"""ZeRO stages 0-3 with Megatron's partition_dim set, and stage 1 without it."""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("tp-ckpt"))
    return run_distributed(tp_checkpoint_worker, 4, CASES, root, timeout=240)


def _runs(ranks: list[dict[str, Any]], case: dict[str, Any]) -> list[dict[str, Any]]:
    i = CASES.index(case)
    return [r["runs"][i] for r in ranks]


def _equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (
        a is not None and b is not None and a.dtype == b.dtype and torch.equal(a, b)
    )


@pytest.mark.parametrize("case", CASES, ids=str)
def test_every_slice_round_trips(ranks: list[dict[str, Any]], case: dict[str, Any]) -> None:
    runs = _runs(ranks, case)
    wrong = []
    for rank, run in enumerate(runs):
        where = f"rank {rank} (tp {rank % 2}, dp {rank // 2})"
        saved, loaded = run["saved"], run["loaded"]
        for name, a, b in zip(saved["names"], saved["params"], loaded["params"], strict=True):
            if not torch.equal(a, b):
                wrong.append(f"{where}: {name} (max diff {(a - b).abs().max():.3g})")
        assert saved["optimizer"].keys() == loaded["optimizer"].keys(), where
        for what, values in saved["optimizer"].items():
            for name, a, b in zip(saved["names"], values, loaded["optimizer"][what], strict=True):
                if not _equal(a, b):
                    wrong.append(f"{where}: {what} of {name}")
    assert not wrong, f"{case}: differ after the load: {wrong}"
    for rank, run in enumerate(runs):
        assert run["resumed"] == run["losses"], f"{case}, rank {rank}: losses after the load"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_manifest_records_the_slicing(ranks: list[dict[str, Any]], case: dict[str, Any]) -> None:
    folder = _runs(ranks, case)[0]["folder"]
    with open(os.path.join(folder, "t", "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["tp_world_size"] == 2
    assert sorted({info["tp_rank"] for info in manifest["files"].values()}) == [0, 1]
    layouts = {name: info["tp"] for name, info in manifest["tensors"].items()}
    for name, layout in layouts.items():
        if name in PARTITION_DIMS:
            dim = PARTITION_DIMS[name] if case["partition_dims"] else None
            assert layout["partition_dim"] == dim, (name, layout)
        else:
            assert layout == {"layout": "replicated"}, (name, layout)


def test_other_degrees_and_sizes(
    ranks: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    sliced = _runs(ranks, CASES[1])  # stage 1 with partition_dim
    unknown = _runs(ranks, CASES[-1])
    whole = str(tmp_path_factory.mktemp("tp1-ckpt"))
    (full,) = run_distributed(full_loader, 1, sliced[0]["folder"], unknown[0]["folder"], whole)
    names = sliced[0]["saved"]["names"]
    for i, name in enumerate(names):
        parts = [sliced[tp]["saved"]["params"][i] for tp in (0, 1)]
        want = torch.cat(parts, PARTITION_DIMS[name]) if name in PARTITION_DIMS else parts[0]
        assert torch.equal(full["weights"][name], want), name
    # The optimizer state came along: the next steps follow the tp 2 x dp 2 run's losses.
    global_losses = [
        (a + b) / 2 for a, b in zip(sliced[0]["losses"], sliced[2]["losses"], strict=True)
    ]
    assert full["losses"] == pytest.approx(global_losses, rel=1e-5)
    refused = full["refused"]
    assert "tensor-parallel degree 2" in refused and "1" in refused, refused
    for name in PARTITION_DIMS:
        assert name in refused, refused
    # The same slices at another data-parallel size and stage: tp 2 x dp 1, stage 2.
    narrow = run_distributed(narrow_loader, 2, sliced[0]["folder"], whole, timeout=120)
    for tp, got in enumerate(narrow):
        for name, a, b in zip(names, sliced[tp]["saved"]["params"], got["params"], strict=True):
            assert torch.equal(a, b), f"tp {tp} x dp 1: {name}"
        assert got["losses"] == pytest.approx(global_losses, rel=1e-5), tp
        # A tp-1 checkpoint at degree 2 is refused, naming both degrees.
        assert "tensor-parallel degree 1, this engine runs at degree 2" in got["refused"], got
