"""Tensor-parallel inference (issue 17): `partita.init_inference` on nine Hugging Face families.

One four-rank spawn (`inference_workers.tp_worker`) runs every distributed case: two TP-2
groups (fp32 on ranks 0-1, bf16 on ranks 2-3) over all families loaded sharded from
``save_pretrained`` folders, TP 4 for two families, DeepSpeed's in-place path, and a loading
memory check. The one-process references are computed here, from the same folders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import inference_workers as w
from partita.config import ConfigError
from partita.inference import PlanError, build_plan, load_inference_config
from partita.inference.plan import RankSlice
from partita.testing import run_distributed

LAYERS = 2
MEMORY_CONSTANT = 24 * 2**20
"""What a rank's loading may hold beyond its own slices and one full tensor: the safetensors
headers, Python objects of the model, allocator slack (bytes)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("tp-models")
    folders = {f: str(root / f) for f in w.FAMILIES}
    refs: dict[str, Any] = {}
    for family, folder in folders.items():
        w.save_family(family, folder)
        dtypes = (torch.float32, torch.bfloat16)
        dtypes += (torch.float16,) if family in w.FP16_FAMILIES else ()
        refs[family] = {d: w.reference(folder, d) for d in dtypes}
    folders["gpt2_v127"] = str(root / "gpt2_v127")
    w.save_family("gpt2", folders["gpt2_v127"], vocab=127)
    refs["gpt2_v127"] = {torch.float32: w.reference(folders["gpt2_v127"], torch.float32)}
    folders["partita_ckpt"] = str(root / "partita_ckpt")
    memory = str(root / "memory")
    w.save_memory_model(memory)
    ranks = run_distributed(w.tp_worker, 4, folders, memory, timeout=300)
    return {"ranks": ranks, "refs": refs, "memory": memory}


@pytest.mark.parametrize("family", w.FAMILIES)
def test_tp2_fp32_logits_and_tokens_match_one_process(runs: dict, family: str) -> None:
    ref = runs["refs"][family][torch.float32]
    for rank in (0, 1):
        got = runs["ranks"][rank]["tp2"][family]
        assert got["tp"] == (rank, 2)
        err = (got["logits"] - ref["logits"]).abs().max().item()
        assert err <= 1e-5, f"{family} rank {rank}: max |logit diff| {err}"
        assert torch.equal(got["tokens"], ref["tokens"]), family


@pytest.mark.parametrize("family", w.FAMILIES)
def test_tp2_bf16_within_bf16_tolerance(runs: dict, family: str) -> None:
    """Against the one-process bf16 model: torch's bf16 tolerance (rtol 1.6e-2), atol the
    same relative to the largest logit (rounding of a sum in another order)."""
    ref = runs["refs"][family][torch.bfloat16]["logits"]
    for rank in (2, 3):
        got = runs["ranks"][rank]["tp2"][family]["logits"]
        scale = ref.abs().max().item()
        torch.testing.assert_close(got, ref, rtol=1.6e-2, atol=1.6e-2 * scale)


@pytest.mark.parametrize("family", w.FP16_FAMILIES)
def test_tp2_fp16_within_fp16_tolerance(runs: dict, family: str) -> None:
    """Against the one-process fp16 model, two fp16 roundings (2 x 2^-10) relative to each
    logit and to the largest one, as the bf16 test allows two bf16 roundings."""
    ref = runs["refs"][family][torch.float16]["logits"]
    for rank in (2, 3):
        got = runs["ranks"][rank]["fp16"][family]["logits"]
        scale = ref.abs().max().item()
        torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3 * scale)


@pytest.mark.parametrize("family", w.TP4_FAMILIES)
def test_tp4_matches_one_process(runs: dict, family: str) -> None:
    ref = runs["refs"][family][torch.float32]
    for rank in range(4):
        got = runs["ranks"][rank]["tp4"][family]
        assert got["tp"] == (rank, 4)
        assert (got["logits"] - ref["logits"]).abs().max().item() <= 1e-5, (family, rank)
        assert torch.equal(got["tokens"], ref["tokens"]), (family, rank)


