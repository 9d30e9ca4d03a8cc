"""Checkpoint save/load time: partita (sync and async), DeepSpeed and torch DCP, against the
disk's own write + fsync of the same bytes measured interleaved with the saves.

A GPT-2 (``--model 124m``: 124M parameters, tied embeddings) trains one step with AdamW on 2
CPU processes (gloo), then saves and loads ``--repeats`` times, for each ZeRO stage in
``--stages`` (default 3 and 0):

- partita: ``save_checkpoint`` (sync: write, fsync, XXH3-128 digest, atomic commit),
  ``load_checkpoint`` (digest checked), and ``save_checkpoint(async_save=True)``: the *stall*
  (until it returns, training could go on) and the *total* (until the checkpoint is committed);
- DeepSpeed 0.19.8 (``DS_ACCELERATOR=cpu``, torch AdamW as a client optimizer, same stage):
  ``save_checkpoint`` (torch.save, no fsync) and ``load_checkpoint``;
- torch DCP on the same model and AdamW state (replicated: DCP deduplicates, so each tensor is
  written once): ``dcp.save``, ``dcp.async_save`` (stall and total) and ``dcp.load``.

The disk reference ("plain write+fsync") is measured inside every engine's run, interleaved
with its saves (the order alternates per repeat): the ranks read the files the save just
wrote back into memory (untimed), then each writes its share (files ``i % world == rank``, so
for partita each rank its own shard) with plain ``write`` calls and one ``fsync`` per file into
the same folder, timed between barriers like the saves. `ratio` is reference time / save time
of each pair: 1.0 is disk speed. A second, stricter reference writes the same bytes the way
partita streams a file (16 MiB writes, each 256 MiB window sent to the disk as it fills, see
`plain_write`): on this machine's disk a plain write + fsync of a large file is often much
slower than that, so "ratio to streamed write" says how close a save comes to the disk's best
write of its bytes, without the hashing, serialisation and commit. This disk's speed drifts a lot within minutes (and other jobs
share it), which is why the pairs are interleaved, each timed step starts after an untimed
``os.sync()`` (so none pays for the writeback of the one before), and there are ``--pairs``
of them (default 5): the table gives the median of the per-pair ratios and their spread
(lowest-highest); compare ratios, not MB/s across rows. Loads and async saves run
``--repeats`` times.

    .venv/bin/python benchmarks/bench_checkpoint.py [--model 124m] [--stages 3 0] [--repeats 3]
        [--pairs 5]

Prints a markdown table per stage; writes ``benchmarks/results/checkpoint_<model>_stage<s>.{json,md}``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from partita.testing import run_distributed

if (
    __package__
):  # imported from the benchmarks package (tests, python -m benchmarks.bench_checkpoint)
    from benchmarks.common import MODEL_SHAPES, build_gpt2, count_params
else:  # python benchmarks/bench_checkpoint.py: this folder is sys.path[0]
    from common import MODEL_SHAPES, build_gpt2, count_params

RESULTS = Path(__file__).resolve().parent / "results"
_REFERENCE_CALLS = itertools.count()
"""`plain_write` calls so far in this process (which reference goes first alternates)."""
SEQ = 64


def _config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
    }


def _files(path: str) -> list[str]:
    return sorted(str(f) for f in Path(path).rglob("*") if f.is_file())


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, SEQ), generator=torch.Generator().manual_seed(0))


def _one_step(engine: Any) -> None:
    tokens = _tokens(engine.module.config.vocab_size)
    loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    engine.step()


def _timed(barrier: Callable[[], None], fn: Callable[[], Any]) -> float:
    """Seconds of `fn()` between barriers, started on a quiet disk: every rank first flushes
    what earlier steps left dirty (untimed; DeepSpeed's saves do not fsync), so no save or
    reference pays for the writeback of the one before it."""
    os.sync()
    barrier()
    start = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - start


def plain_write(
    folder: str, rank: int, world: int, barrier: Callable[[], None]
) -> tuple[float, float]:
    """The disk references: this rank's share of `folder`'s files, read into memory, written
    back with plain writes and one fsync per file (the goal's reference), and again the way
    partita streams a file out (16 MiB writes, the kernel asked to write each 256 MiB window
    as it fills, see [Note: streaming writeback] in `partita.checkpoint.stfile`; no hashing,
    no serialisation, no commit), each timed between barriers (see the module docstring).
    Returns (plain seconds, streamed seconds); the two alternate which goes first."""
    from partita.checkpoint.stfile import _Writeback  # the same writeback pattern

    mine = [f for i, f in enumerate(_files(folder)) if i % world == rank]
    data = [Path(f).read_bytes() for f in mine]
    out = os.path.join(os.path.dirname(folder), f"plain-rank{rank}")
    os.makedirs(out, exist_ok=True)

    def write(streamed: bool) -> None:
        for i, blob in enumerate(data):
            with open(os.path.join(out, f"f{i}"), "wb") as f:
                if streamed:
                    flusher, view = _Writeback(f), memoryview(blob)
                    for at in range(0, len(view), 16 << 20):
                        f.write(view[at : at + (16 << 20)])
                        flusher.written(len(view[at : at + (16 << 20)]))
                else:
                    f.write(blob)
                f.flush()
                os.fsync(f.fileno())
        if data:
            fd = os.open(out, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

    order = [False, True] if next(_REFERENCE_CALLS) % 2 == 0 else [True, False]
    seconds = {streamed: _timed(barrier, functools.partial(write, streamed)) for streamed in order}
    shutil.rmtree(out, ignore_errors=True)
    return seconds[False], seconds[True]


def _interleaved(
    repeats: int,
    save: Callable[[int], float],
    reference: Callable[[int], tuple[float, float]],
) -> tuple[list[float], list[float], list[float]]:
    """Save and references `repeats` times, the order alternating; the references of repeat
    i write the bytes of save i (or, when they go first, of the previous save). Returns the
    save, plain reference and streamed reference seconds."""
    saves, refs, streamed = [], [], []
    for i in range(repeats):
        if i % 2 == 0:
            saves.append(save(i))
            plain, stream = reference(i)
        else:
            plain, stream = reference(i - 1)
            saves.append(save(i))
        refs.append(plain)
        streamed.append(stream)
    return saves, refs, streamed


def partita_worker(
    model_name: str, stage: int, root: str, repeats: int, pairs: int
) -> dict[str, Any]:
    """One rank of the partita run."""
    import partita
    from partita import comm
    from partita.checkpoint import background

    rank, world = comm.get_rank(), comm.get_world_size()
    model = build_gpt2(model_name, seed=0)
    params = count_params(model)
    cfg = {**_config(stage), "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    cfg.pop("zero_allow_untested_optimizer")
    engine, *_ = partita.initialize(model=model, config=cfg)
    _one_step(engine)
    folder = os.path.join(root, "ckpt")

    def save(i: int) -> float:
        return _timed(comm.barrier, lambda: engine.save_checkpoint(folder, tag=f"s{i}"))

    saves, refs, streamed = _interleaved(
        pairs,
        save,
        lambda i: plain_write(os.path.join(folder, f"s{i}"), rank, world, comm.barrier),
    )
    nbytes = sum(os.path.getsize(f) for f in _files(os.path.join(folder, "s0")))
    loads = [_timed(comm.barrier, lambda: engine.load_checkpoint(folder, tag="s0"))]
    loads += [_timed(comm.barrier, lambda: engine.load_checkpoint(folder, tag="s0"))
              for _ in range(repeats - 1)]  # fmt: skip
    stalls, totals = [], []
    for i in range(repeats):
        comm.barrier()
        start = time.perf_counter()
        engine.save_checkpoint(folder, tag=f"a{i}", async_save=True)
        stall = time.perf_counter() - start
        background.wait_for(engine)
        comm.barrier()
        totals.append(time.perf_counter() - start)
        stalls.append(max(comm.all_gather_object(stall)))
    engine.destroy()
    return {"params": params, "bytes": nbytes, "save_s": saves, "ref_s": refs, "stream_ref_s": streamed, "load_s": loads,
            "async_stall_s": stalls, "async_total_s": totals}  # fmt: skip


def deepspeed_worker(
    model_name: str, stage: int, root: str, repeats: int, pairs: int
) -> dict[str, Any]:
    """One rank of the DeepSpeed run (torch AdamW as a client optimizer: no op builds)."""
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_gpt2(model_name, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=_config(stage))
    _one_step(engine)
    folder = os.path.join(root, "ckpt")

    def save(i: int) -> float:
        return _timed(dist.barrier, lambda: engine.save_checkpoint(folder, tag=f"s{i}"))

    saves, refs, streamed = _interleaved(
        pairs,
        save,
        lambda i: plain_write(os.path.join(folder, f"s{i}"), rank, world, dist.barrier),
    )
    nbytes = sum(os.path.getsize(f) for f in _files(os.path.join(folder, "s0")))
    loads = [_timed(dist.barrier, lambda: engine.load_checkpoint(folder, tag="s0"))
             for _ in range(repeats)]  # fmt: skip
    return {
        "bytes": nbytes,
        "save_s": saves,
        "ref_s": refs,
        "stream_ref_s": streamed,
        "load_s": loads,
    }


def dcp_worker(model_name: str, stage: int, root: str, repeats: int, pairs: int) -> dict[str, Any]:
    """One rank of the torch DCP run: replicated model and AdamW state (`stage` unused)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_gpt2(model_name, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = _tokens(model.config.vocab_size)
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    folder = os.path.join(root, "ckpt")

    def save(i: int) -> float:
        return _timed(dist.barrier, lambda: dcp.save(state, checkpoint_id=f"{folder}/s{i}"))

    saves, refs, streamed = _interleaved(
        pairs,
        save,
        lambda i: plain_write(os.path.join(folder, f"s{i}"), rank, world, dist.barrier),
    )
    nbytes = sum(os.path.getsize(f) for f in _files(os.path.join(folder, "s0")))

    def load() -> None:
        dcp.load(state, checkpoint_id=f"{folder}/s0")
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])  # fmt: skip

    loads = [_timed(dist.barrier, load) for _ in range(repeats)]
    stalls, totals = [], []
    for i in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        pending = dcp.async_save(state, checkpoint_id=f"{folder}/a{i}")
        stall = time.perf_counter() - start
        getattr(pending, "upload_completion", pending).result()
        dist.barrier()
        totals.append(time.perf_counter() - start)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, stall)
        stalls.append(max(gathered))
    return {"bytes": nbytes, "save_s": saves, "ref_s": refs, "stream_ref_s": streamed, "load_s": loads,
            "async_stall_s": stalls, "async_total_s": totals}  # fmt: skip


