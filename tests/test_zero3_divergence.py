"""ZeRO-3 when ranks run different modules (issue 19): a `vision` tower that only rank 0's
batches use, an MoE model whose ranks route to different experts, and generation that stops at
different lengths per rank. Undeclared divergence raises on every rank naming each rank's unit
and step; declared conditional modules train like one process over the global batch.

Every two-rank case runs in one spawn (`divergence_cases`): the divergent case last, because
it leaves the process group with collectives that will never complete.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
from torch import nn

from engine_workers import base_config
from models import assert_losses
from partita.testing import run_distributed

VOCAB, DIM, SEQ, MICRO, STEPS = 64, 32, 8, 2, 4
RTOL = 1e-6


class VisionTower(nn.Module):
    """Projects an image feature vector into the token stream (run only with an image)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.proj(image).unsqueeze(1)


class VisionLM(nn.Module):
    """Embedding, an optional `vision` tower, two MLP blocks, a head; returns the mean
    next-token cross-entropy."""

    def __init__(self, late: bool = False) -> None:
        super().__init__()
        self.late = late
        """Run the tower after the blocks: a rank without an image is then done with its
        forward while the other still gathers the tower."""
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.vision = VisionTower()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
            for _ in range(2)
        )
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(tokens)
        if image is not None and not self.late:
            x = x + self.vision(image)
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(x)
        loss = nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)
        )
        if image is not None and self.late:  # after the head: the last module of the forward
            loss = loss + self.vision(image).square().mean()
        return loss


def vision_batch(
    step: int, rank: int, both_until: int = 0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rank `rank`'s micro-batch at `step`: only rank 0's batches carry an image (from step
    `both_until` on; before it, every rank's)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
    image = torch.randn(MICRO, DIM, generator=gen)
    return tokens, image if rank == 0 or step < both_until else None


def _z3(**zero: Any) -> dict[str, Any]:
    return base_config(
        MICRO,
        1,
        zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    )


def _train_vision(
    config: dict[str, Any],
    declare_api: bool = False,
    late: bool = False,
    both_until: int = 0,
    counts: list[tuple[int, int]] | None = None,
) -> list[float]:
    """Trains `VisionLM` for STEPS steps; returns the losses and, into `counts`, each step's
    (identity exchanges, collectives including the end of backward)."""
    import partita
    from partita import comm
    from partita.compat.deepspeed.utils import set_z3_leaf_modules

    model = VisionLM(late)
    if declare_api:
        set_z3_leaf_modules(model, [VisionTower])
    engine, *_ = partita.initialize(model=model, config=config)
    losses = []
    check = engine.strategy.divergence
    for step in range(STEPS):
        before = check.checks
        loss = engine(*vision_batch(step, comm.get_rank(), both_until))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if counts is not None:
            counts.append((check.checks - before, len(check.schedule) + 1))
    engine.destroy()
    return losses


def _mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=1, max_position_embeddings=64, router_aux_loss_coef=0.0,
    )  # fmt: skip
    return MixtralForCausalLM(config)


def _train_mixtral(stage: int) -> dict[str, Any]:
    """Trains the tiny Mixtral; records which experts this rank's tokens were routed to."""
    import partita
    from partita import comm

    rank = comm.get_rank()
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    engine, *_ = partita.initialize(
        model=_mixtral(), config=base_config(1, 1, zero_optimization=zero)
    )
    experts: list[list[int]] = []  # per router call: the experts this rank's tokens went to
    gates = [m for n, m in engine.module.named_modules() if n.endswith("mlp.gate")]
    hooks = [g.register_forward_hook(lambda m, a, out: experts.append(sorted(set(out[2].flatten().tolist()))))
             for g in gates]  # fmt: skip
    losses = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, VOCAB, (1, 4), generator=gen)  # 4 tokens: some expert idle
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    for h in hooks:
        h.remove()
    engine.destroy()
    return {"losses": losses, "experts": experts}


def _generate(reference: bool) -> list[int]:
    """Greedy generation that stops after 2 new tokens on rank 0 and 7 on rank 1; under ZeRO-3
    rank 0 keeps running forwards (``synced_gpus``) until rank 1 is done."""
    import partita
    from partita import comm

    rank = comm.get_rank()
    model = _mixtral()
    prompt = torch.tensor([[1, 2, 3]]) if rank == 0 else torch.tensor([[7, 5, 9, 11]])
    new = 2 if rank == 0 else 7
    if reference:
        with torch.no_grad():
            out = model.generate(
                prompt, max_new_tokens=new, do_sample=False, pad_token_id=0, synced_gpus=False
            )
        return out[0].tolist()
    config = base_config(
        MICRO, 1, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0}
    )
    engine, *_ = partita.initialize(model=model, config=config)
    engine.eval()
    with torch.no_grad():
        out = engine.module.generate(
            prompt, max_new_tokens=new, do_sample=False, pad_token_id=0, synced_gpus=True
        )
    engine.destroy()
    return out[0].tolist()


