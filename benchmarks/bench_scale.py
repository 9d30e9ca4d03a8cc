"""Scale record: the largest GPT this machine trains with ZeRO-3 and every model state on NVMe.

The model (Hugging Face GPT-2 shapes, seeded random weights, no dropout) is built under
``partita.zero.Init(remote_device="nvme")``, so its full weights never sit in host memory: each
module's parameters go to a swap file as soon as the module is constructed. The engine then
runs ZeRO stage 3 with ``offload_param`` and ``offload_optimizer`` on NVMe (swap files under
``--nvme_path``) for ``--steps`` steps on one repeated batch (so the loss must fall).

Reported per step: wall time, loss, bytes this process read and wrote on the disk
(``/proc/self/io``: O_DIRECT transfers count there) and the device's counters (psutil), the
RSS after the step; overall: peak RSS (``ru_maxrss``) of construction, set-up and training.
The disk's own bandwidth is measured in the same folder before and after the run: a plain
sequential O_DIRECT write of ``--disk_mb`` MiB then fsync, and a read of it (the same probe as
``bench_offload.py``), so the step's I/O can be read against it.

Before anything is written the free space of ``--nvme_path`` is checked against the model
states' swap files (``param bytes + 16`` per parameter) plus ``--reserve_gb``; the run refuses
with the path and the bytes when they do not fit. Its swap folder is removed afterwards, also
when the run fails or is interrupted (SIGTERM/SIGINT).

``--deepspeed`` runs the same model and config through DeepSpeed instead (``deepspeed.zero.Init``
and ``deepspeed.initialize``, ``DS_ACCELERATOR=cpu``); its NVMe path needs its ``async_io``
C++ op (libaio), and the error it gives when that is missing is recorded.

docs/benchmarks.md's record is the first command. fp32, because on a CPU without native bf16 (AVX2 only)
torch runs bf16 matmuls on one thread at a small fraction of the fp32 rate (a 3B forward reached
block 11 of 37 in 11 minutes); lr 3e-6, because at 1e-5 and above Adam's first steps on the
one repeated batch overshoot at 3B (the loss rose again at the third step).

    .venv/bin/python benchmarks/bench_scale.py --params 3b --steps 3 --lr 3e-6 --dtype fp32 \
        --nvme_path /var/tmp/scale
    .venv/bin/python benchmarks/bench_scale.py --layers 12 --hidden 768 --steps 3 --nvme_path DIR

Writes ``benchmarks/results/scale_<name>[_deepspeed].json`` (``--out`` overrides).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything can import deepspeed

import psutil
import torch

if __package__:  # imported from the benchmarks package (tests, python -m benchmarks.bench_scale)
    from benchmarks.bench_offload import disk_bandwidth
    from benchmarks.common import RESULTS_DIR, corpus_batches, environment
else:  # python benchmarks/bench_scale.py: this folder is sys.path[0]
    from bench_offload import disk_bandwidth
    from common import RESULTS_DIR, corpus_batches, environment

GB = 1e9
MB = 1e6
VOCAB = 50257
_KEEP: list[Any] = []
"""Objects that must outlive the model (DeepSpeed's Hugging Face config)."""
PRESETS: dict[str, tuple[int, int]] = {
    # name: (layers, hidden); parameters at vocab 50257 and 128 positions
    "tiny": (2, 128),  # 6.8M: a smoke test of the script itself
    "125m": (12, 768),  # 124M (GPT-2 small)
    "1b": (18, 2048),  # 1.01B
    "3b": (37, 2560),  # 3.04B
}


def gpt_numel(layers: int, hidden: int, positions: int) -> int:
    """Parameters of a GPT-2 (tied embeddings) of this shape."""
    block = 12 * hidden * hidden + 13 * hidden
    return layers * block + (VOCAB + positions) * hidden + 2 * hidden


def swap_bytes_needed(numel: int, param_bytes: int) -> int:
    """Disk the engine's swap files take: the parameter shard in the model's dtype, and fp32
    master, gradient and Adam's two moments (16 bytes)."""
    return numel * (param_bytes + 16)


def check_disk(path: Path, needed: int, reserve: int) -> dict[str, int]:
    """Refuses (SystemExit naming the path and the bytes) unless `path` has `needed` bytes
    free with `reserve` left over."""
    free = shutil.disk_usage(path).free
    if free < needed + reserve:
        raise SystemExit(
            f"bench_scale: '{path}' has {free:,} bytes free; the swap files need {needed:,} "
            f"bytes and {reserve:,} must stay free (--reserve_gb): {needed + reserve - free:,} "
            "bytes short. Pick a smaller model or another --nvme_path."
        )
    return {"free_bytes": free, "needed_bytes": needed, "reserve_bytes": reserve}


def engine_config(args: argparse.Namespace, swap_dir: Path) -> dict[str, Any]:
    """DeepSpeed-style config: ZeRO-3, parameters and optimizer state on NVMe under swap_dir."""
    nvme = {"device": "nvme", "nvme_path": str(swap_dir)}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": dict(nvme),
            "offload_optimizer": dict(nvme),
        },
    }
    if args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def proc_io() -> tuple[int, int]:
    """(read, written) bytes this process caused on storage so far (all its threads)."""
    fields = dict(
        line.split(": ") for line in Path("/proc/self/io").read_text().splitlines() if ": " in line
    )
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def device_io() -> tuple[int, int]:
    """(read, written) bytes of every disk of the machine (other processes included)."""
    c = psutil.disk_io_counters()
    return (c.read_bytes, c.write_bytes) if c is not None else (0, 0)


