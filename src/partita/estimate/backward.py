"""ZeRO stages 0-2's training-time memory moment by moment: gradients exist only from the
backward that makes them to the end of the step.

[Note: stage 0-2 moments]
partita releases every gradient it owns after the optimizer step ([Note: released gradients] in
``partita/zero/released_grads.py``), so the activations of a forward never sit beside them: a
gradient bucket (stage 0's, stage 1's full gradients) is made by the first gradient that
reaches it, the fp32 gradient shards of stages 1-2 by the first reduction, stage 0's fp32
master gradients (16-bit modules) only inside the step. Backward frees activations block by
block while it makes gradients bucket by bucket, so the estimate is the largest of these
moments, as for stage 3 ([Note: stage-3 moments] in ``stage3.py``; ``held``: the saved
activations without the loss's two transients of the largest one, ``L``):

- *loss backward* (the activation peak): ``held + 2L`` and no gradient yet.
- *head backward*: ``held + L`` (the output's gradient), the largest parameter's gradient as
  autograd computes it (the ``gradient transient``: a tied embedding's stays until the
  embedding's own backward adds to it) and the buckets of the parameters after the last block.
- *block k* (last block first): the activations of the blocks done freed, those of block k still
  held while its gradients land, the buckets reached so far and, from the first block on, the
  fp32 gradient shards (the first reduction is at most two buckets away).
- *backward's end*: the activations outside the blocks, every gradient.
- *step*: every gradient (and stage 0's master gradients), no activation.

Stage 2 reduces through pooled buffers instead (``reduce buckets``, ``zero/buffer_pool.py``),
let go with the gradients: a moment holds at most the pool's most, and no more than the buckets
reached so far.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from partita.estimate.stage3_moments import Moment
from partita.zero.sharded_grads import MAX_IN_FLIGHT, POOL_KEEP

__all__ = ["GradLayout", "pool_peak", "stage012_moments"]


@dataclass(frozen=True)
class GradLayout:
    """What stages 0-2 hold besides the model states, and when (bytes unless named)."""

    order: Sequence[int]
    """Trainable parameter sizes in registration order (buckets are cut from its end)."""
    arrivals: Sequence[int]
    """`partita.estimate.model.ModelShape.arrivals` (empty: unknown, every bucket counted from
    the head's backward on)."""
    bucket_numel: int
    bucket_bytes: int
    """Bytes per element of the buckets."""
    kept: bool
    """True: the buckets are the gradients, kept to the step (stages 0-1); False: stage 2's
    pooled buffers, reused once reduced."""
    shard_grads: tuple[int, int] = (0, 0)
    """Bytes of the fp32 gradient shards (device, host): stages 1-2."""
    step_grads: int = 0
    """Device bytes made only inside the step: stage 0's fp32 master gradients."""
    pool: int = 0
    """Bytes of stage 2's gradient pool at its most (empty between steps)."""
    held: int = 0
    largest_activation: int = 0
    block_frees: tuple[int, ...] = ()
    """Activation bytes each block's backward frees, last block first."""
    transient: int = 0


def pool_peak(buffers: Sequence[int], keep: int = POOL_KEEP, in_flight: int = MAX_IN_FLIGHT) -> int:
    """Most elements stage 2's pool holds at once (lent out or free) for buffers asked for in
    `buffers`' order, as ``zero/buffer_pool.py`` and ``zero/sharded_grads.py`` run it: a bucket
    takes the smallest free buffer that fits or a new one, waits for reductions beyond
    `in_flight` before its own starts, and each retired buffer goes back to the pool, which
    keeps the `keep` largest free."""
    free: list[int] = []
    flying: list[int] = []
    lent = peak = 0
    for size in buffers:
        fits = [b for b in free if b >= size]
        base = min(fits) if fits else size
        if fits:
            free.remove(base)
        lent += base
        peak = max(peak, lent + sum(free))
        while len(flying) >= in_flight:
            done = flying.pop(0)
            lent -= done
            free.append(done)
            if len(free) > keep:
                free.remove(min(free))
        flying.append(base)
    return peak


def _bucket_starts(order: Sequence[int], bucket_numel: int) -> list[tuple[int, int]]:
    """(parameters before it, elements) of each bucket, cut from the end of `order` as
    ``partita.zero.sharded_grads`` cuts them (`plan_buckets` walked in reverse order)."""
    from partita.partition import plan_buckets

    out, seen = [], 0
    for bucket in plan_buckets(order, bucket_numel, order=reversed(range(len(order)))):
        out.append((seen, bucket.numel))
        seen += len(bucket.indices)
    return out


def stage012_moments(lay: GradLayout) -> list[Moment]:
    """The moments of [Note: stage 0-2 moments] for one configuration."""
    total = len(lay.order)
    arrivals = list(lay.arrivals) or [total]
    starts = _bucket_starts(lay.order, lay.bucket_numel)

    def reached(arrived: int) -> tuple[int, int]:
        """(gradient bytes kept, pooled buffer bytes) once the last `arrived` parameters'
        gradients are in: a bucket exists from its first gradient on."""
        made = sum(numel for before, numel in starts if before < arrived) * lay.bucket_bytes
        return (made, 0) if lay.kept else (0, min(lay.pool, made))

    dev, host = lay.shard_grads
    grads, pool = reached(arrivals[0])
    out = [
        Moment("loss backward", lay.held + 2 * lay.largest_activation),
        Moment(
            "head backward",
            lay.held + lay.largest_activation,
            reduce=pool,
            transient=lay.transient,
            grads=grads,
        ),
    ]
    for k, arrived in enumerate(arrivals[1:]):
        grads, pool = reached(arrived)
        out.append(
            Moment(
                f"block {k + 1} backward",
                max(0, lay.held - sum(lay.block_frees[:k])),
                reduce=pool,
                transient=lay.transient,
                grads=grads + dev,
                host_grads=host,
            )
        )
    grads, pool = reached(total)
    out.append(
        Moment(
            "backward's end",
            max(0, lay.held - sum(lay.block_frees)),
            reduce=pool,
            transient=lay.transient,
            grads=grads + dev,
            host_grads=host,
        )
    )
    every = grads + dev + lay.step_grads
    out.append(Moment("step", reduce=pool, grads=every, host_grads=host))
    return out
