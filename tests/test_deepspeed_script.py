"""A training script written against DeepSpeed's API runs unchanged under `partita`."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import argparse, json, os
    import torch
    import partita as deepspeed
    from partita.utils import safe_get_full_grad

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed()

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=data
    )
    losses = []
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        grad = safe_get_full_grad(next(engine.module.parameters()))
        engine.step()
        losses.append(loss.item())
    record = {
        "rank": engine.global_rank, "world": engine.world_size, "local_rank": args.local_rank,
        "steps": engine.global_steps, "lr": engine.get_lr(), "losses": losses,
        "grad_norm": engine.get_global_grad_norm(), "has_grad": grad is not None,
        "stage": engine.zero_optimization_stage(),
    }
    with open(os.path.join(args.out, f"rank{engine.global_rank}.json"), "w") as fh:
        json.dump(record, fh)
    """
)


def test_deepspeed_style_script_runs_under_partita_launcher(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    config = tmp_path / "ds_config.json"
    config.write_text(
        json.dumps(
            {
                "train_batch_size": 8,
                "gradient_accumulation_steps": 1,
                "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
                "scheduler": {
                    "type": "WarmupLR",
                    "params": {"warmup_num_steps": 2, "warmup_max_lr": 1e-2},
                },
                "zero_optimization": {"stage": 2},
            }
        )
    )
    cmd = [
        sys.executable, "-m", "partita.launcher.cli", "--num_procs", "2", str(script),
        "--deepspeed_config", str(config), "--out", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, rec in enumerate(records):
        assert rec["rank"] == rank and rec["world"] == 2 and rec["local_rank"] == rank
        assert rec["steps"] == 8  # 64 samples / (4 per rank x 2 ranks)
        assert rec["lr"] == [1e-2] and rec["has_grad"] and rec["stage"] == 2
        assert rec["grad_norm"] > 0
    assert records[0]["losses"] != records[1]["losses"]  # each rank read its own data