def peak_rss() -> int:
    """Peak resident set size of this process so far, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def build_model(args: argparse.Namespace, backend: Any, config: dict[str, Any]) -> Any:
    """The GPT built under the backend's ``zero.Init(remote_device="nvme")``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    shape = GPT2Config(
        n_layer=args.layers,
        n_embd=args.hidden,
        n_head=max(1, args.hidden // 64),
        n_positions=args.seq,
        vocab_size=VOCAB,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if args.deepspeed:
        # Without it Hugging Face's _init_weights writes into DeepSpeed's placeholders (lost):
        # the embeddings keep N(0, 1) and the model is not the one partita trains.
        from transformers.integrations import HfDeepSpeedConfig

        _KEEP.append(HfDeepSpeedConfig(config))  # alive while the model is used
    with backend.zero.Init(remote_device="nvme", config_dict_or_path=config, dtype=dtype):
        return GPT2LMHeadModel(shape)


def train(args: argparse.Namespace, swap_dir: Path) -> dict[str, Any]:
    """Builds, sets up and trains; returns the figures."""
    backend: Any
    if args.deepspeed:
        import deepspeed as backend
    else:
        import partita as backend
    config = engine_config(args, swap_dir)
    out: dict[str, Any] = {"rss_start": psutil.Process().memory_info().rss}
    start = time.perf_counter()
    model = build_model(args, backend, config)
    out["build_s"] = time.perf_counter() - start
    out["numel"] = sum(
        p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()
    )
    out["rss_after_build"] = psutil.Process().memory_info().rss
    start = time.perf_counter()
    engine, _, _, _ = backend.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    del model
    out["setup_s"] = time.perf_counter() - start
    out["rss_after_setup"] = psutil.Process().memory_info().rss
    out["peak_rss_setup"] = peak_rss()
    print(f"built in {out['build_s']:.0f} s, set up in {out['setup_s']:.0f} s", flush=True)
    batch = next(corpus_batches(0, 1, args.batch, args.seq))
    steps = []
    for i in range(args.steps):
        io0, dev0, t0 = proc_io(), device_io(), time.perf_counter()
        loss = engine(batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        seconds = time.perf_counter() - t0
        io1, dev1 = proc_io(), device_io()
        step = {
            "step": i,
            "seconds": seconds,
            "loss": float(loss.detach().float()),
            "read_bytes": io1[0] - io0[0],
            "written_bytes": io1[1] - io0[1],
            "device_read_bytes": dev1[0] - dev0[0],
            "device_written_bytes": dev1[1] - dev0[1],
            "rss": psutil.Process().memory_info().rss,
        }
        steps.append(step)
        print(json.dumps(step), flush=True)
    out["steps"] = steps
    out["peak_rss"] = peak_rss()
    if hasattr(engine, "memory_report"):
        out["memory_report"] = engine.memory_report()
    if hasattr(engine, "destroy"):
        engine.destroy()
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line; --params picks a preset, else --layers/--hidden."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--params", choices=sorted(PRESETS), help="model preset (else --layers/--hidden)"
    )
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--nvme_path", required=True, help="folder on the disk for the swap files")
    p.add_argument("--reserve_gb", type=float, default=10.0, help="disk space left free")
    p.add_argument("--disk_mb", type=int, default=1024, help="size of the disk probe")
    p.add_argument("--world", type=int, default=1, help="ranks (this benchmark runs 1)")
    p.add_argument("--deepspeed", action="store_true", help="DeepSpeed instead of partita")
    p.add_argument("--out", help="results JSON (default benchmarks/results/scale_<name>.json)")
    args = p.parse_args(argv)
    if args.params:
        args.layers, args.hidden = PRESETS[args.params]
    if not args.layers or not args.hidden:
        p.error("give --params or both --layers and --hidden")
    if args.world != 1:
        p.error(f"--world {args.world}: this benchmark runs one rank (2 cores here); use --world 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Checks the disk, measures it, trains, removes the swap folder, writes the results."""
    args = parse_args(argv)
    name = args.params or f"{args.layers}x{args.hidden}"
    numel = gpt_numel(args.layers, args.hidden, args.seq)
    root = Path(args.nvme_path).resolve()
    root.mkdir(parents=True, exist_ok=True)
    needed = swap_bytes_needed(numel, 2 if args.dtype == "bf16" else 4)
    disk = check_disk(root, needed, int(args.reserve_gb * GB))
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    swap_dir = root / f"bench-scale-{os.getpid()}"
    swap_dir.mkdir()
    # SIGTERM ends the run through the finally below, so the swap files go too.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result: dict[str, Any] = {
        "name": name,
        "system": "deepspeed" if args.deepspeed else "partita",
        "args": vars(args),
        "expected_numel": numel,
        "disk": disk,
        "environment": environment(),
        "command": " ".join(
            [".venv/bin/python", "benchmarks/bench_scale.py", *(argv or sys.argv[1:])]
        ),
    }
    mbytes = args.disk_mb * 2**20
    try:
        result["disk_before"] = disk_bandwidth(swap_dir, mbytes, 2**20)
        print(f"disk: {result['disk_before']}", flush=True)
        result.update(train(args, swap_dir))
        result["disk_after"] = disk_bandwidth(swap_dir, mbytes, 2**20)
        result["ok"] = True
    except BaseException as exc:  # recorded, then re-raised after the cleanup
        result["ok"] = False
        result["error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        raise
    finally:
        result["swap_dir_bytes_at_end"] = sum(
            f.stat().st_size for f in swap_dir.rglob("*") if f.is_file()
        )
        shutil.rmtree(swap_dir, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
        result["swap_dir_removed"] = not swap_dir.exists()
        suffix = "_deepspeed" if args.deepspeed else ""
        out = Path(args.out) if args.out else RESULTS_DIR / f"scale_{name}{suffix}.json"
        out.write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
