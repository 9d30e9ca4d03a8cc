"""ZeRO stage 3: parameters, gradients and optimizer state all sharded over ranks.

Parameters are grouped into units (by default each child of the model's `nn.ModuleList`s, e.g.
each transformer block, plus a root unit for the rest); parameters smaller than
``stage3_param_persistence_threshold`` stay gathered in one persistent unit that behaves like
ZeRO-2 (sharded gradients and optimizer state, all-gathered after the step). The optimizer
steps one fp32 master chunk per (unit, optimizer group) segment.

[Note: experts at stage 3]
With mixture-of-experts layers ([Note: expert parallelism] in `partita.comm.dims`) each unit
holding expert parameters is cut in two: its dense part, sharded over the data-parallel group as
ever, and ``<unit>/experts``, sharded over the expert-data-parallel group (the ranks holding the
same experts): its gathers and gradient reduce-scatters stay inside that group, and its
gradients, summed there, are divided by the whole data-parallel size like every other (the
reducer's scaling), as DeepSpeed's rule for experts. Both parts are bound to the same modules,
so one forward gathers both. Expert parameters are never persistent (the persistent unit is cut
over the data-parallel group). The norm and the overflow check still sum over the data-parallel
group: each expert element lives on exactly one rank of its expert-data-parallel group, and the
groups at other expert-parallel places hold other experts, so every element counts once.
`GatheredParameters(modifier_rank=r)` broadcasts an expert unit over its own group
(`modifier_group_of`). ZeRO++ (hpZ, qwZ, qgZ) with experts is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from partita import comm
from partita.config.errors import config_error
from partita.offload.copy_back import CopyBack
from partita.offload.placement import OffloadPlacement
from partita.optim.cpu_adam import CPUAdam, CPUAdamW, Slice
from partita.partition import plan_buckets
from partita.precision import PrecisionPolicy
from partita.zero.init import full_value, hand_back
from partita.zero.reduction import ReduceScaling
from partita.zero.released_grads import ensure_grad, held_bytes, release_grads
from partita.zero.shard_step import HostStep, TensorParallelNorm, host_step, sharded_step
from partita.zero.stage3.gather import (
    EXACT,
    GatherPlan,
    plan_from_config,
    reduce_groups_from_config,
)
from partita.zero.stage3.grads import UnitGradReducer
from partita.zero.stage3.identity import END, GATHER, DivergenceCheck
from partita.zero.stage3.leaves import declared_leaves, leaf_groups
from partita.zero.stage3.nvme import SwappedOptimizerState
from partita.zero.stage3.schedule import UnitScheduler
from partita.zero.stage3.settings import Stage3Settings
from partita.zero.stage3.state import UnitShardLayout
from partita.zero.stage3.unit import SegmentInfo, ShardedUnit, trace
from partita.zero.state_access import ParamStates
from partita.zero.strategy import (
    ExpertFamily,
    OptimizerFactory,
    ParamGroups,
    StepOutcome,
    optimizer_state_bytes,
)


def default_unit_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each child of every outermost `nn.ModuleList` (transformer blocks, typically)."""
    found: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            if isinstance(child, torch.nn.ModuleList):
                found.extend(child)
            else:
                visit(child)

    visit(model)
    return found


UnitPlan = list[tuple[str, torch.nn.Module, list[torch.nn.Parameter]]]


def split_sub_groups(
    params: list[torch.nn.Parameter], max_numel: int
) -> list[list[torch.nn.Parameter]]:
    """Consecutive runs of `params` of at most `max_numel` elements each (``sub_group_size``
    times the world size: each rank's share of a run is at most ``sub_group_size``). A
    parameter is never split; one larger than the limit is a run of its own."""
    plan = plan_buckets([p.numel() for p in params], max_numel)
    return [[params[i] for i in bucket.indices] for bucket in plan]