def _diverge(late: bool = False, both_until: int = 0, **zero: Any) -> dict[str, Any]:
    """The undeclared vision tower: returns what the training raised and after how long."""
    start = time.perf_counter()
    try:
        _train_vision(_z3(**zero), late=late, both_until=both_until)
    except Exception as err:
        return {
            "error": type(err).__name__,
            "message": str(err),
            "seconds": time.perf_counter() - start,
        }
    return {"error": None, "message": "", "seconds": time.perf_counter() - start}


def divergence_cases() -> dict[str, Any]:
    """Every two-rank case of this file, on each rank, in one spawn (the divergent one last)."""
    out: dict[str, Any] = {}
    out["declared_counts"] = counts = []
    out["declared_config"] = _train_vision(_z3(leaf_module={"names": ["vision"]}), counts=counts)
    out["declared_api"] = _train_vision(_z3(), declare_api=True)
    out["mixtral3"] = _train_mixtral(3)
    out["mixtral0"] = _train_mixtral(0)
    out["generated"] = _generate(reference=False)
    out["generated_ref"] = _generate(reference=True)
    out["diverged"] = _diverge()
    # The check raised before any mismatched data moved, so the process group still pairs.
    out["diverged_late"] = _diverge(late=True)
    # Both ranks run the tower in steps 0-1, so step 2 runs on their shared schedule, with
    # identities verified after the data collectives start ([Note: asynchronous identities]).
    # Last: the rank on the schedule leaves a gather nobody receives.
    out["diverged_scheduled"] = _diverge(both_until=2)
    return out


def vision_reference() -> list[list[float]]:
    """One process, the global batch (both ranks' micro-batches), fused AdamW as the config's
    "AdamW": each step's loss of rank 0's and of rank 1's half."""
    model = VisionLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    per_rank: list[list[float]] = [[], []]
    for step in range(STEPS):
        halves = [model(*vision_batch(step, rank)) for rank in (0, 1)]
        ((halves[0] + halves[1]) / 2).backward()
        opt.step()
        opt.zero_grad()
        for rank in (0, 1):
            per_rank[rank].append(halves[rank].item())
    return per_rank


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    # The timeout is a hang guard: a rank that never raises would sit in a collective forever.
    return run_distributed(divergence_cases, 2, timeout=240)


def diverge_waiting_on_the_schedule() -> dict[str, Any]:
    """Without prefetch, after two agreeing steps: rank 0 gathers the tower on the schedule
    (its identity only started, [Note: asynchronous identities]) and waits for it at once,
    while rank 1 gathers the first block. Its own spawn: it leaves a gather nobody receives."""
    return _diverge(both_until=2, stage3_prefetch_bucket_size=0)


@pytest.fixture(scope="module")
def waiting_results() -> list[dict[str, Any]]:
    return run_distributed(diverge_waiting_on_the_schedule, 2, timeout=120)  # a hang guard


def test_undeclared_conditional_module_raises_on_every_rank_naming_units_and_step(
    results: list[dict[str, Any]],
) -> None:
    for rank, res in enumerate(results):
        got = res["diverged"]
        assert got["error"] == "RankDivergenceError", (rank, got)
        message = got["message"]
        # Rank 0 gathers the vision tower where rank 1 gathers the first block, at step 0.
        assert "rank 0" in message and "'vision.proj'" in message, message
        assert "rank 1" in message and "'blocks.0'" in message, message
        assert "step 0" in message, message


def test_rank_done_with_forward_meets_the_rank_still_gathering(
    results: list[dict[str, Any]],
) -> None:
    # Rank 1 has no image: after the head it starts its backward and reduce-scatters the
    # head's gradients while rank 0 gathers the tower it runs last.
    for rank, res in enumerate(results):
        got = res["diverged_late"]
        assert got["error"] == "RankDivergenceError", (rank, got)
        message = got["message"]
        assert "rank 0 gathers unit 'vision.proj'" in message, message
        assert "rank 1 reduce-scatters the gradients of unit 'head'" in message, message
        assert "step 0" in message, message


