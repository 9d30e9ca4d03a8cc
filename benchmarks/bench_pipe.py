"""Pipeline schedules on CPU ranks: step time and measured bubble against theory (issue 41).

One model, a stack of layers (embedding, residual MLP blocks, norm, head), trained for a few
steps by each implementation on the same micro-batches, P pipeline stages over P processes
(one intra-op thread each; at P 2 each rank has a core of this 2-core machine), and by one
process running the whole model (`seq`). The measured bubble of a pipeline step T_pipe is
``1 - T_seq / (P * T_pipe)``: the share of the P ranks' time not spent on the work one rank
does alone in T_seq (so it includes the transfers). Theory for 1F1B is (P - 1) / (m + P - 1)
for m micro-batches; interleaving v chunks per rank divides the bubble by about v.

[Note: a compute stand-in for more stages than cores]
With more ranks than cores, a rank idle in the bubble hands its core to another, which hides
the bubble. ``--sleep_ms s`` gives each block a stand-in cost that does not need a core: its
forward sleeps s ms, the backward s ms when the gradient of the block's input is computed (an
identity node of its own) and s ms when its first weight's is (a tensor hook), so zero-bubble's
split backward pays them in its input and weight passes as a GPU pays the two halves; each
runs once per block and micro-batch in every implementation (counted). With a small
``--dim`` the real arithmetic is then a small part of each block's time, and the measured
bubble is the schedule's (plus transfers and per-micro-batch overhead) at any P on 2 cores.
Layers are cut by ``type:Block`` there, so every stage (chunk) holds the same number of blocks.

Implementations: ``partita-1f1b`` (partita's executor of DeepSpeed's TrainSchedule),
``partita-interleaved`` and ``partita-zb`` (torch's interleaved schedules run by partita,
``virtual_stages=2``), ``deepspeed`` (DeepSpeed's PipelineEngine, when installed) and
``torch-1f1b`` (``torch.distributed.pipelining.Schedule1F1B`` with plain AdamW).

    python benchmarks/bench_pipe.py --micro 2,4,8 --steps 6 --warmup 2 --stem pipe_2stage
    python benchmarks/bench_pipe.py --stages 4 --sleep_ms 5 --dim 64 --micro 4,8 --stem pipe_4stage
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB, BLOCKS, SEQ, MICRO_BATCH, LR = 512, 8, 64, 4, 1e-4
IMPLS = ("seq", "partita-1f1b", "partita-interleaved", "partita-zb", "deepspeed", "torch-1f1b")


@dataclass(frozen=True)
class Job:
    """The pipeline and model every implementation runs (see the note on the stand-in)."""

    stages: int = 2
    dim: int = 256
    sleep_ms: float = 0.0
    """Each block's stand-in cost per forward, input-gradient and weight-gradient pass."""

    @property
    def method(self) -> str:
        """How layers are cut: by parameters, or by blocks under the stand-in."""
        return "type:Block" if self.sleep_ms else "parameters"


def _pause(seconds: float) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        del grad
        time.sleep(seconds)

    return hook


class _InputCost(torch.autograd.Function):
    """Identity whose backward sleeps: the stand-in for the input-gradient half of a block's
    backward. A node of its own at the block's input, so it runs once per micro-batch in
    every runtime (a hook on the input tensor fires twice under torch's stages, one on the
    norm's output again in zero-bubble's weight pass)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class Block(nn.Module):
    """A pre-norm residual MLP block (4x hidden), with the stand-in cost when `sleep_ms`."""

    def __init__(self, dim: int, sleep_ms: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.pause = sleep_ms / 1000.0
        if self.pause:  # the weight-gradient half: when fc1's weight gradient is computed
            self.fc1.weight.register_hook(_pause(self.pause))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pause and torch.is_grad_enabled():
            time.sleep(self.pause)
            if x.requires_grad:
                x = _InputCost.apply(x, self.pause)
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def layer_classes(job: Job) -> list[tuple[type[nn.Module], tuple[Any, ...]]]:
    """The model's layers as (class, arguments)."""
    dim = job.dim
    return [(nn.Embedding, (VOCAB, dim)), *[(Block, (dim, job.sleep_ms))] * BLOCKS,
            (nn.LayerNorm, (dim,)), (nn.Linear, (dim, VOCAB))]  # fmt: skip


