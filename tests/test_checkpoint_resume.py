"""Exact resume and reshard-on-load.

Four save spawns (world sizes 1, 2, 3, 4) train, save and keep training; four load spawns
start new processes at world sizes 1, 2, 3, 4 and load (each four two at a time). Resume: the losses after loading are bitwise
those of the uninterrupted run (dropout, shuffling loader, warmup schedule, fp16 dynamic loss
scaling with skipped steps). Resume at another world size: the loader continues at the saved
global sample position of the same shuffle and the (rank-identical) RNG streams continue.
Reshard: every fp32 (N, s) checkpoint loads at every (M, t) with master weights and optimizer
state equal to the saved ones (for N, M in 1, 2, 4 also the next 5 losses within rtol 1e-6);
bf16 and CPU-offloaded checkpoints load at every M into their own variant at another stage and
into fp32 engines, and fp32 ones into bf16 and offloaded engines, states equal.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import pytest
import torch

from checkpoint_workers import load_phase, resume_dataset, save_phase
from partita.testing import run_distributed

# One module fixture runs every spawn (minutes on a loaded 2-core machine); it counts against
# the first test's time limit, so the hang guard here is wider than the suite's default.
pytestmark = pytest.mark.timeout(1200)

WORLDS = (1, 2, 3, 4)
GRID = (1, 2, 4)
"""World sizes whose fp32 pairs also train 5 steps on and compare losses with the reference."""
STAGES = [0, 1, 2, 3]
RESUME_STAGES = {1: [0, 1, 2, 3], 2: [0, 1, 2, 3], 3: [], 4: [2]}
CROSS = {1: (2, 4), 2: (1, 4), 3: (2,), 4: (2,)}
"""Loading world size -> saving world sizes of the resume checkpoints it loads (stage 2)."""
VARIANT_SAVES = {
    1: [(2, "offload")],
    2: [(1, "bf16"), (3, "offload")],
    3: [(3, "bf16"), (1, "offload")],
    4: [(2, "bf16")],
}
"""World size -> its (stage, variant) checkpoints beside the fp32 ones of every stage."""
FP32_INTO = [(2, 0, 3, "offload"), (4, 3, 1, "bf16"), (3, 2, 0, "bf16")]
"""fp32 checkpoints (world, stage) loaded into other variants' engines (stage, variant)."""


def _other_stage(s: int, variant: str) -> int:
    """A stage other than `s` that `variant` supports (offload: 1-3)."""
    return s % 3 + 1 if variant == "offload" else (s + 1) % 4


def saves(n: int) -> list[tuple[int, str]]:
    """(stage, variant) checkpoints saved at world size `n`."""
    return [(s, "fp32") for s in STAGES] + VARIANT_SAVES[n]


def loads(m: int) -> list[tuple[int, int, str, int, str, bool]]:
    """Reshard loads at world size `m`: (N, s, v) -> (t, w), train. Every fp32 checkpoint
    loads at every stage; every other variant's into its own at another stage and into fp32
    at its stage; some fp32 ones into the other variants."""
    out = []
    for n in WORLDS:
        train = n in GRID and m in GRID
        out += [(n, s, "fp32", t, "fp32", train) for s in STAGES for t in STAGES]
        for s, v in VARIANT_SAVES[n]:
            out += [(n, s, v, _other_stage(s, v), v, False), (n, s, v, s, "fp32", False)]
    out += [(n, s, "fp32", t, w, False) for n, s, t, w in FP32_INTO]
    return out