def test_divergence_after_agreeing_steps_is_caught_on_the_schedule(
    results: list[dict[str, Any]],
) -> None:
    for rank, res in enumerate(results):
        got = res["diverged_scheduled"]
        assert got["error"] == "RankDivergenceError", (rank, got)
        message = got["message"]
        # Both prefetch the tower by the recorded order, so forward pairs; rank 1 never ran
        # it, so only rank 0 reduce-scatters its gradients, where rank 1 ends its backward.
        assert "rank 0 reduce-scatters the gradients of unit 'vision.proj'" in message, message
        assert "rank 1 ends its backward" in message, message
        assert "step 2" in message, message


def test_a_rank_waiting_for_its_scheduled_gather_raises_instead_of_hanging(
    waiting_results: list[dict[str, Any]],
) -> None:
    # Rank 0 must verify the identity of the very gather it waits for (not only the earlier
    # ones): rank 1 raised without issuing it, so its data never comes.
    for rank, got in enumerate(waiting_results):
        assert got["error"] == "RankDivergenceError", (rank, got)
        message = got["message"]
        assert "rank 0 gathers unit 'vision.proj'" in message, message
        assert "rank 1 gathers unit 'blocks.0'" in message, message
        assert "step 2" in message, message


def test_declared_conditional_module_trains_like_one_process(
    results: list[dict[str, Any]],
) -> None:
    want = vision_reference()
    for rank, res in enumerate(results):
        assert_losses(res["declared_config"], want[rank], rtol=RTOL)
        assert_losses(res["declared_api"], want[rank], rtol=RTOL)


def test_a_pass_on_the_schedule_exchanges_one_identity_per_window(
    results: list[dict[str, Any]],
) -> None:
    # [Note: identity windows]: the first pass has no schedule, so each of its collectives
    # exchanges its identity; once two passes ran the same collectives, a pass on that
    # schedule exchanges one per window of WINDOW collectives, and one at its end.
    from partita.zero.stage3.identity import WINDOW

    for res in results:
        (first, collectives), _, *later = res["declared_counts"]
        assert first == collectives, res["declared_counts"]
        for exchanges, collectives in later:
            windows = -(-(collectives - 1) // WINDOW)
            assert exchanges == windows + 1, res["declared_counts"]
            assert exchanges < collectives, res["declared_counts"]


def test_mixtral_top1_trains_under_stage3_like_stage0(results: list[dict[str, Any]]) -> None:
    # The ranks' tokens went to different experts, and some expert sat idle on a rank in some
    # forward: otherwise nothing diverged to test.
    routed = [res["mixtral3"]["experts"] for res in results]
    assert routed[0] != routed[1]
    assert any(len(call) < 4 for calls in routed for call in calls)
    for res in results:
        assert_losses(res["mixtral3"]["losses"], res["mixtral0"]["losses"], rtol=RTOL)


def test_generate_with_synced_gpus_finishes_at_different_lengths(
    results: list[dict[str, Any]],
) -> None:
    lengths = [len(res["generated"]) for res in results]
    assert lengths == [3 + 2, 4 + 7]
    for res in results:
        assert res["generated"] == res["generated_ref"]


def test_leaf_module_config_names_a_missing_module() -> None:
    import partita

    config = _z3(leaf_module={"names": ["no_such_tower"]})
    with pytest.raises(ValueError, match="no_such_tower"):
        partita.initialize(model=VisionLM(), config=config, dist_init_required=False)


def test_set_z3_leaf_modules_marks_instances() -> None:
    from partita.compat.deepspeed.utils import (
        get_z3_leaf_modules,
        set_z3_leaf_modules,
        z3_leaf_module,
    )

    model, other = VisionLM(), VisionLM()
    assert set_z3_leaf_modules(model, ["VisionTower"]) == [model.vision]
    assert z3_leaf_module(model.vision) and not z3_leaf_module(other.vision)
    assert get_z3_leaf_modules(model) == [model.vision]
    assert copy.deepcopy(model).vision._z3_leaf


def test_an_unchecked_run_keeps_only_the_last_pass() -> None:
    """With the check off (one rank, or ``stage3_check_divergence: false``) the collectives of
    a pass are still recorded (a benchmark toggles the check), but each backward's end starts
    a new record: nothing grows with the number of steps."""
    from partita.zero.stage3.identity import END, GATHER, REDUCE, DivergenceCheck

    check = DivergenceCheck(["a", "b"], None, enabled=False)
    for _ in range(50):
        for unit in (0, 1):
            check.check(GATHER, unit)
        for unit in (1, 0):
            check.check(REDUCE, unit)
        check.check(END)
        check.next_step()
    assert check.schedule == [(GATHER, 0), (GATHER, 1), (REDUCE, 1), (REDUCE, 0)]
    assert check._current == [] and check.checks == 0
