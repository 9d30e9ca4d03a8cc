"""ZeRO stages 1 and 2: optimizer state (and, in stage 2, gradients) sharded over ranks.

Each optimizer parameter group is laid out in one flat, padded buffer (`FlatLayout`, segments =
gradient buckets); the module's parameters become views into it, so the all-gather of updated
shards after the step writes straight into the module. Each rank keeps an fp32 master copy of
its shard and an fp32 gradient shard, and an ordinary `torch.optim` optimizer steps one flat
shard tensor per group (per-group hyperparameters carry over unchanged). Gradients exist from
the first backward after a step until the step is over ([Note: released gradients]).

[Note: quantized all-gather of stages 1-2]
With ``zero_quantized_weights`` (ZeRO++'s qwZ, which DeepSpeed applies to stage 3 only) the
all-gather of the updated weights after each step moves every rank's chunk as int8 blocks with
an fp32 scale each (`partita.zero.stage3.gather.gather_segment`, [Note: ZeRO++ gathers]): a
quarter of fp32's bytes, half of bf16's, on the one collective of stages 1-2 that carries
weights. Every rank, this one included, takes the dequantized values, so the replicas'
weights stay equal; the fp32 master shards and the optimizer state never see them, so the
error does not accumulate across steps (each step quantizes the exact masters afresh). Gathers
for anything else (after loading a checkpoint, `refresh_params`) stay exact.
"""

from __future__ import annotations

from typing import Any

import torch

from partita import comm
from partita.offload.placement import Placement
from partita.partition import FlatLayout, plan_buckets, segment_views
from partita.platform.accelerator import pin_if
from partita.precision import PrecisionPolicy
from partita.zero.reduction import ReduceScaling
from partita.zero.released_grads import ensure_grad, held_bytes
from partita.zero.shard_step import (
    COPY_SLICE_NUMEL,
    HostStep,
    TensorParallelNorm,
    host_step,
    sharded_step,
)
from partita.zero.sharded_grads import ShardedGradients
from partita.zero.stage3.gather import TRAINING, gather_segment
from partita.zero.state_access import ParamSlot, ParamStates
from partita.zero.strategy import (
    ExpertFamily,
    OptimizerFactory,
    ParamGroups,
    StepOutcome,
    optimizer_state_bytes,
)


