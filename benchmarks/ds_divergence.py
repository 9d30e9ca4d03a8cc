"""What ZeRO-3 does when ranks run different modules: a `vision` sub-module that only rank 0's
batches use (issue 19). Not a timing benchmark: it records, per rank, how the first training
step ends (finishes, raises what, or never returns) and after how many seconds.

Two CPU ranks (gloo), fp32, stage 3 with every parameter partitioned
(``stage3_param_persistence_threshold`` 0). The process group's timeout is lowered to
``--pg_timeout`` seconds (DeepSpeed's default is 30 minutes) and the parent gives up after
``--wall`` seconds. Examples::

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/ds_divergence.py --impl deepspeed
    .venv/bin/python benchmarks/ds_divergence.py --impl partita
    .venv/bin/python benchmarks/ds_divergence.py --impl partita --declare   # leaf module

The first DeepSpeed run compiles its CPU ops (about 2 minutes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

VOCAB, DIM, SEQ = 64, 32, 8


class VisionLM(nn.Module):
    """Embedding, an optional image projection (`vision`), two MLP blocks and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.vision = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
            for _ in range(2)
        )
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy; `image` (batch x DIM) is added to every position."""
        x = self.embed(tokens)
        if image is not None:
            x = x + self.vision(image).unsqueeze(1)
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(x)
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)
        )


def _config(declare: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if declare:
        zero["leaf_module"] = {"names": ["vision"]}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }


def _engine(args: argparse.Namespace, timeout: datetime.timedelta) -> Any:
    """The process group and the engine of `args.impl` (both through the DeepSpeed API)."""
    torch.manual_seed(0)
    model = VisionLM()
    if args.impl == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", timeout=timeout)
        return deepspeed.initialize(model=model, config=_config(args.declare))[0]
    import partita

    partita.init_distributed(dist_backend="gloo", timeout=timeout)
    return partita.initialize(model=model, config=_config(args.declare))[0]


def _rank(rank: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
    )  # fmt: skip
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    start = time.perf_counter()
    queue.put((rank, "training", None, time.time(), 0.0))
    try:
        engine = _engine(args, timeout)
        gen = torch.Generator().manual_seed(rank)
        for step in range(args.steps):
            tokens = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
            image = torch.randn(2, DIM, generator=gen) if rank == 0 else None
            loss = engine(tokens, image)
            engine.backward(loss)
            engine.step()
            queue.put((rank, "step", step, float(loss), time.perf_counter() - start))
        queue.put((rank, "finished", args.steps, None, time.perf_counter() - start))
    except BaseException as err:
        last = traceback.format_exception_only(err)[-1].strip()
        queue.put((rank, "raised", None, last[:600], time.perf_counter() - start))
    queue.close()
    queue.join_thread()  # the events reach the parent before the hard exit below
    sys.stdout.flush()
    os._exit(0)  # a rank left inside a collective cannot be shut down cleanly


def main() -> None:
    """Runs the two ranks and prints one JSON record per event, then a summary."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", choices=["deepspeed", "partita"], default="deepspeed")
    p.add_argument("--declare", action="store_true", help="declare vision a leaf module")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--pg_timeout", type=float, default=60.0)
    p.add_argument("--wall", type=float, default=400.0)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, port, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    deadline, ended, began = time.monotonic() + args.wall, set(), {}
    while len(ended) < 2 and time.monotonic() < deadline:
        for rank, proc in enumerate(procs):
            if rank not in ended and rank in began and not proc.is_alive():
                # Gone without a Python exception (gloo aborts the process on a mismatch).
                seconds = round(time.time() - began[rank], 1)
                died = {"rank": rank, "what": "died", "exitcode": proc.exitcode, "seconds": seconds}
                print(json.dumps(died), flush=True)
                ended.add(rank)
        try:
            event = queue.get(timeout=0.5)
        except Exception:
            continue
        if event[1] == "training":
            began[event[0]] = event[3]
            continue
        names = ["rank", "what", "step", "detail", "seconds"]
        print(json.dumps(dict(zip(names, event, strict=True))), flush=True)
        if event[1] in ("finished", "raised"):
            ended.add(event[0])
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    hung = sorted({0, 1} - ended)  # still inside a collective when the wall limit came
    print(json.dumps({"impl": args.impl, "declare": args.declare, "hung_ranks": hung,
                      "wall_limit_s": args.wall, "pg_timeout_s": args.pg_timeout}))  # fmt: skip


if __name__ == "__main__":
    main()
