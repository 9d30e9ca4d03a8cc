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

The stage-2 gradient pool (``reduce buckets``) is kept between steps, so every moment holds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from partita.estimate.stage3 import Moment

__all__ = ["GradLayout", "stage012_moments"]


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
    """Bytes per element of the buckets (0: stage 2, whose buckets are the pooled ones)."""
    shard_grads: tuple[int, int] = (0, 0)
    """Bytes of the fp32 gradient shards (device, host): stages 1-2."""
    step_grads: int = 0
    """Device bytes made only inside the step: stage 0's fp32 master gradients."""
    pool: int = 0
    """Bytes of stage 2's gradient pool (kept between steps)."""
    held: int = 0
    largest_activation: int = 0
    block_frees: tuple[int, ...] = ()
    """Activation bytes each block's backward frees, last block first."""
    transient: int = 0


def _bucket_elements(order: Sequence[int], bucket_numel: int, arrived: int) -> int:
    """Elements of the buckets made once the last `arrived` parameters' gradients are in: the
    buckets are cut from the end of `order` (``partita.zero.grad_buckets``, the same walk as
    `plan_buckets` in reverse order), and one exists from its first gradient on."""
    from partita.partition import plan_buckets

    made, seen = 0, 0
    for bucket in plan_buckets(order, bucket_numel, order=reversed(range(len(order)))):
        if seen >= arrived:
            break
        made += bucket.numel
        seen += len(bucket.indices)
    return made


def stage012_moments(lay: GradLayout) -> list[Moment]:
    """The moments of [Note: stage 0-2 moments] for one configuration."""
    total = len(lay.order)
    arrivals = list(lay.arrivals) or [total]

    def buckets(arrived: int) -> int:
        return _bucket_elements(lay.order, lay.bucket_numel, arrived) * lay.bucket_bytes

    dev, host = lay.shard_grads
    out = [
        Moment("loss backward", lay.held + 2 * lay.largest_activation, reduce=lay.pool),
        Moment(
            "head backward",
            lay.held + lay.largest_activation,
            reduce=lay.pool,
            transient=lay.transient,
            grads=buckets(arrivals[0]),
        ),
    ]
    for k, arrived in enumerate(arrivals[1:]):
        out.append(
            Moment(
                f"block {k + 1} backward",
                max(0, lay.held - sum(lay.block_frees[:k])),
                reduce=lay.pool,
                transient=lay.transient,
                grads=buckets(arrived) + dev,
                host_grads=host,
            )
        )
    every = buckets(total) + dev
    out.append(
        Moment(
            "backward's end",
            max(0, lay.held - sum(lay.block_frees)),
            reduce=lay.pool,
            transient=lay.transient,
            grads=every,
            host_grads=host,
        )
    )
    out.append(Moment("step", reduce=lay.pool, grads=every + lay.step_grads, host_grads=host))
    return out