class ShardedGroup:
    """One parameter group: its layout, flat parameter buffer and this rank's fp32 shards."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        bucket_numel: int,
        world: int,
        rank: int,
        master_dtype: torch.dtype,
        placement: Placement | None = None,
        group: comm.ProcessGroup | None = None,
    ) -> None:
        self.params = params
        self.process_group = group
        """The data-parallel group the shards are cut over (`rank` and `world` are in it)."""
        numels = [p.numel() for p in params]
        order = list(reversed(range(len(params))))
        buckets = [b.indices for b in plan_buckets(numels, bucket_numel, order=order)]
        self.layout = FlatLayout.build(numels, world, buckets=buckets)
        self.rank = rank
        device, dtype = params[0].device, params[0].dtype
        self.flat_param = torch.zeros(self.layout.padded_numel, dtype=dtype, device=device)
        with torch.no_grad():
            for p, off in zip(params, self.layout.offsets, strict=True):
                view = self.flat_param[off : off + p.numel()].view_as(p)
                view.copy_(p.detach())
                p.data = view
        # Under optimizer offload the master and its gradient live on the host (page-locked on
        # GPU machines with offload_optimizer.pin_memory); the algorithm is the same, only
        # copies cross devices.
        placement = placement or Placement()
        where, pin = placement.device or device, placement.pin_memory
        master = torch.empty(self.layout.shard_numel, dtype=master_dtype, device=where)
        self.master = torch.nn.Parameter(pin_if(pin, master))
        self._pin = pin
        with torch.no_grad():
            for seg in range(len(self.layout.segments)):
                v = segment_views(self.flat_param, self.master, self.layout, seg, rank)
                v.shard.copy_(self._own_chunk(v.full))

    def weight_targets(self) -> list[tuple[int, torch.Tensor]]:
        """(offset in the master shard, view of this rank's chunk of the flat parameters) per
        segment: where the updated master goes."""
        out = []
        for seg in range(len(self.layout.segments)):
            v = segment_views(self.flat_param, self.master, self.layout, seg, self.rank)
            if v.shard.numel():
                out.append((self.layout.segments[seg].shard_offset, self._own_chunk(v.full)))
        return out

    def _own_chunk(self, full: torch.Tensor) -> torch.Tensor:
        chunk = full.numel() // self.layout.world_size
        return full[self.rank * chunk : (self.rank + 1) * chunk]

    def shard_grad(self) -> torch.Tensor:
        """This rank's fp32 gradient shard, made (zeroed; page-locked where the master is) when
        it was released."""
        return ensure_grad(self.master, self._pin)

    @property
    def shard_grad_bytes(self) -> int:
        """Bytes of the fp32 gradient shard while it exists."""
        return self.master.numel() * self.master.element_size()

    def all_gather_params(
        self, handles: list[Any], cast: bool = True, block: int | None = None
    ) -> None:
        """Casts the updated master shard into the flat parameters (unless the step did:
        ``cast=False``) and starts the all-gathers: exact, or with `block` as int8 blocks of
        that many elements dequantized on arrival, into every rank's copy alike (qwZ, [Note:
        quantized all-gather of stages 1-2])."""
        with torch.no_grad():
            for seg in range(len(self.layout.segments)):
                v = segment_views(self.flat_param, self.master, self.layout, seg, self.rank)
                if v.full.numel() == 0:
                    continue
                own = self._own_chunk(v.full)
                if cast:
                    own.copy_(v.shard)
                if block is not None:  # packed at once: the dequantized rows overwrite `own`
                    world = self.layout.world_size
                    handles.append(
                        gather_segment(v.full, own, self.process_group, world, block, TRAINING)
                    )
                    continue
                # In place: the input is this rank's chunk of the output (gloo and NCCL allow it).
                handle = comm.all_gather(
                    v.full, own, group=self.process_group, async_op=True, tag="param"
                )
                if handle is not None:
                    handles.append(handle)


class Sharded:
    """Stage 1 (`stage=1`) and stage 2 (`stage=2`) strategy (see `Strategy`).

    `group` is what the shards are cut over; `replicas`, under hybrid sharding, the ranks that
    hold the same shards ([Note: hybrid sharding] in `partita.comm.dims`): gradient shards are
    summed across it after the reduce-scatter, and nothing else crosses it. The norm and the
    all-gather stay in `group` (replicas hold equal shards: summing across them would count
    each square once per replica)."""

    def __init__(
        self,
        stage: int,
        groups: ParamGroups,
        policy: PrecisionPolicy,
        make_optimizer: OptimizerFactory,
        bucket_numel: int,
        scaling: ReduceScaling,
        group: comm.ProcessGroup | None = None,
        placement: Placement | None = None,
        sub_group_numel: int = COPY_SLICE_NUMEL,
        tensor: TensorParallelNorm | None = None,
        replicas: comm.ProcessGroup | None = None,
        experts: ExpertFamily | None = None,
        quantize_block: int | None = None,
    ) -> None:
        self.stage = stage
        self.quantize_block = quantize_block
        """qwZ: the step's all-gather moves int8 blocks of this many elements ([Note:
        quantized all-gather of stages 1-2]); None: exact."""
        group_of = expert_group_of(groups, group, experts)
        dtype = policy.master_dtype
        self.groups = [
            ShardedGroup(
                g, bucket_numel, comm.get_world_size(pg), comm.get_rank(pg), dtype, placement, pg
            )
            for g, pg in zip(groups, group_of, strict=True)
        ]
        rank = comm.get_rank(group)
        self.comm_device = groups[0][0].device if groups and groups[0] else torch.device("cpu")
        self.grads = ShardedGradients(
            layouts=[g.layout for g in self.groups],
            params=[g.params for g in self.groups],
            shard_grad=lambda i: self.groups[i].shard_grad(),
            persistent=stage == 1,
            scaling=scaling,
            reduce_dtype=policy.reduce_dtype,
            rank=rank,
            group=group,
            replicas=replicas,
            group_of=None if experts is None else group_of,
        )
        self.process_group = group
        self.optimizer = make_optimizer([[g.master] for g in self.groups])
        self.state = ParamStates(FlatShardLayout(self))
        """State access for accessors and checkpoints (see `partita.zero.state_access`)."""
        self.tensor = None if tensor is None else tensor.bind(self.state.layout)
        """With tensor parallelism, the norm's tensor group ([Note: norms over tensor ranks])."""
        # Masters on the host (optimizer offload, CPU training): the step writes the updated
        # weights slice by slice (see `step_with_copy_back`).
        self._host_step: HostStep | None = None
        if self.groups and self.groups[0].master.device.type == "cpu":
            masters = [g.master for g in self.groups]
            targets = [g.weight_targets() for g in self.groups]
            self._host_step = host_step(self.optimizer, masters, targets, sub_group_numel)

    def begin_backward(self, sync: bool) -> None:
        """Stage 1 reduces in the boundary backward only; stage 2 in every backward."""
        self.grads.begin_backward(sync or self.stage >= 2)

    def end_backward(self) -> None:
        """Finishes this backward's reduce-scatters."""
        self.grads.end_backward()

    def absorb_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Gradients autograd did not accumulate join their buckets (see `Strategy`)."""
        self.grads.absorb(params)

    def hold_gradients(self, params: list[torch.Tensor]) -> None:
        """Stage 2 in a pipeline: `params`' gradients wait for `flush_held` (see
        `ShardedGradients.hold`)."""
        self.grads.hold(params)

    def held_grad(self, p: torch.Tensor) -> torch.Tensor:
        """`p`'s gradient accumulated so far (a held parameter)."""
        return self.grads.held_grad(p)

    def flush_held(self) -> None:
        """Reduces the held gradients."""
        self.grads.flush_held()

    def step(self, clip: float, loss_scale: float) -> StepOutcome:
        """Unscale, global norm (one scalar all-reduce), clip, step the shards, all-gather."""
        for g in self.groups:  # zeros where no backward ran since the last step
            g.shard_grad()
        masters = [g.master for g in self.groups]
        run = self._host_step
        outcome = sharded_step(
            masters, self.optimizer, clip, loss_scale, self.process_group, self.comm_device, run,
            tensor=self.tensor,
        )  # fmt: skip
        if not outcome.applied:
            return outcome
        self._all_gather(cast=run is None, block=self.quantize_block)
        return outcome

    def zero_grad(self) -> None:
        """Releases full (stage 1) and sharded gradients ([Note: released gradients])."""
        self.grads.release()
        for g in self.groups:
            g.master.grad = None

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held per category on this rank: ``grads`` while gradients exist (during a
        step), ``grads_held`` now."""
        shard_grad = sum(g.shard_grad_bytes for g in self.groups)
        held = held_bytes(g.master.grad for g in self.groups)
        return {
            "params": sum(g.flat_param.numel() * g.flat_param.element_size() for g in self.groups),
            "grads": shard_grad + self.grads.persistent_bytes,
            "grads_held": held + self.grads.persistent_held_bytes,
            "master_params": sum(g.master.numel() * g.master.element_size() for g in self.groups),
            "optimizer_state": optimizer_state_bytes(self.optimizer),
            "comm_buffers": self.grads.peak_transient_bytes
            + (0 if self._host_step is None else self._host_step.sink.nbytes),
            "comm_buffers_held": self.grads.pool_held_bytes,
        }

    def close(self) -> None:
        """Removes the gradient hooks."""
        self.grads.remove_hooks()

    def refresh_params(self) -> None:
        """All-gathers the master shards into the module's parameters (after loading state)."""
        self._all_gather(cast=True)

    def _all_gather(self, cast: bool, block: int | None = None) -> None:
        handles: list[Any] = []
        for g in self.groups:
            g.all_gather_params(handles, cast, block)
        for h in handles:
            h.wait()


