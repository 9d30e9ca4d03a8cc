"""Checkpoints of mixture-of-experts training ([Note: expert slices] in
`partita.checkpoint.experts`): each expert is saved once, master weights and Adam state, under
its global name (the name it has in the one-process model), and loads at another
expert-parallel size, world size and ZeRO stage with the experts re-split.

DeepSpeed's MoE tutorial shape (tests/moe_workers.py, top-2, fp32, dropless) trains two steps
at 4 CPU ranks (ep 2 x dp 2 at ZeRO 2 and at ZeRO 3; ep 4 at ZeRO 0, saved in the background;
with one optimizer group of every parameter; with a frozen bias in every expert), saves, and
fresh engines at ep 4, ep 2, ep 1 x dp 2, ep 2 x dp 1 and world 1, ZeRO 0-3, load and train two more
steps: every loss within rtol 1e-6 of one process holding every expert; at the saving layout
bitwise the uninterrupted run. A round trip through ep 4 gives back every saved state bitwise.
A plain module loads the consolidated weights; ``partita export`` writes the module's own
names. One spawn per world size runs its cases (tests/moe_checkpoint_workers.py)."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import pytest
import torch

from models import assert_losses
from moe_checkpoint_workers import SAVED_AT, TAG, K, grid, reference
from moe_workers import EXPERTS, Net
from partita.checkpoint.export import main as export_main
from partita.checkpoint.reader import PartitaSource
from partita.testing import run_distributed_grid

SAVES = {"A": (2, 2), "B": (4, 0), "U": (2, 2), "F": (2, 1), "T": (2, 3)}
"""Checkpoints saved at 4 ranks: name -> (ep, stage). "B" is saved in the background
(``async_save``) while the run trains on."""
VARIANT = {"U": "unsplit", "F": "frozen"}
"""How the runs saving and loading a checkpoint are set up (`moe_checkpoint_workers.VARIANTS`;
"split" unless named): "U" with every parameter in one optimizer group (the engine splits
experts off), "F" with a frozen bias in every expert (module tensors, not masters)."""
RESUMES: dict[int, list[tuple[str, int, int]]] = {
    # world -> (checkpoint, ep, stage) loaded
    4: [("A", 2, 2), ("A", 4, 1), ("A", 4, 0), ("B", 2, 1), ("B", 2, 0), ("U", 4, 0),
        ("F", 4, 2), ("T", 2, 3), ("T", 4, 1), ("A", 4, 3)],
    2: [("A", 1, 0), ("A", 1, 2), ("B", 2, 1), ("F", 2, 0), ("T", 2, 3)],
    1: [("A", 1, 0), ("B", 1, 2), ("U", 1, 0), ("F", 1, 1), ("T", 1, 3)],
}  # fmt: skip
ROUND_TRIP = 1
"""The world-4 resume that saves again right after loading (ep 2 -> ep 4)."""
EXPERT = "moe.deepspeed_moe.experts.deepspeed_experts"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folders = {name: str(tmp_path_factory.mktemp(f"moe-{name}")) for name in [*SAVES, "C"]}
    saves = [{"case": "save", "ep": ep, "stage": s, "folder": folders[n],
              "variant": VARIANT.get(n, "split"), "async_save": n == "B"}
             for n, (ep, s) in SAVES.items()]  # fmt: skip
    out: dict[str, Any] = {"folders": folders, "resumes": {}}
    for world, resumes in RESUMES.items():
        cases: list[dict[str, Any]] = [
            {"case": "resume", "ep": ep, "stage": stage, "folder": folders[name],
             "again": folders["C"] if world == 4 and i == ROUND_TRIP else None,
             "variant": VARIANT.get(name, "split")}
            for i, (name, ep, stage) in enumerate(resumes)
        ]  # fmt: skip
        if world == 4:
            cases = saves + cases
        if world == 1:
            cases.append({"case": "plain", "folder": folders["A"]})
        per_case = run_distributed_grid(grid, world, cases, timeout=300)
        if world == 4:
            out["saves"] = dict(zip(SAVES, per_case[: len(saves)], strict=True))
            per_case = per_case[len(saves) :]
        if world == 1:
            out["plain"] = per_case.pop()[0]
        out["resumes"][world] = per_case
    return out


def _saved_weights(results: dict[str, Any], name: str) -> dict[str, list[float]]:
    return {k: v for rank in results["saves"][name] for k, v in rank["weights"].items()}


@pytest.mark.parity
def test_saving_runs_match_one_process(results: dict[str, Any]) -> None:
    for name, per_rank in results["saves"].items():
        want = reference(4, frozen=name == "F")
        for rank, got in enumerate(per_rank):
            assert_losses(got["losses"], [step[rank] for step in want])


def test_resume_at_the_saving_layout_is_bitwise(results: dict[str, Any]) -> None:
    saved = results["saves"]["A"]
    again = results["resumes"][4][0]
    assert [r["losses"] for r in again] == [r["losses"][SAVED_AT:] for r in saved]


@pytest.mark.parity
@pytest.mark.parametrize("world", sorted(RESUMES))
def test_resumed_runs_match_one_process(results: dict[str, Any], world: int) -> None:
    """Losses after a load at another ep, world size or stage, against one process that
    trained the first steps on 4 micro-batches and the rest on `world`."""
    for case, per_rank in zip(RESUMES[world], results["resumes"][world], strict=True):
        want = reference(world, frozen=case[0] == "F")[SAVED_AT:]
        for rank, got in enumerate(per_rank):
            try:
                assert_losses(got["losses"], [step[rank] for step in want])
            except AssertionError as e:
                raise AssertionError(f"{case} rank {rank}: {e}") from e


def test_every_loaded_expert_is_the_saved_one(results: dict[str, Any]) -> None:
    """Each rank's experts after the load equal the saving engine's experts of the same
    global index, bitwise; together the ranks of each world hold all of them."""
    for world, resumes in RESUMES.items():
        for (name, ep, stage), per_rank in zip(resumes, results["resumes"][world], strict=True):
            saved = _saved_weights(results, name)
            seen = set()
            for got in per_rank:
                for key, value in got["weights"].items():
                    assert value == saved[key], (world, name, ep, stage, key)
                    seen.add(key)
            assert seen == set(saved), (world, name, ep, stage)


def _states(folder: str) -> dict[tuple[str, str], torch.Tensor]:
    """Every trainable tensor's saved states, whole, by (name, state)."""
    with open(os.path.join(folder, TAG, "manifest.json")) as f:
        manifest = json.load(f)
    source = PartitaSource(os.path.join(folder, TAG), manifest)
    out = {}
    for name, info in manifest["tensors"].items():
        if info["kind"] != "trainable":
            continue
        numel = math.prod(info["shape"])
        for what in ["param", *manifest["optimizer_state_keys"]]:
            ranges = [] if what in manifest["scalar_state_keys"] else [(0, numel)]
            value = source.scalar(name, what) if not ranges else source.read(name, what, ranges)
            assert value is not None, (folder, name, what)
            out[(name, what)] = value
    source.close()
    return out


