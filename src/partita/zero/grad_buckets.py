"""How data-parallel gradient reductions scale: `ReduceScaling` (every stage's reducer reads it;
the reducers are `partita.zero.sharded_grads.ShardedGradients` for stages 0-2 and
`partita.zero.stage3.grads.UnitGradReducer` for stage 3).

[Note: bucket buffers and gradient views]
At stages 0 and 1 every trainable parameter's ``.grad`` is a view into one flat bucket buffer, so
autograd accumulates straight into the buffer and the reduction reads every gradient in it with
no copy in. Buckets hold parameters in reverse registration order, which is close to the order
gradients become ready in backward. A post-accumulate-grad hook per parameter counts arrivals;
when a bucket is complete its reduction starts asynchronously while backward continues. Buckets
are launched strictly in a fixed order on every rank (a complete bucket waits for its
predecessors), so collectives pair up across ranks even if gradient arrival order differs.
Whatever did not complete is launched at the end of backward (parameters unused this step still
carry their zeroed slice). If something replaced a ``.grad`` with a fresh tensor (e.g.
``optimizer.zero_grad(set_to_none=True)``), the hook copies it back into the view and
reinstates the view.

A bucket's buffer exists only from the first gradient that reaches it after a step until the
next release ([Note: released gradients]): the hook of that gradient makes the buffer (zeroed),
copies the gradient in and points every parameter of the bucket at its view, so the others
accumulate into it directly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReduceScaling:
    """How gradients are averaged, following DeepSpeed's ``prescale_gradients`` and
    ``gradient_predivide_factor``: divide by the factor before the sum and by
    world_size/factor after it (or by world_size before, when prescaling). With ``average``
    False (``gradient_allreduce_op: "sum"``) the plain sum: neither divides, as in DeepSpeed."""

    world_size: int
    prescale: bool = False
    predivide_factor: float = 1.0
    average: bool = True

    @property
    def before(self) -> float:
        """Multiplier applied before the all-reduce."""
        if not self.average:
            return 1.0
        if self.prescale:
            return 1.0 / self.world_size
        return 1.0 / self.predivide_factor

    @property
    def after(self) -> float:
        """Multiplier applied after the all-reduce."""
        if not self.average:
            return 1.0
        if self.prescale:
            return 1.0
        return self.predivide_factor / self.world_size
