"""The quick start's demo runs end to end (a few steps) under the partita launcher."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_trains_a_few_steps_on_two_processes() -> None:
    cmd = [
        sys.executable, "-m", "partita.launcher.cli", "--num_procs", "2",
        str(ROOT / "examples" / "train_gpt.py"),
        "--deepspeed_config", str(ROOT / "examples" / "ds_config.json"),
        "--steps", "3", "--sample_tokens", "5",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "master_params" in out and "optimizer_state" in out  # the per-rank memory table
