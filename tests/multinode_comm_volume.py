"""Bytes one training step moves per rank, per ZeRO stage, from partita's comm counters.

`step_traffic` runs on every rank (module level, so spawned ranks can import it): a fresh
engine per stage trains two steps and the second step's payload bytes are read from
`partita.comm.COUNTERS` per (op, tag). docs/scaling.md's table comes from running this file:

    .venv/bin/python tests/multinode_comm_volume.py

which prints, for world sizes 2 and 4, each stage's traffic as multiples of the model size
(Ψ elements); tests/test_launcher_comm_volume.py holds them to 2Ψ (stages 0-2) and 3Ψ (3).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the tests' models module

import partita
from models import global_batches, make_model, rank_micro_batch
from partita import comm

GLOBAL_BATCH = 8
# Tags of collectives that are bookkeeping, not model state: the loss average the script
# itself issues, overflow flags and gradient norms (a few elements each).
_MODEL_TAGS = ("grad", "param")
#: gloo's own reduce-scatter and all-gather, not the all-reduce forms partita uses on gloo for
#: speed (`partita.comm.collectives`, [Note: gloo collectives]): the algorithms' traffic.
NATIVE = {"PARTITA_COLLECTIVES": "native"}


def _config(stage: int, world: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        # Every parameter partitioned (none kept whole for being small) and released after
        # use (none kept for reuse within the distance), so stage 3 gathers the whole model
        # in forward and again in backward, as on a model too large to keep.
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
        },
        "steps_per_print": 1000,
    }


def step_traffic(stage: int, dim: int = 64, layers: int = 2) -> dict[str, Any]:
    """The second training step's payload bytes per ``op/tag`` on this rank, and Ψ."""
    rank, world = comm.get_rank(), comm.get_world_size()
    model = make_model(seed=0, dim=dim, layers=layers)
    psi = sum(p.numel() for p in model.parameters())
    engine, _, _, _ = partita.initialize(
        model=model, model_parameters=model.parameters(), config=_config(stage, world)
    )
    batches = global_batches(2, GLOBAL_BATCH)
    before: dict[tuple[str, str], int] = {}
    for step, batch in enumerate(batches):
        if step == 1:
            before = dict(comm.COUNTERS.total_bytes)
        loss = engine(*rank_micro_batch(batch, rank, world, GLOBAL_BATCH // world, 0))
        engine.backward(loss)
        engine.step()
    after = dict(comm.COUNTERS.total_bytes)
    engine.destroy()
    moved = {f"{op}/{tag}": n - before.get((op, tag), 0) for (op, tag), n in after.items()}
    return {"psi": psi, "bytes": {k: v for k, v in moved.items() if v}}


def volume_in_psi(traffic: dict[str, Any], elem_bytes: int = 4) -> float:
    """Elements moved per rank over Ψ, an all-reduce counted as reduce-scatter + all-gather
    (`partita.comm.counters`), model-state collectives only."""
    total = 0
    for key, nbytes in traffic["bytes"].items():
        op, _, tag = key.partition("/")
        if tag.split(".")[0] in _MODEL_TAGS or tag in _MODEL_TAGS:
            total += nbytes // elem_bytes * (2 if op == "all_reduce" else 1)
    return total / traffic["psi"]


def main() -> None:
    """Prints each stage's traffic at world sizes 2 and 4 (the docs/scaling.md table)."""
    from partita.testing import run_distributed_grid

    for world in (2, 4):
        cases = [{"stage": s} for s in range(4)]
        results = run_distributed_grid(step_traffic, world, cases, timeout=600, env=NATIVE)
        for stage, per_rank in enumerate(results):
            traffic = per_rank[0]
            print(
                f"world {world} stage {stage}: psi {traffic['psi']} "
                f"volume {volume_in_psi(traffic):.4f} psi  {traffic['bytes']}"
            )


if __name__ == "__main__":
    main()