def plan_units(
    model: torch.nn.Module,
    blocks: Sequence[torch.nn.Module],
    threshold: int,
    leaves: Sequence[torch.nn.Module] = (),
    sharded: Collection[torch.nn.Parameter] = (),
) -> tuple[UnitPlan, list[torch.nn.Parameter]]:
    """(name, module, parameters) of each unit — each block, then each parent of declared
    conditional modules (`leaves`: its own parameters and theirs, see [Note: conditional
    modules]), then one unit per other module owning parameters directly — and the parameters
    below `threshold` elements, which stay gathered (persistent), but for those in `sharded`
    (expert parameters: their group is not the persistent unit's)."""
    assigned: set[torch.nn.Parameter] = set()
    plan: UnitPlan = []
    names = {id(m): n for n, m in model.named_modules()}
    keep = frozenset(sharded)

    def take(m: torch.nn.Module, params: Any) -> None:
        mine = [p for p in params if p not in assigned and (p.numel() >= threshold or p in keep)]
        assigned.update(mine)
        if mine:
            plan.append((names[id(m)] or "root", m, mine))

    for m in blocks:
        take(m, m.parameters())
    for _, parent, kids in leaf_groups(model, list(leaves)):
        own = list(parent.parameters(recurse=False))
        take(parent, own + [p for kid in kids for p in kid.parameters()])
    for m in model.modules():
        take(m, m.parameters(recurse=False))
    return plan, [p for p in model.parameters() if p not in assigned]


def _binding_modules(
    unit_module: torch.nn.Module,
    root: torch.nn.Module,
    params: list[torch.nn.Parameter],
    blocks: list[torch.nn.Module],
) -> list[torch.nn.Module]:
    """Modules whose forward must gather a unit: a block unit's block; for any other unit,
    every module that directly owns one of its parameters (a tied weight is gathered by each
    module using it, and entry points such as Hugging Face's ``generate`` on an inner model
    still gather what they touch)."""
    if any(unit_module is b for b in blocks):
        return [unit_module]
    owned = {id(p) for p in params}
    return [m for m in root.modules() if any(id(p) in owned for p in m.parameters(recurse=False))]


def _plan(
    model: torch.nn.Module,
    blocks: list[torch.nn.Module],
    zero: Stage3Settings,
    experts: ExpertFamily | None,
) -> tuple[UnitPlan, list[torch.nn.Parameter]]:
    """`plan_units` with the conditional modules the model and ``zero.leaf_module`` declare;
    their parents join `blocks` (in place): a parent's own forward gathers its unit whole.
    Each unit holding expert parameters is cut in two, the experts' part named
    ``<unit>/experts`` ([Note: experts at stage 3])."""
    leaves = declared_leaves(model, zero.leaf_module)
    # Frozen expert parameters too: they differ across expert-parallel ranks, so they must be
    # cut over the expert-data-parallel group with the trained ones, never over every rank.
    own = frozenset() if experts is None else experts.all_params
    units, persistent = plan_units(model, blocks, zero.param_persistence_threshold, leaves, own)
    blocks += [parent for _, parent, _ in leaf_groups(model, leaves)]
    if not own:
        return units, persistent
    plan: UnitPlan = []
    for name, m, params in units:
        dense = [p for p in params if p not in own]
        expert = [p for p in params if p in own]
        plan += [(name, m, dense)] if dense else []
        plan += [(f"{name}/experts", m, expert)] if expert else []
    return plan, persistent


