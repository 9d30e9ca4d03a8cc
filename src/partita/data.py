"""The data loader `initialize(training_data=...)` returns: each rank reads its own part."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class DistributedDataLoader:
    """A `DataLoader` over this rank's share of `dataset`, reshuffled every epoch.

    Like DeepSpeed's loader it yields micro-batches of ``train_micro_batch_size_per_gpu``
    samples; unlike a bare `DistributedSampler`, a new pass over it starts a new epoch (a new
    shuffle) without the caller having to call ``set_epoch``.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        rank: int,
        world_size: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        self.sampler: DistributedSampler[Any] = DistributedSampler(
            dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            collate_fn=collate_fn,
            drop_last=drop_last,
            num_workers=num_workers,
            pin_memory=pin_memory,
        )
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """Selects the shuffle of pass `epoch` for the next iteration."""
        self.epoch = epoch

    @property
    def batch_size(self) -> int:
        """Micro-batch size per rank."""
        return int(self.loader.batch_size or 0)


def is_dataset(obj: Any) -> bool:
    """True for map-style datasets a `DistributedSampler` can split."""
    return isinstance(obj, Dataset) or (hasattr(obj, "__getitem__") and hasattr(obj, "__len__"))


__all__ = ["DistributedDataLoader", "is_dataset", "torch"]
