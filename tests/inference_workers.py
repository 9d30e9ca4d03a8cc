"""Tiny Hugging Face models of nine families and the rank side of tests/test_inference_tp.py.

Models are built from small configs with seeded random weights and saved with
``save_pretrained``; nothing is downloaded. `tp_worker` runs on four ranks: ranks {0, 1} and
{2, 3} are two tensor-parallel groups of 2 (fp32 on the first, bf16 then fp16 on the
second), then all four split two families at TP 4 and load a larger model for the memory
check.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import torch

FAMILIES = ("gpt2", "llama", "qwen2", "mistral", "mixtral", "opt", "gpt_neox", "falcon", "phi",
            "falcon_rw", "falcon_40b")  # fmt: skip
"""Falcon three ways: Falcon-7B's multi-query parallel blocks, Falcon-RW's multi-head ALiBi
sequential blocks, Falcon-40B's new decoder (grouped key/value heads)."""
FP16_FAMILIES = ("gpt2", "llama", "falcon_rw")
"""Run in fp16 as well, on the second TP-2 group."""
TP4_FAMILIES = ("llama", "gpt2")
VOCAB_CASES = ("gpt2_v127", "llama")
"""Vocabulary-parallel cases: GPT-2 with a tied head and 127 tokens (ranks hold 64 and 63
rows), Llama with its own head."""
PROMPT = [[3, 17, 42, 99, 5, 64, 7, 11], [8, 1, 2, 120, 33, 4, 90, 15]]
NEW_TOKENS = 6
_SMALL = dict(vocab_size=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def family_config(family: str) -> Any:
    """A tiny config of `family` (2 layers, hidden 64; heads split by 2 and 4)."""
    import transformers as t

    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **_SMALL)
    llama_like = dict(common, intermediate_size=96, num_key_value_heads=2,
                      max_position_embeddings=64)  # fmt: skip
    if family == "gpt2":
        return t.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, **_SMALL)
    if family == "llama":  # 8 heads, 4 key/value heads: GQA that splits at TP 4
        return t.LlamaConfig(**dict(llama_like, num_attention_heads=8, num_key_value_heads=4))
    if family == "qwen2":
        return t.Qwen2Config(**llama_like)
    if family == "mistral":
        return t.MistralConfig(**llama_like, sliding_window=None)
    if family == "mixtral":
        return t.MixtralConfig(**llama_like, num_local_experts=4, num_experts_per_tok=2)
    if family == "opt":
        return t.OPTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           ffn_dim=96, word_embed_proj_dim=64, max_position_embeddings=64,
                           **_SMALL)  # fmt: skip
    if family == "gpt_neox":
        return t.GPTNeoXConfig(**common, intermediate_size=96, max_position_embeddings=64)
    if family == "falcon":  # Falcon-7B's layout: multi-query attention, parallel blocks
        return t.FalconConfig(**common, multi_query=True, parallel_attn=True, alibi=False)
    if family == "falcon_rw":  # Falcon-RW: every head its own key/value, ALiBi, sequential
        return t.FalconConfig(**common, multi_query=False, parallel_attn=False, alibi=True,
                              bias=True)  # fmt: skip
    if family == "falcon_40b":  # Falcon-40B: new decoder architecture, 2 key/value groups
        return t.FalconConfig(**common, new_decoder_architecture=True, num_kv_heads=2,
                              parallel_attn=True, alibi=False)  # fmt: skip
    if family == "phi":
        return t.PhiConfig(**common, intermediate_size=96, max_position_embeddings=64)
    raise ValueError(family)


def save_family(family: str, folder: str, seed: int = 0, vocab: int | None = None) -> None:
    """Builds `family`'s tiny model with seeded weights (and `vocab` tokens if given) and
    saves it into `folder`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = family_config(family)
    if vocab is not None:
        config.vocab_size = vocab
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # biases and norms away from their constant inits
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(folder)


def reference(folder: str, dtype: torch.dtype) -> dict[str, Any]:
    """Logits and greedy tokens of the one-process model of `folder` in `dtype`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = model(ids).logits.float()
        tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return {"logits": logits, "tokens": tokens}


def _run_case(folder: str, dtype: torch.dtype, tp: dict[str, Any]) -> dict[str, Any]:
    import partita
    from partita.comm import COUNTERS
    from partita.inference import from_pretrained

    engine = from_pretrained(folder, tensor_parallel=tp, dtype=dtype)
    ids = torch.tensor(PROMPT)
    before = dict(COUNTERS.total_calls)
    logits = engine(ids).logits.float()
    calls = COUNTERS.total_calls[("all_reduce", "tp")] - before.get(("all_reduce", "tp"), 0)
    gathers = COUNTERS.total_calls[("all_gather", "tp")] - before.get(("all_gather", "tp"), 0)
    tokens = engine.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    del partita
    return {
        "logits": logits,
        "tokens": tokens,
        "all_reduces": calls,
        "all_gathers": gathers,
        "held": sum(p.numel() for p in engine.module.parameters()),
        "planned": engine.all_reduces_per_forward,
        "tp": (engine.dims.tp_rank, engine.dims.tp_world_size),
    }


def _training_checkpoint_case(hf_folder: str, ckpt_dir: str, tp: dict[str, Any]) -> dict[str, Any]:
    """Saves the model of `hf_folder` as a ZeRO-3 training checkpoint at world 4 (each rank
    holding a quarter of every unit), then loads it tensor-parallel from that checkpoint:
    the logits must be the model's."""
    from transformers import AutoModelForCausalLM

    import partita
    from partita.inference import init_inference
    from partita.inference.load import build_skeleton

    model = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = partita.initialize(model=model, config=config)
    engine.save_checkpoint(ckpt_dir, tag="step0")
    engine.destroy()
    skeleton = build_skeleton(hf_folder, torch.float32)
    tp_engine = init_inference(
        skeleton, tensor_parallel=tp, dtype=torch.float32, checkpoint=ckpt_dir
    )
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = tp_engine(ids).logits.float()
    tokens = tp_engine.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return {"logits": logits, "tokens": tokens}


