"""ZeRO stage 0: plain data parallelism with bucketed, overlapped gradient all-reduce.

Every rank holds the whole model, gradients and optimizer state. With a 16-bit module, fp32
master weights (and their gradients) are kept for the optimizer; with an fp32 module the
optimizer steps the module's parameters directly, so no copy of the weights exists. Gradients
exist from the first backward after a step until the next step is over ([Note: released
gradients]).
"""

from __future__ import annotations

import math

import torch

from partita import comm
from partita.precision import PrecisionPolicy
from partita.zero.master import MasterWeights
from partita.zero.reduction import ReduceScaling
from partita.zero.shard_step import TensorParallelNorm, sum_of_squares, tensor_norms
from partita.zero.sharded_grads import ShardedGradients, stage0_layout
from partita.zero.state_access import ParamSlot, ParamStates
from partita.zero.strategy import (
    ExpertFamily,
    OptimizerFactory,
    ParamGroups,
    StepOutcome,
    optimizer_state_bytes,
)

ALL_IN_FLIGHT = 1 << 30
"""Stage 0 waits for no all-reduce before `end_backward`: its buffers are the gradients, which
exist anyway, so nothing is saved by bounding them in flight."""


class DataParallel:
    """Stage 0 strategy (see `partita.zero.strategy.Strategy`)."""

    def __init__(
        self,
        groups: ParamGroups,
        policy: PrecisionPolicy,
        make_optimizer: OptimizerFactory,
        bucket_numel: int,
        scaling: ReduceScaling,
        group: comm.ProcessGroup | None = None,
        tensor: TensorParallelNorm | None = None,
        experts: ExpertFamily | None = None,
    ) -> None:
        self.params = [p for g in groups for p in g]
        self.experts = experts
        """Expert parameters, reduced over their own group ([Note: expert parallelism])."""
        self.bucket_numel = bucket_numel
        # One reducer group per optimizer group and kind: expert parameters are summed over
        # their expert-data-parallel group, the rest over `group`.
        own = frozenset() if experts is None else experts.params
        reduce_groups: list[list[torch.nn.Parameter]] = []
        group_of: list[comm.ProcessGroup | None] = []
        for g in groups:
            for kind, pg in ((False, group), (True, None if experts is None else experts.group)):
                members = [p for p in g if (p in own) == kind]
                if members:
                    reduce_groups.append(members)
                    group_of.append(pg)
        self.grads = ShardedGradients(
            layouts=[stage0_layout(ps, bucket_numel) for ps in reduce_groups],
            params=reduce_groups,
            shard_grad=None,
            persistent=True,
            scaling=scaling,
            reduce_dtype=policy.reduce_dtype,
            rank=0,
            max_in_flight=ALL_IN_FLIGHT,
            group=group,
            group_of=group_of,
            collective="all_reduce",
        )
        self.master = (
            MasterWeights(self.params, policy.master_dtype) if policy.needs_master else None
        )
        if self.master is not None:
            mapping = self.master.by_model_param
            self.optimizer = make_optimizer([[mapping[p] for p in g] for g in groups])
        else:
            self.optimizer = make_optimizer([list(g) for g in groups])
        self.state = ParamStates(ReplicatedLayout(self.params, self.master, self.optimizer))
        """State access for accessors and checkpoints (see `partita.zero.state_access`)."""
        self.tensor = None if tensor is None else tensor.bind(self.state.layout)
        """With tensor parallelism, the norm's tensor group ([Note: norms over tensor ranks])."""

    def begin_backward(self, sync: bool) -> None:
        """Arms the all-reduce hooks for the boundary backward."""
        self.grads.begin_backward(sync)

    def end_backward(self) -> None:
        """Waits for every bucket's all-reduce (launching stragglers first), if armed."""
        self.grads.end_backward()

    def absorb_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Gradients autograd did not accumulate join their buckets (see `Strategy`)."""
        self.grads.absorb(params)

    def _stepped_params(self) -> list[torch.nn.Parameter]:
        """The tensors the optimizer steps, with this step's gradients in their `.grad` (zeros
        for a parameter no backward reached)."""
        self.grads.materialize()
        if self.master is None:
            return self.params
        self.master.load_grads([p.grad for p in self.params])  # type: ignore[misc]
        return self.master.params

    def step(self, clip: float, loss_scale: float) -> StepOutcome:
        """Unscale, norm and overflow check, clip, step; returns what happened."""
        stepped = self._stepped_params()
        grads: list[torch.Tensor] = [p.grad for p in stepped]  # type: ignore[misc]
        if loss_scale != 1.0 and grads:
            torch._foreach_mul_(grads, 1.0 / loss_scale)
        if self.experts is not None:
            norm = self._expert_parallel_norm(grads)
        elif self.tensor is None:
            # The reduced gradients are identical on every rank, so the norm (and with it the
            # overflow decision) is too: no collective is needed to agree on skipping.
            norm = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros(())
        else:
            norm = self._tensor_parallel_norm(stepped)
        norm_value = float(norm)
        if not math.isfinite(norm_value):
            return StepOutcome(applied=False, grad_norm=norm_value)
        if clip > 0.0:
            torch.nn.utils.clip_grads_with_norm_(stepped, clip, norm)
        self.optimizer.step()
        if self.master is not None:
            self.master.copy_to_model()
        return StepOutcome(applied=True, grad_norm=norm_value)

    def _tensor_parallel_norm(self, stepped: list[torch.nn.Parameter]) -> torch.Tensor:
        """The model's gradient norm over the tensor ranks ([Note: norms over tensor ranks]):
        the gradients are identical on the data-parallel ranks already, so only the tensor
        group sums."""
        assert self.tensor is not None
        split, replicated = self.tensor.split(stepped)
        device = stepped[0].device if stepped else torch.device("cpu")
        sq = self.tensor.squares(
            sum_of_squares(tensor_norms(split), device),
            sum_of_squares(tensor_norms(replicated), device),
        )
        comm.all_reduce(sq, group=self.tensor.group, tag="norm")
        return sq.sqrt()

    def _expert_parallel_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The model's gradient norm with expert parallelism ([Note: expert parallelism]):
        dense gradients are the same on every rank, expert ones on the ranks holding the same
        experts, so only the experts' squares are summed, over the expert-parallel group."""
        assert self.experts is not None
        dense, expert = self.experts.split(self.params)
        device = grads[0].device if grads else torch.device("cpu")
        dense_sq = sum_of_squares(tensor_norms([grads[i] for i in dense]), device)
        expert_sq = sum_of_squares(tensor_norms([grads[i] for i in expert]), device)
        comm.all_reduce(expert_sq, group=self.experts.ep_group, tag="norm")
        return (dense_sq + expert_sq).sqrt()

    def zero_grad(self) -> None:
        """Releases the gradient buckets and the masters' gradients ([Note: released
        gradients])."""
        self.grads.release()
        if self.master is not None:
            self.master.release_grads()

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held per category on this rank: ``grads`` while gradients exist (during a
        step), ``grads_held`` now."""
        param_bytes = sum(p.numel() * p.element_size() for p in self.params)
        master = self.master
        return {
            "params": param_bytes,
            "grads": self.grads.persistent_bytes + (master.grad_nbytes if master else 0),
            "grads_held": self.grads.persistent_held_bytes
            + (master.held_grad_nbytes if master else 0),
            "master_params": master.nbytes if master else 0,
            "optimizer_state": optimizer_state_bytes(self.optimizer),
            "comm_buffers": 0,
        }

    def close(self) -> None:
        """Removes the gradient hooks."""
        self.grads.remove_hooks()


class ReplicatedLayout:
    """Stage 0's state layout: every rank holds each parameter whole, in its fp32 master (or,
    without masters, in the parameter itself)."""

    replicated = True
    shards_params = False
    process_group: comm.ProcessGroup | None = None
    """Unused: every rank holds everything, so nothing is assembled."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        master: MasterWeights | None,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        self.master = master
        self.optimizer = optimizer
        self._slots = {
            p: ParamSlot(
                p.shape,
                [(0, 0, p.numel())],
                p if master is None else master.by_model_param[p],
                home=p,
            )
            for p in params
        }

    def slot(self, param: torch.Tensor) -> ParamSlot | None:
        """The slot of a parameter this strategy trains."""
        return self._slots.get(param)  # type: ignore[call-overload]

    def source(self, slot: ParamSlot, what: str) -> torch.Tensor | None:
        """Master (or parameter), the parameter's reduced gradient, or optimizer state."""
        assert slot.stepped is not None
        if what == "param":
            return slot.stepped
        if what == "grad":
            return slot.home.grad
        return self.optimizer.state.get(slot.stepped, {}).get(what)

    def after_write(
        self, param: torch.Tensor, slot: ParamSlot, what: str, full: torch.Tensor | None
    ) -> None:
        """A new master value is copied into the module weight at once."""
        del full
        if what == "param" and self.master is not None:
            assert slot.stepped is not None
            param.data.copy_(slot.stepped.detach().view_as(param))

    def refresh_params(self) -> None:
        """Copies the masters into the module (after loading state into them)."""
        if self.master is not None:
            self.master.copy_to_model()