@pytest.mark.parametrize("family", w.FAMILIES)
def test_two_all_reduces_per_block_per_forward(runs: dict, family: str) -> None:
    """Counted by partita.comm: attention and MLP each sum once (Mixtral: attention and the
    experts; Falcon's and Phi's parallel blocks: still one each)."""
    for rank in range(4):
        got = runs["ranks"][rank]["tp2"][family]
        assert got["all_reduces"] == got["planned"] == 2 * LAYERS, (family, rank)
    for family4 in w.TP4_FAMILIES:
        # At 4 gloo ranks the all-gather of an untied head's logits runs as an all-reduce
        # and is counted as one ([Note: gloo collectives]).
        untied = not w.family_config(family4).tie_word_embeddings
        assert runs["ranks"][0]["tp4"][family4]["all_reduces"] == 2 * LAYERS + untied


@pytest.mark.parametrize("family", w.FAMILIES)
def test_untied_output_head_split_by_vocabulary(runs: dict, family: str) -> None:
    """An output head with weights of its own is split by vocabulary rows by default (one
    all-gather of the logits per forward, a part of the head per rank); a head tied to the
    embedding stays whole with it."""
    tied = w.family_config(family).tie_word_embeddings
    for rank in range(4):
        got = runs["ranks"][rank]["tp2"][family]
        assert got["all_gathers"] == (0 if tied else 1), (family, rank)


def test_small_all_reduce_is_one_swap_on_two_gloo_ranks(runs: dict) -> None:
    """A decode step's all-reduces (one token's activations) run as one exchange between the
    two ranks, not through gloo's all-reduce (its worker thread costs latency), with the sum
    bitwise that of the two ranks' values; a large one still goes to gloo."""
    for rank in range(4):
        got = runs["ranks"][rank]["small_all_reduce"]
        assert got == {"small": 0, "large": 1, "exact": True}, rank


def test_init_inference_installs_the_host_cache(runs: dict) -> None:
    """Each forward allocates the same activations (prefill: also the logits): through
    partita's caching host allocator they are served again from kept blocks instead of
    fresh mappings that page-fault (the harness leaves PARTITA_HOST_CACHE unset)."""
    for rank in range(4):
        assert runs["ranks"][rank]["host_cache"], rank


def test_plan_splits_an_untied_head_unless_the_policy_replicates_it() -> None:
    plan = build_plan(_meta_model("llama"), 2, 1)
    assert plan.slices["lm_head.weight"] == RankSlice(0, ((64, 128),))
    assert plan.vocab == {"lm_head": "head"} and plan.vocab_size == 128
    assert "model.embed_tokens.weight" not in plan.slices
    plan = build_plan(_meta_model("llama"), 2, 1, policy={"lm_head": "replicate"})
    assert "lm_head.weight" not in plan.slices and not plan.vocab
    plan = build_plan(_meta_model("gpt2"), 2, 1)  # tied to the embedding: whole with it
    assert "lm_head.weight" not in plan.slices and not plan.vocab


@pytest.mark.parametrize("case", w.VOCAB_CASES)
def test_vocab_parallel_embedding_and_head(runs: dict, case: str) -> None:
    """Embedding and head split by vocabulary rows: same logits and tokens, one more
    all-reduce (the embedding) and one all-gather (the logits) per forward, and each rank
    holds fewer parameters than with them replicated."""
    ref = runs["refs"][case][torch.float32]
    family = case.split("_")[0]
    for rank in range(4):
        got = runs["ranks"][rank]["vocab"][case]
        assert (got["logits"] - ref["logits"]).abs().max().item() <= 1e-5, (case, rank)
        assert torch.equal(got["tokens"], ref["tokens"]), (case, rank)
        assert got["all_reduces"] == got["planned"] == 2 * LAYERS + 1
        assert got["all_gathers"] == 1
        if case in w.FAMILIES:
            assert got["held"] < runs["ranks"][rank]["tp2"][family]["held"]