def _inplace_case(folder: str, group: Any) -> torch.Tensor:
    """DeepSpeed's way: every rank holds the full model, init_inference slices it in place
    (vocabulary-parallel, GPT-2's tied head)."""
    from transformers import AutoModelForCausalLM

    from partita import init_inference

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tp = {"tp_size": 2, "tp_group": group, "vocab_parallel": True}
    engine = init_inference(model, tensor_parallel=tp, dtype=torch.float32)
    assert engine.module.lm_head.weight is engine.module.transformer.wte.weight  # still tied
    return engine(torch.tensor(PROMPT)).logits


def small_all_reduce_case(group: Any) -> dict[str, Any]:
    """partita's all-reduce over a two-rank gloo group: how many times it called gloo's own
    all-reduce for a small tensor (decode-sized: 768 floats, synchronous and async) and for
    a large one (1 MiB), and whether each sum equals rank 0's values plus rank 1's bitwise."""
    import torch.distributed as dist

    from partita import comm

    me = comm.get_rank(group)
    calls = {"small": 0, "large": 0}
    native = dist.all_reduce

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls["small" if tensor.numel() <= 768 else "large"] += 1
        return native(tensor, *args, **kwargs)

    gen = [torch.Generator().manual_seed(r) for r in (0, 1)]
    exact = True
    dist.all_reduce = counted  # type: ignore[assignment]
    try:
        for n, async_op in ((768, False), (768, True), (2**18, False)):
            parts = [torch.randn(n, generator=g) for g in gen]
            mine = parts[me].clone()
            handle = comm.all_reduce(mine, group=group, async_op=async_op)
            if handle is not None:
                handle.wait()
            exact = exact and torch.equal(mine, parts[0] + parts[1])
    finally:
        dist.all_reduce = native  # type: ignore[assignment]
    return {**calls, "exact": exact}


def save_memory_model(folder: str) -> None:
    """A Llama of ~200 MB in fp32 (3 layers, hidden 1024), saved in 50 MB files with an
    index, for the loading-memory check."""
    import transformers as t

    config = t.LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=3,
                           num_attention_heads=16, num_key_value_heads=8,
                           max_position_embeddings=64, **_SMALL)  # fmt: skip
    torch.manual_seed(0)
    model = t.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder, max_shard_size="50MB")


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def memory_case(folder: str) -> dict[str, Any]:
    """Loads `folder` at TP 4 and runs one forward; reports this rank's peak RSS growth over
    both (the forward touches every weight the rank holds, file-backed or not)."""
    import ctypes

    from partita.inference import from_pretrained
    from partita.inference.load import build_skeleton

    build_skeleton(folder, torch.float32)  # imports and lazy module set-up, not loading
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap would hide loading's growth
    start = _rss_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset this process's VmHWM
        f.write("5")
    engine = from_pretrained(folder, tensor_parallel={"tp_size": 4}, dtype=torch.float32)
    engine(torch.tensor(PROMPT[:1]))
    peak = _rss_kb("VmHWM")
    held = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    return {"growth": (peak - start) * 1024, "held": held}


def tp_worker(folders: dict[str, str], memory_folder: str) -> dict[str, Any]:
    """Every case of tests/test_inference_tp.py on this rank (see the module docstring)."""
    from partita import comm
    from partita.comm import ParallelDims
    from partita.platform.host_cache import host_cache_stats

    rank = comm.get_rank()
    groups = [comm.new_group([0, 1]), comm.new_group([2, 3])]
    group = groups[rank // 2]
    dtype = torch.float32 if rank < 2 else torch.bfloat16
    out: dict[str, Any] = {"tp2": {}, "tp4": {}}
    tp = {"tp_size": 2, "tp_group": group}
    for family in FAMILIES:
        out["tp2"][family] = _run_case(folders[family], dtype, tp)
    out["host_cache"] = host_cache_stats() is not None  # before any training engine runs
    if rank >= 2:
        out["fp16"] = {f: _run_case(folders[f], torch.float16, tp) for f in FP16_FAMILIES}
    for family in TP4_FAMILIES:
        out["tp4"][family] = _run_case(folders[family], torch.float32, {"tp_size": 4})
    out["vocab"] = {
        name: _run_case(folders[name], torch.float32, {**tp, "vocab_parallel": True})
        for name in VOCAB_CASES
    }
    out["inplace"] = _inplace_case(folders["gpt2_v127"], group)
    out["small_all_reduce"] = small_all_reduce_case(group)
    out["from_training"] = _training_checkpoint_case(folders["gpt2"], folders["partita_ckpt"], tp)
    dims = ParallelDims.tensor_parallel(2)
    out["dims"] = (dims.tp_ranks, dims.tp_rank, dims.dp_ranks, dims.dp_rank)
    out["memory"] = memory_case(memory_folder)
    out["threads"] = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    return out


def save_tokenizer(folder: str) -> None:
    """A word-level tokenizer over the tiny vocabulary ("[PAD]", "[BOS]", "[EOS]", "w3" ...
    "w127"), so ``partita generate`` can run on the tiny models without a download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, **{f"w{i}": i for i in range(3, 128)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[PAD]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", bos_token="[BOS]",
                                   eos_token="[EOS]")  # fmt: skip
    fast.save_pretrained(folder)