def _run(worker: Any, args: argparse.Namespace, stage: int, env: dict[str, str] | None) -> Any:
    root = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
    try:
        ranks = run_distributed(
            worker, 2, args.model, stage, root, args.repeats, args.pairs, timeout=3600, env=env
        )
        return ranks[0]
    except Exception as e:  # report why, keep the other engines' numbers
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    """Runs the comparison for every stage and writes the results."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="124m", choices=sorted(MODEL_SHAPES))
    p.add_argument("--stages", type=int, nargs="+", default=[3, 0])
    p.add_argument("--repeats", type=int, default=3, help="loads and async saves")
    p.add_argument("--pairs", type=int, default=5, help="interleaved save/reference pairs")
    p.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    args = p.parse_args()
    for stage in args.stages:
        runs = {
            "partita": _run(partita_worker, args, stage, None),
            "deepspeed": _run(deepspeed_worker, args, stage, {"DS_ACCELERATOR": "cpu"}),
            "torch DCP": _run(dcp_worker, args, stage, None),
        }
        result = {"model": args.model, "params": runs["partita"].get("params"), "stage": stage,
                  "world_size": 2, "repeats": args.repeats, "pairs": args.pairs, "runs": runs,
                  "torch": torch.__version__}  # fmt: skip
        text = render(result)
        print(text, flush=True)
        RESULTS.mkdir(parents=True, exist_ok=True)
        stem = RESULTS / f"checkpoint_{args.model}_stage{stage}"
        stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
        stem.with_suffix(".md").write_text(text + "\n")


def _ratios(run: dict[str, Any], key: str = "ref_s") -> list[float]:
    return [r / s for r, s in zip(run[key], run["save_s"], strict=True)]


def _spread(values: list[float]) -> str:
    """Median [lowest-highest] of `values`."""
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def render(result: dict[str, Any]) -> str:
    """The markdown table of one stage."""
    params = result["params"]
    size = f"{params / 1e6:.0f}M parameters" if params else "parameters unknown"
    pairs = result.get("pairs", result["repeats"])
    lines = [
        f"GPT-2 {result['model']} ({size}), ZeRO stage {result['stage']}, 2 CPU processes; "
        f"{pairs} interleaved save/reference pairs, {result['repeats']} loads and async saves "
        "(median [lowest-highest]; ratio = plain write+fsync of the same bytes / save, per "
        "pair: 1.0 is disk speed)",
        "",
        "| engine | bytes | save s | ratio | ratio of each pair | plain write+fsync s "
        "| ratio to streamed write | async stall s | async total s | load s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, run in result["runs"].items():
        if "error" in run:
            lines.append(f"| {name} | not run: {run['error']} | | | | | | | | |")
            continue
        med = statistics.median
        ratios = _ratios(run)
        stall = f"{med(run['async_stall_s']):.2f}" if "async_stall_s" in run else "-"
        total = f"{med(run['async_total_s']):.2f}" if "async_total_s" in run else "-"
        streamed = _spread(_ratios(run, "stream_ref_s")) if "stream_ref_s" in run else "-"
        lines.append(
            f"| {name} | {run['bytes'] / 1e6:.0f} MB | {_spread(run['save_s'])} | "
            f"{_spread(ratios)} | {', '.join(f'{r:.2f}' for r in ratios)} | "
            f"{_spread(run['ref_s'])} | {streamed} | {stall} | {total} | "
            f"{_spread(run['load_s'])} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
