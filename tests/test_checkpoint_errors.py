"""Corruption, partial calls, non-JSON client state, export (Hugging Face layout) and reading
DeepSpeed ZeRO-2 checkpoints; one world-2 spawn runs every distributed case."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_workers import build_deepspeed_checkpoint, misc_cases
from partita.checkpoint import CheckpointError, get_fp32_state_dict_from_zero_checkpoint
from partita.checkpoint.export import main as export_main
from partita.testing import run_distributed

TAG = "global_step2"


@pytest.fixture(scope="module")
def spawn(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("ckerr"))
    ds_root = str(tmp_path_factory.mktemp("ds"))
    expected = build_deepspeed_checkpoint(ds_root)
    results = run_distributed(misc_cases, 2, root, ds_root, timeout=240)
    return {"root": root, "ds_root": ds_root, "expected": expected, "ranks": results}


CORRUPTIONS = {
    "truncated": ("rank00001-of-00002.safetensors", "size check failed"),
    "flipped": ("rank00000-of-00002.safetensors", "checksum check failed"),
    "missing": ("rank00001-of-00002.safetensors", "missing"),
    "empty_latest": ("latest", "empty"),
    "no_manifest": ("manifest.json", "manifest missing"),
}


@pytest.mark.parametrize("variant", sorted(CORRUPTIONS))
def test_corruption_fails_every_rank_naming_file_and_check(
    spawn: dict[str, Any], variant: str
) -> None:
    # Every rank raises (none waits in a collective: the spawn's timeout is the hang guard).
    fname, check = CORRUPTIONS[variant]
    for rank, result in enumerate(spawn["ranks"]):
        kind, message, _ = result["errors"]["corrupt"][variant]
        assert kind == "CheckpointError", (rank, kind, message)
        assert fname in message and check in message, (rank, message)


def test_latest_naming_a_missing_tag_falls_back(spawn: dict[str, Any]) -> None:
    # `latest` names global_step99, which does not exist: the newest complete checkpoint
    # (the only one, TAG) loads on every rank (the warning is checked in test_checkpoint_hostile).
    for rank, result in enumerate(spawn["ranks"]):
        kind, message, _ = result["errors"]["corrupt"]["latest_missing_tag"]
        assert kind == "tuple" and f"/{TAG}'" in message, (rank, kind, message)


def test_client_state_must_be_json(spawn: dict[str, Any]) -> None:
    for result in spawn["ranks"]:
        kind, message = result["errors"]["client_error"]
        assert kind == "CheckpointError"
        assert "client_state['extra']['tensor'] is a Tensor" in message
    assert not os.path.exists(os.path.join(spawn["root"], "bad", "global_step2", "manifest.json"))


@pytest.mark.parametrize("op", ["partial_save", "partial_load"])
def test_call_from_some_ranks_names_the_missing_ones(spawn: dict[str, Any], op: str) -> None:
    # Rank 0 alone calls; it must give up by itself (the spawn's timeout is the hang guard)
    # after the configured wait (PARTITA_CHECKPOINT_TIMEOUT_S=2), naming rank 1.
    message, _ = spawn["ranks"][0]["errors"][op]
    name = op.removeprefix("partial_")
    assert f"rank(s) [1] of 2 did not call {name}_checkpoint within 2 s" in message, message
    assert "PARTITA_CHECKPOINT_TIMEOUT_S" in message
    if op == "partial_save":  # nothing was written: no checkpoint, no `latest`, no staging
        partial = os.path.join(spawn["root"], "partial")
        assert [n for n in os.listdir(partial) if n != ".partita-calls"] == []


def test_export_equals_gathered_state(spawn: dict[str, Any]) -> None:
    errors = spawn["ranks"][0]["errors"]
    states, module = errors["states"], errors["module"]
    single = load_file(os.path.join(spawn["root"], "export1", "model.safetensors"))
    assert set(single) == set(module)
    for name, value in single.items():
        want = states.get(f"param::{name}", states.get(f"frozen::{name}", module[name].float()))
        assert value.dtype == torch.float32 and torch.equal(value, want), name
    sharded_dir = os.path.join(spawn["root"], "export3")
    with open(os.path.join(sharded_dir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    merged: dict[str, torch.Tensor] = {}
    for shard in shards:
        merged.update(load_file(os.path.join(sharded_dir, shard)))
    assert set(merged) == set(single)
    assert all(torch.equal(merged[k], single[k]) for k in single)
    bf16 = load_file(os.path.join(spawn["root"], "export_bf16", "model.safetensors"))
    assert all(torch.equal(bf16[k], single[k].to(torch.bfloat16)) for k in single)


def test_hugging_face_model_round_trip(spawn: dict[str, Any]) -> None:
    hf = spawn["ranks"][0]["hf"]
    assert "model.safetensors.index.json" in hf["files"]
    ours, theirs = hf["logits"]
    torch.testing.assert_close(theirs, ours, rtol=0, atol=0)


def test_deepspeed_checkpoint_read(spawn: dict[str, Any], tmp_path: Any) -> None:
    expected = spawn["expected"]
    with pytest.raises(CheckpointError, match="pickle"):
        get_fp32_state_dict_from_zero_checkpoint(spawn["ds_root"])
    state = get_fp32_state_dict_from_zero_checkpoint(spawn["ds_root"], trust_pickle=True)
    params = {k.removeprefix("param::"): v for k, v in expected.items() if k.startswith("param")}
    assert set(state) == set(params)
    assert all(torch.equal(state[k], params[k]) for k in params)
    assert export_main([spawn["ds_root"], str(tmp_path), "--trust-pickle"]) == 0
    exported = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(exported[k], params[k]) for k in params)
    for result in spawn["ranks"]:
        ds = result["ds"]
        assert ds["refused"][0] == "CheckpointError" and "trust_pickle" in ds["refused"][1]
        assert ds["steps"] == 5 and ds["client"]["my_key"] == 42
        assert set(ds["states"]) == set(expected)
        differ = [k for k in expected if not torch.equal(ds["states"][k], expected[k])]
        assert differ == []
