"""Tensor-parallel inference benchmark: partita vs DeepSpeed's ``init_inference`` (AutoTP) vs
Transformers' own ``tp_plan="auto"``, on CPU ranks with gloo.

A GPT-2 124M-class model (12 layers, hidden 768, vocabulary 50257; random weights, saved once
with ``save_pretrained``, nothing downloaded) generates 64 new tokens greedily after a
128-token prompt, at TP 1 and TP 2. Every job runs under ``torch.distributed.run`` (torchrun)
with gloo, with ``2 // TP`` threads per rank so that each job uses the same cores:

* partita: ``partita.inference.from_pretrained`` (each rank reads only its slices), with the
  embedding replicated and the (untied) head split by vocabulary rows, its logits
  all-gathered, as Transformers' plan and DeepSpeed's AutoTP split it; as ``partita-vocab``
  the embedding split too (``tensor_parallel.vocab_parallel``);
* DeepSpeed 0.19.8: the full model loaded by ``from_pretrained`` on every rank, then
  ``deepspeed.init_inference(model, tensor_parallel={"tp_size": N}, dtype=torch.float32,
  replace_with_kernel_inject=False)`` with ``DS_ACCELERATOR=cpu`` (AutoTP);
* Transformers: ``AutoModelForCausalLM.from_pretrained(dir, tp_plan="auto")``.

Each worker times the prefill (one forward over the prompt, building the KV cache) and the
decode (64 single-token steps with the cache), after one untimed warm-up of both, ``--repeats``
times, each forward called as ``generate()`` calls it: with ``logits_to_keep=1`` (the models'
forward takes it; generate passes it), so the prefill computes, and a split head exchanges, the
logits of the last position only, in every system alike (``--full_logits``: the whole
prompt's, as runs before 2026-12-04 14:40 UTC measured); prefill tokens/s is the prompt over the median prefill, decode tokens/s one over the
median step (medians, since the machine may be shared); rank 0 reports the figures, every rank its peak RSS (``VmHWM``: loading included). A job that fails
is reported with its last error line, not hidden. Example::

    .venv/bin/python benchmarks/bench_inference.py               # all systems, TP 1 and 2
    .venv/bin/python benchmarks/bench_inference.py --systems partita --tp 2

Prints a markdown table and writes it to ``--out`` (with the raw figures as ``.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("partita", "partita-vocab", "deepspeed", "transformers")
CORES = 2


def save_model(folder: str, arch: str, layers: int) -> None:
    """A 124M-class model with seeded random weights, saved with save_pretrained: GPT-2 124M,
    or a Llama of the same width and depth (hidden 768, 12 heads, MLP 2048, vocabulary 32000:
    134M parameters), which DeepSpeed's AutoTP and Transformers' tp_plan also split."""
    import torch
    import transformers as t

    torch.manual_seed(0)
    if arch == "gpt2":
        config: Any = t.GPT2Config(n_layer=layers, n_embd=768, n_head=12, vocab_size=50257,
                                   n_positions=1024)  # fmt: skip
    else:
        config = t.LlamaConfig(num_hidden_layers=layers, hidden_size=768, intermediate_size=2048,
                               num_attention_heads=12, num_key_value_heads=12, vocab_size=32000,
                               max_position_embeddings=1024)  # fmt: skip
    t.AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _load(system: str, folder: str, tp: int) -> Any:
    import torch

    if system.startswith("partita"):
        from partita.inference import from_pretrained

        tp_config = {"tp_size": tp, "vocab_parallel": system == "partita-vocab" and tp > 1}
        return from_pretrained(folder, tensor_parallel=tp_config, dtype=torch.float32).module
    from transformers import AutoModelForCausalLM

    if system == "transformers":
        kwargs = {"tp_plan": "auto"} if tp > 1 else {}
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
    import deepspeed
    import deepspeed.comm.comm as ds_comm

    deepspeed.init_distributed(dist_backend="gloo")
    if os.environ.get("BENCH_DS_SHM") != "1" and ds_comm.cdb is not None:
        # DeepSpeed's shared-memory all-reduce (torch.ops.deepspeed.inference_all_reduce_)
        # died with SIGSEGV at TP 2 on this machine (DeepSpeed 0.19.8); at kernel level 0 its
        # inference_all_reduce falls back to torch.distributed over gloo, like the others.
        # BENCH_DS_SHM=1 keeps the kernel.
        ds_comm.cdb.shm_vector_kernel_level = 0
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = deepspeed.init_inference(
        model, tensor_parallel={"tp_size": tp}, dtype=torch.float32,
        replace_with_kernel_inject=False,
    )  # fmt: skip
    return engine.module


def _keep_last(model: Any, full_logits: bool) -> dict[str, int]:
    """``logits_to_keep=1``, as ``generate()`` passes it, when the model's forward takes it."""
    import inspect

    takes = "logits_to_keep" in inspect.signature(model.forward).parameters
    return {} if full_logits or not takes else {"logits_to_keep": 1}


