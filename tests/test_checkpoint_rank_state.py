"""What a checkpoint's per-rank state (RNG, loader position) restores at another world size,
in process: partita's loaders are built for each (rank, world size) by hand, no spawn."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from partita.checkpoint.state import loader_for_rank, rng_for_rank
from partita.data import DistributedDataLoader


def _loaders(size: int, world: int, batch: int, drop_last: bool = False) -> list[Any]:
    data = list(range(size))  # each sample is its index
    return [
        DistributedDataLoader(data, batch, rank, world, seed=5, drop_last=drop_last)
        for rank in range(world)
    ]


def _epoch_order(size: int, epoch: int) -> list[int]:
    """The shuffle every world size deals out (DistributedSampler's, seed 5)."""
    return torch.randperm(size, generator=torch.Generator().manual_seed(5 + epoch)).tolist()


@pytest.mark.parametrize(
    ("size", "n", "b", "steps", "m", "c", "drop_last"),
    [
        (40, 2, 2, 3, 4, 3, False),  # 12 consumed, 4 | 12
        (40, 4, 1, 5, 3, 2, False),  # 20 consumed, 3 does not divide: 2 seen again
        (25, 3, 2, 2, 2, 4, False),  # padded shares (25 over 3 ranks)
        (41, 2, 3, 4, 3, 2, True),  # drop_last
    ],
)
def test_loader_resumes_at_the_global_sample_position(
    size: int, n: int, b: int, steps: int, m: int, c: int, drop_last: bool
) -> None:
    saved = _loaders(size, n, b, drop_last)
    seen = []
    for loader in saved:
        it = iter(loader)
        seen.append([int(i) for _ in range(steps) for i in next(it)])
    states = [loader.state_dict() for loader in saved]
    consumed = steps * b * n
    order = _epoch_order(size, 0)
    # The saved ranks together consumed exactly the shuffle's first `consumed` samples.
    assert sorted(i for s in seen for i in s) == sorted(order[:consumed])

    new = _loaders(size, m, c, drop_last)
    restored = [loader_for_rank(states, r, m) for r in range(m)]
    for loader, (state, _) in zip(new, restored, strict=True):
        assert state is not None
        loader.load_state_dict(state)
    rest = [[int(i) for batch in loader for i in batch] for loader in new]
    again = consumed % m
    assert (restored[0][1] is None) == (again == 0), restored[0][1]
    # Rank r continues at positions r + k*m from k = consumed // m: the unconsumed rest of
    # the shuffle (padding and drop_last aside), after `again` samples consumed a second time.
    start = consumed - again
    got = {r + (start // m + k) * m: x for r in range(m) for k, x in enumerate(rest[r])}
    real = sorted(p for p in got if p < size)
    assert real == list(range(start, start + len(real)))
    assert [got[p] for p in real] == order[start : start + len(real)]
    if not drop_last:
        assert real[-1] == size - 1  # nothing of the epoch left out
    # The next epoch starts from its beginning on every rank.
    assert sorted(int(i) for loader in new for i in next(iter(loader))) == sorted(
        _epoch_order(size, 1)[: m * c]
    )


def test_rng_restored_only_where_the_saved_ranks_agree() -> None:
    same = {"python": [3, [1, 2], None], "torch_cpu": "AAA"}
    saved = [{**same, "numpy": ["MT", [r], 0, 0, 0.0]} for r in range(2)]
    assert rng_for_rank(saved, 1, 2) == (saved[1], [])  # same world size: its own
    common, differ = rng_for_rank(saved, 2, 3)
    assert common == same and differ == ["numpy"]
    assert rng_for_rank(None, 0, 4) == (None, [])


def test_loader_not_restored_when_ranks_disagree() -> None:
    a = {"epoch": 0, "samples": 4, "batch_size": 2, "seed": 0}
    state, note = loader_for_rank([a, {**a, "samples": 6}], 0, 3)
    assert state is None and note is not None and "different positions" in note
    state, note = loader_for_rank([{"epoch": 0, "batches": 2, "batch_size": 2}] * 2, 0, 3)
    assert state is None and note is not None and "does not count samples" in note
