"""The quick start's demo runs end to end (a few steps) under the partita launcher and leaves
its log, loss curve and memory picture where it says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import matplotlib.image

ROOT = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    """``path`` is a non-empty PNG file that decodes to a picture of some size."""
    assert path.is_file(), f"{path} missing"
    data = path.read_bytes()
    assert len(data) > 0 and data.startswith(PNG_SIGNATURE), f"{path}: not a PNG"
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100, f"{path}: {pixels.shape}"


def test_demo_trains_a_few_steps_on_two_processes(tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "partita.launcher.cli", "--num_procs", "2",
        str(ROOT / "examples" / "train_gpt.py"),
        "--deepspeed_config", str(ROOT / "examples" / "ds_config.json"),
        "--steps", "3", "--print_every", "2", "--sample_tokens", "5", "--out_dir", str(out_dir),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "master_params" in out and "optimizer_state" in out  # the per-rank memory table
    # It says where its outputs are, and they are there.
    assert f"log: {out_dir / 'train.log'}" in out, out
    assert f"wrote {out_dir}/" in out, out
    assert_png(out_dir / "loss.png")
    assert_png(out_dir / "memory.png")
    # The log has every step once, with both ranks' losses (gathered at steps 2 and 3).
    log = (out_dir / "train.log").read_text()
    step_lines = [line.split() for line in log.splitlines() if " loss " in line]
    assert [int(words[1]) for words in step_lines] == [1, 2, 3], log
    assert all(words[4] == "ranks" and len(words) == 9 for words in step_lines), log
    assert "optimizer_state" in log and "sample: It is a truth" in log, log
