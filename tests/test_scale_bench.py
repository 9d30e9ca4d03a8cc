"""benchmarks/bench_scale.py's guards: it refuses before writing when the disk is too small,
and removes its swap folder when the run fails (issue 21, item 3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks import bench_scale


def test_refuses_naming_the_path_and_bytes_when_the_disk_is_too_small(tmp_path: Path) -> None:
    """A reserve larger than the disk: SystemExit naming the folder and the bytes needed,
    before any file is created there."""
    with pytest.raises(SystemExit) as info:
        bench_scale.main(["--params", "tiny", "--nvme_path", str(tmp_path), "--reserve_gb", "1e9"])
    message = str(info.value)
    needed = bench_scale.swap_bytes_needed(bench_scale.gpt_numel(2, 128, 128), 2)
    assert str(tmp_path.resolve()) in message and f"{needed:,}" in message
    assert list(tmp_path.iterdir()) == []


def test_swap_folder_removed_when_training_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure mid-run still removes the swap folder and records the error."""

    def fail(args: object, swap_dir: Path) -> dict:
        (swap_dir / "state.swp").write_bytes(b"x" * 4096)
        raise RuntimeError("disk gone")

    monkeypatch.setattr(bench_scale, "train", fail)
    out = tmp_path / "result.json"
    nvme = tmp_path / "nvme"
    args = ["--params", "tiny", "--nvme_path", str(nvme), "--reserve_gb", "0", "--disk_mb", "1"]
    with pytest.raises(RuntimeError, match="disk gone"):
        bench_scale.main([*args, "--out", str(out)])
    assert list(nvme.iterdir()) == []
    result = json.loads(out.read_text())
    assert result["ok"] is False and "disk gone" in result["error"]
    assert result["swap_dir_bytes_at_end"] == 4096 and result["swap_dir_removed"]
