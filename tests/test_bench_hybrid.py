"""benchmarks/bench_hybrid.py's byte counter: each collective handed to torch.distributed is
counted once, by payload, under its group's kind (one gloo process, in a subprocess so the
wrapped torch.distributed functions stay out of the test process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import json, sys, tempfile
from benchmarks import bench_hybrid
import torch, torch.distributed as dist
bench_hybrid.BYTES.install()
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
bench_hybrid.BYTES.on = True
x = torch.zeros(10)
dist.all_reduce(x)
dist.all_gather_into_tensor(torch.zeros(10), x)
dist.reduce_scatter_tensor(torch.zeros(10), torch.zeros(10))
dist.distributed_c10d._all_gather_base(torch.zeros(10), x)  # calls all_gather_into_tensor
bench_hybrid.BYTES.on = False
dist.all_reduce(x)  # not counted
print(json.dumps({"snap": bench_hybrid.BYTES.snapshot(), "ops": bench_hybrid.BYTES.by_op}))
"""


def test_group_bytes_counts_each_collective_once() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ops"] == {
        "world/all_reduce": 40,
        "world/all_gather_into_tensor": 40,
        "world/reduce_scatter_tensor": 40,
        "world/_all_gather_base": 40,
    }
    assert out["snap"]["payload/world"] == 160
    assert out["snap"]["sent/world"] == 0  # one rank sends nothing on a ring
