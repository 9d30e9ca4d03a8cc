"""The planner under a memory cap: the configuration `partita plan` picks for a per-rank cap
runs within that cap.

The cap is an input, as a user's machine would give it: 370 MiB per CPU rank for a ~9M
parameter GPT-2 at micro-batch 4 x 128 tokens, fp32, 2 ranks, of which the planner uses all but
`HEADROOM`. With it no configuration that keeps all activations fits (the estimator puts
each at 350 MiB or more, over the 340 MiB it allows), so the planner must pick one with
activation checkpointing; the chosen configuration then trains 3 steps in fresh processes and
each rank's peak RSS over its baseline (taken after imports, before the model is built) stays
under the cap. Which of the fitting candidates is fastest is measured by
``benchmarks/bench_estimate.py --plan_cap 300MiB,330MiB,370MiB,400MiB,445MiB``, all candidates
side by side in one pair of ranks (timings are not asserted in tests).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from partita.estimate import (
    Candidate,
    Hardware,
    ModelShape,
    candidates,
    estimate,
    from_hf_config,
)
from partita.estimate.calibrate import calibration_depth, rank_threads
from partita.estimate.plan import HEADROOM, Rates, ds_config, rank, step_time
from partita.testing import run_distributed

MIB = 2**20
CAP = 370 * MIB
RANKS, MICRO_BATCH, SEQ, STEPS = 2, 4, 128, 3
SHAPE = {"n_layer": 6, "n_embd": 256, "n_head": 4, "n_positions": 256, "vocab_size": 16384}
# Fixed rates (a 2-core CPU's order of magnitude) so the choice does not depend on this
# machine's speed; the benchmark calibrates them instead.
RATES = Rates(flops=50e9, link_bandwidth=1e9, adam_rate=2e8)


def _config(shape: dict[str, int] = SHAPE) -> Any:
    from transformers import GPT2Config

    return GPT2Config(**shape, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _plan() -> tuple[list[Any], Candidate]:
    shape = from_hf_config(_config(), MICRO_BATCH, SEQ, torch.float32)
    hw = Hardware(RANKS, host_memory=RANKS * CAP, accelerator="cpu", headroom=HEADROOM)
    ests = [
        estimate(shape, c, hw)
        for c in candidates("fp32", None)
        if "nvme" not in (c.offload_optimizer, c.offload_param)
    ]
    ranked = rank(ests, shape.trainable, MICRO_BATCH * SEQ, RATES)
    assert ranked, "nothing fits the cap: the test's cap no longer tests a choice"
    return ests, ranked[0][0].candidate


def train_under_plan(
    config: dict[str, Any], checkpointing: bool, shape: dict[str, int] = SHAPE
) -> int:
    """One rank: baseline after imports, build, initialize, three steps; peak RSS over base,
    less the file-backed pages (libraries' code) mapped meanwhile: reclaimable, and 26 MiB in
    one virtual environment, 65 in a fresh one, for the same run (`host_file_rss`)."""
    import transformers.loss.loss_utils
    import transformers.masking_utils  # noqa: F401  (code is not training memory)
    from transformers import GPT2LMHeadModel

    import partita
    from partita.platform.accelerator import host_file_rss, host_peak_rss, host_rss

    with open("/proc/self/clear_refs", "w") as f:  # VmHWM from here on
        f.write("5")
    base, base_files = host_rss(), host_file_rss()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(_config(shape))
    if checkpointing:
        model.gradient_checkpointing_enable()  # HF per-block checkpointing
    engine, *_ = partita.initialize(model=model, config=config)
    del model
    g = torch.Generator().manual_seed(engine.global_rank)
    for _ in range(STEPS):
        x = torch.randint(0, shape["vocab_size"], (MICRO_BATCH, SEQ), generator=g)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    peak = host_peak_rss() - base - (host_file_rss() - base_files)
    engine.destroy()
    return peak


def test_the_cap_rules_out_keeping_every_activation() -> None:
    """The cap binds: every configuration without activation checkpointing is predicted over
    it, so the choice is a real one."""
    ests, chosen = _plan()
    assert chosen.checkpointing
    assert all(not e.fits for e in ests if not e.candidate.checkpointing)


def test_the_planners_choice_runs_within_the_cap() -> None:
    _, chosen = _plan()
    config = ds_config(chosen, MICRO_BATCH)
    peaks = run_distributed(train_under_plan, RANKS, config, chosen.checkpointing, timeout=600)
    print(chosen.label, [f"{p / MIB:.0f} MiB" for p in peaks])
    for r, peak in enumerate(peaks):
        assert peak <= CAP, (
            f"rank {r}: {chosen.label} peaked {peak / MIB:.0f} MiB over its baseline, "
            f"cap {CAP / MIB:.0f} MiB"
        )


def test_checkpointing_recomputes_only_the_blocks_it_wraps() -> None:
    """Activation checkpointing runs each wrapped block's forward again in backward; the
    embedding, the tied LM head and the loss run once. So the predicted cost of checkpointing
    is 2 FLOPs per token per parameter *inside the blocks*, not per parameter of the model
    (for this GPT-2 the LM head is nearly half of it)."""
    shape = from_hf_config(_config(), MICRO_BATCH, SEQ, torch.float32)
    block = sum(n for unit in shape.units[: SHAPE["n_layer"]] for n in unit)
    assert shape.recomputed == block < shape.trainable
    hw = Hardware(RANKS, accelerator="cpu")
    tokens = MICRO_BATCH * SEQ
    off, on = (
        rank([estimate(shape, Candidate(1, precision="fp32", checkpointing=c), hw)],
             shape.trainable, tokens, RATES, shape.recomputed)[0][1]
        for c in (False, True)
    )  # fmt: skip
    assert on.compute - off.compute == pytest.approx(2 * block * tokens / RATES.flops)
    assert on.comm == off.comm and on.offload == off.offload


def test_a_count_alone_recomputes_every_parameter() -> None:
    """Without the blocks known (a parameter count), the planner keeps the upper bound: the
    whole forward runs again."""
    shape = ModelShape.from_count(10**9)
    assert shape.recomputed == shape.trainable


def test_equal_predicted_times_rank_the_smaller_peak_first() -> None:
    """Stages 1 and 2 move the same bytes and step the same shard, so their predicted times
    are equal; the planner then prefers the one that leaves more memory free. With no
    activations known the step's moment decides the peak: stage 1 holds every full gradient
    there, stage 2 only its pooled reduce buffers, so stage 2 comes first."""
    shape = ModelShape.from_count(100_000_000, 10_000_000)
    hw = Hardware(RANKS, host_memory=2**40, accelerator="cpu")
    ests = [estimate(shape, Candidate(s, precision="fp32"), hw) for s in (1, 2)]
    ranked = rank(ests, shape.trainable, MICRO_BATCH * SEQ, RATES)
    assert ranked[0][1].total == ranked[1][1].total
    first, second = (e.total("device") + e.total("host") for e, _ in ranked)
    assert first < second
    assert [e.candidate.stage for e, _ in ranked] == [2, 1]


# --- the step-time model follows the engine's schedule; calibration on the rank's threads ----


def _timings(accelerator: str, rates: Rates) -> dict[int, Any]:
    shape = from_hf_config(_config(), MICRO_BATCH, SEQ, torch.float32)
    device = None if accelerator == "cpu" else 2**40
    hw = Hardware(RANKS, device_memory=device, host_memory=2**40, accelerator=accelerator)
    tokens = MICRO_BATCH * SEQ
    return {
        s: step_time(
            estimate(shape, Candidate(s, precision="fp32"), hw), shape.trainable, tokens, rates
        )
        for s in range(4)
    }


def _one_pass(rates: Rates) -> float:
    """Seconds of one collective pass over the test model's fp32 parameters at 2 ranks."""
    shape = from_hf_config(_config(), MICRO_BATCH, SEQ, torch.float32)
    return shape.trainable * 4 * (RANKS - 1) / RANKS / rates.link_bandwidth


def test_on_a_gpu_gradient_reductions_hide_behind_backward_and_gathers_do_not() -> None:
    """Stage 0 all-reduces and stages 1-3 reduce-scatter gradients in buckets during backward,
    which hides them behind its compute; stages 1-2 all-gather the updated shards after the
    optimizer step, before the next forward can run, and stage 3's units wait for their
    gathers in forward and backward: those passes add to the step."""
    rates = Rates(flops=1e12, link_bandwidth=10e9)  # compute >> communication
    one = _one_pass(rates)
    t = _timings("cuda", rates)
    assert t[0].comm == 0.0
    assert t[1].comm == t[2].comm == pytest.approx(one)
    assert t[3].comm == pytest.approx(2 * one)
    assert t[0].total < t[2].total < t[3].total


def test_on_cpu_ranks_collectives_beside_compute_take_their_cpu_share() -> None:
    """CPU ranks fill the cores with compute, so a gradient reduction that runs beside it
    (stage 0's all-reduce, the others' reduce-scatter) takes its own CPU work from it; stages
    1-2 wait for the post-step all-gather whole, stage 3 for its gathers. The optimizer step
    runs over the whole model at stage 0 and over the shard at stages 1-3."""
    rates = Rates(flops=50e9, link_bandwidth=1e9, adam_rate=2e8, comm_cpu_share=0.25)
    one = _one_pass(rates)
    t = _timings("cpu", rates)
    assert t[0].comm == pytest.approx(0.25 * 2 * one)
    assert t[1].comm == t[2].comm == pytest.approx(0.25 * one + one)
    assert t[3].comm == pytest.approx(0.25 * one + 2 * one)
    assert t[0].offload == pytest.approx(2 * t[2].offload)
    every = _timings("cpu", Rates(flops=50e9, link_bandwidth=1e9, adam_rate=2e8))
    assert every[0].comm == every[2].comm == pytest.approx(2 * one)  # share 1: nothing hides


def test_rank_threads_share_the_cores() -> None:
    assert [rank_threads(r, cpus=16) for r in (1, 2, 3, 32)] == [16, 8, 5, 1]


def test_deep_models_are_calibrated_on_fewer_blocks() -> None:
    """Each block costs 6 x its parameters x tokens; the copy keeps as many as the budget
    holds beside the embeddings and head, never fewer than one."""
    tokens = 2048
    assert calibration_depth(32, 10**6, 10**6, tokens, budget=6 * tokens * 11e6) == 10
    assert calibration_depth(32, 10**6, 10**6, tokens, budget=6 * tokens * 1e9) == 32
    assert calibration_depth(32, 2 * 10**8, 2 * 10**8, tokens, budget=1e9) == 1


def test_the_compute_calibration_runs_the_model_on_the_ranks_threads(monkeypatch: Any) -> None:
    """The rate is the model's own forward and backward (a copy with fewer blocks when it is
    deep), on the threads given, in 6-FLOPs-per-parameter-per-token units; torch's thread
    setting is restored afterwards."""
    from partita.estimate import calibrate

    tiny = {"n_layer": 4, "n_embd": 32, "n_head": 2, "n_positions": 32, "vocab_size": 128}
    seen: dict[str, int] = {}
    built = calibrate._built

    def spy(config: Any, dtype: torch.dtype, device: str) -> torch.nn.Module:
        seen["layers"], seen["threads"] = config.n_layer, torch.get_num_threads()
        return built(config, dtype, device)

    monkeypatch.setattr(calibrate, "_built", spy)
    before = torch.get_num_threads()
    want = 1 if before > 1 else 2
    shape = from_hf_config(_config(tiny), 2, 16, torch.float32)
    block = shape.blocks // 4
    budget = 6 * 32 * (shape.trainable - shape.blocks + 2 * block)
    rate = calibrate.calibrate_model_flops(
        _config(tiny), 2, 16, torch.float32, threads=want, seconds=0.0, budget=budget
    )
    assert seen == {"layers": 2, "threads": want}
    assert torch.get_num_threads() == before
    assert 0 < rate < float("inf")


def _plan_argv(model_dir: Any, host_memory: str, out: Any) -> list[str]:
    """``partita plan`` on the test model saved in `model_dir`, CPU ranks, the fixed rates."""
    return [
        "--model", str(model_dir), "--cpu", "--num_gpus", str(RANKS),
        "--host_memory", host_memory, "--micro_batch", str(MICRO_BATCH),
        "--seq_len", str(SEQ), "--precision", "fp32", "--flops", str(RATES.flops),
        "--adam_rate", str(RATES.adam_rate), "--link_bandwidth", str(RATES.link_bandwidth),
        "--output", str(out),
    ]  # fmt: skip


def test_the_planner_names_the_faster_configurations_its_headroom_keeps_out(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """At this cap the headroom leaves 340 MiB, and every configuration that keeps its
    activations is predicted at 350.5-368.5 MiB: within the cap in full, predicted faster
    than the checkpointed choice, but not within the headroom. The planner keeps to its
    headroom and says what it gave up, naming each such configuration (side by side they ran
    4-14% faster than the choice: ``benchmarks/results/plan_cap_10m.md``, runs 9-10)."""
    import json
    import re

    from partita.estimate.cli import plan_main

    _config().save_pretrained(tmp_path)
    out = tmp_path / "ds_config.json"
    argv = _plan_argv(tmp_path, f"{RANKS * CAP // MIB}MiB", out)
    assert plan_main(argv) == 0
    text = capsys.readouterr().out
    _, chosen = _plan()
    assert f"chose {chosen.label};" in text
    assert json.loads(out.read_text()) == ds_config(chosen, MICRO_BATCH)
    named = re.findall(r"^note: (.+) is predicted \d+% faster .* --headroom kept free", text, re.M)
    kept_out = {
        e.candidate.label
        for e in _plan()[0]
        if not e.candidate.checkpointing and "nvme" not in e.candidate.label
    }
    assert named and set(named) <= kept_out, text
    # With no headroom asked for, nothing is kept out and nothing is said.
    assert plan_main([*argv, "--headroom", "0"]) == 0
    assert "--headroom kept free" not in capsys.readouterr().out


def test_plan_takes_the_share_of_collectives_compute_cannot_hide(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--comm_cpu_share`` reaches the step model: the comm column is the model's for the
    share given (1: nothing hidden), and a share outside (0, 1] is refused naming the flag."""
    from partita.estimate.cli import plan_main

    _config().save_pretrained(tmp_path)
    argv = _plan_argv(tmp_path, "64GiB", tmp_path / "c.json")
    comm = {}
    for share in ("1", "0.25"):
        assert plan_main([*argv, "--comm_cpu_share", share]) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines()]
        comm[share] = {" ".join(r[:-5]): float(r[-3]) for r in rows if r and r[0].startswith("z")}
    shape = from_hf_config(_config(), MICRO_BATCH, SEQ, torch.float32)
    for share, got in comm.items():
        rates = replace(RATES, comm_cpu_share=float(share))
        ests = [estimate(shape, c, Hardware(RANKS, host_memory=64 << 30, accelerator="cpu"))
                for c in candidates("fp32", None) if "nvme" not in c.label]  # fmt: skip
        want = {e.candidate.label: t.comm for e, t in rank(ests, shape.trainable,
                MICRO_BATCH * SEQ, rates, shape.recomputed)}  # fmt: skip
        assert got.keys() == want.keys()
        assert all(got[k] == pytest.approx(want[k], rel=1e-2, abs=1e-3) for k in got), (got, want)
    assert comm["0.25"] != comm["1"]
    with pytest.raises(SystemExit):
        plan_main([*argv, "--comm_cpu_share", "0"])
    assert "--comm_cpu_share" in capsys.readouterr().err


def test_a_trial_takes_the_faster_configuration_the_headroom_kept_out(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """With ``--trial`` the planner runs what its headroom kept out, fastest first, and takes
    the first that peaks within the cap (less `TRIAL_MARGIN`): at this cap a configuration
    that keeps its activations (``benchmarks/results/plan_cap_10m.md``: side by side they ran
    4-14% faster than the checkpointed choice). That choice, run again here, stays within
    the cap."""
    import json
    import re

    from partita.estimate.cli import plan_main
    from partita.estimate.trial import TRIAL_MARGIN
    from partita.estimate.units import parse_bytes

    _config().save_pretrained(tmp_path)
    out = tmp_path / "ds_config.json"
    argv = [*_plan_argv(tmp_path, f"{RANKS * CAP // MIB}MiB", out), "--trial"]
    assert plan_main(argv) == 0
    text = capsys.readouterr().out
    tried = re.findall(r"^trial: (.+) \(predicted .*\) peaked at (.+), (within|over) ", text, re.M)
    assert tried, text
    label, peak, verdict = tried[-1]
    assert verdict == "within" and f"chose {label};" in text, text
    assert parse_bytes(peak, "peak") <= CAP * (1 - TRIAL_MARGIN) * 1.01  # printed to 3 digits
    assert "ckpt" not in label  # the headroom's choice was checkpointed (the test above)
    config = json.loads(out.read_text())
    peaks = run_distributed(train_under_plan, RANKS, config, False, timeout=600)
    assert max(peaks) <= CAP, (label, [p / MIB for p in peaks])


def test_a_trial_that_fails_is_a_result_not_a_crash(tmp_path: Any) -> None:
    """A configuration whose ranks fail (here: NVMe offload to a folder that cannot exist) comes
    back as a `TrialRun` naming the error, so the planner goes on to the next one."""
    from partita.estimate.trial import trial_peaks

    _config().save_pretrained(tmp_path)
    bad = Candidate(3, offload_optimizer="nvme", precision="fp32")
    run = trial_peaks(str(tmp_path), bad, RANKS, MICRO_BATCH, SEQ, "cpu", nvme_path="/proc/x")
    assert run.error and run.peaks == (), run