def test_tp2_loads_a_partita_zero3_training_checkpoint(runs: dict) -> None:
    """A ZeRO-3 checkpoint saved at world 4 loads tensor-parallel (each rank reading its
    slices through the checkpoint reader): logits within 1e-5, same greedy tokens."""
    ref = runs["refs"]["gpt2"][torch.float32]
    for rank in range(4):
        got = runs["ranks"][rank]["from_training"]
        err = (got["logits"] - ref["logits"]).abs().max().item()
        assert err <= 1e-5, f"rank {rank}: max |logit diff| {err}"
        assert torch.equal(got["tokens"], ref["tokens"]), rank


def test_in_place_sharding_of_a_full_model(runs: dict) -> None:
    """DeepSpeed's path: the full model on every rank, sliced by init_inference (here
    vocabulary-parallel, with GPT-2's tied head)."""
    ref = runs["refs"]["gpt2_v127"][torch.float32]["logits"]
    for rank in range(4):
        assert (runs["ranks"][rank]["inplace"] - ref).abs().max().item() <= 1e-5


def test_parallel_dims_tensor_parallel_groups(runs: dict) -> None:
    for rank in range(4):
        tp_ranks, tp_rank, dp_ranks, dp_rank = runs["ranks"][rank]["dims"]
        assert tp_ranks == ((0, 1) if rank < 2 else (2, 3))
        assert tp_rank == rank % 2
        assert dp_ranks == (rank % 2, rank % 2 + 2) and dp_rank == rank // 2


def test_loading_reads_only_this_ranks_slices(runs: dict) -> None:
    """Peak RSS growth over loading at TP 4 and one forward stays under the rank's own slices
    plus the largest tensor plus `MEMORY_CONSTANT` (seen: 64 MB against 46 + 16 + 24), far
    below the whole model (200 MB)."""
    from safetensors import safe_open

    from partita.inference.load import checkpoint_index

    index = checkpoint_index(runs["memory"])
    assert len(set(index.values())) > 1  # sharded files with an index
    total = largest = 0
    for key, path in index.items():
        with safe_open(path, "pt") as f:
            t = f.get_slice(key)
            n = 4 * int(torch.tensor(t.get_shape()).prod())
        total, largest = total + n, max(largest, n)
    for rank in range(4):
        mem = runs["ranks"][rank]["memory"]
        bound = mem["held"] + largest + MEMORY_CONSTANT
        assert mem["growth"] <= bound, (rank, mem, largest, total)
        assert mem["held"] < 0.3 * total  # the bound is meaningful: a quarter plus norms


# --- refusals, before any process group (single process) -------------------------------


def test_unknown_key_named_with_a_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"tensor_paralel: unknown key; did you mean "):
        load_inference_config({"tensor_paralel": {"tp_size": 2}})
    with pytest.raises(ConfigError, match=r"tensor_parallel.tp_sise: unknown key; did you mean"):
        load_inference_config(tensor_parallel={"tp_sise": 2})


def test_unsupported_features_refused_by_key() -> None:
    with pytest.raises(ConfigError) as e:
        load_inference_config(replace_with_kernel_inject=True, dtype=torch.int8, use_triton=True)
    text = str(e.value)
    assert "replace_with_kernel_inject: True is not supported: kernel injection" in text
    assert "dtype: int8" in text and "use_triton" in text
    load_inference_config(kernel_inject=False, tp={"tp_size": 2}, dtype="bf16")  # aliases
    with pytest.raises(ConfigError, match="given as"):
        load_inference_config({"dtype": "fp16"}, dtype=torch.float32)
    with pytest.raises(ConfigError, match="checkpoint: DeepSpeed's checkpoint descriptions"):
        load_inference_config(checkpoint={"type": "ds_model", "checkpoints": []})