def _decode(
    model: Any, ids: Any, steps: int, keep: dict[str, int]
) -> tuple[float, list[float], Any, tuple]:
    """(prefill seconds, each decode step's seconds, generated ids, (prefill CPU seconds,
    CPU seconds per decode step) of this process): greedy with the KV cache."""
    import torch

    with torch.no_grad():
        start, cpu = time.perf_counter(), time.process_time()
        out = model(ids, use_cache=True, **keep)
        prefill = time.perf_counter() - start
        prefill_cpu = time.process_time() - cpu
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        tokens, times = [token], []
        cpu = time.process_time()
        for _ in range(steps - 1):
            start = time.perf_counter()
            out = model(token, past_key_values=cache, use_cache=True, **keep)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - start)
            tokens.append(token)
        decode_cpu = (time.process_time() - cpu) / (steps - 1)
    return prefill, times, torch.cat(tokens, dim=1), (prefill_cpu, decode_cpu)


def worker(ns: argparse.Namespace) -> None:
    """One rank of one job (under torchrun)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, CORES // ns.tp))
    rank = int(os.environ.get("RANK", "0"))
    start = time.perf_counter()
    model = _load(ns.system, ns.model, ns.tp)
    load_s = time.perf_counter() - start
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32000, (1, ns.prompt), generator=gen)
    keep = _keep_last(model, ns.full_logits)
    _decode(model, ids[:, :16], 4, keep)  # warm-up
    # A shared machine: medians over repeats (prefill) and over steps (decode) keep another
    # process's burst from deciding the figure.
    runs = [_decode(model, ids, ns.new_tokens, keep) for _ in range(ns.repeats)]
    prefill = statistics.median(r[0] for r in runs)
    decode = statistics.median(t for r in runs for t in r[1])
    tokens = runs[0][2]
    # CPU seconds this rank spent (all its threads): what contention from other processes
    # changes least, so the systems' work can be compared on a busy machine.
    cpu_prefill = statistics.median(r[3][0] for r in runs)
    cpu_step = statistics.median(r[3][1] for r in runs)
    mine = (_peak_rss_mb(), cpu_prefill, cpu_step)
    per_rank = [mine]
    if dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        per_rank = gathered
    rss = [r[0] for r in per_rank]
    if rank == 0:
        result = {
            "system": ns.system, "tp": ns.tp, "load_s": load_s,
            "prefill_tok_s": ns.prompt / prefill, "decode_tok_s": 1 / decode,
            "logits_to_keep": keep.get("logits_to_keep", 0),
            "peak_rss_mb": rss, "tokens": tokens[0, :8].tolist(),
            "cpu_prefill_s": [r[1] for r in per_rank], "cpu_ms_per_step": [1e3 * r[2] for r in per_rank],
            "load_avg": os.getloadavg()[0],
        }  # fmt: skip
        Path(ns.result).write_text(json.dumps(result))


def _job(system: str, tp: int, folder: str, ns: argparse.Namespace) -> dict[str, Any]:
    result = tempfile.mktemp(suffix=".json")
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, CORES // tp)), DS_ACCELERATOR="cpu",
               PYTHONPATH=str(ROOT / "src"))  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp}",
           __file__, "--worker", "--system", system, "--tp", str(tp), "--model", folder,
           "--prompt", str(ns.prompt), "--new_tokens", str(ns.new_tokens), "--result", result,
           "--repeats", str(ns.repeats), *(["--full_logits"] if ns.full_logits else [])]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0 or not os.path.exists(result):
        # The rank's own exception line, not torchrun's summary of it.
        lines = [
            ln for ln in proc.stderr.splitlines() if "Error: " in ln and "ChildFailed" not in ln
        ]
        return {"system": system, "tp": tp, "error": (lines or ["?"])[0][:300]}
    return dict(json.loads(Path(result).read_text()))


def _table(rows: list[dict[str, Any]]) -> str:
    out = ["| model | system | TP | CPU ms per prefill, per rank | CPU ms per decode step, per rank | prefill tok/s | decode tok/s | peak RSS per rank (MB) | load s | load avg |",
           "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if "error" in r:
            out.append(
                f"| {r['arch']} | {r['system']} | {r['tp']} | | | failed: {r['error']} | | | | |"
            )
            continue
        rss = " / ".join(f"{x:.0f}" for x in r["peak_rss_mb"])
        cpu = " / ".join(f"{x:.0f}" for x in r["cpu_ms_per_step"])
        pre = " / ".join(f"{1e3 * x:.0f}" for x in r["cpu_prefill_s"])
        out.append(f"| {r['arch']} | {r['system']} | {r['tp']} | {pre} | {cpu} | {r['prefill_tok_s']:.1f} | "
                   f"{r['decode_tok_s']:.1f} | {rss} | {r['load_s']:.1f} | {r['load_avg']:.1f} |")  # fmt: skip
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", choices=SYSTEMS)
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--model", help="a saved model folder (default: build GPT-2 124M)")
    p.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per job (medians)")
    p.add_argument("--full_logits", action="store_true",
                   help="forwards return every position's logits (default: the last, as "
                        "generate() asks)")  # fmt: skip
    p.add_argument("--result")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/inference.md"))
    ns = p.parse_args()
    if ns.worker:
        ns.tp = ns.tp[0]
        worker(ns)
        return
    folder = ns.model or tempfile.mkdtemp(prefix="bench_inference_")
    if ns.model is None:
        save_model(folder, ns.arch, ns.layers)
        os.sync()  # the saved file's writeback would otherwise overlap the first job
    rows = []
    for tp in ns.tp:
        for system in ns.systems:
            rows.append({"arch": ns.arch, **_job(system, tp, folder, ns)})
            print(json.dumps(rows[-1]), flush=True)
    table = _table(rows)
    print(table)
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(table + "\n")
    Path(ns.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
