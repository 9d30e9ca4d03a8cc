"""The estimator's sequence dimension: one Ulysses rank's activations, their fit over the
sequence length, and the longest sequence that fits (``partita estimate --sp/--longest``)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
import torch

from partita.estimate import EstimateError, Hardware, estimate, from_hf_config
from partita.estimate.cli import estimate_main
from partita.estimate.longest import (
    FIT_LENGTHS,
    fit_sequence,
    longest_sequence,
    shape_at,
)
from partita.estimate.memory import Candidate
from partita.estimate.model import meta_model, trace_rank

pytestmark = pytest.mark.filterwarnings("ignore")


def _llama(kv: int = 4, impl: str = "eager", layers: int = 2) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=128, intermediate_size=344, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=kv, vocab_size=1024,
        attn_implementation=impl,
    )  # fmt: skip


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_sp_divides_position_wise_activations_and_the_score_heads(impl: str) -> None:
    """With all heads their own key/value (nothing repeated, no fused view kept alive), one
    rank at S tokens and degree sp saves exactly: every position-wise storage as the model
    does at S/sp tokens, and every attention-score storage sp times its size at S/sp (h/sp
    heads of S x S, not h heads of (S/sp)^2), read storage by storage from two traces."""
    model = meta_model(_llama(impl=impl), torch.float32)
    seq = 1024
    for sp in (2, 4):
        plain = trace_rank(model, 1, seq // sp)
        plain_twice = trace_rank(model, 1, 2 * seq // sp)
        rank = trace_rank(model, 1, seq // sp, sp)
        assert [b for b, _ in rank.storages] == [b for b, _ in plain.storages]
        quadratic = 0
        for (_, r), (_, p), (_, p2) in zip(
            rank.storages, plain.storages, plain_twice.storages, strict=True
        ):
            if p2 == 4 * p:  # grows with the square of the length: attention's scores
                assert r == sp * p
                quadratic += 1
            else:
                assert r == p
        assert quadratic >= 2  # one score matrix per layer at least: the test sees them


def test_fused_attention_keeps_nothing_quadratic_and_sp_divides_all() -> None:
    """Counted as a fused kernel (flash / memory-efficient SDPA), attention keeps no score
    matrix: a rank's activations have no quadratic term, and at S and degree sp they are the
    model's at S/sp (all heads their own key/value) but for the output's all-to-all copy: the
    kernel's output and the output projection's input are one storage at sp 1 (the kernels
    lay it out ``[b, s, h, d]``), two under Ulysses (a hidden-sized tensor more per layer and
    token). The traced math path keeps more."""
    config = _llama(impl="sdpa")
    fits = {sp: fit_sequence(config, 1, sp, torch.float32, "fused")[1] for sp in (1, 2, 4)}
    traced = fit_sequence(config, 1, 1, torch.float32, "traced")[1]
    for fit in fits.values():
        assert fit.total[2] == 0
    assert fits[2].total == fits[4].total  # a polynomial in the rank's own tokens
    copy = config.num_hidden_layers * config.hidden_size * 4  # bytes per token, fp32
    assert fits[2].total[1] == fits[1].total[1] + copy and fits[2].total[0] == fits[1].total[0]
    assert traced.total[2] > 0
    assert traced.profile(4096).saved > fits[1].profile(4096).saved


def test_the_fit_matches_a_trace_at_a_fourth_length() -> None:
    """Fitted from three traced lengths, the profile at a fourth equals its own trace,
    storage by storage, for GPT-2 (fused qkv) and a grouped-query Llama under Ulysses."""
    from transformers import GPT2Config

    gpt2 = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=4096, vocab_size=1024)
    for config, sp in ((gpt2, 1), (gpt2, 2), (_llama(kv=2, impl="sdpa"), 4)):
        shape, fit = fit_sequence(config, 2, sp, torch.float32)
        local = 1000
        assert local not in FIT_LENGTHS
        traced = trace_rank(meta_model(config, torch.float32), 2, local, sp)
        assert fit.sizes(local) == traced.storages
        assert fit.profile(local) == replace(traced, storages=())
        direct = from_hf_config(config, 2, local * sp, torch.float32, sp)
        assert shape_at(shape, fit, local * sp).activations == replace(
            direct.activations, storages=()
        )


def test_sizes_that_are_not_quadratic_in_the_length_are_refused() -> None:
    """A storage growing with the cube of the length fits three lengths exactly and misses the
    fourth: refused, not extrapolated; a quadratic one passes."""
    from partita.estimate.activations import ActivationProfile
    from partita.estimate.longest import fit_from

    def trace(power: int) -> Any:
        return lambda n: ActivationProfile(n**power, (n**power,), (n,), n**power, ((0, n**power),))

    assert fit_from(trace(2), 1).profile(1000).saved == 1000**2
    with pytest.raises(EstimateError, match="do not grow as a quadratic"):
        fit_from(trace(3), 1)


def test_ulysses_saves_less_than_a_slice_where_its_copies_replace_views() -> None:
    """GPT-2 keeps its fused qkv storage alive through value's view; after the all-to-all
    the rank keeps only its own value: less than the model saves at S/sp tokens."""
    from transformers import GPT2Config

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=4096, vocab_size=1024)
    model = meta_model(config, torch.float32)
    plain = trace_rank(model, 1, 512)
    rank = trace_rank(model, 1, 512, 2)
    scores = sum(n for _, n in plain.storages if n >= 512 * 512)
    assert rank.saved < plain.saved + scores  # scores double (h/sp heads of 2x the length)


@pytest.fixture(scope="module")
def fits() -> dict[int, Any]:
    config = _llama(kv=2, impl="sdpa")
    return {sp: fit_sequence(config, 1, sp, torch.bfloat16) for sp in (1, 2, 4)}


_CANDIDATES = [Candidate(0, checkpointing=True), Candidate(3, "cpu", checkpointing=False)]


@pytest.mark.parametrize("cand", _CANDIDATES, ids=lambda c: c.label)
def test_the_longest_sequence_fits_and_one_step_more_does_not(
    fits: dict[int, Any], cand: Candidate
) -> None:
    """At the answer the estimate fits and sp tokens more does not, checked against
    activations traced directly at those lengths (not the fit)."""
    config = _llama(kv=2, impl="sdpa")
    hw = Hardware(4, 1, 1 << 30, headroom=0.08)
    for sp, (shape, fit) in fits.items():
        found = longest_sequence(shape, fit, cand, hw, 1 << 24)
        assert found.seq_len > 0 and found.seq_len % sp == 0 and not found.limit
        assert found.at is not None and found.at.fits
        assert found.beyond is not None and not found.beyond.fits
        at = from_hf_config(config, 1, found.seq_len, torch.bfloat16, sp)
        assert estimate(at, cand, hw).fits
        beyond = from_hf_config(config, 1, found.seq_len + sp, torch.bfloat16, sp)
        assert not estimate(beyond, cand, hw).fits


def test_the_longest_sequence_grows_with_memory_and_with_sp(fits: dict[int, Any]) -> None:
    cand = Candidate(2, checkpointing=True)
    table = {
        (sp, mib): longest_sequence(shape, fit, cand, Hardware(4, 1, mib << 20), 1 << 24).seq_len
        for sp, (shape, fit) in fits.items()
        for mib in (256, 512, 1024, 4096)
    }
    for sp in (1, 2, 4):
        row = [table[sp, mib] for mib in (256, 512, 1024, 4096)]
        assert row == sorted(row) and row[0] < row[-1], row
    for mib in (256, 512, 1024, 4096):
        column = [table[sp, mib] for sp in (1, 2, 4)]
        assert column == sorted(column) and column[0] < column[-1], column


def test_the_head_and_loss_hold_every_byte_the_vocabulary_adds() -> None:
    """'head+loss': what the final norm, the LM head and the loss keep. Two models that differ
    only in their vocabulary differ in their activations' peak by exactly the difference of
    that part (the logits and their transients), and it is a part, not all."""
    from transformers import LlamaConfig

    def fit(vocab: int) -> Any:
        config = LlamaConfig(
            hidden_size=128, intermediate_size=344, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
        )  # fmt: skip
        return fit_sequence(config, 1, 2, torch.float32, "fused")[1]

    small, large = fit(1024), fit(8192)
    local = 700
    peak = {f: f.profile(local).peak(False) for f in (small, large)}
    assert peak[large] - peak[small] == large.head_bytes(local) - small.head_bytes(local) > 0
    assert 0 < small.head_bytes(local) < small.profile(local).saved


def test_the_search_stops_at_max_seq_len_and_says_so(fits: dict[int, Any]) -> None:
    shape, fit = fits[2]
    found = longest_sequence(shape, fit, _CANDIDATES[0], Hardware(4, 1, 64 << 30), 4097)
    assert found.limit and found.seq_len == 4096 and found.beyond is None


def test_zero_shards_model_states_over_every_rank_with_sp() -> None:
    """Model states shard over dp x sp (all 4 ranks), so they do not change with sp; only the
    activations shrink."""
    config = _llama(kv=2, impl="sdpa")
    hw = Hardware(4, 1, 8 << 30)
    one, two = (from_hf_config(config, 1, 2048, torch.bfloat16, sp) for sp in (1, 2))
    for stage in (1, 3):
        a, b = (estimate(m, Candidate(stage), hw) for m in (one, two))
        assert a.model_states() == b.model_states() > 0
        acts = {e.candidate.stage: e.peaks["activations"] for e in (a, b)}
        assert b.peaks["activations"] < a.peaks["activations"], acts


@pytest.mark.parametrize(
    ("heads", "kv", "sp", "said"),
    [
        (4, 4, 3, "4 query heads do not divide by the sequence-parallel size 3"),
        (12, 6, 4, "6 key/value heads cannot be split over the sequence-parallel size 4"),
    ],
)
def test_sp_the_heads_cannot_split_is_refused_naming_key_and_sizes(
    heads: int, kv: int, sp: int, said: str
) -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=96, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv, vocab_size=256,
    )  # fmt: skip
    for call in (
        lambda: from_hf_config(config, 1, 12 * sp, torch.float32, sp),
        lambda: fit_sequence(config, 1, sp),
    ):
        with pytest.raises(EstimateError, match=f"sequence_parallel_size {sp}: .*{said}"):
            call()


def test_a_length_sp_does_not_divide_is_refused() -> None:
    with pytest.raises(EstimateError, match="seq_len 1001 does not divide by sequence_paral"):
        from_hf_config(_llama(), 1, 1001, torch.float32, 2)


def test_cli_refuses_sp_that_does_not_divide_the_ranks(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    _llama().save_pretrained(tmp_path)
    argv = ["--model", str(tmp_path), "--num_gpus", "4", "--device_memory", "8GB"]
    assert estimate_main([*argv, "--sp", "3"]) == 2
    err = capsys.readouterr().err
    assert "sequence_parallel_size 3 does not divide the 4 ranks" in err
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"sequence_parallel_size": 8}))
    assert estimate_main([*argv, "--ds_config", str(config)]) == 2
    assert "sequence_parallel_size 8 does not divide the 4 ranks" in capsys.readouterr().err


def test_cli_reads_sp_from_the_ds_config_and_prints_each_degree(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    _llama().save_pretrained(tmp_path)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"sequence_parallel_size": 2}))
    argv = ["--model", str(tmp_path), "--num_gpus", "4", "--device_memory", "8GB"]
    assert estimate_main([*argv, "--seq_len", "4096", "--ds_config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "sequence_parallel_size 2 (2048 per rank)" in out
    assert estimate_main([*argv, "--seq_len", "4096", "--sp", "1", "4"]) == 0
    out = capsys.readouterr().out
    assert "sequence_parallel_size 4 (1024 per rank)" in out and "x 4096 tokens\n" in out


def test_cli_longest_prints_a_row_per_degree_and_configuration(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    _llama().save_pretrained(tmp_path)
    argv = ["--model", str(tmp_path), "--num_gpus", "4", "--longest", "--checkpointing", "on"]
    assert estimate_main(argv) == 2  # no memory to fit
    assert "--longest needs a memory to fit: give --device_memory" in capsys.readouterr().err
    too_long = ["--model", str(tmp_path), "--num_gpus", "4", "--device_memory", "1GiB"]
    assert estimate_main([*too_long, "--seq_len", "65536", "--sp", "2"]) == 1
    assert "--longest finds the longest sequence that fits" in capsys.readouterr().out
    assert estimate_main([*argv, "--device_memory", "1GiB", "--sp", "1", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert len(rows) == 2 * 8  # no NVMe given: 8 checkpointed configurations per degree
    at = [next(i for i, word in enumerate(r) if i and word.isdigit()) for r in rows]
    by_sp = {(r[0], " ".join(r[1:i])): int(r[i]) for r, i in zip(rows, at, strict=True)}
    for (sp, label), seq in by_sp.items():
        assert seq % int(sp) == 0
        if sp == "2":
            assert seq > by_sp["1", label]
    (sp, label), seq = max(by_sp.items(), key=lambda kv: kv[1])
    assert f"longest: {seq} tokens at sequence_parallel_size {sp} with {label}\n" in out
    limit = _llama().max_position_embeddings
    said = f"answers above {limit} tokens pass the model's max_position_embeddings" in out
    assert said == (seq > limit)


def test_plan_writes_the_degree_and_plans_one_ranks_share(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """`plan --sp 2` predicts half the compute per rank and adds the all-to-alls' wait
    (`all_to_all_bytes`, checked against a real run below, half of it over links, twice per
    step and three times under checkpointing) to the collectives; it writes the key."""
    from partita.config import validate_config
    from partita.estimate.cli import plan_main
    from partita.estimate.ulysses import all_to_all_bytes

    _llama().save_pretrained(tmp_path)
    out = tmp_path / "ds_config.json"
    argv = ["--model", str(tmp_path), "--num_gpus", "4", "--device_memory", "80GB"]
    argv += ["--seq_len", "65536", "--attention", "fused", "--flops", "1e14"]
    argv += ["--link_bandwidth", "1MB", "--output", str(out)]
    times = {}
    for sp in (1, 2):
        assert plan_main([*argv, "--sp", str(sp)]) == 0
        config = json.loads(out.read_text())
        assert config.get("sequence_parallel_size", 1) == sp
        validate_config(config, world_size=4)
        rows = [line.split() for line in capsys.readouterr().out.splitlines()]
        # A ranking row: configuration, then step, compute, comm, offload, nvme seconds.
        times[sp] = {
            " ".join(r[:-5]): (float(r[-4]), float(r[-3])) for r in rows if r[:1] and r[0][0] == "z"
        }
    assert times[1] and times[2].keys() == times[1].keys()
    link = all_to_all_bytes(_llama(), 1, 65536, 2, 2) / 2 / 1e6  # seconds per pass
    for label, (compute, comm) in times[1].items():
        # Half the tokens per rank: half the compute (printed to 3 digits).
        assert times[2][label][0] == pytest.approx(compute / 2, rel=0.01)
        passes = 3 if label.endswith("ckpt") else 2
        assert times[2][label][1] - comm == pytest.approx(passes * link, rel=0.02)
    assert plan_main([*argv, "--sp", "1", "2"]) == 2
    assert "partita plan takes one --sp, got 1 2" in capsys.readouterr().err


def real_rank_saves(local: int) -> tuple[Any, int]:
    """On one rank of a live group: the tensors a real forward of a tiny Llama saves for
    backward through partita's Ulysses (`UlyssesHFAttention` around Transformers' SDPA, the
    whole world as the sequence group), counted as the estimator counts them, and the bytes
    its all-to-alls recorded over the forward and the backward."""
    from transformers import LlamaForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from partita.comm.counters import COUNTERS
    from partita.estimate.activations import trace_activations
    from partita.parallel.ulysses import UlyssesHFAttention
    from partita.zero.stage3.strategy import default_unit_modules

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama(kv=2, impl="sdpa")).train()
    core = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = UlyssesHFAttention(core, None)
    losses = []
    try:
        ids = torch.randint(0, 1024, (1, local))
        COUNTERS.reset()
        run = lambda m: losses.append(m(input_ids=ids, labels=ids).loss)  # noqa: E731
        profile = trace_activations(model, run, default_unit_modules(model))
        losses[0].backward()
        return profile, COUNTERS.bytes("all_to_all", "ulysses")
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = core


def test_a_real_ulysses_rank_saves_what_the_fused_count_says() -> None:
    """Two CPU ranks run a tiny grouped-query Llama through partita's Ulysses (CPU SDPA runs
    its fused kernel there): each rank's saved tensors are, storage for storage, the ones
    `trace_rank` counts with ``attention="fused"`` at the same degree; the traced math path
    counts more (the scores). Its all-to-alls record, forward and backward, twice what
    `all_to_all_bytes` (the planner's) says one forward sends."""
    from partita.estimate.ulysses import all_to_all_bytes
    from partita.testing import run_distributed

    local = 256
    ranks = run_distributed(real_rank_saves, 2, local, timeout=120)
    model = meta_model(_llama(kv=2, impl="sdpa"), torch.float32)
    fused = trace_rank(model, 1, local, 2, "fused")
    sent = all_to_all_bytes(_llama(kv=2), 1, 2 * local, 2, 4)
    assert all(recorded == 2 * sent > 0 for _, recorded in ranks)  # forward and backward
    for real, _ in ranks:
        assert sorted(real.storages) == sorted(fused.storages)
        assert (real.saved, real.block_saved, real.block_inputs, real.largest) == (
            fused.saved, fused.block_saved, fused.block_inputs, fused.largest,
        )  # fmt: skip
    assert trace_rank(model, 1, local, 2).saved > fused.saved


def _tiled_real_saves(local: int, tile: int) -> Any:
    """One process, real weights: a tiny Llama whose MLPs run as partita's `TiledMLP` and whose
    head and loss run as `TiledFusedLogitsLoss` (wired here, as a user would), its saved
    tensors counted as the estimator counts them."""
    import math

    from transformers import LlamaForCausalLM

    from partita.estimate.activations import trace_activations
    from partita.tiling import TiledFusedLogitsLoss, TiledMLP
    from partita.zero.stage3.strategy import default_unit_modules

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama(kv=2, impl="sdpa")).train()
    blocks = default_unit_modules(model)

    def mlp_fn(module: Any, x: torch.Tensor) -> torch.Tensor:
        return module.down_proj(module.act_fn(module.gate_proj(x)) * module.up_proj(x))

    for block in blocks:
        mlp = block.mlp
        mlp.forward = lambda x, m=mlp: TiledMLP.apply(  # type: ignore[method-assign]
            mlp_fn, m, x, math.ceil(x.shape[1] / tile), None
        )

    def loss_fn(head: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(head(x).float(), y)

    def run(m: Any) -> torch.Tensor:
        hidden = m.model(input_ids=ids).last_hidden_state
        shards = math.ceil(ids.numel() / tile)
        return TiledFusedLogitsLoss.apply(loss_fn, m.lm_head, hidden, ids, None, shards)

    ids = torch.randint(0, 1024, (1, local))
    return trace_activations(model, run, blocks)


def test_tiled_mlp_and_loss_keep_what_a_real_tiled_run_keeps() -> None:
    """The trace with ``Tiling`` saves, storage for storage, what a real run of the same tiny
    Llama with partita's tiled MLP and loss saves (attention counted as the fused kernel CPU
    SDPA runs), and far less than untiled: no MLP intermediates, no logits."""
    from partita.estimate.tiled import Tiling

    local, tile = 256, 64
    real = _tiled_real_saves(local, tile)
    model = meta_model(_llama(kv=2, impl="sdpa"), torch.float32)
    tiled = trace_rank(model, 1, local, 1, "fused", Tiling(tile, tile))
    assert sorted(real.storages) == sorted(tiled.storages)
    assert (real.saved, real.block_saved, real.largest) == (
        tiled.saved, tiled.block_saved, tiled.largest,
    )  # fmt: skip
    untiled = trace_rank(model, 1, local, 1, "fused")
    assert tiled.saved < untiled.saved and tiled.largest < untiled.largest
    assert tiled.recompute > 0 == untiled.recompute


def test_a_tiled_backward_holds_one_shard_beside_its_inputs_gradient() -> None:
    """The tiled transient grows with the tokens only by the input's whole gradient (hidden
    values per token); one shard's part stays as the sequence grows, so the longest sequence
    grows with tiling."""
    from partita.estimate.tiled import Tiling

    config = _llama(kv=2, impl="sdpa")
    _, plain = fit_sequence(config, 1, 2, torch.float32, "fused")
    shape, tiled = fit_sequence(config, 1, 2, torch.float32, "fused", tiling=Tiling(64, 64))
    assert tiled.recompute[2] == 0 and tiled.recompute[1] == config.hidden_size * 4
    hw, cand = Hardware(4, 1, 256 << 20), Candidate(2, precision="fp32", checkpointing=True)
    lengths = [longest_sequence(shape, f, cand, hw, 1 << 24).seq_len for f in (plain, tiled)]
    assert lengths[1] > lengths[0] > 0


def test_tiling_a_model_without_an_mlp_module_is_refused() -> None:
    from transformers import OPTConfig

    from partita.estimate.tiled import Tiling

    config = OPTConfig(
        hidden_size=64, ffn_dim=128, num_hidden_layers=1, num_attention_heads=4,
        vocab_size=256, word_embed_proj_dim=64,
    )  # fmt: skip
    with pytest.raises(EstimateError, match="--tiled_mlp: the model's blocks have no 'mlp'"):
        from_hf_config(config, 1, 64, torch.float32, tiling=Tiling(mlp_tokens=16))