def _meta_model(family: str, **overrides: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    config = w.family_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_heads_that_do_not_split_are_refused_naming_the_module() -> None:
    # 8 query heads, 4 key/value heads: TP 8 splits the projections but not the kv heads.
    with pytest.raises(PlanError, match=r"model.layers.0.self_attn: 8 attention heads and 4 "):
        build_plan(_meta_model("llama"), 8, 0)
    with pytest.raises(PlanError, match=r"transformer.h.0.attn.c_attn \(query heads\): size 64"):
        build_plan(_meta_model("gpt2"), 3, 0)
    # One key/value head in separate k/v projections: splitting them would cut the head.
    with pytest.raises(PlanError, match=r"8 attention heads and 1 key/value heads"):
        build_plan(_meta_model("llama", num_key_value_heads=1), 2, 0)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.mixer, self.o_proj = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block()])


def test_unknown_layer_refused_and_policy_overrides() -> None:
    with pytest.raises(PlanError, match=r"layers.0.mixer \(Linear\): no rule says how"):
        build_plan(_Toy(), 2, 0)
    plan = build_plan(_Toy(), 2, 1, policy={"layers.*.mixer": "replicate"})
    assert plan.styles == {"layers.0.q_proj": "colwise", "layers.0.o_proj": "rowwise"}
    assert plan.reduce == ["layers.0.o_proj"]
    plan = build_plan(_Toy(), 2, 1, policy={_Block: ("mixer",)})  # DeepSpeed's form
    assert plan.styles["layers.0.mixer"] == "rowwise"
    assert plan.styles["layers.0.o_proj"] == "colwise"
    nested = nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"attn": _Block()})])})
    plan = build_plan(nested, 2, 0, policy={nn.ModuleDict: ("attn.o_proj",)})  # qualified
    assert plan.styles["layers.0.attn.o_proj"] == "rowwise"
    assert plan.styles["layers.0.attn.mixer"] == "colwise"
    toy = _Toy()
    toy.layers[0].c_attn = nn.Linear(8, 24)  # a fused layer of a model with no known layout
    with pytest.raises(PlanError, match=r"layers.0.c_attn: fused layer .* unknown layout"):
        build_plan(toy, 2, 0, policy={"layers.*.mixer": "replicate"})
    with pytest.raises(PlanError, match="injection_policy: entry"):
        build_plan(_Toy(), 2, 0, policy={"layers.*.mixer": "diagonal"})


def test_meta_model_without_checkpoint_refused(tmp_path: Path) -> None:
    from partita.inference import init_inference

    with pytest.raises(ValueError, match="meta device; pass checkpoint="):
        init_inference(_meta_model("gpt2"), dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"checkpoint: .* is not a folder"):
        init_inference(_meta_model("gpt2"), checkpoint=str(tmp_path / "nope"))


# --- partita generate ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = str(tmp_path_factory.mktemp("cli-model"))
    w.save_family("llama", folder)
    w.save_tokenizer(folder)
    return folder


def _bad(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from partita.launcher.cli import main

    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_generate_bad_input_one_line_before_any_rank(
    cli_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "missing")
    assert "no such folder" in _bad(["--model", missing, "--tp", "2", "--prompt", "x"], capsys)
    err = _bad(["--model", cli_model, "--tp", "3", "--prompt", "x"], capsys)
    assert "--tp 3: the model's 8 attention heads do not split over 3 ranks" in err
    err = _bad(["--model", cli_model, "--tp", "8", "--prompt", "x"], capsys)
    assert "4 key/value heads" in err
    err = _bad(["--model", cli_model, "--prompt_file", missing], capsys)
    assert f"--prompt_file {missing}: no such file" in err
    assert "no config.json" in _bad(["--model", str(tmp_path), "--prompt", "x"], capsys)


def test_generate_rank_prints_the_greedy_text(
    cli_model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rank's side of ``partita generate`` (one rank, in this process): the text is the
    one-process model's greedy continuation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from partita.inference.cli import rank_main

    prompt = "w5 w17 w42"
    assert rank_main(["--model", cli_model, "--prompt", prompt, "--max_new_tokens", "5"]) == 0
    text, speed = capsys.readouterr().out.strip().splitlines()[-2:]
    tok = AutoTokenizer.from_pretrained(cli_model)
    model = AutoModelForCausalLM.from_pretrained(cli_model).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert text == tok.decode(out[0], skip_special_tokens=True)
    assert "5 new tokens" in speed and "tokens/s" in speed
