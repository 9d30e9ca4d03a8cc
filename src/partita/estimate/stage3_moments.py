"""ZeRO-3's training-time memory moment by moment, from the engine's own rules.

[Note: stage-3 moments]
The stage-3 buffers do not all peak at once, so adding each one's maximum overstates the peak
(with NVMe offload by 16-30% on the validation models). The estimate takes the largest of a few
moments of a step instead, each holding only what ``partita.zero.stage3`` holds then (``held``:
the activations the forward saved, without the loss's two transients of the largest one that
`ActivationProfile.peak` adds; ``L``: that largest activation):

- *loss backward* (the activation peak): ``held + 2L``, every unit still gathered (the reuse
  and live bounds, `window`), and no gradient buffer: the pool (`BufferPool(keep=2)` in
  ``grads.py``) lets its free ones go when the step releases the gradients. No NVMe buffer is
  in memory: the forward gathered (and freed) every shard it read ahead, no unit has reduced
  yet, and the previous step released its sub-groups (``nvme.py``).
- *head backward* (the first unit's hooks): ``held + L`` (the output's gradient), the largest
  parameter's gradient as autograd computes it (the ``gradient transient``), the first unit's
  gradient buffer (at most the largest), and under parameter offload the shards the
  scheduler reads ahead: ``offload_param.buffer_count`` of them, within ``buffer_count x
  buffer_size`` elements beyond the first, not the largest unit's (it is the one gathered).
- *backward after k units* (k = 1 .. 4): a unit's buffer of the largest size (a tied
  embedding's is taken at the head and kept to the end; an untied head's, once reduced, is
  lent to the next unit), the other units' reductions in flight, the free buffers of the
  units retired (at most two, each at most the second largest), and, under optimizer offload
  to NVMe, the gradients written through (``GRAD_WRITES_IN_FLIGHT + 1`` sub-groups at most,
  the largest ones; after k reductions launched at most k - 1 have retired into a write),
  while the activations of the blocks done are freed (k - 2 of them: the first unit done may
  be the head, outside them).
- *backward's end*: the pool at its peak (`pool_peak`: the largest buffer, two free ones and
  the reductions in flight) with only the activations outside the blocks left.
- *step*: no activations and no gathered units (``end_backward`` reshards them), the pool's
  free buffers (`kept`), and under NVMe offload the resident sub-groups (master, gradient and
  optimizer state of one, or three with ``pipeline_read``/``pipeline_write``), or the two
  gradient writes backward left running, whichever is more, plus the parameter shard the step
  writes back (one unit's, under parameter offload).

The fp32 gradient shards (in host memory under optimizer offload to the CPU) are released
after every step and made by the first unit's reduction ([Note: released gradients] in
``partita/zero/released_grads.py``): the two first moments hold none, the later ones all.

Between these, buffers stay within the bounds above while activations are freed, so no other
moment holds more. Measured on 2 CPU ranks, fp32 (GPT-2 10m at stage 3, 50m at stage 3 with
NVMe offload; bytes tensors asked of partita's host allocator at every unit hook): each step's
most is at the loss backward.
"""

from __future__ import annotations

from dataclasses import dataclass

# The engine's own figures: the estimate follows them if they change.
from partita.zero.stage3.grads import MAX_IN_FLIGHT, POOL_KEEP

__all__ = ["GRAD_WRITES", "MAX_IN_FLIGHT", "POOL_KEEP", "Moment", "Stage3Layout", "moments"]

GRAD_WRITES = 3
"""Sub-group gradients NVMe offload holds in backward (``zero/stage3/nvme.py``:
``GRAD_WRITES_IN_FLIGHT`` writes running plus the one being added)."""


@dataclass(frozen=True)
class Moment:
    """What one moment of a stage-3 step holds beyond the model states (bytes per rank):
    device items, and NVMe swap buffers in host memory."""

    name: str
    activations: int = 0
    gathered: int = 0
    reduce: int = 0
    transient: int = 0
    nvme: int = 0
    grads: int = 0
    """Gradients made since the last step (they are released after it) in device memory."""
    host_grads: int = 0
    """The same in host memory (shards under optimizer offload to the CPU)."""

    @property
    def device(self) -> int:
        """Device bytes of this moment's items."""
        return self.activations + self.gathered + self.reduce + self.transient + self.grads


