"""Exit soak: many finished jobs through the ``partita`` launcher, none calling
``destroy_process_group``; every one must exit 0 (issue 34, "Exit"; [Note: ordered shutdown]
in `partita.platform.shutdown`).

    .venv/bin/python benchmarks/exit_soak.py [--runs 15] [--steps 4] [--tree TREE]

Runs a DeepSpeed-style script (``import partita as deepspeed``, ``deepspeed.initialize``, a
few steps of a small MLP, then the end of the script) at 4 and 2 CPU ranks with ZeRO-2 and
ZeRO-3, ``--runs`` jobs of each combination, interleaved, and prints per combination the
runs, the launcher's exit-0 count and each failure's last output lines. ``--tree`` puts
another checkout's ``src`` first on ``PYTHONPATH`` (the code before a fix, say). Tens of
minutes on 2 loaded cores: each job starts the launcher and 2 or 4 interpreters.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = """
import argparse
import torch
import partita as deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=4)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(16 * args.steps, 8), torch.randn(16 * args.steps, 1))
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
engine, _, loader, _ = deepspeed.initialize(
    args=args, model=model, model_parameters=model.parameters(), training_data=data
)
for x, y in loader:
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
# No torch.distributed.destroy_process_group(): the interpreter exits with the group up.
"""


def _config(stage: int) -> dict[str, object]:
    return {
        "train_batch_size": 16,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
    }


def _run(work: Path, ranks: int, stage: int, steps: int, env: dict[str, str]) -> tuple[int, str]:
    config = work / f"ds_stage{stage}.json"
    cmd = [sys.executable, "-m", "partita.launcher.cli", "--num_procs", str(ranks)]
    cmd += [str(work / "train.py"), "--deepspeed_config", str(config), "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work, timeout=900)
    return proc.returncode, proc.stdout + proc.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="jobs per combination")
    parser.add_argument("--steps", type=int, default=4, help="training steps per job")
    parser.add_argument("--tree", help="a checkout whose src/ goes first on PYTHONPATH")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    if args.tree:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(args.tree, "src").resolve()), env.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep)
    combos = [(ranks, stage) for ranks in (4, 2) for stage in (2, 3)]
    results: dict[tuple[int, int], list[tuple[int, str]]] = {c: [] for c in combos}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="exit_soak_") as tmp:
        work = Path(tmp)
        (work / "train.py").write_text(SCRIPT)
        for stage in (2, 3):
            (work / f"ds_stage{stage}.json").write_text(json.dumps(_config(stage)))
        for i in range(args.runs):
            for ranks, stage in combos:  # interleaved: the machine's drift hits all alike
                code, out = _run(work, ranks, stage, args.steps, env)
                results[(ranks, stage)].append((code, out))
                mark = "ok" if code == 0 else f"FAILED (exit {code})"
                print(
                    f"[{time.monotonic() - start:6.0f}s] run {i + 1} ranks={ranks} "
                    f"zero={stage}: {mark}",
                    flush=True,
                )
    print(f"\n{sum(len(r) for r in results.values())} jobs in {time.monotonic() - start:.0f} s")
    print(f"{'combination':<20} {'runs':>5} {'exit 0':>7} {'failures':>9}")
    for (ranks, stage), runs in results.items():
        ok = sum(code == 0 for code, _ in runs)
        print(f"{f'{ranks} ranks, ZeRO-{stage}':<20} {len(runs):>5} {ok:>7} {len(runs) - ok:>9}")
    for (ranks, stage), runs in results.items():
        for n, (code, out) in enumerate(runs, 1):
            if code != 0:
                tail = "\n    ".join(out.strip().splitlines()[-6:])
                print(f"\n{ranks} ranks, ZeRO-{stage}, run {n}: exit {code}\n    {tail}")


if __name__ == "__main__":
    main()
