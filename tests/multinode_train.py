"""Training script the multi-node launcher tests start under ``partita`` (one process per rank).

``multinode_train.py --local_rank=N OUT stages``: ZeRO stages 0-3 in one process lifetime, a
fresh engine per stage on the same model and data; rank 0 writes each stage's global losses to
``OUT/losses.json``. Every rank writes ``OUT/rank{R}_restart{N}.json`` (its pid, node rank,
world size). ``--hold``: afterwards each rank writes ``OUT/held{R}`` and waits, process group
up, until ``OUT/release`` exists (a test lists the job's sockets meanwhile).

``multinode_train.py --local_rank=N OUT elastic CKPT TOTAL [--stop_at K] [--gate K]``: trains
``TOTAL`` steps of ZeRO-2, resuming from ``CKPT``'s ``latest`` whenever it exists (partita's
load reshards to the current world size) and saving after every step. ``--stop_at K`` ends
after step K. ``--gate K`` (a multi-node world only): after saving step K the ranks keep
meeting in barriers until a peer dies, which is the moment a test kills a node. Rank 0 writes
the final parameters to ``OUT/final.pt`` and the losses to ``OUT/losses.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the tests' models module

import partita
from models import global_batches, make_model, rank_micro_batch
from partita import comm
from partita.compat import accessors

GLOBAL_BATCH = 4
STAGE_STEPS = 3


def _config(stage: int, world: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 700},
        "steps_per_print": 1000,
    }


def _engine(stage: int) -> Any:
    model = make_model(seed=0)
    engine, _, _, _ = partita.initialize(
        model=model, model_parameters=model.parameters(), config=_config(stage, _world())
    )
    return engine


def _world() -> int:
    return int(os.environ["WORLD_SIZE"])


def _step(engine: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    """One optimizer step on this rank's share of ``batch``; the loss averaged over ranks."""
    rank, world = comm.get_rank(), comm.get_world_size()
    loss = engine(*rank_micro_batch(batch, rank, world, GLOBAL_BATCH // world, 0))
    engine.backward(loss)
    engine.step()
    total = loss.detach().float().clone()
    comm.all_reduce(total, tag="test")
    return total.item() / world


def _write_json(path: Path, data: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)  # readers never see half a file


def run_stages(out: Path) -> None:
    """Stages 0-3, ``STAGE_STEPS`` steps each from the same start."""
    batches = global_batches(STAGE_STEPS, GLOBAL_BATCH)
    losses = {}
    for stage in range(4):
        engine = _engine(stage)
        losses[str(stage)] = [_step(engine, b) for b in batches]
        engine.destroy()
    if comm.get_rank() == 0:
        _write_json(out / "losses.json", losses)


def _full_params(engine: Any) -> dict[str, torch.Tensor]:
    return {
        name: accessors.safe_get_full_fp32_param(p) for name, p in engine.module.named_parameters()
    }


def _hold_until_a_peer_dies(out: Path) -> None:
    """Barriers until one fails: the test kills a node once every rank is here."""
    (out / f"gate{comm.get_rank()}").write_text(str(os.getpid()))
    while True:  # ends by an exception when a peer's process is gone
        dist.barrier()
        time.sleep(0.2)


def run_elastic(out: Path, ckpt: Path, total: int, stop_at: int | None, gate: int | None) -> None:
    """Trains to ``total`` steps, resuming from ``ckpt`` and saving after every step."""
    engine = _engine(stage=2)
    start = 0
    if (ckpt / "latest").exists():
        engine.load_checkpoint(str(ckpt))
        start = engine.global_steps
    batches = global_batches(total, GLOBAL_BATCH)
    losses = []
    for step in range(start, stop_at if stop_at is not None else total):
        losses.append(_step(engine, batches[step]))
        engine.save_checkpoint(str(ckpt))
        if gate == step + 1 and _world() > 1:
            _hold_until_a_peer_dies(out)
    params = _full_params(engine)
    if comm.get_rank() == 0:
        torch.save(params, out / "final.pt")
        _write_json(out / f"losses_from{start}_world{_world()}.json", losses)
    engine.destroy()


def main() -> None:
    """Parses the arguments (``--local_rank`` first, as the launcher passes it) and runs."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, required=True)
    parser.add_argument("out", type=Path)
    parser.add_argument("mode", choices=["stages", "elastic"])
    parser.add_argument("ckpt", type=Path, nargs="?")
    parser.add_argument("total", type=int, nargs="?")
    parser.add_argument("--stop_at", type=int)
    parser.add_argument("--gate", type=int)
    parser.add_argument("--hold", action="store_true")
    args = parser.parse_args()
    comm.init_distributed()
    record = {
        "rank": comm.get_rank(),
        "pid": os.getpid(),
        "world": _world(),
        "node_rank": int(os.environ.get("GROUP_RANK", "-1")),
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    }
    _write_json(args.out / f"rank{record['rank']}_restart{record['restart']}.json", record)
    if args.mode == "stages":
        run_stages(args.out)
    else:
        run_elastic(args.out, args.ckpt, args.total, args.stop_at, args.gate)
    if args.hold:
        (args.out / f"held{record['rank']}").write_text("")
        while not (args.out / "release").exists():
            time.sleep(0.05)
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
