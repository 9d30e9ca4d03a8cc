"""Bytes-moved accounting for every collective partita issues.

Each collective records the payload bytes it carries under its op name (``all_reduce``,
``reduce_scatter``, ``all_gather``, ``broadcast``, ``all_to_all``) and an optional tag (``"grad"``, ``"param"``,
``"overflow"``...). Tests and benchmarks read totals per op, per tag and for the current step.

Payload convention: all_reduce and broadcast count the tensor they carry; reduce_scatter counts
its full (unsharded) input; all_gather counts its full (gathered) output; all_to_all counts the
tensor each rank sends (its own chunk included). So ZeRO's
reduce-scatter + all-gather of Ψ elements reads as 2Ψ, and a data-parallel all-reduce of Ψ
elements reads as Ψ; `volume_elements` converts both to the same "elements moved per rank"
measure (an all-reduce is a reduce-scatter followed by an all-gather, so it counts twice).

Each record also names the group it ran on, when the group was named with `name_group` (the
hybrid layout names its groups ``"dp_shard"`` and ``"dp_replicate"``; others read as ``""``):
``bytes(group="dp_replicate")`` is the traffic between replicas, the one that crosses nodes.

[Note: links]
Each record also says which link carries it: ``"intra"`` when every rank of its group is on one
node, ``"inter"`` when the group spans nodes (`partita.comm.collectives.link_of`; a node is a
block of ``LOCAL_WORLD_SIZE`` consecutive ranks, as the launchers place them). The payload of a
collective over a group that spans nodes is counted as inter-node whole: an upper bound of what
crosses (a ring over 2 nodes of n ranks sends 2 of its n hops across), and the figure a
hierarchical layout (hybrid sharding, hpZ, qgZ) is judged by: ``bytes(link="inter")``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Protocol

_ALL_REDUCE_FACTOR = 2


class CommObserver(Protocol):
    """Sees every collective: its payload when recorded, its latency once finished (the comms
    logger, `partita.profiling.comms`). Calls arrive in issue order from one thread."""

    def recorded(self, op: str, tag: str, nbytes: int) -> None:
        """A collective's payload, as `CommCounters.record` counts it."""

    def finished(self, op: str, seconds: float) -> None:
        """The oldest unfinished collective took `seconds` from issue to completion."""


@dataclass
class CommCounters:
    """Running totals of collective payloads, overall and since the last `begin_step`."""

    total_bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    total_calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    step_bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    step_elements: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    total_group_bytes: dict[tuple[str, str, str], int] = field(
        default_factory=lambda: defaultdict(int)
    )
    """Bytes by (group name, op, tag): the per-group view of `total_bytes`."""
    step_group_bytes: dict[tuple[str, str, str], int] = field(
        default_factory=lambda: defaultdict(int)
    )
    total_link_bytes: dict[tuple[str, str, str], int] = field(
        default_factory=lambda: defaultdict(int)
    )
    """Bytes by (link, op, tag), link "intra" or "inter" node ([Note: links])."""
    step_link_bytes: dict[tuple[str, str, str], int] = field(
        default_factory=lambda: defaultdict(int)
    )
    observer: CommObserver | None = None
    """Told of every record and completion when set (the comms logger); None costs one test."""

    def record(
        self, op: str, tag: str, nbytes: int, numel: int, group: str = "", link: str = "intra"
    ) -> None:
        """Adds one collective's payload to the totals (`group`: its group's name; `link`:
        "intra" or "inter" node, [Note: links])."""
        key = (op, tag)
        self.total_link_bytes[(link, op, tag)] += nbytes
        self.step_link_bytes[(link, op, tag)] += nbytes
        self.total_group_bytes[(group, op, tag)] += nbytes
        self.step_group_bytes[(group, op, tag)] += nbytes
        self.total_bytes[key] += nbytes
        self.total_calls[key] += 1
        self.step_bytes[key] += nbytes
        self.step_elements[key] += numel
        if self.observer is not None:
            self.observer.recorded(op, tag, nbytes)

    def finished(self, op: str, seconds: float) -> None:
        """A collective issued as `op` completed after `seconds` (tells the observer)."""
        if self.observer is not None:
            self.observer.finished(op, seconds)

    def begin_step(self) -> None:
        """Starts a new per-step window (the engine calls it after each optimizer step)."""
        self.step_bytes = defaultdict(int)
        self.step_elements = defaultdict(int)
        self.step_group_bytes = defaultdict(int)
        self.step_link_bytes = defaultdict(int)

    def reset(self) -> None:
        """Clears every total."""
        self.total_bytes = defaultdict(int)
        self.total_calls = defaultdict(int)
        self.total_group_bytes = defaultdict(int)
        self.total_link_bytes = defaultdict(int)
        self.begin_step()

    def bytes(
        self,
        op: str | None = None,
        tag: str | None = None,
        *,
        step: bool = False,
        group: str | None = None,
        link: str | None = None,
    ) -> int:
        """Sum of payload bytes matching `op`, `tag` and the group's name, or the `link`
        ("intra" / "inter" node; None matches any)."""
        if link is not None:
            by_link = self.step_link_bytes if step else self.total_link_bytes
            return sum(v for (k, o, t), v in by_link.items() if k == link and _match(o, t, op, tag))
        if group is not None:
            by_group = self.step_group_bytes if step else self.total_group_bytes
            return sum(
                v for (g, o, t), v in by_group.items() if g == group and _match(o, t, op, tag)
            )
        table = self.step_bytes if step else self.total_bytes
        return sum(v for (o, t), v in table.items() if _match(o, t, op, tag))

    def elements(self, op: str | None = None, tag: str | None = None) -> int:
        """Sum of payload elements in the current step matching `op` and `tag`."""
        return sum(v for (o, t), v in self.step_elements.items() if _match(o, t, op, tag))

    def volume_elements(self, tag: str | None = None) -> int:
        """Elements moved per rank in the current step, all-reduce counted as RS + AG."""
        total = 0
        for (o, t), v in self.step_elements.items():
            if _match(o, t, None, tag):
                total += v * (_ALL_REDUCE_FACTOR if o == "all_reduce" else 1)
        return total


def _match(o: str, t: str, op: str | None, tag: str | None) -> bool:
    return (op is None or o == op) and (tag is None or t == tag)


_GROUP_NAMES: dict[int, tuple[Any, str]] = {}
"""Named groups by id (the group object is kept with its name, so an id is never reused
while its entry lives)."""


def name_group(group: Any, name: str) -> None:
    """Records `group`'s collectives under `name` in the per-group totals."""
    _GROUP_NAMES[id(group)] = (group, name)


def group_name(group: Any) -> str:
    """The name `group` was given with `name_group` ("" when none)."""
    entry = _GROUP_NAMES.get(id(group)) if group is not None else None
    return entry[1] if entry is not None else ""


COUNTERS = CommCounters()
"""The process-wide counters every collective in `partita.comm` records into."""