@dataclass(frozen=True)
class Stage3Layout:
    """The sizes the moments are built from (elements unless named bytes)."""

    units: list[int]
    """Sharded units' sizes (the persistent one excluded)."""
    persistent: int
    """Elements of the persistent unit (it has a gradient buffer too)."""
    world: int
    p: int
    """Bytes per element of the module dtype (parameters, their gradients and buffers)."""
    window: int
    """Elements gathered at once (`partita.estimate.memory._window`)."""
    reduce_bucket: int
    held: int = 0
    """Activation bytes saved for backward, without the loss's transients."""
    largest_activation: int = 0
    block_frees: tuple[int, ...] = ()
    """Activation bytes each block's backward frees, last block first."""
    transient: int = 0
    """Bytes of the largest parameter's gradient while autograd holds it (0: not counted)."""
    head_unit: int | None = None
    """Elements of the largest unit the head's backward reaches first (`ModelShape.head_unit`;
    None: unknown, the largest unit's)."""
    shard_grads: tuple[int, int] = (0, 0)
    """Bytes of the fp32 gradient shards (device, host) while they exist (NVMe-swapped ones:
    none, they are not held between uses)."""
    swapped: list[int] | None = None
    """Per-rank shard elements of the units whose shards NVMe parameter offload swaps (None:
    every unit's; ``offload_param.max_in_cpu`` keeps the first ones in host memory)."""

    @property
    def shards(self) -> list[int]:
        """Per-rank shard elements of the units, largest first."""
        return sorted((-(-u // self.world) for u in self.units), reverse=True)

    def kept(self) -> int:
        """Bytes of the free gradient buffers the pool keeps once every unit has reduced (until
        the step releases them): the two largest."""
        return sum(self._buffers()[:POOL_KEEP]) * self.p

    def largest_buffer(self) -> int:
        """Bytes of the largest unit's gradient buffer."""
        return max(self._buffers(), default=0) * self.p

    def first_buffer(self) -> int:
        """Bytes of the buffer the head's backward makes first and keeps while the blocks
        reduce: the head unit's (at most the largest; a tied embedding registered before the
        blocks gets its gradient only at the backward's end)."""
        if self.head_unit is None:
            return self.largest_buffer()
        return min(self.head_unit * self.p, self.largest_buffer())

    def _second(self) -> int:
        """Elements of the second largest unit's buffer (0 with one unit)."""
        ordered = self._buffers()
        return ordered[1] if len(ordered) > 1 else 0

    def held_after(self, units: int, first: int | None = None) -> int:
        """Bytes of gradient buffers once `units` units have launched their reductions: one
        kept throughout (`first`, bytes; default the largest's), and of the other units'
        buffers (largest first) those in flight (`in_flight_count`) and one free per unit
        retired (k - 1 at most, `POOL_KEEP` at most)."""
        others = self._buffers()[1:]
        count = self.in_flight_count() + min(max(0, units - 1), POOL_KEEP)
        kept = self.largest_buffer() if first is None else first
        return kept + sum(others[:count]) * self.p

    def _buffers(self) -> list[int]:
        """Elements of each unit's gradient buffer, largest first."""
        return sorted([*self.units, *([self.persistent] if self.persistent else [])], reverse=True)

    def in_flight_count(self) -> int:
        """Reductions of units other than the largest in flight at once: `MAX_IN_FLIGHT`
        within ``reduce_bucket_size`` elements (of the second largest size), one always."""
        second = self._second()
        if not second:
            return 0
        return min(MAX_IN_FLIGHT, max(1, self.reduce_bucket // second))

    def pool_peak(self) -> int:
        """Bytes of gradient buffers at the pool's peak: one of the largest size, the other
        units' reductions in flight and the free buffers the pool keeps (`held_after`)."""
        return self.held_after(POOL_KEEP + 1)

    def sub_groups(self, sub_group_size: int) -> list[int]:
        """Per-rank elements of every sub-group (a unit's shard cut at ``sub_group_size``),
        largest first."""
        out = []
        for shard in self.shards:
            whole, rest = divmod(shard, sub_group_size)
            out += [sub_group_size] * whole + ([rest] if rest else [])
        return sorted(out, reverse=True)


def _read_ahead(lay: Stage3Layout, count: int, size: int) -> int:
    """Bytes of the shards read ahead of the backward's gathers (``zero/stage3/schedule.py``
    `_read_ahead`): up to `count` swapped ones, beyond the first within ``count x size``
    elements; the largest unit's is excluded (it is the head, gathered when the backward
    starts)."""
    head = lay.shards[0] if lay.shards else 0
    swapped = sorted(lay.shards if lay.swapped is None else lay.swapped, reverse=True)
    if swapped and swapped[0] == head:
        swapped = swapped[1:]
    ahead = swapped[:count]
    if not ahead:
        return 0
    return min(sum(ahead), count * size + ahead[0]) * lay.p


def moments(
    lay: Stage3Layout,
    opt_nvme: bool,
    param_nvme: bool,
    sub_group_size: int,
    step_resident: int,
    read_ahead: tuple[int, int],
    optimizer_bytes: int,
) -> list[Moment]:
    """The moments of [Note: stage-3 moments] for one configuration; `step_resident`:
    sub-groups in memory during the step, `read_ahead`: (``buffer_count``, ``buffer_size``)."""
    groups = lay.sub_groups(sub_group_size) if opt_nvme else []
    ahead = _read_ahead(lay, *read_ahead) if param_nvme else 0
    gathered, transient = lay.window * lay.p, lay.transient
    first = lay.first_buffer()
    out = [
        Moment("loss backward", lay.held + 2 * lay.largest_activation, gathered),
        Moment(
            "head backward", lay.held + lay.largest_activation, gathered, first, transient, ahead
        ),
    ]
    for k in range(1, GRAD_WRITES + 2):
        freed = sum(lay.block_frees[: max(0, k - 2)])
        out.append(
            Moment(
                f"backward after {k} unit(s)",
                max(0, lay.held - freed),
                gathered,
                lay.held_after(k, first),
                transient,
                ahead + sum(groups[: min(GRAD_WRITES, k - 1)]) * 4,
                *lay.shard_grads,
            )
        )
    out.append(
        Moment(
            "backward's end",
            max(0, lay.held - sum(lay.block_frees)),
            gathered,
            lay.pool_peak(),
            transient,
            ahead + sum(groups[:GRAD_WRITES]) * 4,
            *lay.shard_grads,
        )
    )
    step = 0
    if opt_nvme:
        resident = step_resident * groups[0] * (4 + 4 + optimizer_bytes) if groups else 0
        step = max(resident, sum(groups[: GRAD_WRITES - 1]) * 4)
    if param_nvme:  # the unit being stepped: its shard is read in and written back
        step += max(lay.shards if lay.swapped is None else lay.swapped, default=0) * lay.p
    dev, host = lay.shard_grads
    out.append(Moment("step", reduce=lay.kept(), nvme=step, grads=dev, host_grads=host))
    return out