@dataclass
class _UnitFactory:
    """Builds the units of one strategy from the settings they all share."""

    group_of: dict[torch.nn.Parameter, int]
    n_groups: int
    world: int
    rank: int
    policy: PrecisionPolicy
    placement: OffloadPlacement
    sub_group_numel: int
    """Most elements of one segment (``sub_group_size`` x world size)."""
    shards_in_cpu: int = 0
    """NVMe parameter offload: shard elements (per rank) still to keep in CPU memory instead
    (``offload_param.max_in_cpu``); units take from it in build order while their shard fits."""
    group: comm.ProcessGroup | None = None
    """The data-parallel group the units are sharded over (`world` and `rank` are in it)."""
    gather_plan: GatherPlan = EXACT
    """How training gathers move the units' segments (ZeRO++: [Note: ZeRO++ gathers])."""

    def __call__(
        self, name: str, params: list[torch.nn.Parameter], persistent: bool
    ) -> ShardedUnit:
        """A unit of `params`: one segment per sub-group of each optimizer group, then one for
        the frozen parameters."""
        by_group: list[list[torch.nn.Parameter]] = [[] for _ in range(self.n_groups)]
        frozen = []
        for p in params:
            if p in self.group_of:
                by_group[self.group_of[p]].append(p)
            else:
                frozen.append(p)
        segments: list[tuple[int | None, list[torch.nn.Parameter]]] = [
            (g, run)
            for g, ps in enumerate(by_group)
            for run in split_sub_groups(ps, self.sub_group_numel)
        ]
        if frozen:
            segments.append((None, frozen))
        infos = [SegmentInfo(i, g, ps) for i, (g, ps) in enumerate(segments)]
        opt, par = self.placement.optimizer, self.placement.params
        shard_space = par.swap
        shard_numel = -(-sum(p.numel() for p in params) // self.world)
        if shard_space is not None and not persistent and shard_numel <= self.shards_in_cpu:
            self.shards_in_cpu -= shard_numel
            shard_space = None
        return ShardedUnit(
            name,
            infos,
            self.world,
            self.rank,
            self.policy.master_dtype,
            persistent=persistent,
            source=full_value,
            state_device=opt.device,
            shard_device=par.device,
            alias_masters=self.placement.masters_alias_shards,
            shard_space=shard_space,
            # Swapped masters and shards live in the swap buffers, not in these tensors.
            pin_memory=(opt.pin_memory and opt.in_memory, par.pin_memory and shard_space is None),
            group=self.group,
            gather_plan=self.gather_plan,
        )


def _factories(
    groups: ParamGroups,
    policy: PrecisionPolicy,
    placement: OffloadPlacement,
    zero: Stage3Settings,
    group: comm.ProcessGroup | None,
    gather_plan: GatherPlan,
    experts: ExpertFamily | None,
) -> dict[bool, _UnitFactory]:
    """The unit factories by "holds experts": units over `group`, expert units over the
    expert-data-parallel group ([Note: experts at stage 3])."""
    world, rank = comm.get_world_size(group), comm.get_rank(group)
    group_of = {p: gi for gi, g in enumerate(groups) for p in g}
    # A sub-group (one master, stepped and swapped as a whole) holds at most
    # sub_group_size elements per rank.
    build = _UnitFactory(
        group_of, len(groups), world, rank, policy, placement,
        zero.sub_group_size * world, placement.params.max_in_cpu, group, gather_plan,
    )  # fmt: skip
    return {False: build, True: _expert_factory(build, experts, zero)}


def _expert_factory(
    dense: _UnitFactory, experts: ExpertFamily | None, zero: Stage3Settings
) -> _UnitFactory:
    """The factory of expert units: `dense`'s settings over the expert-data-parallel group
    ([Note: experts at stage 3]); `dense` itself without experts."""
    if experts is None:
        return dense
    if zero.hpz_partition_size > 1 or zero.quantized_weights or zero.quantized_gradients:
        raise config_error(
            "zero_optimization",
            "ZeRO++ (zero_hpz_partition_size, zero_quantized_weights/gradients) together with "
            "MoE layers at stage 3 is not supported by partita yet",
        )
    world, rank = comm.get_world_size(experts.group), comm.get_rank(experts.group)
    return dataclasses.replace(
        dense, world=world, rank=rank, group=experts.group,
        sub_group_numel=zero.sub_group_size * world, gather_plan=EXACT,
    )  # fmt: skip


class FullySharded:
    """Stage 3 strategy (see `partita.zero.strategy.Strategy`)."""

    def __init__(
        self,
        module: torch.nn.Module,
        groups: ParamGroups,
        policy: PrecisionPolicy,
        make_optimizer: OptimizerFactory,
        zero: Stage3Settings,
        scaling: ReduceScaling,
        unit_modules: Sequence[torch.nn.Module] | None = None,
        group: comm.ProcessGroup | None = None,
        placement: OffloadPlacement | None = None,
        tensor: TensorParallelNorm | None = None,
        replicas: comm.ProcessGroup | None = None,
        holders: comm.ProcessGroup | None = None,
        experts: ExpertFamily | None = None,
    ) -> None:
        # Hybrid sharding: units are cut over `group` (the shard group) and every gradient
        # chunk is summed across `replicas` ([Note: hybrid sharding] in `partita.comm.dims`);
        # gathers, norms and overflow checks stay inside `group`, which holds every shard.
        self.process_group = group
        self.modifier_group = holders if replicas is not None else group
        """Every rank holding these parameters (`holders`, the whole data-parallel group, when
        hybrid; None: the default group): `GatheredParameters(modifier_rank=r)` broadcasts rank
        r's values over it, so that every replica takes them (`modifier_group_of`)."""
        self.placement = placement = placement or OffloadPlacement()
        """Where masters with optimizer state, and parameter shards, live (chosen once)."""
        self.comm_device = next(module.parameters()).device
        modules = list(unit_modules) if unit_modules is not None else default_unit_modules(module)
        plan, persistent = _plan(module, modules, zero, experts)
        gather_plan = plan_from_config(zero, group)  # ZeRO++ ([Note: ZeRO++ gathers])
        factories = _factories(groups, policy, placement, zero, group, gather_plan, experts)
        self._experts = experts
        opt = placement.optimizer
        self.swapped = None if opt.swap is None else SwappedOptimizerState(opt.swap, opt.pipeline)
        bindings = self._build_units(factories, plan, persistent, module, modules)
        self.divergence = self._check_divergence(group, zero.check_divergence)
        """Identities of the units' collectives, checked across ranks ([Note: rank
        divergence])."""
        if opt.where == "host" and opt.ratio < 1.0:
            self._keep_masters_on_device(opt.ratio)
        bucket = zero.reduce_bucket_size  # gradient elements in reduce-scatters at once
        self.reducer = UnitGradReducer(
            scaling, policy.reduce_dtype, max_in_flight_numel=bucket,
            quantized=reduce_groups_from_config(zero, gather_plan), replicas=replicas,
        )  # fmt: skip
        self.scheduler = UnitScheduler(
            self.units, bindings, self._reduce_unit,
            prefetch_numel=zero.prefetch_bucket_size,
            max_live_numel=zero.max_live_parameters,
            max_reuse_distance=zero.max_reuse_distance,
            read_ahead=placement.params.read_ahead,
        )  # fmt: skip
        self._where = {p: (unit, i) for unit in self.all_units for i, p in enumerate(unit.params)}
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad)
            for unit in self.all_units
            for seg in unit.segments
            if seg.group is not None
            for p in seg.params
        ]
        self.optimizer = make_optimizer(self._masters_by_group(len(groups)))
        self._index_masters()
        if self.swapped is not None:
            self.swapped.bind(self.optimizer)
            self.reducer.sink = self._add_swapped_grad
        self._host_step = self._make_host_step(zero.sub_group_size)
        self._choose_step()
        if self.swapped is None:  # made by the first reduction: [Note: released gradients]
            release_grads(self._masters())
        self._state_layout = UnitShardLayout(
            self.all_units, self.optimizer, self.swapped, self._master_index, group,
            self.refresh_params,
        )  # fmt: skip
        self.state = ParamStates(self._state_layout, gatherer=self)
        """State access for accessors and checkpoints (see `partita.zero.state_access`)."""
        self.tensor = None if tensor is None else tensor.bind(self._state_layout)
        """With tensor parallelism, the norm's tensor group ([Note: norms over tensor ranks])."""

    def _check_divergence(self, group: comm.ProcessGroup | None, enabled: bool) -> DivergenceCheck:
        """The cross-rank identity check every unit's collectives go through."""
        check = DivergenceCheck([u.name for u in self.all_units], group, enabled)
        for index, unit in enumerate(self.all_units):
            unit.index, unit.divergence = index, check
        check.fulfil = self._pass_collective
        return check

    def _pass_collective(self, what: int, index: int) -> list[comm.Work]:
        """Issues unit `index`'s gather (`what` GATHER) or gradient reduce-scatter without
        using it: see [Note: identity windows]."""
        unit = self.all_units[index]
        return unit.pass_gather() if what == GATHER else self.reducer.pass_reduce(unit)

    def _index_masters(self) -> None:
        """Where each master sits in the optimizer, which unit it belongs to, and after which
        master a unit's shard is complete."""
        self._master_index = {id(m): i for i, m in enumerate(self._masters())}
        self._master_home = [(u, idx) for u in self.all_units for idx in u.masters]
        # A unit's masters are consecutive: its shard is written back after the last of them.
        self._unit_done = {
            i for i, (u, _) in enumerate(self._master_home)
            if i + 1 == len(self._master_home) or self._master_home[i + 1][0] is not u
        }  # fmt: skip

    def _make_host_step(self, sub_group_size: int) -> HostStep | None:
        """Masters on the host that are copies of shards in memory (optimizer offload to CPU,
        16-bit CPU training): the step writes each sub-group into its shard as it goes (see
        `step_with_copy_back`). Swapped state or shards keep the per-sub-group path of
        `SwappedOptimizerState`; masters that are their shards need no copy."""
        homes = self._master_home
        if not self.placement.masters_alias_shards or not homes:
            return None
        chunks = [u.shard_chunk(idx) for u, idx in homes]
        masters = [u.masters[idx] for u, idx in homes]
        if any(
            m.device.type != "cpu" or m.data_ptr() == c.data_ptr()
            for m, c in zip(masters, chunks, strict=True)
        ):
            return None
        return host_step(self.optimizer, masters, [[(0, c)] for c in chunks], sub_group_size)

    def _build_units(
        self,
        factories: dict[bool, _UnitFactory],
        plan: UnitPlan,
        persistent: list[torch.nn.Parameter],
        module: torch.nn.Module,
        modules: list[torch.nn.Module],
    ) -> list[tuple[ShardedUnit, torch.nn.Module]]:
        """Builds the units of `plan` (and the persistent one), handing each unit's masters to
        the swapped state as soon as it exists; returns (unit, module) hook bindings."""
        self.units: list[ShardedUnit] = []
        bindings: list[tuple[ShardedUnit, torch.nn.Module]] = []
        expert = frozenset() if self._experts is None else self._experts.all_params
        for name, m, params in plan:
            unit = factories[params[0] in expert](name, params, persistent=False)
            self.units.append(unit)
            if self.swapped is not None:
                self.swapped.add(list(unit.masters.values()))
            bindings.extend((unit, b) for b in _binding_modules(m, module, params, modules))
        build = factories[False]
        self.persistent = build("persistent", persistent, persistent=True) if persistent else None
        if self.swapped is not None and self.persistent is not None:
            self.swapped.add(list(self.persistent.masters.values()))
        self.all_units = self.units + ([self.persistent] if self.persistent else [])
        return bindings

    def _keep_masters_on_device(self, ratio: float) -> None:
        """Partial optimizer offload (``offload_optimizer.ratio``, as DeepSpeed splits it):
        of the n sub-group masters in build order, the first int((1 - ratio) * n) move to the
        compute device and are stepped there; the rest stay on the host."""
        homes = [(u, idx) for u in self.all_units for idx in u.masters]
        self.masters_on_device = int((1.0 - ratio) * len(homes))
        for unit, idx in homes[: self.masters_on_device]:
            unit.move_master(idx, self.comm_device)

    masters_on_device = 0
    """Sub-group masters kept with the compute under partial optimizer offload."""

    def _masters_by_group(self, n_groups: int) -> list[list[torch.Tensor]]:
        """Each optimizer group's master tensors (one per unit segment of that group)."""
        per_group: list[list[torch.Tensor]] = [[] for _ in range(n_groups)]
        for unit in self.all_units:
            for seg in unit.segments:
                if seg.group is not None:
                    per_group[seg.group].append(unit.masters[seg.index])
        return per_group

    def _add_swapped_grad(self, unit: ShardedUnit, seg: int, value: torch.Tensor) -> None:
        assert self.swapped is not None
        self.swapped.add_grad(self._master_index[id(unit.masters[seg])], value)

    _held: tuple[ShardedUnit, ...] = ()
    """Units whose reduction waits for `flush_held` (a pipeline's tied weights)."""

    def _reduce_unit(self, unit: ShardedUnit) -> None:
        """Reduces `unit` when its backward is over, unless it is held."""
        if not any(unit is u for u in self._held):
            self.reducer.reduce(unit)

    def hold_gradients(self, params: list[torch.Tensor]) -> None:
        """A pipeline's tied weights: the units holding `params` keep accumulating their
        gradients over the micro-batches, reduced only by `flush_held` (after the tied sum over
        the stages, [Note: pipeline engine]); the same on every rank of the group."""
        ids = {id(self._where[p][0]) for p in params}  # type: ignore[index]
        self._held = tuple(u for u in self.all_units if id(u) in ids)

    def held_grad(self, p: torch.Tensor) -> torch.Tensor:
        """`p`'s gradient accumulated so far (zeros when none arrived), a view into its held
        unit's gradient buffer."""
        unit, i = self._where[p]  # type: ignore[index]
        return self.reducer.grad_region(unit, i, p)

    def flush_held(self) -> None:
        """Reduces the held units (in unit order) and finishes every reduction."""
        for unit in self._held:
            self.reducer.reduce(unit)
        self.reducer.finish()

    def absorb_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Gradients autograd did not accumulate join their units' buffers (see
        `partita.zero.strategy.Strategy.absorb_grads`)."""
        for p in params:
            if p.grad is not None and p in self._where:
                self._on_grad(p)

    def _on_grad(self, p: torch.Tensor) -> None:
        unit, i = self._where[p]  # type: ignore[index]
        if p.grad is not None:
            self.reducer.accumulate(unit, i, p.grad)
            p.grad = None

    # --- Strategy -------------------------------------------------------------------------------
    def begin_backward(self, sync: bool) -> None:
        """Stage 3 reduces every backward (gradients are only kept sharded)."""
        del sync

    def end_backward(self) -> None:
        """Reduces what the hooks did not, finishes reductions, releases every unit."""
        with trace("end_backward"):
            self.scheduler.end_backward()
            if self.persistent is not None:
                self._reduce_unit(self.persistent)
            # A rank done with this backward meets any rank still gathering: [Note: rank
            # divergence].
            self.divergence.check(END)
            self.reducer.finish()

    def _masters(self) -> list[torch.nn.Parameter]:
        return [m for u in self.all_units for m in u.masters.values()]

    def step(self, clip: float, loss_scale: float) -> StepOutcome:
        """Unscale, global norm (one scalar all-reduce), clip, step, refresh the shards."""
        if self.swapped is None:  # zeros where no backward ran since the last step
            for m in self._masters():
                ensure_grad(m)
        outcome = self._run_step(clip, loss_scale)
        if outcome.applied:
            for unit in self.all_units:  # hpZ's secondary copies are stale now
                unit.parameters_changed()
            self._after_step()
        else:
            self.reducer.step_skipped()
        self.divergence.next_step()
        return outcome

    def _choose_step(self) -> None:
        """Picks the step for this placement once: masters swapped sub-group by sub-group
        (NVMe), or all in memory; after it, the shards are refreshed from the masters unless
        the step already wrote them sub-group by sub-group (then only persistent units are
        re-gathered)."""
        swapped = self.swapped
        self._run_step: Callable[[float, float], StepOutcome]
        if swapped is None:
            self._run_step = lambda clip, scale: sharded_step(
                self._masters(), self.optimizer, clip, scale, self.process_group,
                self.comm_device, self._host_step, tensor=self.tensor,
            )  # fmt: skip
        else:
            self._run_step = lambda clip, scale: swapped.step(
                self._step_one, clip, scale, self.process_group, self.comm_device, self.tensor
            )
        copied = swapped is not None or self._host_step is not None
        self._after_step = self._regather_persistent if copied else self.refresh_params

    def _regather_persistent(self) -> None:
        for unit in self.all_units:
            unit.regather_if_persistent()

    def _step_one(self, i: int) -> None:
        """Steps master i alone, then casts it into its unit's shard (resident until the
        unit's last master is done). partita's CPU Adam steps it by itself and writes a shard
        in host memory in the same pass; other optimizers step with the other masters'
        gradients hidden (they skip parameters without one), then the cast follows."""
        unit, idx = self._master_home[i]
        master = unit.masters[idx]
        if isinstance(self.optimizer, CPUAdamW | CPUAdam):
            unit.ensure_shard()
            chunk = unit.shard_chunk(idx)
            if chunk.is_cpu and chunk.data_ptr() != master.data_ptr():
                plan = [[Slice(master, 0, master.numel())]]
                if self.optimizer.step_planned(plan, CopyBack([[chunk]])):
                    unit.shard_modified()
                    if i in self._unit_done:
                        unit.evict_shard()
                    return
        masters = self._masters()
        grads = [m.grad for m in masters]
        for j, m in enumerate(masters):
            if j != i:
                m.grad = None
        try:
            self.optimizer.step()
        finally:
            for m, g in zip(masters, grads, strict=True):
                m.grad = g
        unit, idx = self._master_home[i]
        unit.copy_master(idx)
        if i in self._unit_done:
            unit.evict_shard()

    def refresh_params(self) -> None:
        """Copies the masters into the parameter shards (and re-gathers persistent ones)."""
        for unit in self.all_units:
            unit.refresh_from_masters()

    def zero_grad(self) -> None:
        """Releases the master gradients ([Note: released gradients]; swapped ones are zero
        without memory already)."""
        self.reducer.drop_free()
        if self.swapped is not None:
            self.swapped.zero_grads()
            return
        release_grads(self._masters())

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held per category on this rank (gathered units counted while gathered):
        ``grads`` while gradients exist (during a step), ``grads_held`` now."""
        masters = self._masters()
        swapped = self.swapped is not None  # gradients in their swap files between uses
        return {
            "params": sum(
                u.shard_bytes + u.gathered_bytes + u.secondary_bytes for u in self.all_units
            ),
            "grads": 0 if swapped else sum(m.numel() * m.element_size() for m in masters),
            "grads_held": held_bytes(m.grad for m in masters),
            "master_params": sum(u.master_bytes for u in self.all_units),
            "optimizer_state": optimizer_state_bytes(self.optimizer),
            "comm_buffers": self.reducer.peak_buffer_bytes
            + (0 if self._host_step is None else self._host_step.sink.nbytes),
            "comm_buffers_held": self.reducer.held_buffer_bytes,
            "persistent_params": 0 if self.persistent is None else self.persistent.gathered_bytes,
        }

    def close(self) -> None:
        """Hands the parameters back to the module (`release_params`), removes all hooks and
        deletes NVMe swap files. Collective: every rank must close (``engine.destroy()``)."""
        self.release_params()
        self.scheduler.remove_hooks()
        self.placement.close()
        for h in self._hooks:
            h.remove()
        self._hooks = []

    @torch.no_grad()
    def release_params(self) -> None:
        """Leaves every parameter as ``zero.Init`` leaves one (this rank's chunk, a placeholder
        in the module; persistent ones whole), one unit gathered at a time, so the module
        outlives this strategy: without it the values would go with the shards."""
        for unit in self.all_units:
            unit.wait_for_unshard(tag="release")
            fulls = [p.data.clone() for p in unit.params]
            if unit.persistent:
                for p, full in zip(unit.params, fulls, strict=True):
                    p.data = full
                continue
            unit.reshard()
            for p, full in zip(unit.params, fulls, strict=True):
                hand_back(p, full, unit.process_group)
        self.all_units = []  # nothing of the module is held here any more
        self._where = {}
        self._state_layout.clear()

    # --- GatheredParameters -------------------------------------------------------------------
    def unit_of(self, param: torch.Tensor) -> ShardedUnit | None:
        """The unit holding `param` (trainable or frozen), or None."""
        found = self._where.get(param)  # type: ignore[call-overload]
        return None if found is None else found[0]

    def modifier_group_of(self, unit: ShardedUnit) -> comm.ProcessGroup | None:
        """The ranks holding `unit`'s parameters, over which `GatheredParameters` broadcasts a
        modifier rank's values: the expert-data-parallel group for an expert unit, else
        `modifier_group`."""
        if self._experts is not None and unit.process_group is self._experts.group:
            return unit.process_group
        return self.modifier_group

    def pin(self, unit: ShardedUnit) -> None:
        """Gathers `unit` and keeps it gathered until `unpin` (a use on the unit's counter, so
        forward and backward hooks do not release it meanwhile)."""
        unit.acquire()
        unit.wait_for_unshard(tag="gathered")

    def load_gathered(self, unit: ShardedUnit, params: list[torch.Tensor]) -> None:
        """`unit`'s gathered values of `params` become their shards and masters (swapped-out
        masters are read in first; the next step writes them back)."""
        if self.swapped is not None:
            for master in unit.masters.values():
                self.swapped.ensure_resident(self._master_index[id(master)])
        unit.load_from_full(params)

    def unpin(self, unit: ShardedUnit) -> None:
        """Releases a `pin` (the unit is resharded when nothing else uses it)."""
        if unit.release():
            unit.reshard()