def expert_group_of(
    groups: ParamGroups, group: comm.ProcessGroup | None, experts: ExpertFamily | None
) -> list[comm.ProcessGroup | None]:
    """The process group each parameter group's shards are cut over: `group`, or for a group
    of expert parameters the expert-data-parallel group ([Note: expert parallelism] in
    `partita.comm.dims`). The sum of squares over `group` still counts every element once:
    each expert-data-parallel group holds different experts. A group mixing both kinds
    cannot be cut one way and raises, naming the helper that splits groups."""
    if experts is None:
        return [group] * len(groups)
    out: list[comm.ProcessGroup | None] = []
    for i, g in enumerate(groups):
        dense, expert = experts.split(g)
        if dense and expert:
            raise ValueError(
                f"optimizer parameter group {i} holds both expert and dense parameters "
                f"({len(expert)} and {len(dense)}); ZeRO stages 1-2 shard them over different "
                "groups: split them with deepspeed.moe.utils."
                "split_params_into_different_moe_groups_for_optimizer"
            )
        out.append(experts.group if expert else group)
    return out


class FlatShardLayout:
    """The state layout of stages 1-2: a parameter's elements on this rank are pieces of its
    group's flat master shard (`FlatLayout.shard_pieces`)."""

    replicated = False
    shards_params = False

    def __init__(self, strategy: Sharded) -> None:
        self.optimizer = strategy.optimizer
        self.process_group = strategy.process_group
        self._refresh = strategy.refresh_params
        self._slots: dict[torch.Tensor, ParamSlot] = {}
        for g in strategy.groups:
            ranges: list[list[tuple[int, int, int]]] = [[] for _ in g.params]
            for pc in g.layout.shard_pieces(g.rank):
                ranges[pc.index].append((pc.param_offset, pc.shard_offset, pc.length))
            own = g.process_group is not strategy.process_group  # an expert group
            for p, r in zip(g.params, ranges, strict=True):
                self._slots[p] = ParamSlot(
                    p.shape, r, g.master, home=g, group=g.process_group, own_group=own
                )

    def slot(self, param: torch.Tensor) -> ParamSlot | None:
        """The slot of a parameter this strategy trains."""
        return self._slots.get(param)

    def source(self, slot: ParamSlot, what: str) -> torch.Tensor | None:
        """The group's master shard, its gradient shard, or its optimizer state."""
        group: ShardedGroup = slot.home
        if what == "param":
            return group.master
        if what == "grad":
            return group.master.grad  # None between the step and the next backward
        return self.optimizer.state.get(group.master, {}).get(what)

    def after_write(
        self, param: torch.Tensor, slot: ParamSlot, what: str, full: torch.Tensor | None
    ) -> None:
        """A whole new value goes into the module weight at once; a local one follows at the
        next all-gather (`refresh_params` forces one)."""
        del slot
        if what == "param" and full is not None:
            param.data.copy_(full.view_as(param))

    def refresh_params(self) -> None:
        """All-gathers the master shards into the module's parameters."""
        self._refresh()
