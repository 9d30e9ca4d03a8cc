"""The GPU check: one run, at most 8 minutes on one H200, of what only a GPU can show.

Sections (each case passes, fails, errors, is skipped with a reason, or is "not run (time)"):

1. correctness on CUDA: stages 0-3 in bf16 (fp32 masters) bitwise equal per step to a
   plain-torch reference; fp16 with loss scaling and an injected overflow skipped; the same run
   twice bitwise; two ranks sharing the GPU (NCCL where it allows, else gloo) against torch.
2. offload: stage 2/3 ``offload_optimizer: cpu`` and stage 3 ``offload_param: cpu`` bitwise
   equal to no offload with their host buffers page-locked; NVMe offload to the local disk;
   the share of the copy-back's side-stream copies hidden behind the next slice's CPU Adam.
3. checkpoints: saved at stage 3, loaded at stage 0 and 3, RNG restored (dropout continues).
4. speed: a ~1B GPT, world size 1: partita stages 0 and 3, FSDP2, DeepSpeed stage 3 (where
   installed and its ops build), plain torch with fused AdamW; stage 3 with CPU offload against
   DeepSpeed's ZeRO-Offload. Time-boxed by ``--budget-s``.

``--dry-run`` (automatic without CUDA) runs every case on CPU at tiny sizes, so the script
cannot rot; CI runs it (tests/test_gpu_check.py). Writes ``gpu_check.json`` and
``gpu_check.md`` into ``--out`` (default ``$OUT``, else benchmarks/results/gpu_check) and exits
1 when any case fails or errors. ``--perturb parity`` breaks the bf16 reference on purpose
(its learning rate x 1.001), to show that the check fails when the numbers differ.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("1", "1r", "2", "3", "4")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--dry-run", action="store_true", help="CPU, tiny sizes (automatic without CUDA)"
    )
    p.add_argument(
        "--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks/results/gpu_check")
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds from start after which no case starts (default 450 on the GPU, none dry)",
    )
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help="comma-separated subset of 1,1r (two ranks),2,3,4",
    )
    p.add_argument(
        "--perturb", default="", choices=["", "parity"], help="break one case on purpose"
    )
    args = p.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"--sections: unknown {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs the chosen sections; 0 when no case failed or errored."""
    args = parse_args(argv)
    start = time.monotonic()
    if args.dry_run:  # before torch and partita are imported: they pick the device at import
        os.environ["PARTITA_ACCELERATOR"] = "cpu"
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
    }.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    import torch

    from gpu_check import core, report

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means fp32 matmuls
    torch.backends.cudnn.allow_tf32 = False
    mode = core.Mode.detect(args.dry_run)
    os.makedirs(args.out, exist_ok=True)
    # The dry run runs every case whatever the time (it is CI's check that nothing rotted).
    budget = args.budget_s if args.budget_s is not None else (float("inf") if mode.dry else 450.0)
    ctx = core.Context(mode, start + budget, os.path.abspath(args.out), perturb=args.perturb)
    env = _environment(mode)
    print(
        f"[gpu_check] {'dry run (CPU, tiny sizes)' if mode.dry else 'GPU run'}; out {ctx.out_dir}",
        flush=True,
    )
    _init_world(mode)
    chosen = set(args.sections.split(","))
    if "4" in chosen:
        from gpu_check import speed

        speed.start_ds_build(ctx)
    try:
        _run_sections(ctx, chosen)
    except KeyboardInterrupt:  # scripts/gpu_check.sh's hard time limit (SIGINT): still report
        ctx.cases.append(
            core.Case(
                "-", "interrupted", core.NOT_RUN, "hard time limit: cases after this did not run"
            )
        )
    # A DeepSpeed ops build still running is left to finish (speed.start_ds_build's note).
    env["seconds"] = round(time.monotonic() - start, 1)
    # CPU time of this process and its finished children: unlike wall time, independent of
    # how loaded a shared machine is.
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    env["cpu_seconds"] = round(time.process_time() + children.ru_utime + children.ru_stime, 1)
    md_path, json_path = report.write(ctx, env)
    print(Path(md_path).read_text())
    failed = [c for c in ctx.cases if c.status in core.FAILING]
    print(
        f"[gpu_check] wrote {md_path} and {json_path}; {len(failed)} failing; {env['seconds']} s",
        flush=True,
    )
    return 1 if failed else 0


def _run_sections(ctx: Any, chosen: set[str]) -> None:
    """The chosen sections in order; one whose set-up (outside its cases) raises is recorded
    as an ``error`` case and the next section still runs."""
    import torch

    from gpu_check import correctness, offload, speed, two_ranks

    sections: list[tuple[str, str, Callable[[Any], None]]] = [
        ("1", "1 correctness", correctness.run_section1),
        ("1r", "1 correctness", two_ranks.run_two_ranks),
        ("2", "2 offload", offload.run_section2),
        ("3", "3 checkpoints", correctness.run_section3),
        ("4", "4 speed", speed.run_section4),
    ]
    for key, section, run in sections:
        if key not in chosen:
            continue
        # Deterministic kernels where torch has them (warnings elsewhere) for the bitwise
        # checks; the speed section times the default, fastest ones.
        torch.use_deterministic_algorithms(key != "4", warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = False  # keep torch.empty cheap
        try:
            run(ctx)
        except Exception as exc:
            ctx.run(section, f"section {key} set-up", lambda e=exc: _raise(e))


def _raise(exc: Exception) -> None:
    raise exc


def _init_world(mode: object) -> None:
    """A world-size-1 process group (NCCL on the GPU, gloo on CPU) for partita, FSDP2 and
    DeepSpeed in this process."""
    import torch

    from partita import comm

    store = torch.distributed.FileStore(tempfile.mktemp(prefix="gpu-check-store-"), 1)
    backend = "nccl" if mode.is_cuda else "gloo"  # type: ignore[attr-defined]
    comm.init_distributed(dist_backend=backend, rank=0, world_size=1, store=store, timeout=300)


def _environment(mode: object) -> dict[str, object]:
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import environment

    env = environment()
    env["cuda"] = torch.version.cuda
    if mode.is_cuda:  # type: ignore[attr-defined]
        env["device_name"] = torch.cuda.get_device_name(0)
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: process-group and DeepSpeed destructors can hang there (see
    # benchmarks/common.exit_worker), and the report is written.
    os._exit(code)
