"""Worker the launcher-flag tests start (tests/test_launcher_deepspeed_flags.py): records what
it was given and exits; imports torch only in ``allreduce`` mode.

``launcher_probe.py [--local_rank=N] OUT [allreduce]`` writes ``OUT/rank<RANK>.json``: its
argv, the launcher variables it got, its CPU affinity, and the content of the launcher's
``--save_pid`` file as it was while the job ran. It prints one line to stdout and one to
stderr (the per-rank log test looks for them). ``allreduce``: ``import deepspeed`` (partita,
under the launcher), ``deepspeed.init_distributed()`` and an all-reduce of rank + 1, whose
result is recorded: the ranks form one world.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "PARTITA_AS_DEEPSPEED",
    "PARTITA_ACCELERATOR",
    "PYTHONPATH",
    "CUDA_VISIBLE_DEVICES",
    "UCX_TLS",
)


def _pid_file() -> str | None:
    launcher = os.environ.get("PARTITA_LAUNCHER_PID")
    path = Path("/tmp") / f"{launcher}.deepspeed"
    return path.read_text() if launcher and path.exists() else None


def main() -> None:
    """Records this rank's view of its launch under OUT."""
    args = sys.argv[1:]
    out, mode = Path(args[-2] if args[-1] == "allreduce" else args[-1]), args[-1]
    rank = os.environ.get("RANK", "none")
    record: dict[str, object] = {
        "argv": args,
        "env": {key: os.environ.get(key) for key in _VARS},
        "affinity": sorted(os.sched_getaffinity(0)),
        "pid_file": _pid_file(),
        "launcher_pid": os.environ.get("PARTITA_LAUNCHER_PID"),
    }
    print(f"stdout of rank {rank}", flush=True)
    print(f"stderr of rank {rank}", file=sys.stderr, flush=True)
    if mode == "allreduce":
        import deepspeed
        import torch

        deepspeed.init_distributed()
        total = torch.tensor([float(int(rank) + 1)])
        torch.distributed.all_reduce(total)
        record["all_reduce"] = total.item()
        record["deepspeed"] = deepspeed.__name__
        torch.distributed.destroy_process_group()
    part = out / f"rank{rank}.part"
    part.write_text(json.dumps(record))
    part.replace(out / f"rank{rank}.json")


if __name__ == "__main__":
    main()
