"""ZeRO++ on stage 3 ([Note: ZeRO++ gathers] in `partita.zero.stage3.gather`): quantized weight
gathers (qwZ), quantized frozen weights, and the hierarchical secondary partition (hpZ), on a
tiny GPT-2 at 4 CPU ranks. Bytes as partita's counters record them against the figure computed
from the units' layouts; losses against the unquantized run; without the options, bitwise the
plain run. One spawn runs every case."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from partita.config import ConfigError, load_config
from partita.engine.setup import check_supported
from partita.testing import run_distributed_grid
from zeropp_workers import STEPS, zeropp_grid

WORLD = 4
QW = {"zero_quantized_weights": True}
HPZ = {"zero_hpz_partition_size": 2}
OFF = {
    "zero_quantized_weights": False,
    "zero_quantized_nontrainable_weights": False,
    "zero_hpz_partition_size": 1,
}
TRAIN: dict[str, dict[str, Any]] = {
    "plain": {"zero": {}},
    "bound": {"zero": {}, "bound": True},
    "plain_again": {"zero": {}},
    "off": {"zero": OFF},
    "qwz": {"zero": QW},
    "hpz": {"zero": HPZ},
    "qwz_hpz": {"zero": QW | HPZ},
    "qwz_bf16": {"zero": QW, "bf16": True},
    "frozen_plain": {"zero": {}, "bf16": True, "frozen": True},
    "qgz": {"zero": {"zero_quantized_gradients": True, "zero_quantized_gradients_bits": 4} | HPZ},
    "qgz8": {"zero": {"zero_quantized_gradients": True, "zero_quantized_gradients_bits": 8} | HPZ},
    "frozen_q": {
        "zero": {"zero_quantized_nontrainable_weights": True},
        "bf16": True,
        "frozen": True,
    },
}
QG = {"zero_quantized_gradients": True} | HPZ
GRADS: dict[str, dict[str, Any]] = {
    "exact": {},
    "int4": QG | {"zero_quantized_gradients_bits": 4},
    "int4_feedback": QG
    | {"zero_quantized_gradients_bits": 4, "zero_quantized_gradients_error_feedback": True},
    "int8": QG | {"zero_quantized_gradients_bits": 8},
    "int8_feedback": QG
    | {"zero_quantized_gradients_bits": 8, "zero_quantized_gradients_error_feedback": True},
}
"""Reduced gradients at learning rate 0 ([Note: qgZ error feedback])."""
FEEDBACK = QG | {"zero_quantized_gradients_error_feedback": True}
SKIPPED, AFTER = 1, 2
OVERFLOW: dict[str, dict[str, Any]] = {
    "overflow": {"zero": FEEDBACK, "fp16": True, "inject": SKIPPED},
    "fresh": {"zero": FEEDBACK, "fp16": True, "start": AFTER},
    "history": {"zero": FEEDBACK, "fp16": True},
}
"""fp16 with a static loss scale, error feedback on: a step forced to overflow, a run that
starts after it (no feedback history) and one that never overflows (all of its history)."""
SHARDED = {  # stages 1-2: qwZ on the all-gather of the updated weights
    (1, False): {"stage": 1, "quantized": False},
    (1, True): {"stage": 1, "quantized": True},
    (2, False): {"stage": 2, "quantized": False},
    (2, True): {"stage": 2, "quantized": True},
    (2, "bf16"): {"stage": 2, "quantized": True, "bf16": True},
}
REFUSED_HPZ = (3, 8)
QGZ_ALONE = {"zero_quantized_gradients": True}


@pytest.fixture(scope="module")
def results() -> dict:
    cases: list[dict[str, Any]] = [{"kind": "train", **case} for case in TRAIN.values()]
    cases += [{"kind": "refusal", "zero": {"zero_hpz_partition_size": h}} for h in REFUSED_HPZ]
    cases += [{"kind": "refusal", "zero": QGZ_ALONE}]
    cases += [{"kind": "grads", "zero": zero} for zero in GRADS.values()]
    cases += [{"kind": "grads", **case} for case in OVERFLOW.values()]
    cases += [{"kind": "sharded", **case} for case in SHARDED.values()]
    per_case = iter(run_distributed_grid(zeropp_grid, WORLD, cases, timeout=500))
    out = {name: next(per_case) for name in TRAIN}
    out["refusals"] = {h: next(per_case) for h in REFUSED_HPZ}
    out["qgz_alone"] = next(per_case)
    out["grads"] = {name: next(per_case) for name in GRADS}
    out["overflow"] = {name: next(per_case) for name in OVERFLOW}
    out["sharded"] = {key: next(per_case) for key in SHARDED}
    return out


def _same(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(
        x.equal(y) for x, y in zip(a["params"], b["params"], strict=True)
    )


def _within(counted: int, expected: int) -> bool:
    return abs(counted - expected) <= 0.01 * expected


def test_without_the_options_training_is_bitwise_the_plain_run(results: dict) -> None:
    """Absent keys, keys set to their off values and hpZ (whose secondary copies are exact)
    train bitwise alike; every gather moves the module dtype's bytes (no quantized path)."""
    plain = results["plain"]
    for rank in range(WORLD):
        for other in ("plain_again", "off", "hpz"):
            assert _same(plain[rank], results[other][rank]), (other, rank)
    for rank_result in plain:
        assert rank_result["counted"] == rank_result["expected"]
        assert set(rank_result["counted"][0]) == {""}  # the world's group only


