"""Transformers' Trainer with ``tensor_parallel.autotp_size: 2`` in its DeepSpeed config, run
on partita by ``accelerate launch --use_deepspeed`` with ``PARTITA_AS_DEEPSPEED=1``: the Trainer
calls ``deepspeed.tp_model_init`` and ``deepspeed.initialize`` (its "auto" batch sizes counting
both ranks, as DeepSpeed's AutoTP arithmetic does), Accelerate gives both tensor ranks the same
batches, and each step's loss equals one process's on the same batches. SGD shows any scaling
of the gradient. The script is tests/tp_trainer_script.py; one launch of 2 ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models import assert_losses
from partita.launcher.launch import find_free_port
from tp_trainer_script import reference

TESTS = Path(__file__).parent


@pytest.mark.parity
def test_trainer_with_autotp_size_2_matches_one_process(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(TESTS), "PARTITA_AS_DEEPSPEED": "1"}
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--zero_stage",
        "1", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--main_process_port", str(find_free_port()),
        str(TESTS / "tp_trainer_script.py"), str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    want = reference()
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["engine"] == "partita.engine" and got["tp"] == 2
        assert_losses(got["losses"], want)
