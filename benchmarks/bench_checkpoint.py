"""Checkpoint save/load time and bytes: partita vs DeepSpeed vs the disk's write bandwidth.

A GPT-2 (``--model 124m``: 124M parameters, tied embeddings) trains one step with AdamW under
ZeRO ``--stage`` (default 3, the highest available) on 2 CPU processes, then saves and loads
a checkpoint ``--repeats`` times. DeepSpeed runs the same (ZeRO ``--stage``, torch AdamW as a
client optimizer, DS_ACCELERATOR=cpu, gloo) when ``import deepspeed`` works. The disk's
sequential write bandwidth is measured in the same run by writing and fsyncing as many bytes
as partita's checkpoint holds, in 64 MiB blocks, to the same folder.

    .venv/bin/python benchmarks/bench_checkpoint.py [--model 124m] [--stage 3] [--repeats 2]

Prints a markdown table; writes ``benchmarks/results/checkpoint_<model>_stage<s>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODEL_SHAPES, build_gpt2, count_params
from partita.testing import run_distributed

RESULTS = Path(__file__).resolve().parent / "results"
SEQ = 64


def _config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
    }


def _dir_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _one_step(engine: Any) -> None:
    vocab = engine.module.config.vocab_size
    tokens = torch.randint(0, vocab, (1, SEQ), generator=torch.Generator().manual_seed(0))
    loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    engine.step()


def _timed_rounds(engine: Any, folder: str, repeats: int, barrier: Any) -> dict[str, Any]:
    saves, loads, sizes = [], [], []
    for i in range(repeats):
        barrier()
        start = time.perf_counter()
        engine.save_checkpoint(folder, tag=f"bench{i}")
        barrier()
        saves.append(time.perf_counter() - start)
        sizes.append(_dir_bytes(os.path.join(folder, f"bench{i}")))
        start = time.perf_counter()
        engine.load_checkpoint(folder, tag=f"bench{i}")
        barrier()
        loads.append(time.perf_counter() - start)
    return {"save_s": saves, "load_s": loads, "bytes": sizes}


def partita_worker(model_name: str, stage: int, folder: str, repeats: int) -> dict[str, Any]:
    """One rank of the partita run."""
    import partita
    from partita import comm

    model = build_gpt2(model_name, seed=0)
    params = count_params(model)
    cfg = {**_config(stage), "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    cfg.pop("zero_allow_untested_optimizer")
    engine, *_ = partita.initialize(model=model, config=cfg)
    _one_step(engine)
    out = _timed_rounds(engine, folder, repeats, comm.barrier)
    out["params"] = params
    return out


def deepspeed_worker(model_name: str, stage: int, folder: str, repeats: int) -> dict[str, Any]:
    """One rank of the DeepSpeed run (torch AdamW as a client optimizer: no op builds)."""
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    model = build_gpt2(model_name, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=_config(stage))
    _one_step(engine)
    return _timed_rounds(engine, folder, repeats, dist.barrier)


def disk_write_bandwidth(folder: str, nbytes: int) -> float:
    """Bytes per second of a sequential write + fsync of `nbytes` in 64 MiB blocks."""
    block = os.urandom(64 << 20)
    path = os.path.join(folder, "dd.bin")
    start = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    os.unlink(path)
    return nbytes / seconds


def _run(worker: Any, args: argparse.Namespace, env: dict[str, str] | None) -> dict[str, Any]:
    folder = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
    try:
        ranks = run_distributed(
            worker, 2, args.model, args.stage, folder, args.repeats, timeout=1800, env=env
        )
        return ranks[0]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    """Runs the comparison and writes the results."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="124m", choices=sorted(MODEL_SHAPES))
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    args = p.parse_args()
    rows: dict[str, Any] = {"partita": _run(partita_worker, args, None)}
    try:
        import deepspeed  # noqa: F401

        rows["deepspeed"] = _run(deepspeed_worker, args, {"DS_ACCELERATOR": "cpu"})
    except Exception as e:  # report why, keep partita's numbers
        rows["deepspeed"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    folder = tempfile.mkdtemp(prefix="ckpt-bench-dd-", dir=args.dir)
    nbytes = max(rows["partita"]["bytes"])
    bandwidth = disk_write_bandwidth(folder, nbytes)
    shutil.rmtree(folder, ignore_errors=True)
    result = {"model": args.model, "params": rows["partita"]["params"], "stage": args.stage,
              "world_size": 2, "repeats": args.repeats, "disk_write_bytes_per_s": bandwidth,
              "runs": rows, "torch": torch.__version__}  # fmt: skip
    text = render(result)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"checkpoint_{args.model}_stage{args.stage}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    stem.with_suffix(".md").write_text(text + "\n")


def render(result: dict[str, Any]) -> str:
    """The markdown table."""
    bw = result["disk_write_bytes_per_s"]
    lines = [
        f"GPT-2 {result['model']} ({result['params'] / 1e6:.0f}M parameters), ZeRO stage "
        f"{result['stage']}, 2 CPU processes, best of {result['repeats']}; disk sequential "
        f"write+fsync: {bw / 1e6:.0f} MB/s",
        "",
        "| engine | bytes written | save s | save MB/s | % of disk | load s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, run in result["runs"].items():
        if "error" in run:
            lines.append(f"| {name} | not run: {run['error']} | | | | |")
            continue
        nbytes, save, load = max(run["bytes"]), min(run["save_s"]), min(run["load_s"])
        lines.append(
            f"| {name} | {nbytes / 1e6:.0f} MB | {save:.2f} | {nbytes / save / 1e6:.0f} | "
            f"{100 * nbytes / save / bw:.0f}% | {load:.2f} |"
        )
    nbytes = max(result["runs"]["partita"]["bytes"])
    lines.append(f"| disk (dd-like) | {nbytes / 1e6:.0f} MB | {nbytes / bw:.2f} | "
                 f"{bw / 1e6:.0f} | 100% | |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