@pytest.mark.parametrize("name", ["qwz", "qwz_bf16", "qwz_hpz", "frozen_q"])
def test_quantized_gathers_move_the_analytic_bytes(results: dict, name: str) -> None:
    """Per step and per group, the training gathers' bytes equal the figure from the layouts
    (one byte per element plus a 4-byte scale per block where quantized, the module dtype's
    bytes elsewhere) within 1%."""
    for rank_result in results[name]:
        assert len(rank_result["counted"]) == STEPS
        for counted, expected in zip(rank_result["counted"], rank_result["expected"], strict=True):
            assert counted.keys() == expected.keys(), (counted, expected)
            for group, nbytes in expected.items():
                assert _within(counted[group], nbytes), (name, group, counted, expected)


def test_qwz_moves_a_quarter_of_fp32_and_half_of_bf16_bytes(results: dict) -> None:
    """One primary gather of every unit: int8 plus scales against 4-byte and 2-byte weights
    (scales add 4 bytes per block of at most 2048 elements: < 0.2%)."""
    plain, qwz, bf16 = (results[n][0]["primary_per_step"] for n in ("plain", "qwz", "qwz_bf16"))
    assert 0.25 <= qwz / plain <= 0.25 * (1 + 4 / 16)  # a block is at least one 16-element chunk
    assert qwz == bf16  # the same int8 payload whatever the module dtype
    frozen_plain, frozen_q = results["frozen_plain"][0], results["frozen_q"][0]
    for step in range(STEPS):
        assert frozen_q["counted"][step][""] < frozen_plain["counted"][step][""]


def test_qwz_losses_stay_within_the_quantization_bound(results: dict) -> None:
    """Step 0 starts from the same weights: the quantized forward may change the loss by at
    most sum |dL/dw| * scale/2 to first order (the bound of each weight's block, from the
    plain run's gradient). Later steps: within 1% of the plain run's loss, the issue's bar."""
    plain, qwz, bound = results["plain"][0], results["qwz"][0], results["bound"][0]["bound"]
    assert bound > 0
    assert abs(qwz["losses"][0] - plain["losses"][0]) <= bound
    for name in ("qwz", "qwz_bf16", "qwz_hpz", "qgz", "qgz8"):
        for got, want in zip(results[name][0]["losses"], plain["losses"], strict=True):
            assert abs(got - want) <= 0.01 * want, (name, got, want)
    assert qwz["losses"] != plain["losses"]  # the weights the forward saw were quantized


def test_hpz_regathers_inside_the_node_group(results: dict) -> None:
    """hpZ 2 at 4 ranks: each step the world's group carries one gather of every unit (the
    first forward's); backward and the second micro-batch read the node group ("hpz"); each
    rank holds half a unit's bytes of secondary copies (as int8 blocks under qwZ)."""
    plain = results["plain"][0]
    for name in ("hpz", "qwz_hpz"):
        for r in results[name]:
            for counted in r["counted"]:
                assert counted[""] == r["primary_per_step"]
                assert counted["hpz"] > 0
                assert counted[""] < plain["counted"][0][""]
            assert r["secondary_bytes"] == r["secondary_expected"] > 0
    assert results["hpz"][0]["secondary_bytes"] == results["hpz"][0]["unit_bytes"] // 2
    assert results["hpz"][0]["primary_per_step"] == plain["primary_per_step"]


def test_hpz_changes_where_bytes_travel_never_the_numbers(results: dict) -> None:
    """The node group's gathers hand every rank the very values (under qwZ the very bytes)
    the first gather did, so hpZ trains bitwise as without it, quantized or not."""
    for rank in range(WORLD):
        assert _same(results["plain"][rank], results["hpz"][rank])
        assert _same(results["qwz"][rank], results["qwz_hpz"][rank])


