"""The FLOPs profiler counts a transformer block's forward as the analytic formula does,
attributes it to the right modules, prints DeepSpeed's report, and runs from the config at the
configured step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GPT2Config, LlamaConfig
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

import partita
from partita.compat.deepspeed.profiling.flops_profiler import FlopsProfiler, get_model_profile
from partita.profiling import peak_flops

B, S, HIDDEN, HEADS = 2, 16, 64, 4


def _linear_weights(module: torch.nn.Module) -> int:
    """Weights of the block's linears (GPT-2's Conv1D is a linear with a transposed weight)."""
    kinds = ("Linear", "Conv1D")
    return sum(m.weight.numel() for m in module.modules() if type(m).__name__ in kinds)


def _analytic(block: torch.nn.Module) -> int:
    """2 x linear weights x tokens, plus attention's two matmuls (scores and weighted sum)."""
    return 2 * _linear_weights(block) * B * S + 2 * 2 * B * HEADS * S * S * (HIDDEN // HEADS)


def _gpt2_block() -> GPT2Block:
    config = GPT2Config(n_embd=HIDDEN, n_head=HEADS, n_layer=1, n_positions=S)
    config._attn_implementation = "eager"
    return GPT2Block(config)


def _llama_layer(attention: str) -> tuple[LlamaDecoderLayer, dict[str, Any]]:
    config = LlamaConfig(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=2,
        intermediate_size=128, num_hidden_layers=1,
    )  # fmt: skip
    config._attn_implementation = attention
    x = torch.randn(B, S, HIDDEN)
    positions = torch.arange(S).expand(B, S)
    rotary = LlamaRotaryEmbedding(config)(x, positions)
    return LlamaDecoderLayer(config, 0), {"position_embeddings": rotary, "attention_mask": None}


def test_gpt2_block_flops_equal_the_analytic_count() -> None:
    torch.manual_seed(0)
    block = _gpt2_block()
    flops, macs, params = get_model_profile(
        block, args=[torch.randn(B, S, HIDDEN)], print_profile=False, as_string=False
    )
    assert flops == pytest.approx(_analytic(block), rel=0.01)
    assert macs == flops // 2
    assert params == sum(p.numel() for p in block.parameters())


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_llama_layer_flops_equal_the_analytic_count(attention: str) -> None:
    """SDPA on the CPU runs a fused kernel torch's counter does not know; it counts here."""
    torch.manual_seed(0)
    layer, kwargs = _llama_layer(attention)
    x = torch.randn(B, S, HIDDEN)
    flops, _, _ = get_model_profile(
        layer, args=[x], kwargs=kwargs, print_profile=False, as_string=False
    )
    assert flops == pytest.approx(_analytic(layer), rel=0.01)


def test_flops_are_attributed_to_the_modules_that_run_them() -> None:
    block = _gpt2_block()
    profiler = FlopsProfiler(block)
    profiler.start_profile()
    block(torch.randn(B, S, HIDDEN))
    profiler.stop_profile()
    profiles = profiler.module_profiles()
    c_fc = profiles["mlp.c_fc"]
    assert c_fc.flops == 2 * B * S * HIDDEN * 4 * HIDDEN
    assert c_fc.params == HIDDEN * 4 * HIDDEN + 4 * HIDDEN and c_fc.calls == 1
    assert profiles["mlp"].flops == profiles["mlp.c_fc"].flops + profiles["mlp.c_proj"].flops
    assert profiles["ln_1"].flops == 0
    assert profiles[""].flops == profiles["attn"].flops + profiles["mlp"].flops
    assert profiler.get_total_duration() > 0
    profiler.end_profile()
    assert not profiler.started


def test_ignored_modules_leave_the_totals() -> None:
    block = _gpt2_block()
    x = torch.randn(B, S, HIDDEN)
    everything, _, _ = get_model_profile(block, args=[x], print_profile=False, as_string=False)
    mlp_type = type(block.mlp)
    without_mlp, _, _ = get_model_profile(
        block, args=[x], print_profile=False, as_string=False, ignore_modules=[mlp_type]
    )
    assert without_mlp == everything - 2 * B * S * 2 * 4 * HIDDEN * HIDDEN


def test_profile_counts_only_between_start_and_stop() -> None:
    model = torch.nn.Linear(8, 4, bias=False)
    profiler = FlopsProfiler(model)
    model(torch.randn(3, 8))  # before start: not counted
    profiler.start_profile()
    model(torch.randn(3, 8))
    model(torch.randn(3, 8))
    profiler.stop_profile()
    model(torch.randn(3, 8))  # after stop: not counted
    assert profiler.get_total_flops() == 2 * (2 * 3 * 8 * 4)
    assert profiler.get_total_params() == 32
    assert profiler.get_total_flops(as_string=True) == "384"
    profiler.end_profile()


def test_report_is_written_with_the_requested_depth(tmp_path: Path) -> None:
    block = _gpt2_block()
    out = tmp_path / "profile.txt"
    get_model_profile(
        block, args=[torch.randn(B, S, HIDDEN)], module_depth=1, top_modules=2, output_file=str(out)
    )
    text = out.read_text()
    assert "fwd flops per GPU" in text and "fwd MFU:" in text and "unknown" in text
    assert "(mlp): GPT2MLP(" in text and "depth 1:" in text
    assert "(c_fc)" not in text and "depth 2:" not in text  # deeper than module_depth
    get_model_profile(block, args=[torch.randn(B, S, HIDDEN)], detailed=False, output_file=str(out))
    assert "Detailed profile" not in out.read_text()


def test_mfu_uses_the_device_peak() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == pytest.approx(756e12)
    assert peak_flops("cpu", torch.float32) is None
    model = torch.nn.Linear(8, 8)
    assert FlopsProfiler(model).get_mfu() is None  # CPU: unknown unless given
    profiler = FlopsProfiler(model, peak_flops=1e9)
    profiler.start_profile()
    model(torch.randn(4, 8))
    profiler.stop_profile()
    expected = profiler.get_total_flops() / profiler.get_total_duration() / 1e9
    assert profiler.get_mfu() == pytest.approx(expected)


def test_engine_profiles_the_configured_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    out = tmp_path / "flops.txt"
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": str(out)},
    }
    engine, *_ = partita.initialize(model=model, config=config, dist_init_required=False)
    for step in range(3):
        engine.backward(engine(torch.randn(2, 16)).sum())
        assert out.exists() == (step >= 1), step  # written by step 1's forward, not before
        engine.step()
    assert engine.flops_profile.flops == 2 * 2 * (16 * 32 + 32 * 4)
    assert isinstance(engine.flops_profiler, FlopsProfiler)
    assert "Profile summary at step 1" in out.read_text()
