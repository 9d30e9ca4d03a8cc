"""Step times of the planner's candidates measured side by side, for `bench_estimate --plan_cap`.

[Note: side-by-side step times]
On the 2-core machines this project is measured on, one configuration's median step moved
10-27% between runs minutes apart (plan_cap_10m.md, runs 7-8: z1 fp32 0.661 s, then 0.841 s,
the same code), and within a run steps spread +-15% with the process CPU time moving with
the wall time: the machine itself runs faster or slower from minute to minute. Stages 0-3 of
a small model differ by less than that, so candidates trained one after another, each in its
own pair of processes, cannot be ordered (runs 4-8 never could).

Here every candidate's engine is built in the same two rank processes, each on its own copy
of the model (same seed), and the engines take their steps in turn: step k of every candidate
runs within a few seconds of step k of every other, in a rotating order (a candidate is not
always first or after the same neighbour), both ranks starting each step together (a
barrier). A slow minute then slows every candidate's step k alike, and the ratio of two
candidates' times at the same k keeps their difference. Each candidate's figure is the median
of its steps (the slower rank's time per step); a pair is compared by the median over k of
their per-step ratio, and called apart only by a one-sided sign test over the paired steps
at level `ALPHA` (with 30 steps: one faster at 22 or more of them). Anything closer is a tie
this machine cannot break.

Memory is not measured here (engines side by side share one process's peak): the peaks come
from the fresh-process runs (`bench_estimate._measure`).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch

ALPHA = 0.01
"""One-sided sign test level: candidate A counts as faster than B when A's step was the
faster at so many of the n paired steps that n fair coin flips would show as many heads with
probability below this."""


def side_by_side_worker(
    name: str,
    cands: list[tuple[str, int, str, str, bool]],
    warmup: int,
    steps: int,
) -> dict[str, list[float]]:
    """One rank: an engine per candidate (label, stage, offload_optimizer, offload_param,
    checkpointing) on its own GPT-2 `name`, `warmup` untimed steps each, then `steps` timed
    steps each, taken in turn in a rotating order; per candidate, this rank's step times."""
    import torch.distributed as dist

    import partita
    from bench_estimate import MICRO_BATCH, SEQ, SHAPES, build

    engines = {}
    for label, stage, opt, param, ckpt in cands:
        model, config = build(name, stage, opt, param, ckpt)
        engines[label], *_ = partita.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(dist.get_rank())
    vocab = SHAPES[name]["vocab_size"]
    labels = list(engines)
    times: dict[str, list[float]] = {k: [] for k in labels}
    for k in range(warmup + steps):
        shift = k % len(labels)
        for label in labels[shift:] + labels[:shift]:
            engine = engines[label]
            x = torch.randint(0, vocab, (MICRO_BATCH, SEQ), generator=g)
            dist.barrier()
            start = time.perf_counter()
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
            if k >= warmup:
                times[label].append(time.perf_counter() - start)
    for engine in engines.values():
        engine.destroy()
    return times


def slower_rank(per_rank: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per candidate, each step's time on the slower rank (a step ends when both have)."""
    return {
        label: [max(ts) for ts in zip(*(r[label] for r in per_rank), strict=True)]
        for label in per_rank[0]
    }


def sign_test(wins: int, n: int) -> float:
    """P(at least `wins` heads in `n` fair coin flips): the one-sided sign test's p-value."""
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2**n


def compare(a: list[float], b: list[float]) -> dict[str, Any]:
    """`a` against `b` (step times at the same k): the median ratio a/b, at how many steps each
    was the faster, and the verdict ("a faster", "b faster" or "tied", by `sign_test` at
    `ALPHA`; equal times count for neither)."""
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    a_wins, b_wins = sum(r < 1 for r in ratios), sum(r > 1 for r in ratios)
    n = a_wins + b_wins
    p_a, p_b = (sign_test(w, n) if n else 1.0 for w in (a_wins, b_wins))
    apart = "a faster" if p_a < ALPHA else "b faster" if p_b < ALPHA else "tied"
    return {
        "ratio": statistics.median(ratios), "a_wins": a_wins, "b_wins": b_wins,
        "p_a_faster": p_a, "verdict": apart,
    }  # fmt: skip


def verdict(chosen: str | None, within: list[str], times: dict[str, list[float]]) -> dict[str, Any]:
    """The choice against every other candidate within the cap: "fastest" when none is
    faster by `compare`; else "slower", naming those that are, with their ratio and wins."""
    if chosen is None or chosen not in times:
        return {"speed": "no choice", "faster_than_chosen": []}
    faster = []
    for other in within:
        if other == chosen or other not in times:
            continue
        c = compare(times[other], times[chosen])
        if c["verdict"] == "a faster":
            faster.append({"config": other, **c})
    return {"speed": "slower" if faster else "fastest", "faster_than_chosen": faster}


def cap_table(
    name: str,
    cap_mib: float,
    rows: list[dict[str, Any]],
    chosen: str | None,
    times: dict[str, list[float]],
    result: dict[str, Any],
) -> str:
    """Markdown for one cap: per candidate (rows: label, fits, predicted and measured peak in
    MiB, within cap, predicted step or None) the side-by-side median step, its ratio to the
    choice's and the steps it won against it."""
    head = (
        f"cap {cap_mib:.1f} MiB per rank ({name}): chosen {chosen}; side by side over "
        f"{len(next(iter(times.values()), []))} steps: {result['speed']}"
    )
    if result["faster_than_chosen"]:
        head += (
            " (faster: "
            + ", ".join(
                f"{f['config']} x{f['ratio']:.3f}, won {f['a_wins']}/{f['a_wins'] + f['b_wins']}"
                for f in result["faster_than_chosen"]
            )
            + ")"
        )
    lines = [
        head, "",
        "| config | fits (predicted) | predicted peak MiB | measured peak MiB | within cap "
        "| predicted step s | measured step s (median) | / chosen (median ratio) "
        "| steps faster than chosen |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        t = times.get(r["label"])
        pred = "-" if r["predicted_step"] is None else f"{r['predicted_step']:.3f}"
        ratio = wins = "-"
        if t and chosen in times and r["label"] != chosen:
            c = compare(t, times[chosen])
            ratio, wins = f"{c['ratio']:.3f}", f"{c['a_wins']}/{c['a_wins'] + c['b_wins']}"
        median = f"{statistics.median(t):.3f}" if t else "-"
        lines.append(
            f"| {r['label']} | {'yes' if r['fits'] else 'no'} | {r['predicted_peak']:.1f} "
            f"| {r['measured_peak']:.1f} | {'yes' if r['within'] else 'NO'} | {pred} | {median} "
            f"| {ratio} | {wins} |"
        )
    return "\n".join(lines)