def test_hpz_size_that_does_not_divide_the_world_is_refused(results: dict) -> None:
    for h in REFUSED_HPZ:
        for message in results["refusals"][h]:
            assert "zero_optimization.zero_hpz_partition_size" in message, message
            assert "positive divisor of the world size 4" in message, message


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("zero_quantized_nontrainable_weights", True),
        ("zero_hpz_partition_size", 2),
        ("zero_quantized_gradients", True),
        ("zero_quantized_gradients_error_feedback", True),
    ],
)
def test_options_below_stage_3_are_refused_naming_the_key(
    stage: int, key: str, value: object
) -> None:
    raw = {"train_batch_size": 1, "zero_optimization": {"stage": stage, key: value}}
    with pytest.raises(ConfigError, match=rf"zero_optimization\.{key}.*stage 3 only"):
        check_supported(load_config(raw, world_size=1))


@pytest.mark.parametrize(("name", "fraction"), [("qgz", 1 / 15), ("qgz8", 1 / 7)])
def test_qgz_reduces_in_two_quantized_hops_with_the_analytic_bytes(
    results: dict, name: str, fraction: float
) -> None:
    """qgZ with nodes of 2: per step, each trainable segment's gradient crosses the node group
    as h packed rows of N chunks and the lane across nodes as N packed rows of one chunk, once
    per micro-batch; nothing else carries gradients. Against plain ZeRO-3's reduce-scatter of
    fp32 (4 bytes an element), the lane (the inter-node link) sends about a sixteenth at int4
    (the default, as DeepSpeed's) and an eighth at int8, plus the scales."""
    plain = results["plain"][0]["grad_counted"][0]
    plain_bytes = sum(plain.values())
    for r in results[name]:
        for counted in r["grad_counted"]:
            assert counted.keys() == {"hpz", "hpz_lane"}, counted
            for group, nbytes in r["grad_expected"].items():
                assert _within(counted[group], nbytes), (group, counted, r["grad_expected"])
            assert counted["hpz_lane"] < plain_bytes * fraction
    int4, int8 = results["qgz"][0]["grad_counted"][0], results["qgz8"][0]["grad_counted"][0]
    assert int4["hpz_lane"] < int8["hpz_lane"] * 0.55  # half the codes, the same scales


def _accumulated_errors(grads: dict, name: str) -> list[float]:
    """Per step t, summed over ranks: the norm of the sum over steps <= t of the quantized
    run's reduced gradients minus the exact run's (the error an optimizer integrates)."""
    out = [0.0] * len(grads["exact"][0]["grads"])
    for exact, got in zip(grads["exact"], grads[name], strict=True):
        drift = torch.zeros_like(exact["grads"][0])
        for t, (e, g) in enumerate(zip(exact["grads"], got["grads"], strict=True)):
            drift += g - e
            out[t] += float(drift.norm())
    return out


@pytest.mark.parametrize("bits", [4, 8])
def test_qgz_error_feedback_shrinks_the_accumulated_gradient_error(
    results: dict, bits: int
) -> None:
    """Same weights every step (learning rate 0), so the exact run's reduced gradients are the
    reference: the sum of what qgZ delivered drifts from the sum of the exact ones by T
    independent roundings without feedback, by the last residual with it. Measured, not
    assumed: from the second step on, the run with feedback has the smaller accumulated
    error; the state it holds is (world + N) * c fp32 elements per segment, more than the
    rank's shard of the gradient."""
    grads = results["grads"]
    without = _accumulated_errors(grads, f"int{bits}")
    feedback = _accumulated_errors(grads, f"int{bits}_feedback")
    assert without[0] > 0
    for t in range(1, len(without)):
        assert feedback[t] < without[t], (bits, t, feedback, without)
    shard = grads["exact"][0]["grads"][0].numel() * 4
    assert grads[f"int{bits}_feedback"][0]["feedback_bytes"] > shard
    assert grads[f"int{bits}"][0]["feedback_bytes"] is None


def test_error_feedback_without_qgz_is_refused_naming_the_key() -> None:
    zero = {"stage": 3, "zero_quantized_gradients_error_feedback": True}
    raw = {"train_batch_size": 1, "zero_optimization": zero}
    with pytest.raises(ConfigError, match=r"error_feedback.*needs .*zero_quantized_gradients"):
        check_supported(load_config(raw, world_size=1))


