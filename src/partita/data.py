"""The data loader `initialize(training_data=...)` returns: each rank reads its own part."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler


class _ResumeSampler(Sampler[int]):
    """Passes `inner`'s indices through, dropping the first `skip` of the next pass once (how a
    restored loader continues mid-epoch without loading the skipped samples)."""

    def __init__(self, inner: Sampler[Any]) -> None:
        self.inner = inner
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.inner), skip, None)

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]


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
        self._resume = _ResumeSampler(self.sampler)
        self.seed = seed
        self.drop_last = drop_last
        self.generator = torch.Generator()
        self.loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self._resume,
            generator=self.generator,
            collate_fn=collate_fn,
            drop_last=drop_last,
            num_workers=num_workers,
            pin_memory=pin_memory,
        )
        self.epoch = 0
        self._resume_samples = 0
        self._position = (0, 0)
        """(epoch, this rank's samples consumed in it) of the pass in progress or about to
        start. Counted in samples, not batches, so a position restored at another world size
        (another micro-batch size) need not fall on a batch boundary."""

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        epoch, start = self.epoch, self._resume_samples
        self._resume_samples = 0
        self.sampler.set_epoch(epoch)
        self.generator.manual_seed(self.seed + epoch)
        self._resume.skip = start
        self.epoch += 1
        self._position = (epoch, start)
        return self._counted(iter(self.loader), epoch, start)

    def _counted(self, batches: Iterator[Any], epoch: int, start: int) -> Iterator[Any]:
        per_epoch = len(self.sampler)
        consumed = start
        for batch in batches:
            consumed = min(per_epoch, consumed + self.batch_size)
            self._position = (epoch, consumed)
            yield batch
        self._position = (epoch + 1, 0)

    def state_dict(self) -> dict[str, int]:
        """Where the next batch comes from: ``{"epoch", "samples"}`` (this rank's samples
        already consumed in that epoch), with the batches that makes at this batch size, the
        batch size, seed, this rank's samples per epoch and the number of ranks."""
        epoch, done = self._position
        left = len(self.sampler) - done
        # A pass that has nothing left to yield (with drop_last: less than a batch) is over.
        if left <= 0 or (self.drop_last and left < self.batch_size):
            epoch, done = epoch + 1, 0
        return {
            "epoch": epoch,
            "samples": done,
            "batches": -(-done // self.batch_size),
            "batch_size": self.batch_size,
            "seed": self.seed,
            "samples_per_epoch": len(self.sampler),
            "num_replicas": int(self.sampler.num_replicas),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Makes the next pass continue at `state_dict`'s position (create iterators after
        this call: one made before it keeps its old position). A state without ``samples``
        (saved before they were counted) must come from a loader of the same batch size."""
        if "samples" in state:
            samples = int(state["samples"])
        elif int(state["batch_size"]) != self.batch_size:
            raise ValueError(
                f"data loader state saved with batch_size={state['batch_size']}, this loader "
                f"has batch_size={self.batch_size}"
            )
        else:
            samples = int(state["batches"]) * self.batch_size
        self.epoch = int(state["epoch"])
        self._resume_samples = samples
        self._position = (self.epoch, samples)

    def set_epoch(self, epoch: int) -> None:
        """Selects the shuffle of pass `epoch` for the next iteration."""
        self.epoch = epoch
        self._resume_samples = 0
        self._position = (epoch, 0)

    @property
    def batch_size(self) -> int:
        """Micro-batch size per rank."""
        return int(self.loader.batch_size or 0)


def is_dataset(obj: Any) -> bool:
    """True for map-style datasets a `DistributedSampler` can split."""
    return isinstance(obj, Dataset) or (hasattr(obj, "__getitem__") and hasattr(obj, "__len__"))


__all__ = ["DistributedDataLoader", "is_dataset", "torch"]