def build_layers(job: Job) -> list[nn.Module]:
    """Every layer, seeded per layer (as ``seed_layers`` does), so all implementations start
    from the same weights."""
    out = []
    for i, (cls, args) in enumerate(layer_classes(job)):
        torch.manual_seed(1000 + i)
        out.append(cls(*args))
    return out


def micro_batches(steps: int, m: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (m, MICRO_BATCH, SEQ), generator=gen)
        out.append([(tokens[i], (tokens[i] * 7 + 3) % VOCAB) for i in range(m)])
    return out


def cuts(job: Job) -> list[int]:
    """Stage boundaries by `job.method`, as DeepSpeed and partita cut."""
    from partita.parallel.pipe_module import LayerSpec, partition

    specs = [LayerSpec(cls, *args) for cls, args in layer_classes(job)]
    return partition(specs, job.stages, job.method)


# --- one step function per implementation ----------------------------------------------------
def _seq(job: Job, m: int) -> Callable[[list[Any]], float]:
    model = nn.Sequential(*build_layers(job))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(batch: list[Any]) -> float:
        total = 0.0
        for tokens, targets in batch:
            loss = loss_fn(model(tokens), targets)
            (loss / m).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        return total / m

    return step


def _partita(job: Job, m: int, schedule: str, virtual: int) -> Callable[[list[Any]], float]:
    import partita
    from partita.parallel.pipe_module import LayerSpec, PipelineModule

    torch.manual_seed(0)
    specs = [LayerSpec(cls, *args) for cls, args in layer_classes(job)]
    module = PipelineModule(specs, num_stages=job.stages, loss_fn=loss_fn, seed_layers=True,
                            base_seed=1000, virtual_stages=virtual,
                            partition_method=job.method)  # fmt: skip
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": m,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "pipeline": {"schedule": schedule},
    }
    engine, *_ = partita.initialize(model=module, config=config)
    return lambda batch: float(engine.train_batch(iter(batch)))


def _deepspeed(job: Job, m: int) -> Callable[[list[Any]], float]:
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    assert "partita" not in (deepspeed.__file__ or ""), "not DeepSpeed itself"
    deepspeed.init_distributed(dist_backend="gloo")
    specs = [LayerSpec(cls, *args) for cls, args in layer_classes(job)]
    module = PipelineModule(specs, num_stages=job.stages, loss_fn=loss_fn, partition_method=job.method,
                            seed_layers=True, base_seed=1000, seed_fn=lambda s: torch.manual_seed(int(s)))  # fmt: skip
    opt = torch.optim.AdamW([p for p in module.parameters()], lr=LR, weight_decay=0.0)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": m,
              "gradient_clipping": 0.0, "steps_per_print": 10**9}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=config)
    return lambda batch: float(engine.train_batch(iter(batch)))


def _torch_1f1b(job: Job, m: int, rank: int) -> Callable[[list[Any]], float]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    layers, bounds = build_layers(job), cuts(job)
    mine = nn.Sequential(*layers[bounds[rank] : bounds[rank + 1]])
    stage = PipelineStage(mine, rank, job.stages, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=loss_fn)
    opt = torch.optim.AdamW(mine.parameters(), lr=LR)

    def step(batch: list[Any]) -> float:
        tokens = torch.cat([t for t, _ in batch])
        targets = torch.cat([y for _, y in batch])
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(tokens)
        elif rank == job.stages - 1:
            schedule.step(target=targets, losses=losses)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
        return float(torch.stack(losses).mean().detach()) if losses else float("nan")

    return step


def _make(job: Job, impl: str, m: int, rank: int) -> Callable[[list[Any]], float]:
    if impl == "seq":
        return _seq(job, m)
    if impl == "deepspeed":
        return _deepspeed(job, m)
    if impl == "torch-1f1b":
        return _torch_1f1b(job, m, rank)
    schedule, virtual = {"partita-1f1b": ("1f1b", 1), "partita-interleaved":
                         ("interleaved_1f1b", 2), "partita-zb": ("zero_bubble", 2)}[impl]  # fmt: skip
    return _partita(job, m, schedule, virtual)