def test_qgz_without_a_node_dimension_is_refused(results: dict) -> None:
    for message in results["qgz_alone"]:
        assert "zero_optimization.zero_quantized_gradients" in message, message
        assert "zero_hpz_partition_size" in message, message


@pytest.mark.parametrize("name", ["plain", "qwz", "hpz", "qwz_hpz", "qwz_bf16", "qgz", "qgz8"])
def test_the_estimate_prices_each_step_as_the_engine_counts_it(results: dict, name: str) -> None:
    """`partita.estimate.zeropp.price`, from the units `describe_module` finds before the
    engine exists: per step and per group (so per link, nodes of 2), the gathers' and the
    gradient reductions' bytes equal the counters', and hpZ's secondary copy the bytes the
    units hold."""
    for r in results[name]:
        priced = r["price"]
        for counted, grads in zip(r["counted"], r["grad_counted"], strict=True):
            assert counted == priced.gather, (name, counted, priced.gather)
            assert grads == priced.reduce, (name, grads, priced.reduce)
        assert r["secondary_bytes"] == priced.secondary_bytes


def test_the_estimate_prices_error_feedback_memory(results: dict) -> None:
    for name in ("int4_feedback", "int8_feedback"):
        for r in results["grads"][name]:
            assert r["feedback_bytes"] == r["price"].feedback_bytes > 0
    assert results["grads"]["int4"][0]["price"].feedback_bytes == 0


def test_a_skipped_step_clears_error_feedback_and_the_next_starts_afresh(results: dict) -> None:
    """fp16, qgZ with error feedback, learning rate 0: rank 0's gradient holds an inf in step
    1's first micro-batch, so that step's reductions carry inf/nan residuals and the step is
    skipped on every rank. After it the residuals are gone (0 bytes held; the steps before and
    after hold them), and step 2's reduced gradients equal, bitwise on every rank, those of a
    run that starts at step 2's batch with no feedback history. The run that never overflowed
    reaches step 2 with its history and reduces differently, so the equality is the clearing's
    doing, not feedback's absence of effect."""
    runs = results["overflow"]
    poisoned = False
    for rank in range(WORLD):
        over, fresh, kept = (runs[name][rank] for name in ("overflow", "fresh", "history"))
        assert over["applied"] == [step != SKIPPED for step in range(STEPS)], over["applied"]
        assert over["feedback_after"][SKIPPED] == 0
        assert over["feedback_after"][SKIPPED - 1] > 0 and over["feedback_after"][AFTER] > 0
        assert over["grads"][AFTER].equal(fresh["grads"][0]), rank
        assert not kept["grads"][AFTER].equal(fresh["grads"][0]), rank
        assert kept["applied"] == [True] * STEPS
        poisoned |= not bool(over["grads"][SKIPPED].isfinite().all())
    assert poisoned  # the forced overflow reached the reduced gradients


def test_qwz_at_stage_0_is_refused_naming_the_key() -> None:
    raw = {"train_batch_size": 1, "zero_optimization": {"stage": 0, "zero_quantized_weights": True}}
    with pytest.raises(ConfigError, match=r"zero_optimization\.zero_quantized_weights.*stage 1-3"):
        check_supported(load_config(raw, world_size=1))


@pytest.mark.parametrize("stage", [1, 2])
def test_qwz_at_stages_1_2_quantizes_the_all_gather_of_the_updated_weights(
    results: dict, stage: int
) -> None:
    """[Note: quantized all-gather of stages 1-2]: each step's all-gather of the updated
    weights moves the layouts' figure (packed int8 plus scales; exact without the option) within
    1%, a quarter of fp32's bytes and the same as under bf16; every replica holds the same
    (dequantized) weights; the losses stay within 1% of the exact run's and differ from them."""
    exact, quantized = results["sharded"][(stage, False)], results["sharded"][(stage, True)]
    for plain, qwz in zip(exact, quantized, strict=True):
        assert plain["counted"] == [plain["expected"]] * STEPS
        assert all(_within(c, qwz["expected"]) for c in qwz["counted"]), qwz
        assert 0.25 <= qwz["expected"] / plain["expected"] <= 0.26
        assert plain["equal"] and qwz["equal"]
        for got, want in zip(qwz["losses"], plain["losses"], strict=True):
            assert abs(got - want) <= 0.01 * want
        assert qwz["losses"][1:] != plain["losses"][1:]  # later forwards saw quantized weights
    bf16 = results["sharded"][(2, "bf16")]
    if stage == 2:
        assert [r["expected"] for r in bf16] == [r["expected"] for r in quantized]
