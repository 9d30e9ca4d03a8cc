"""Accelerate's own Ulysses path on partita: ``accelerate launch --use_deepspeed`` with
``PARTITA_AS_DEEPSPEED=1`` runs a loop with ``ParallelismConfig(sp_backend="deepspeed",
sp_size=2)`` (Accelerate calls ``register_with_transformers``, passes its mpu to
``deepspeed.initialize`` and wraps the loader in ``UlyssesSPDataLoaderAdapter``) and
Transformers' Trainer loss under sequence parallelism (``deepspeed_sp_compute_loss``), and the
Trainer itself with ``TrainingArguments(parallelism_config=...)``; each is held to one process
on the same sequences. SGD: a gradient sp times too large (DeepSpeed's average over the
data-parallel ranks only) or too small fails it. The script is tests/ulysses_workers.py run as a
program; two launches of 30-60 s each (apart from tests/test_ulysses.py so that the files run
side by side)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models import assert_losses
from partita.launcher.launch import find_free_port
from ulysses_workers import accelerate_reference

TESTS = Path(__file__).parent


def _launch(out: Path, *mode: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(TESTS), "PARTITA_AS_DEEPSPEED": "1"}
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--zero_stage",
        "2", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--main_process_port", str(find_free_port()),
        str(TESTS / "ulysses_workers.py"), str(out), *mode,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.mark.parity
def test_accelerate_sp2_with_trainer_loss_matches_one_process(tmp_path: Path) -> None:
    _launch(tmp_path)
    want = accelerate_reference()
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["engine"] == "partita.engine"
        assert_losses(got["losses"], want)


@pytest.mark.parity
def test_trainer_with_parallelism_config_sp2_matches_one_process(tmp_path: Path) -> None:
    """TrainingArguments(parallelism_config=ParallelismConfig(sp_size=2, sp_backend=
    "deepspeed"), deepspeed=config with "auto" values), optim="sgd": the Trainer's own loss,
    step by step, equals one process's (the Trainer's log rounds it, so the test records what
    its loss function returns)."""
    _launch(tmp_path, "trainer")
    want = accelerate_reference()
    for rank in (0, 1):
        got = json.loads((tmp_path / f"trainer_rank{rank}.json").read_text())
        assert got["engine"] == "partita.engine"
        assert_losses(got["losses"], want)
