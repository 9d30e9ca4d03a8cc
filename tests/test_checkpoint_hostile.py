"""Checkpoint safety against failed re-saves and hostile folders (see
`checkpoint_hostile_workers`; one world-2 spawn runs every case):

- re-saving an existing tag that fails (disk full in a shard or in the manifest, or right after
  a load of the same global_stepN) leaves the previous content loadable; a successful re-save
  replaces it and leaves no staging folder behind;
- `latest` naming a missing or incomplete folder falls back to the newest complete checkpoint
  with a warning naming both;
- paths leading out of the checkpoint (manifest file names, `latest`, the tag, symlinks),
  stored tensors whose dtype or length disagree with the manifest, and malformed manifests are
  refused on every rank with an error naming the file or value; a malformed manifest in an
  unrelated folder does not block loading another checkpoint;
- a save cleans only leftovers of dead saves, never another live job's staging folder or a
  folder it did not write.
"""

from __future__ import annotations

from typing import Any

import pytest

from checkpoint_hostile_workers import TAG, all_cases
from partita.testing import run_distributed

SHARD0 = "rank00000-of-00002.safetensors"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("hostile"))
    return run_distributed(all_cases, 2, root, timeout=300)


def _no_staging(listing: list[str]) -> bool:
    return not [n for n in listing if n.startswith(".partita-save")]


@pytest.mark.parametrize("case", ["shard_rank1", "manifest", "after_load"])
def test_failed_resave_keeps_previous_content(ranks: list[dict[str, Any]], case: str) -> None:
    for rank, result in enumerate(ranks):
        kind, message = result["resave"][f"{case}:save"]
        assert kind == "CheckpointError" and "No space left on device" in message, (rank, message)
        (loaded, message), same = result["resave"][f"{case}:load"]
        assert loaded == "ok", (rank, message)
        assert same, (rank, "the loaded weights are not the previously saved ones")
    listing = ranks[0]["resave"].get(f"{case}:listing")
    if listing is not None:
        assert _no_staging(listing), listing


def test_successful_resave_replaces_content(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        (loaded, message), same = result["resave"]["replaced:load"]
        assert loaded == "ok" and same, message
    assert _no_staging(ranks[0]["resave"]["replaced:listing"])
    assert ranks[0]["resave"]["replaced:folder"] == [
        "manifest.json",
        SHARD0,
        "rank00001-of-00002.safetensors",
    ]


@pytest.mark.parametrize(("case", "named"), [("latest_missing", "global_step99"),
                                             ("latest_incomplete", "half")])  # fmt: skip
def test_latest_falls_back_to_newest_complete(
    ranks: list[dict[str, Any]], case: str, named: str
) -> None:
    for rank, result in enumerate(ranks):
        (loaded, message), same, warned = result["fallback"][case]
        assert loaded == "ok" and same, (rank, message)
        if rank == 0:
            assert any(named in w and repr(TAG) in w for w in warned), warned


HOSTILE = {
    "manifest_dotdot": ["manifest.json", "../../x.safetensors"],
    "manifest_absolute": ["manifest.json", "x.safetensors", "absolute"],
    "manifest_symlink": [SHARD0, "outside"],
    "latest_absolute": ["latest", "/outside/ckpt"],
    "latest_dotdot": ["latest", "../../outside/ckpt"],
    "tag_dotdot": ["tag", "../../outside/ckpt"],
    "tag_absolute": ["tag", "/outside/ckpt"],
    "tag_symlink": ["linked", "outside"],
    "stored_dtype": [SHARD0, "float64", "float32"],
    "stored_longer": [SHARD0, "shape"],
    "stored_shorter": [SHARD0, "shape"],
    "module_dtype": [SHARD0, "float16", "float32"],
    "bad_ranges": ["manifest.json", "ranges"],
    "broken_other:asked": ["unrelated/manifest.json"],
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_checkpoint_refused(ranks: list[dict[str, Any]], case: str) -> None:
    for rank, result in enumerate(ranks):
        (kind, message), loaded, exported = result["hostile"][case]
        assert kind == "CheckpointError", (rank, kind, message)
        assert not loaded
        for part in HOSTILE[case]:
            assert part in message, (rank, part, message)
        if rank == 0:  # the export path (get_fp32_state_dict_from_zero_checkpoint) refuses too
            assert exported[0] == "CheckpointError", exported
            assert all(part in exported[1] for part in HOSTILE[case]), exported


def test_broken_manifest_elsewhere_does_not_block(ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(ranks):
        (kind, message), loaded, exported = result["hostile"]["broken_other:latest"]
        assert kind == "ok" and loaded, (rank, kind, message)
        if rank == 0:
            assert exported[0] == "ok", exported


def test_cleanup_spares_other_jobs(ranks: list[dict[str, Any]]) -> None:
    out = ranks[0]["sharing"]
    assert out["save"][0] == "ok", out["save"]
    # The other job's files and its live arrival marker survive; the dead process's goes.
    assert out["other_job_files"] == [SHARD0]
    assert out["markers"] == ["save-00000099-rank00000"], out["markers"]
    assert out["live"] in out["listing"], out["listing"]
    assert out["dead"] not in out["listing"], out["listing"]
    assert out["other_job_files"] == [SHARD0]
    assert TAG in out["listing"]


def test_two_rename_fallback(ranks: list[dict[str, Any]]) -> None:
    # Without renameat2: the same guarantees, through the set-aside folder and its repair.
    for rank, result in enumerate(ranks):
        out = result["two_rename"]
        assert out["ok:save"][0] == "ok", (rank, out["ok:save"])
        assert out["ok:load"] == (("ok", out["ok:load"][0][1]), True), (rank, out["ok:load"])
        kind, message = out["failed:save"]
        assert kind == "CheckpointError" and "injected failure" in message, (rank, message)
        assert out["failed:load"][0][0] == "ok" and out["failed:load"][1], (rank, out)
        assert out["killed:load_before"][0] == "CheckpointError", out["killed:load_before"]
        (loaded, message), same = out["killed:load_after"]
        assert loaded == "ok" and same, (rank, message)
    for key in ("failed:listing", "killed:listing"):
        assert _no_staging(ranks[0]["two_rename"][key]), ranks[0]["two_rename"][key]
