"""ZeRO-3 reads like its algorithm: a torch profiler trace of one step names every unit's
transitions in order, each unit's counters and training state live on the unit, and
`GatheredParameters` pins through the unit's counter."""

from __future__ import annotations

from typing import Any

import torch

from engine_workers import base_config
from models import global_batches, make_model, rank_micro_batch
from partita.testing import run_distributed

LAYERS = 3
UNITS = ["embed", *[f"blocks.{k}" for k in range(LAYERS)], "norm", "head"]
"""The units of TinyLM at persistence threshold 0, in forward order."""


def _config(**extra: Any) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
    return base_config(2, 1, zero_optimization={**zero, **extra})


def _engine(**extra: Any) -> Any:
    import partita

    model = make_model(layers=LAYERS)
    engine, _, _, _ = partita.initialize(model=model, config=_config(**extra))
    return engine


def _train_step(engine: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    from partita import comm

    tokens, targets = rank_micro_batch(batch, comm.get_rank(), comm.get_world_size(), 2, 0)
    loss = engine(tokens, targets)
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def traced_step(extra: dict[str, Any]) -> list[str]:
    """Two steps (the first records the order); the second under the torch profiler. Returns
    the names of the ``partita::`` ranges of the second step in the order they began.
    `extra` adds ``zero_optimization`` keys."""
    from torch.profiler import ProfilerActivity, profile

    engine = _engine(**extra)
    first, second = global_batches(2, 4)
    _train_step(engine, first)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _train_step(engine, second)
    engine.destroy()
    events = [e for e in prof.events() if e.name.startswith("partita::")]
    # A range starts before the ranges inside it; (start, -end) orders a parent first.
    events.sort(key=lambda e: (e.time_range.start, -e.time_range.end))
    return [e.name for e in events]


def _parse(name: str) -> tuple[str, str | None]:
    """("unshard", "blocks.0") from "partita::unshard[blocks.0]"; (what, None) without a unit."""
    body = name.removeprefix("partita::")
    if body.endswith("]"):
        what, unit = body[:-1].split("[", 1)
        return what, unit
    return body, None


def _assert_algorithm_order(names: list[str]) -> list[tuple[str, str | None]]:
    """The order every ZeRO-3 step follows, offloaded or not; returns the parsed labels."""
    labels = [_parse(n) for n in names]
    first_backward = next(k for k, (what, _) in enumerate(labels) if what == "pre_backward")
    forward, backward = labels[:first_backward], labels[first_backward:]
    # Forward gathers the units in order; backward reduce-scatters them in reverse.
    assert [u for what, u in forward if what == "unshard"] == UNITS, names
    assert [u for what, u in backward if what == "reduce_scatter"] == UNITS[::-1], names
    # The step follows the last reduction; nothing is gathered or reduced after it.
    step = [k for k, (what, _) in enumerate(labels) if what == "step"]
    assert len(step) == 1, names
    after = {what for what, _ in labels[step[0] :]}
    assert not after & {"unshard", "reduce_scatter", "pre_forward"}, names
    for unit in UNITS:
        own = [what for what, u in labels if u == unit]
        # Gathered for forward, freed, gathered for backward, reduced, freed.
        moves = [w for w in own if w in ("unshard", "reshard", "reduce_scatter")]
        assert moves == ["unshard", "reshard", "unshard", "reduce_scatter", "reshard"], (unit, own)
        hooks = [w for w in own if w in ("pre_forward", "post_forward", "pre_backward")]
        assert hooks == ["pre_forward", "post_forward", "pre_backward"], (unit, own)
    return labels


def test_profiler_trace_of_one_step_reads_like_the_algorithm() -> None:
    for names in run_distributed(traced_step, 2, {}, timeout=300):
        labels = _assert_algorithm_order(names)
        # Every block after the first is prefetched (gathered inside its predecessor's hook) in
        # both directions; the middle block's whole story, in order:
        assert [w for w, u in labels if u == "blocks.1"] == [
            "prefetch", "unshard", "pre_forward", "wait_for_unshard", "post_forward", "reshard",
            "prefetch", "unshard", "pre_backward", "wait_for_unshard", "post_backward",
            "reduce_scatter", "reshard",
        ], names  # fmt: skip


def test_profiler_trace_shows_nvme_reads_and_writes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    extra = {"offload_optimizer": nvme, "offload_param": nvme}
    for names in run_distributed(traced_step, 2, extra, timeout=300):
        labels = _assert_algorithm_order(names)
        for unit in UNITS:
            # Each shard is read from its file before its gather completes in forward.
            own = [what for what, u in labels if u == unit]
            assert "nvme_read" in own, (unit, own)
            assert own.index("nvme_read") < own.index("wait_for_unshard"), (unit, own)
        # The step reads every sub-group (master and optimizer state) and writes it back.
        step = next(k for k, (what, _) in enumerate(labels) if what == "step")
        read = {
            u for what, u in labels[step:] if what == "nvme_read" and str(u).startswith("sub_group")
        }
        written = {u for what, u in labels[step:] if what == "nvme_write"}
        assert read and {u for u in written if str(u).startswith("sub_group")} == read, names
        assert {f"grad.{u.split('.')[1]}" for u in read} <= {
            u for what, u in labels[step:] if what == "nvme_read"
        }, names


def unit_counters_and_pins() -> dict[str, Any]:
    """Probes, on each rank: (1) a GatheredParameters block inside a unit's forward, (2) the
    training state of units seen from inside forward and backward, (3) a GatheredParameters
    block held over a whole training step, then the next step's forward."""
    from partita.zero import GatheredParameters

    engine = _engine()
    strategy = engine.strategy
    model = engine.module
    fc1 = model.blocks[0].fc1
    unit0 = strategy.unit_of(fc1.weight)
    unit1 = strategy.unit_of(model.blocks[1].fc1.weight)
    head = strategy.unit_of(model.head.weight)
    seen: dict[str, Any] = {}

    def nested(module: torch.nn.Module, args: Any) -> None:
        # Inside blocks.0's forward: the nested block must not release the unit forward needs.
        with GatheredParameters([fc1.weight]):
            seen["in_use_inside"] = unit0.in_use
        seen["in_use_after"] = unit0.in_use
        seen["state_after_nested"] = unit0.state.name

    def in_block1(module: torch.nn.Module, args: Any) -> None:
        seen.setdefault("forward_states", (unit0.training_state.name, unit1.training_state.name))
        seen.setdefault("block0_in_next_forward", []).append(unit0.state.name)

    def on_block0_output(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        def grad_hook(grad: torch.Tensor) -> None:
            # blocks.1 and the head have finished their backward; blocks.0 has not.
            seen.setdefault(
                "backward_states", (head.training_state.name, unit1.training_state.name)
            )

        if output.requires_grad and torch.is_grad_enabled():
            output.register_hook(grad_hook)

    hooks = [
        fc1.register_forward_pre_hook(nested),
        model.blocks[1].fc1.register_forward_pre_hook(in_block1),
        model.blocks[0].register_forward_hook(on_block0_output),
    ]
    batches = global_batches(3, 4)
    losses = [_train_step(engine, batches[0])]
    seen["after_step_states"] = sorted({u.training_state.name for u in strategy.all_units})
    hooks[0].remove()
    seen["block0_in_next_forward"] = []
    with GatheredParameters([fc1.weight]):
        seen["pinned"] = unit0.in_use
        losses.append(_train_step(engine, batches[1]))
    seen["in_use_after_block"] = unit0.in_use
    seen["block0_in_next_forward"] = []
    losses.append(_train_step(engine, batches[2]))
    for h in hooks:
        h.remove()
    engine.destroy()
    seen["losses"] = losses
    return seen


def plain_losses() -> list[float]:
    """The losses of `unit_counters_and_pins`'s three steps without any probe."""
    engine = _engine()
    losses = [_train_step(engine, b) for b in global_batches(3, 4)]
    engine.destroy()
    return losses


def test_units_own_their_counters_and_gathered_parameters_pins_through_them() -> None:
    results = run_distributed(unit_counters_and_pins, 2, timeout=300)
    plain = run_distributed(plain_losses, 2, timeout=300)
    for seen, want in zip(results, plain, strict=True):
        # A GatheredParameters block inside the unit's forward counts on the unit's own counter
        # and leaves the unit gathered for the rest of the forward.
        assert seen["in_use_inside"] == 2 and seen["in_use_after"] == 1
        assert seen["state_after_nested"] == "UNSHARDED"
        assert seen["losses"] == want  # the probes change nothing
        assert seen["forward_states"] == ("IDLE", "FORWARD")
        assert seen["backward_states"] == ("POST_BACKWARD", "POST_BACKWARD")
        assert seen["after_step_states"] == ["IDLE"]
        # A block held over a whole step: the count comes back to zero, so the next step's
        # forward frees blocks.0 before blocks.1 runs again.
        assert seen["pinned"] == 1 and seen["in_use_after_block"] == 0
        assert seen["block0_in_next_forward"] == ["SHARDED"]
