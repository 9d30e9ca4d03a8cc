"""Where ZeRO state lives: a placement per kind of state, chosen once from the config.

A strategy is given an `OffloadPlacement` when it is built and never looks at the offload
config blocks or tests flags per call: the optimizer's masters and state, and stage 3's
parameter shards, each have a `Placement` — with the compute device, in host memory (page-locked
with ``pin_memory``), or in NVMe swap files staged through host memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from partita.offload.swap_space import SwapSpace

Where = Literal["device", "host", "nvme"]


@dataclass(frozen=True)
class Placement:
    """Where one kind of state lives."""

    where: Where = "device"
    pin_memory: bool = False
    """Page-lock host copies (``pin_memory`` of the offload block; host and NVMe only)."""
    swap: SwapSpace | None = None
    """This rank's swap files (NVMe only)."""

    @property
    def device(self) -> torch.device | None:
        """The host for offloaded state (NVMe state is staged there), None for the compute
        device."""
        return None if self.where == "device" else torch.device("cpu")

    @property
    def in_memory(self) -> bool:
        """True unless the state lives in swap files between uses."""
        return self.swap is None


@dataclass(frozen=True)
class OptimizerPlacement(Placement):
    """Masters and optimizer state (``offload_optimizer``)."""

    ratio: float = 1.0
    """Share of the sub-group masters offloaded (``offload_optimizer.ratio``; stage 3, host)."""
    pipeline: tuple[bool, bool] = (False, False)
    """NVMe: (read the next sub-group ahead, write the last one behind) the step."""


@dataclass(frozen=True)
class ParamPlacement(Placement):
    """Stage 3's parameter shards (``offload_param``)."""

    max_in_cpu: int = 0
    """NVMe: shard elements per rank kept in host memory instead (``max_in_cpu``)."""
    read_ahead: tuple[int, int] = (1, 0)
    """NVMe: (shards, elements) that may be read ahead of use (``buffer_count``,
    ``buffer_count x buffer_size``)."""


@dataclass(frozen=True)
class OffloadPlacement:
    """The placement of every kind of ZeRO state of one engine."""

    optimizer: OptimizerPlacement = field(default_factory=OptimizerPlacement)
    params: ParamPlacement = field(default_factory=ParamPlacement)

    @property
    def masters_alias_shards(self) -> bool:
        """A master may be its parameter shard (no copy) only when both stay in memory."""
        return self.optimizer.in_memory and self.params.in_memory

    def close(self) -> None:
        """Deletes the swap files."""
        for placement in (self.optimizer, self.params):
            if placement.swap is not None:
                placement.swap.close()