def _two_at_a_time(calls: dict[int, Callable[[], Any]]) -> dict[int, Any]:
    """Each call's result, the calls run two at a time in threads, in the order given.

    The calls are independent spawns; ranks that wait on each other in collectives leave
    about half of a 2-core machine idle, which a second spawn fills."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {key: pool.submit(call) for key, call in calls.items()}
        return {key: future.result() for key, future in futures.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("ckpt"))
    largest_first = sorted(WORLDS, reverse=True)
    saved = _two_at_a_time(
        {
            n: partial(
                run_distributed, save_phase, n, root, RESUME_STAGES[n], saves(n), timeout=300
            )
            for n in largest_first
        }
    )
    refs = {
        (n, s, v): saved[n][0]["reshard"][(s, v)]["states"] for n in WORLDS for s, v in saves(n)
    }
    args = {m: (root, RESUME_STAGES[m], refs, loads(m), CROSS[m]) for m in largest_first}
    loaded = _two_at_a_time(
        {m: partial(run_distributed, load_phase, m, *args[m], timeout=300) for m in largest_first}
    )
    return {"saved": saved, "loaded": loaded}


@pytest.mark.parametrize(
    ("world", "stage"), [(w, s) for w, stages in RESUME_STAGES.items() for s in stages]
)
def test_resume_is_bitwise(runs: dict[str, Any], world: int, stage: int) -> None:
    full = runs["saved"][world][0]["resume"][stage]
    resumed = runs["loaded"][world][0]["resume"][stage]
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
    cases = [c for c in loads(load_world) if c[0] == save_world]
    assert len(cases) >= len(STAGES) ** 2
    for n, s, v, t, w, train in cases:
        ref = runs["saved"][n][0]["reshard"][(s, v)]
        got = runs["loaded"][load_world][0]["reshard"][(n, s, v, t, w)]
        case = f"saved N={n} s={s} {v}, loaded M={load_world} t={t} {w}"
        assert got["differ"] == [], f"{case}: states differ: {got['differ'][:5]}"
        assert got["global_steps"] == 3 + (5 if train else 0), case
        if train:
            torch.testing.assert_close(
                torch.tensor(got["losses"], dtype=torch.float64),
                torch.tensor(ref["losses"], dtype=torch.float64),
                rtol=1e-6,
                atol=0.0,
                msg=case,
            )


def _stream(
    tokens: list[list[torch.Tensor]], skip: int, per_epoch: int, size: int
) -> dict[tuple[int, int], torch.Tensor]:
    """(epoch offset, position in the epoch's shuffle) -> sample, from each rank's consumed
    micro-batches (a `DistributedSampler` gives rank r positions r, r + W, r + 2W, ...).
    `skip`: samples each rank had consumed of the first epoch; padding positions dropped."""
    world = len(tokens)
    out = {}
    for r, batches in enumerate(tokens):
        epoch, k = 0, skip
        for row in torch.cat(batches):
            if k >= per_epoch:
                epoch, k = epoch + 1, 0
            if r + k * world < size:
                out[(epoch, r + k * world)] = row
            k += 1
    return out


@pytest.mark.parametrize(
    ("save_world", "load_world"), [(n, m) for m, ns in CROSS.items() for n in ns]
)
def test_resume_across_world_sizes(runs: dict[str, Any], save_world: int, load_world: int) -> None:
    size = len(resume_dataset())
    full = runs["saved"][save_world]
    position = full[0]["resume"][2]["position"]
    consumed = position["samples"] * save_world  # of epoch position["epoch"]'s shuffle
    assert 0 < consumed < size
    # RNG: the saved ranks' torch streams were identical (same seed, same draws), so each new
    # rank continues exactly that stream.
    rng = full[0]["resume"][2]["rng"]
    assert all(torch.equal(r["resume"][2]["rng"], rng) for r in full)
    ref = _stream(
        [r["resume"][2]["tokens"] for r in full],
        position["samples"],
        position["samples_per_epoch"],
        size,
    )
    loaded = [r["cross"][save_world] for r in runs["loaded"][load_world]]
    for rank, got in enumerate(loaded):
        assert torch.equal(got["rng"], rng), f"rank {rank}: RNG not restored"
    skip = consumed // load_world
    resumed = _stream([g["tokens"] for g in loaded], skip, loaded[0]["samples_per_epoch"], size)
    # Positions consumed again: the last `consumed % load_world` before the saved position.
    first_epoch = sorted(p for e, p in resumed if e == 0)
    assert first_epoch[0] == skip * load_world
    assert consumed - first_epoch[0] == consumed % load_world
    # Up to where the shorter of the two runs stops, both consumed the same positions from
    # the saved one on, and the same samples at each (at least 12 micro-batches of 2).
    end = min(max(ref), max(resumed))
    common = {k for k in ref if k <= end}
    assert common == {k for k in resumed if (0, consumed) <= k <= end}
    assert len(common) >= 24
    differ = sorted(k for k in common if not torch.equal(ref[k], resumed[k]))
    assert differ == [], f"samples at (epoch offset, position) {differ[:5]} differ"
