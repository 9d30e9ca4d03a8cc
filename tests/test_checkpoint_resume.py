"""Exact resume and reshard-on-load.

Three save spawns (world sizes 1, 2, 4) train, save and keep training; three load spawns start
new processes at world sizes 1, 2, 4 and load. Resume: the losses after loading are bitwise
those of the uninterrupted run (dropout, shuffling loader, warmup schedule, fp16 dynamic loss
scaling with skipped steps). Reshard: every (N, s) checkpoint loads at every (M, t) with master
weights and optimizer state equal to the saved ones, and the next 5 losses within rtol 1e-6.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from checkpoint_workers import load_phase, save_phase
from partita.testing import run_distributed

WORLDS = (1, 2, 4)
STAGES = [0, 1, 2, 3]
RESUME_STAGES = {1: [0, 1, 2, 3], 2: [0, 1, 2, 3], 4: [2]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("ckpt"))
    saved = {}
    for n in WORLDS:
        saved[n] = run_distributed(save_phase, n, root, RESUME_STAGES[n], STAGES, timeout=300)[0]
    refs = {(n, s): saved[n]["reshard"][s]["states"] for n in WORLDS for s in STAGES}
    loaded = {}
    for m in WORLDS:
        loaded[m] = run_distributed(
            load_phase, m, root, RESUME_STAGES[m], refs, STAGES, timeout=300
        )[0]
    return {"saved": saved, "loaded": loaded}


@pytest.mark.parametrize(
    ("world", "stage"), [(w, s) for w, stages in RESUME_STAGES.items() for s in stages]
)
def test_resume_is_bitwise(runs: dict[str, Any], world: int, stage: int) -> None:
    full = runs["saved"][world]["resume"][stage]
    resumed = runs["loaded"][world]["resume"][stage]
    # The fp16 run really skipped steps (one before the save, one after) and scaled the loss.
    assert full["skipped"] == 2
    assert resumed["skipped"] == 2
    assert resumed["after"] == full["after"]  # float equality: bitwise
    assert resumed["scale"] == full["scale"]
    assert resumed["client"] == {"save_at": 4, "note": "resume"}
    assert resumed["path"].endswith("global_step4")


@pytest.mark.parametrize("load_world", WORLDS)
@pytest.mark.parametrize("save_world", WORLDS)
def test_reshard_matrix(runs: dict[str, Any], save_world: int, load_world: int) -> None:
    for s in STAGES:
        ref = runs["saved"][save_world]["reshard"][s]
        for t in STAGES:
            got = runs["loaded"][load_world]["reshard"][(save_world, s, t)]
            case = f"saved N={save_world} s={s}, loaded M={load_world} t={t}"
            assert got["differ"] == [], f"{case}: states differ: {got['differ'][:5]}"
            assert got["global_steps"] == 3 + 5, case
            torch.testing.assert_close(
                torch.tensor(got["losses"], dtype=torch.float64),
                torch.tensor(ref["losses"], dtype=torch.float64),
                rtol=1e-6,
                atol=0.0,
                msg=case,
            )