def test_manifest_names_each_expert_once_by_global_index(results: dict[str, Any]) -> None:
    """Every expert tensor appears under its global index, the same names as the one-process
    model's, marked with that index; a trainable one's saved ranges cover it exactly once
    across the files, a frozen one is stored whole in exactly one file."""
    from safetensors import safe_open

    want = set(Net(1, K).state_dict())
    for name in SAVES:
        folder = os.path.join(results["folders"][name], TAG)
        with open(os.path.join(folder, "manifest.json")) as f:
            manifest = json.load(f)
        assert set(manifest["tensors"]) == want
        stored: list[str] = []
        for fname in manifest["files"]:
            with safe_open(os.path.join(folder, fname), framework="pt") as handle:
                stored += list(handle.keys())
        for tensor, info in manifest["tensors"].items():
            if tensor.startswith(EXPERT):
                index = int(tensor[len(EXPERT) + 1 :].split(".")[0])
                assert info["expert"] == {"index": index, "of": EXPERTS}, (name, tensor)
            frozen = name == "F" and tensor.startswith(EXPERT) and tensor.endswith(".2.bias")
            assert info["kind"] == ("frozen" if frozen else "trainable"), (name, tensor)
            if frozen:
                assert stored.count(f"module::{tensor}") == 1, (name, tensor)
                continue
            covered = sorted(
                (int(o), int(n))
                for f in manifest["files"].values()
                for o, n in f["ranges"].get(tensor, [])
            )
            ends = [0] + [o + n for o, n in covered]
            assert [o for o, _ in covered] == ends[:-1], (name, tensor, covered)
            assert ends[-1] == math.prod(info["shape"]), (name, tensor, covered)
        assert manifest["optimizer_state_keys"] == ["exp_avg", "exp_avg_sq", "step"]
        assert manifest["ep_world_size"] == SAVES[name][0]


