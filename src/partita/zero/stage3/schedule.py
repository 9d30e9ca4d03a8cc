"""When ZeRO-3 units are gathered and released: module hooks, recorded order, prefetch, and
the live-parameter and reuse-distance bounds.

[Note: hook flow]
Forward: a unit's module pre-hook gathers it (waiting for a prefetch if one is in flight) and
prefetches the next unit in the order recorded on the first step; the post-hook releases it
unless it will be reused soon (`max_reuse_distance`), registers a pre-backward hook on its
outputs and wraps its inputs in `_PostBackward`, whose backward runs once the unit's whole
backward is done. Backward mirrors this: pre-backward gathers and prefetches the previous unit;
post-backward (after the last of several calls of the same unit) starts the gradient
reduce-scatter and releases. Forward pre-hooks that run inside backward are activation-checkpoint
recomputation: they gather but change no bookkeeping. Anything a hook did not finish (units
whose inputs need no gradient, such as the root) is finished in `end_backward`.

Each hook moves its unit's `TrainingState` (pre-forward: FORWARD, post-forward: IDLE,
pre-backward: PRE_BACKWARD, the last post-backward: POST_BACKWARD, `end_backward`: IDLE) and
its use count, through the unit's own methods; each is a ``partita::<hook>[<unit>]`` range in a
profiler trace, around the unit's own ``unshard``/``wait_for_unshard``/``reshard`` ranges.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from partita.zero.stage3.unit import ShardedUnit, UnitState, trace


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward signals that the unit's backward is over."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *inputs: torch.Tensor) -> Any:
        ctx.callback = callback
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.callback()
        return (None, *grads)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class UnitScheduler:
    """Drives gather/release of `units` (each bound to a module) during forward and backward.

    Per-unit counters and training state live on the units ([Note: ZeRO-3 state map]); this
    object keeps the recorded order (a list of units), its cursors and the live-set bounds."""

    def __init__(
        self,
        units: list[ShardedUnit],
        bindings: list[tuple[ShardedUnit, torch.nn.Module]],
        on_post_backward: Callable[[ShardedUnit], None],
        prefetch_numel: int,
        max_live_numel: int,
        max_reuse_distance: int,
        read_ahead: tuple[int, int] = (1, 0),
    ) -> None:
        self.units = units
        self.read_ahead_count, self.read_ahead_numel = read_ahead
        """NVMe parameter offload: shards read ahead of their gathers, at most this many and
        (beyond the first) this many elements (``offload_param.buffer_count`` and
        ``buffer_count x buffer_size``); see `_read_ahead`."""
        self.on_post_backward = on_post_backward
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_distance = max_reuse_distance
        self.order: list[ShardedUnit] = []
        """Units in the order the first training forward used them (one entry per use)."""
        self.recording = True
        self.peak_live_numel = 0
        self._cursor = 0
        self._bcursor = 0
        self._pos: dict[ShardedUnit, int] = {}
        """Position in `order` of each unit's current use."""
        self.gathers: list[tuple[str, int]] = []
        """(unit name, live numel after the gather): instrumentation for tests."""
        self.peak_resident_shards = 0
        """NVMe parameter offload: most swapped shards in memory after a read-ahead (tests)."""
        self._handles = []
        for unit, module in bindings:
            self._handles.append(
                module.register_forward_pre_hook(self._pre_forward_hook(unit), with_kwargs=True)
            )
            self._handles.append(
                module.register_forward_hook(self._post_forward_hook(unit), with_kwargs=True)
            )

    # --- live set -------------------------------------------------------------------------------
    def live_numel(self) -> int:
        """Elements of non-persistent units currently gathered or being gathered."""
        return sum(u.gathered_numel for u in self.units if not u.persistent)

    def _make_room(self, unit: ShardedUnit) -> None:
        for other in self.units:
            if self.live_numel() + unit.numel <= self.max_live_numel:
                return
            if other is not unit and other.in_use == 0 and other.state is UnitState.UNSHARDED:
                other.reshard()

    def _gather(self, unit: ShardedUnit, wait: bool) -> None:
        if unit.state is UnitState.SHARDED:
            self._make_room(unit)
            unit.unshard()
            live = self.live_numel()
            self.peak_live_numel = max(self.peak_live_numel, live)
            self.gathers.append((unit.name, live))
        if wait:
            unit.wait_for_unshard()

    def _prefetch(self, position: int, step: int) -> None:
        target = position + step
        if not (0 <= target < len(self.order)):
            return
        unit = self.order[target]
        self._read_ahead(target + step, step)
        if unit.state is not UnitState.SHARDED or unit.numel > self.prefetch_numel:
            return
        if self.live_numel() + unit.numel <= self.max_live_numel:
            with trace("prefetch", unit.name):
                self._gather(unit, wait=False)

    def _read_ahead(self, start: int, step: int) -> None:
        """NVMe parameter offload: starts reading the shards of the units from position `start`
        on in the recorded order (`step` is the direction), so each is in memory by the time its
        gather is issued. Shards already in memory count against the window too; a read that
        would take the elements past ``read_ahead_numel`` waits, except the first."""
        count = numel = 0
        pos = start
        while 0 <= pos < len(self.order) and count < self.read_ahead_count:
            unit = self.order[pos]
            pos += step
            size = unit.swapped_shard_numel
            if size == 0 or unit.state is not UnitState.SHARDED:
                continue  # in memory for good, or gathered (its shard is not needed now)
            if count and numel + size > self.read_ahead_numel:
                return
            unit.fetch_shard()
            count += 1
            numel += size
        if count:
            resident = sum(1 for u in self.units if u.swapped_shard_numel and u.shard_bytes)
            self.peak_resident_shards = max(self.peak_resident_shards, resident)

    def _locate(self, unit: ShardedUnit, backward: bool) -> int:
        """Position of this use of `unit` in the recorded order, advancing the cursor."""
        if backward:
            candidates = [
                k
                for k in range(min(self._bcursor, len(self.order) - 1), -1, -1)
                if self.order[k] is unit
            ]
            pos = candidates[0] if candidates else -1
            self._bcursor = pos - 1 if pos >= 0 else self._bcursor
        else:
            candidates = [k for k in range(self._cursor, len(self.order)) if self.order[k] is unit]
            pos = candidates[0] if candidates else -1
            self._cursor = pos + 1 if pos >= 0 else self._cursor
        self._pos[unit] = pos
        return pos

    def _distinct_numel(self, positions: range, unit: ShardedUnit) -> int:
        return sum(u.numel for u in {self.order[k] for k in positions} if u is not unit)

    def _reuse_distance(self, unit: ShardedUnit, backward: bool) -> int:
        """Elements other units gather before `unit` is needed again (from the recorded order:
        later in this pass, else on the way back in the other direction)."""
        pos = self._pos.get(unit, -1)
        if pos < 0:
            return 0
        n = len(self.order)
        if not backward:
            later = [k for k in range(pos + 1, n) if self.order[k] is unit]
            if later:
                return self._distinct_numel(range(pos + 1, later[0]), unit)
            return 2 * self._distinct_numel(range(pos + 1, n), unit)
        earlier = [k for k in range(pos - 1, -1, -1) if self.order[k] is unit]
        if earlier:
            return self._distinct_numel(range(earlier[0] + 1, pos), unit)
        return 2 * self._distinct_numel(range(0, pos), unit)

    def _release(self, unit: ShardedUnit, unused: bool, backward: bool) -> None:
        if unused and self._reuse_distance(unit, backward) >= self.max_reuse_distance:
            unit.reshard()

    # --- hooks ----------------------------------------------------------------------------------
    def _pre_forward_hook(self, unit: ShardedUnit) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            del module
            with trace("pre_forward", unit.name):
                self._gather(unit, wait=True)
                if _in_backward() or not torch.is_grad_enabled():
                    return None  # recomputation or evaluation: see [Note: hook flow]
                if self.recording:
                    self.order.append(unit)
                unit.begin_forward()
                self._prefetch(self._locate(unit, backward=False), +1)
                return self._wrap_inputs(unit, args, kwargs)

        return hook

    def _wrap_inputs(self, unit: ShardedUnit, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        flat, spec = tree_flatten((args, kwargs))
        slots = [k for k, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not slots:
            return None
        wrapped = _PostBackward.apply(lambda: self._post_backward(unit), *[flat[k] for k in slots])
        wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
        for k, t in zip(slots, wrapped, strict=True):
            flat[k] = t
        return tree_unflatten(flat, spec)

    def _post_forward_hook(self, unit: ShardedUnit) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
            del module, args, kwargs
            if _in_backward():
                return None
            if not torch.is_grad_enabled():
                if unit.in_use == 0:
                    unit.reshard()
                return None
            with trace("post_forward", unit.name):
                self._release(unit, unit.end_forward(), backward=False)
                tensors = [
                    t
                    for t in tree_flatten(output)[0]
                    if isinstance(t, torch.Tensor) and t.requires_grad
                ]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, lambda _: self._pre_backward(unit), mode="any"
                    )
            return None

        return hook

    def _pre_backward(self, unit: ShardedUnit) -> None:
        with trace("pre_backward", unit.name):
            if self.recording or self._bcursor < 0:
                self._bcursor = len(self.order) - 1
            self.recording = False
            self._gather(unit, wait=True)
            unit.begin_backward()
            self._prefetch(self._locate(unit, backward=True), -1)

    def _post_backward(self, unit: ShardedUnit) -> None:
        with trace("post_backward", unit.name):
            if not unit.end_backward_call():
                return
            self.on_post_backward(unit)
            self._release(unit, unit.in_use == 0, backward=True)

    def end_backward(self) -> None:
        """Finishes units whose post-backward never ran and releases everything. A unit whose
        module never ran but whose parameters got gradients (read directly inside
        `GatheredParameters`, as TRL's fused LM-head loss reads ``lm_head.weight``) is reduced
        too: its gradients would otherwise be lost."""
        for unit in self.units:
            used = unit.forward_calls > 0 or unit.grad_buffer is not None
            if not unit.reduced and (used or unit.persistent):
                self.on_post_backward(unit)
        self.reset()
        for unit in self.units:
            unit.reshard()

    def reset(self) -> None:
        """Clears per-step counters (a forward without backward, e.g. evaluation)."""
        self.recording = self.recording and not self.order
        self._cursor = 0
        self._bcursor = len(self.order) - 1
        self._pos = {}
        for unit in self.units:
            unit.finish_step()

    def remove_hooks(self) -> None:
        """Detaches the module hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []
