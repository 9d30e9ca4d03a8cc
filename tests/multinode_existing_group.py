"""A rank of a job whose process group someone else made, as Ray Train's TorchTrainer does:
``python multinode_existing_group.py RANK WORLD STORE_FILE OUT``, started with no launcher
variables (no RANK, WORLD_SIZE, MASTER_ADDR). It creates the group itself over a FileStore,
then trains one ZeRO-2 step through ``partita.initialize`` and records what partita saw."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the tests' models module

import partita
from models import global_batches, make_model, rank_micro_batch
from partita import comm


def main() -> None:
    """Creates the group, hands it to partita, trains one step, writes OUT/rankR.json."""
    rank, world, store_file, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", store=dist.FileStore(store_file, world), rank=rank,
                            world_size=world)  # fmt: skip
    group = dist.group.WORLD
    model = make_model(seed=0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
    }
    engine, _, _, _ = partita.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    batch = global_batches(1, 2 * world)[0]
    loss = engine(*rank_micro_batch(batch, rank, world, 2, 0))
    engine.backward(loss)
    engine.step()
    record = {
        "same_group": dist.group.WORLD is group,
        "world": comm.get_world_size(),
        "rank": comm.get_rank(),
        "grad_bytes": comm.COUNTERS.bytes(tag="grad"),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