def test_round_trip_through_another_ep_gives_back_every_state(results: dict[str, Any]) -> None:
    """Saved at ep 2 x dp 2 ZeRO 2, loaded at ep 4 ZeRO 1 and saved again: every master
    weight, Adam moment and step bitwise the first checkpoint's."""
    first, again = _states(results["folders"]["A"]), _states(results["folders"]["C"])
    assert first.keys() == again.keys()
    for key, value in first.items():
        assert torch.equal(value, again[key]), key


def test_plain_module_loads_the_consolidated_weights(results: dict[str, Any]) -> None:
    got = results["plain"]
    assert got["missing"] == [] and got["unexpected"] == []
    assert_losses(got["losses"], reference(4)[SAVED_AT])


def test_export_writes_the_modules_own_expert_names(results: dict[str, Any], tmp_path: Any) -> None:
    """``partita export``'s safetensors load strictly into the one-process model, each expert
    under its usual name, equal to the saving engine's weights."""
    from safetensors.torch import load_file

    assert export_main([results["folders"]["A"], str(tmp_path), "--tag", TAG]) == 0
    state = load_file(os.path.join(tmp_path, "model.safetensors"))
    Net(1, K).load_state_dict(state, strict=True)
    for key, value in _saved_weights(results, "A").items():
        assert state[key].reshape(-1).tolist() == value, key


class _Tied(torch.nn.Module):
    """An expert whose two linear layers share one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 3)
        self.b = torch.nn.Linear(3, 3)
        self.b.weight = self.a.weight


def test_names_and_table_of_expert_rank_one_of_two() -> None:
    """Expert-parallel rank 1 of 2 of a 4-expert layer holds experts 2 and 3 under local
    names 0 and 1; the table rank 0 writes lists experts 0-3 in the one-process order, a
    weight tied inside an expert an alias of that expert's own (one process, no groups)."""
    from partita.checkpoint import experts
    from partita.comm import ParallelDims
    from partita.moe import MoE

    module = torch.nn.Sequential(MoE(3, _Tied(), num_experts=4, ep_size=2))
    prefix = "0.deepspeed_moe.experts.deepspeed_experts"
    rank1 = ParallelDims(1, 4, None, (0, 1, 2, 3), ep_ranks=(0, 1), edp_ranks=(1, 3))
    names = {k: e.name for k, e in experts.global_names(module, rank1).items()}
    assert names[f"{prefix}.1.b.bias"] == f"{prefix}.3.b.bias"
    assert names[f"{prefix}.0.a.weight"] == f"{prefix}.2.a.weight"
    rank0 = ParallelDims(0, 4, None, (0, 1, 2, 3), ep_ranks=(0, 1), edp_ranks=(0, 2))
    local = {f"{prefix}.{i}.{k}": {"kind": "trainable"} for i in (0, 1) for k in ("a.weight",
             "a.bias", "b.bias")}  # fmt: skip
    for i in (0, 1):
        local[f"{prefix}.{i}.b.weight"] = {"kind": "alias", "alias_of": f"{prefix}.{i}.a.weight"}
    table = experts.table({"gate": {"kind": "trainable"}, **local}, module, rank0)
    keys = ["a.weight", "a.bias", "b.weight", "b.bias"]  # the expert's state_dict order
    assert list(table) == ["gate"] + [f"{prefix}.{g}.{k}" for g in range(4) for k in keys]
    assert table[f"{prefix}.3.b.weight"]["alias_of"] == f"{prefix}.3.a.weight"
    assert table[f"{prefix}.2.a.bias"]["expert"] == {"index": 2, "of": 4}
    # Stage-0 writers of rank 1's experts: its expert-data-parallel ranks 1, 3 take turns.
    assert experts.writers(module, rank1)[f"{prefix}.2.a.bias"] == 1
    assert experts.writers(module, rank1)[f"{prefix}.3.a.bias"] == 3
