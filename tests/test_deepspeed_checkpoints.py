"""Checkpoints written by DeepSpeed 0.19.8 itself (ZeRO 1, 2 in fp32 and bf16, 3; frozen
parameters) load into partita at the saving world size (2) and at another (3), at the same and
other stages: fp32 masters, Adam moments and steps equal DeepSpeed's own full values exactly.
Reading them is opted into per call (``trust_pickle=True``): the environment cannot turn it on.

One world-2 spawn runs DeepSpeed's saves and partita's loads; one world-3 spawn loads again.
Skipped when deepspeed is not installed (scripts/setup_env.sh installs it).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed's import picks a device
pytest.importorskip("deepspeed")

from checkpoint_workers import build_deepspeed_checkpoint
from deepspeed_workers import CASES, DS_STEPS, partita_load, save_and_load
from partita.checkpoint import (
    CheckpointError,
    get_fp32_state_dict_from_zero_checkpoint,
)
from partita.testing import run_distributed

ENV = {"DS_ACCELERATOR": "cpu"}
LOADS_2 = [("s1", 1), ("s1", 3), ("s2", 2), ("s2", 0), ("s2-bf16", 2), ("s3", 3), ("s3", 1)]
LOADS_3 = [("s1", 2), ("s2", 2), ("s3", 3)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("dsckpt"))
    # 600: DeepSpeed compiles its C++ ops on first use in a venv (minutes on two busy cores).
    two = run_distributed(save_and_load, 2, root, LOADS_2, timeout=600, env=ENV)
    three = run_distributed(partita_load, 3, root, LOADS_3, timeout=200, env=ENV)
    return {"root": root, "ds": two[0]["ds"], "loaded": {2: two, 3: three}}


def _differ(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k in want if k not in got or not torch.equal(got[k].float(), want[k]))


@pytest.mark.parametrize(
    ("world", "case", "stage"), [(2, c, s) for c, s in LOADS_2] + [(3, c, s) for c, s in LOADS_3]
)
def test_deepspeed_checkpoint_loads_into_partita(
    runs: dict[str, Any], world: int, case: str, stage: int
) -> None:
    want = runs["ds"][case]
    assert any(k.startswith("exp_avg::") for k in want)
    for rank, result in enumerate(runs["loaded"][world]):
        got = result["loaded"][(case, stage)] if world == 2 else result[(case, stage)]
        where = f"DeepSpeed {case} (world 2) -> partita stage {stage}, world {world}, rank {rank}"
        assert "error" not in got, f"{where}: {got.get('error')}"
        assert _differ(got["states"], want) == [], where
        assert set(got["states"]) == set(want), where
        assert got["global_steps"] == DS_STEPS, where
        assert got["path"].endswith(f"global_step{DS_STEPS}"), where


@pytest.mark.parametrize("case", sorted(CASES))
def test_deepspeed_checkpoint_consolidates(runs: dict[str, Any], case: str) -> None:
    state = get_fp32_state_dict_from_zero_checkpoint(
        os.path.join(runs["root"], case), trust_pickle=True
    )
    want = runs["ds"][case]
    params = {k.split("::", 1)[1]: v for k, v in want.items() if k.startswith(("param", "frozen"))}
    assert set(state) == set(params)
    assert [k for k in params if not torch.equal(state[k], params[k].float())] == []


def test_trust_is_per_call(runs: dict[str, Any]) -> None:
    """A trusted load does not make the next load of the same files trusted."""
    for result in runs["loaded"][2]:
        for key, got in result["loaded"].items():
            assert "trust_pickle=True" in got["untrusted"], (key, got["untrusted"])
            assert got["env"] is None, key


def test_environment_cannot_trust_pickles(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``PARTITA_TRUST_PICKLE`` in the environment (process-wide, inherited by every later
    load) does not open a DeepSpeed checkpoint: only the call's own argument does."""
    build_deepspeed_checkpoint(str(tmp_path))
    monkeypatch.setenv("PARTITA_TRUST_PICKLE", "1")
    with pytest.raises(CheckpointError, match="trust_pickle=True"):
        get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    assert get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), trust_pickle=True)
