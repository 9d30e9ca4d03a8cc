"""Ranks started with different configs fail at initialize(), every rank, naming the keys and
the ranks' values, before anything else collective runs (one world-2 spawn)."""

from __future__ import annotations

from typing import Any

import torch

import partita
from partita.config import ConfigError
from partita.testing import run_distributed


def _initialize_with_rank_config() -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    outcome: dict[str, Any] = {}
    configs = {
        "differs": {
            "train_micro_batch_size_per_gpu": 2 * (rank + 1),
            "zero_optimization": {"stage": 1, "reduce_bucket_size": 1000 + rank},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        },
        "same": {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        },
    }
    for name, config in configs.items():
        torch.manual_seed(0)
        try:
            partita.initialize(model=torch.nn.Linear(4, 4), config=config)
        except ConfigError as error:
            outcome[name] = [(p.path, p.message) for p in error.problems]
        else:
            outcome[name] = "accepted"
    return outcome


def test_config_that_differs_across_ranks_fails_on_every_rank() -> None:
    results = run_distributed(_initialize_with_rank_config, 2, timeout=120)
    for outcome in results:
        assert outcome["same"] == "accepted"
        problems = dict(outcome["differs"])
        assert problems["train_micro_batch_size_per_gpu"] == (
            "config differs across ranks: rank 0=2, rank 1=4"
        )
        assert problems["train_batch_size"] == "config differs across ranks: rank 0=4, rank 1=8"
        assert problems["zero_optimization.reduce_bucket_size"] == (
            "config differs across ranks: rank 0=1000, rank 1=1001"
        )
        assert len(problems) == 3, problems