# --- processes -------------------------------------------------------------------------------
def _worker(job: Job, rank: int, world: int, impl: str, m: int, steps: int, warmup: int,
            port: int, out: Any) -> None:  # fmt: skip
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    if world > 1 and impl != "deepspeed":
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    step = _make(job, impl, m, rank)
    times, losses = [], []
    for i, batch in enumerate(micro_batches(warmup + steps, m)):
        if world > 1:
            torch.distributed.barrier()
        start = time.perf_counter()
        losses.append(step(batch))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    out.put((rank, {"step_s": statistics.median(times), "losses": losses}))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def run(job: Job, impl: str, m: int, steps: int, warmup: int) -> dict[str, Any]:
    """One implementation at `m` micro-batches: the slowest rank's median step time and the
    last rank's losses (the last stage's are the real ones)."""
    world = 1 if impl == "seq" else job.stages
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(job, r, world, impl, m, steps, warmup, port,
                                               queue)) for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    last = results[world - 1]
    return {"step_s": max(r["step_s"] for r in results.values()), "losses": last["losses"]}


def theory(stages: int, m: int, virtual: int) -> float:
    """1F1B's bubble share (P - 1) / (v m + P - 1) with v chunks per rank."""
    return (stages - 1) / (virtual * m + stages - 1)


def table(job: Job, rows: dict[str, dict[int, dict[str, Any]]], micro: list[int]) -> str:
    virtual = {"partita-interleaved": 2, "partita-zb": 2}
    lines = ["| implementation | m | step (s) | bubble measured | bubble theory (1F1B, v) "
             "| first loss |", "| --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for impl, by_m in rows.items():
        for m in micro:
            r = by_m[m]
            seq = rows.get("seq", {}).get(m)
            bubble = "" if impl == "seq" or seq is None else \
                f"{1 - seq['step_s'] / (job.stages * r['step_s']):.3f}"  # fmt: skip
            th = "" if impl == "seq" else f"{theory(job.stages, m, virtual.get(impl, 1)):.3f}"
            first = r["losses"][0]  # the same weights and batches: equal up to rounding
            lines.append(f"| {impl} | {m} | {r['step_s']:.3f} | {bubble} | {th} | {first:.6f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro", default="2,4,8", help="micro-batch counts m")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages P (= ranks)")
    parser.add_argument("--dim", type=int, default=256, help="model width")
    parser.add_argument("--sleep_ms", type=float, default=0.0,
                        help="per-block stand-in cost (see the note); 0: none")  # fmt: skip
    parser.add_argument("--stem", default=None, help="write results/<stem>.json and .md")
    args = parser.parse_args(argv)
    job = Job(args.stages, args.dim, args.sleep_ms)
    micro = [int(x) for x in args.micro.split(",")]
    impls = [i for i in args.impls.split(",") if i]
    rows: dict[str, dict[int, dict[str, Any]]] = {}
    for impl in impls:
        if impl == "deepspeed":
            try:
                import deepspeed  # noqa: F401
            except ImportError:
                print("deepspeed not installed: skipped", file=sys.stderr)
                continue
        for m in micro:
            rows.setdefault(impl, {})[m] = run(job, impl, m, args.steps, args.warmup)
            print(f"{impl} m={m}: {rows[impl][m]['step_s']:.3f} s/step", flush=True)
    text = table(job, rows, micro)
    print(text)
    if args.stem:
        RESULTS.mkdir(exist_ok=True)
        command = "python benchmarks/bench_pipe.py " + " ".join(argv or sys.argv[1:])
        (RESULTS / f"{args.stem}.json").write_text(json.dumps(
            {"command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             "rows": {k: {str(m): v for m, v in by.items()} for k, by in rows.items()}}, indent=1))  # fmt: skip
        (RESULTS / f"{args.stem}.md").write_text(f"`{command}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.exit(main())
