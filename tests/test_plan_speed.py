"""The planner benchmark's speed verdict (`benchmarks/plan_speed.py`): a candidate counts as
faster than the planner's choice only by a one-sided sign test over paired steps; the rest
is a tie. Pure arithmetic on given step times: nothing here is timed."""

from __future__ import annotations

import math

from benchmarks import plan_speed


def test_sign_test_is_the_binomial_tail() -> None:
    assert plan_speed.sign_test(0, 10) == 1.0
    assert plan_speed.sign_test(10, 10) == 2.0**-10
    assert math.isclose(plan_speed.sign_test(8, 10), (45 + 10 + 1) / 1024)
    # At 30 paired steps the level 0.01 needs 22 wins: 21 is not enough.
    assert plan_speed.sign_test(22, 30) < plan_speed.ALPHA < plan_speed.sign_test(21, 30)


def test_a_candidate_faster_at_nearly_every_step_is_apart_and_a_mixed_one_ties() -> None:
    chosen = [1.0] * 30
    faster = [0.9] * 27 + [1.1] * 3
    mixed = [0.9] * 20 + [1.1] * 10  # 20 of 30: p = 0.049, not below 0.01
    c = plan_speed.compare(faster, chosen)
    assert (c["verdict"], c["a_wins"], c["b_wins"]) == ("a faster", 27, 3)
    assert plan_speed.compare(chosen, faster)["verdict"] == "b faster"
    assert plan_speed.compare(mixed, chosen)["verdict"] == "tied"
    # Equal steps count for neither side.
    assert plan_speed.compare(chosen, chosen)["verdict"] == "tied"


def test_verdict_names_only_candidates_within_the_cap_that_are_faster() -> None:
    times = {
        "chosen": [1.0] * 30,
        "faster but over the cap": [0.5] * 30,
        "faster": [0.95] * 25 + [1.05] * 5,
        "slower": [1.2] * 30,
    }
    within = ["chosen", "faster", "slower"]
    v = plan_speed.verdict("chosen", within, times)
    assert v["speed"] == "slower"
    assert [f["config"] for f in v["faster_than_chosen"]] == ["faster"]
    assert plan_speed.verdict("faster", within, times)["speed"] == "fastest"
    assert plan_speed.verdict(None, within, times)["speed"] == "no choice"


def test_slower_rank_takes_each_steps_larger_time() -> None:
    ranks = [{"a": [1.0, 3.0]}, {"a": [2.0, 1.0]}]
    assert plan_speed.slower_rank(ranks) == {"a": [2.0, 3.0]}
