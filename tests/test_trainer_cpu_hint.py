"""A Hugging Face Trainer on a CPU-only torch launched on two ranks without
``TrainingArguments(use_cpu=True)``: Accelerate counts one process, the Trainer fills the batch
sizes for it, and partita's batch check fails; the error names ``use_cpu=True`` as the fix.
The same script with ``use_cpu=True`` trains (the positive case runs in test_hf_trainer.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from partita.compat.deepspeed._cpu_world import accelerate_processes, with_cpu_world_hint
from partita.config.errors import ConfigError, Problem

TESTS = Path(__file__).parent
GUARD_S = 240  # hang guard for the launch

# What a user writes: nothing partita-specific, no use_cpu; a tiny GPT-2, nothing downloaded.
SCRIPT = """
import argparse, torch
from transformers import AutoModelForCausalLM, GPT2Config, Trainer, TrainingArguments

class Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        self.ids = torch.randint(0, 64, (n, 8), generator=torch.Generator().manual_seed(0))
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}

p = argparse.ArgumentParser()
p.add_argument("--deepspeed")
p.add_argument("--out")
p.add_argument("--local_rank", type=int, default=-1)  # the launcher passes it, as DeepSpeed's
a = p.parse_args()
args = TrainingArguments(output_dir=a.out, per_device_train_batch_size=2, max_steps=1,
                         report_to=[], deepspeed=a.deepspeed, save_strategy="no",
                         disable_tqdm=True)
config = GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=16,
                    bos_token_id=0, eos_token_id=0)
model = AutoModelForCausalLM.from_config(config)
Trainer(model=model, args=args, train_dataset=Tokens(8)).train()
"""
DS_CONFIG = """{"zero_optimization": {"stage": 2}, "train_batch_size": "auto",
 "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
 "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="Accelerate builds its group on GPUs")
def test_trainer_without_use_cpu_is_told_to_pass_it(tmp_path: Path) -> None:
    script, config = tmp_path / "train.py", tmp_path / "ds_config.json"
    script.write_text(SCRIPT)
    config.write_text(DS_CONFIG)
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    for name in ("PARTITA_AS_DEEPSPEED", "ACCELERATE_USE_CPU", "PARTITA_DEBUG"):
        env.pop(name, None)
    cmd = [
        sys.executable, "-m", "partita.launcher.cli", "--num_procs", "2", str(script),
        "--deepspeed", str(config), "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=GUARD_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-4000:]
    assert "train_batch_size must equal" in out, out[-4000:]
    assert "the launcher started 2 ranks but Accelerate counted 1 process" in out, out[-4000:]
    assert "pass TrainingArguments(use_cpu=True)" in out


def _batch_error() -> ConfigError:
    return ConfigError([Problem("train_batch_size", "train_batch_size must equal ...")], "<dict>")


def test_no_hint_unless_accelerate_counted_one_of_several(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hint needs Accelerate's own count of 1 against a larger world: with no Accelerate
    state, with Accelerate counting the world, or on one rank, the error stays as it was."""
    from accelerate.state import PartialState

    import partita.compat.deepspeed._cpu_world as cw

    monkeypatch.setattr(cw, "_world_size", lambda: 2)
    PartialState._reset_state()
    try:
        assert accelerate_processes() is None and with_cpu_world_hint(_batch_error()) is None
        PartialState(cpu=False)  # one process, no LOCAL_RANK: Accelerate counts 1
        assert accelerate_processes() == 1
        hinted = with_cpu_world_hint(_batch_error())
        assert hinted is not None and "use_cpu=True" in str(hinted)
        assert str(hinted).startswith("DeepSpeed config in <dict>: train_batch_size: ")
        other = ConfigError([Problem("zero_optimization.stage", "bad")])
        assert with_cpu_world_hint(other) is None  # only the batch problem has this cause
        monkeypatch.setattr(cw, "_world_size", lambda: 1)
        assert with_cpu_world_hint(_batch_error()) is None
        monkeypatch.setattr(cw, "_world_size", lambda: 2)
        PartialState._shared_state["num_processes"] = 2  # as when it built the gloo group
        assert with_cpu_world_hint(_batch_error()) is None
    finally:
        PartialState._reset_state()
