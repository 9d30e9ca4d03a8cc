"""Activation checkpointing trains bit for bit as without it, keeps only each layer's input, and
keeps it where the ``activation_checkpointing`` section says (device, host, one shard per
model-parallel rank, slots of one buffer)."""

from __future__ import annotations

import gc
import json
import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import GPT2Config
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

import partita
from partita.activations import STATS, checkpoint, checkpoint_wrapper, configure, is_configured
from partita.activations import checkpointing as ckpt
from partita.activations.rng import get_rng_tracker, model_parallel_manual_seed
from partita.config.sections.runtime import ActivationCheckpointingConfig
from partita.testing import run_distributed

B, S, HIDDEN, LAYERS = 2, 8, 32, 4
INPUT_BYTES = B * S * HIDDEN * 4  # one layer's input, float32


@pytest.fixture(autouse=True)
def _default_settings() -> Iterator[None]:
    ckpt.apply_config(ActivationCheckpointingConfig())
    ckpt.settings().configured = False
    yield
    ckpt.apply_config(ActivationCheckpointingConfig())
    ckpt.settings().configured = False
    model_parallel_manual_seed(0)  # leaves the tracker with a state; reset it
    get_rng_tracker().reset()


class Blocks(torch.nn.Module):
    """GPT-2 blocks (dropout on) run under `checkpoint` when asked."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = GPT2Config(n_embd=HIDDEN, n_head=4, n_layer=LAYERS, n_positions=S)
        config._attn_implementation = "eager"
        self.blocks = torch.nn.ModuleList(GPT2Block(config, layer_idx=i) for i in range(LAYERS))
        self.checkpointed = checkpointed

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            out = checkpoint(block, h) if self.checkpointed else block(h)
            h = out[0] if isinstance(out, tuple) else out
        return h


def _train(model: torch.nn.Module, steps: int = 3) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Per-step losses and the final weights of a few SGD steps; the peaks of saved-input bytes
    seen before the first backward."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    losses, peaks = [], {}
    torch.manual_seed(2)  # dropout masks
    for step in range(steps):
        STATS.reset_peaks()
        loss = model(torch.randn(B, S, HIDDEN, generator=data)).square().mean()
        if step == 0:
            peaks = {"device": STATS.peak_device_bytes, "host": STATS.peak_host_bytes}
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses, {"peaks": peaks, "weights": [p.detach().clone() for p in model.parameters()]}


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


SETTINGS: dict[str, dict[str, Any]] = {
    "default": {},
    "cpu": {"cpu_checkpointing": True},
    "contiguous": {"contiguous_memory_optimization": True, "number_checkpoints": LAYERS},
    "partition_without_mp": {"partition_activations": True},
    "sync_and_profile": {"synchronize_checkpoint_boundary": True, "profile": True},
}


@pytest.mark.parametrize("name", SETTINGS)
def test_training_is_bitwise_equal_to_no_checkpointing(name: str) -> None:
    plain_losses, plain = _train(Blocks(checkpointed=False))
    configure(None, **SETTINGS[name])
    losses, checked = _train(Blocks(checkpointed=True))
    assert _bitwise(plain_losses, losses)
    assert _bitwise(plain["weights"], checked["weights"])


def test_only_each_layers_input_is_kept_and_cpu_checkpointing_moves_it_to_the_host() -> None:
    """The layer inputs (LAYERS x INPUT_BYTES) are all a checkpointed forward keeps; with
    cpu_checkpointing none of them stays on the compute device (on a CPU run that device is
    the host: the bytes are counted where a GPU run would keep them, see storage's note)."""
    _, on_device = _train(Blocks(checkpointed=True), steps=1)
    assert on_device["peaks"] == {"device": LAYERS * INPUT_BYTES, "host": 0}
    configure(None, cpu_checkpointing=True)
    _, on_host = _train(Blocks(checkpointed=True), steps=1)
    assert on_host["peaks"] == {"device": 0, "host": LAYERS * INPUT_BYTES}
    gc.collect()
    assert (STATS.device_bytes, STATS.host_bytes) == (0, 0)  # freed with the graph


def test_contiguous_buffer_holds_number_checkpoints_inputs() -> None:
    with pytest.raises(ValueError, match="number_checkpoints"):
        configure(None, contiguous_memory_optimization=True)
    configure(None, contiguous_memory_optimization=True, number_checkpoints=LAYERS - 1)
    with pytest.raises(RuntimeError, match=f"number_checkpoints={LAYERS - 1}"):
        _train(Blocks(checkpointed=True), steps=1)
    configure(None, contiguous_memory_optimization=True, number_checkpoints=LAYERS)
    _train(Blocks(checkpointed=True), steps=2)  # slots come back after each backward


def test_model_parallel_dropout_is_replayed_in_recomputation() -> None:
    """Dropout drawn from the tracker's model-parallel stream gets the same mask when the
    checkpoint recomputes (the tracker's state is saved with the forward)."""

    def layer(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        with get_rng_tracker().fork():
            x = torch.nn.functional.dropout(x, 0.5)
        return torch.tanh(x @ weight)

    grads = []
    for checkpointed in (False, True):
        model_parallel_manual_seed(123)
        weight = torch.randn(16, 16, generator=torch.Generator().manual_seed(0))
        weight.requires_grad_(True)
        x = torch.ones(4, 16)
        y = checkpoint(layer, x, weight) if checkpointed else layer(x, weight)
        with get_rng_tracker().fork():  # the stream moves on before backward
            torch.rand(100)
        y.sum().backward()
        grads.append(weight.grad)
    assert torch.equal(grads[0], grads[1])


def test_profile_times_each_call_and_its_recomputation(caplog: pytest.LogCaptureFixture) -> None:
    configure(None, profile=True)
    before = ckpt.settings().timings
    forwards, recomputes = before.forwards, before.recomputes
    with caplog.at_level(logging.INFO, logger="partita"):
        _train(Blocks(checkpointed=True), steps=1)
    timings = ckpt.settings().timings
    assert (timings.forwards - forwards, timings.recomputes - recomputes) == (LAYERS, LAYERS)
    assert sum("activation checkpoint recompute" in r.message for r in caplog.records) == LAYERS


def test_checkpoint_wrapper_checkpoints_a_module() -> None:
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    x = torch.randn(3, 8)
    inner(x).sum().backward()
    expected = [p.grad.clone() for p in inner.parameters()]  # type: ignore[union-attr]
    inner.zero_grad()
    STATS.reset_peaks()
    checkpoint_wrapper(inner)(x).sum().backward()
    assert STATS.saved == 1
    assert _bitwise(expected, [p.grad for p in inner.parameters()])  # type: ignore[misc]


def test_initialize_applies_the_section_unless_configured() -> None:
    model = torch.nn.Linear(4, 4)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "activation_checkpointing": {"cpu_checkpointing": True},
    }
    partita.initialize(model=model, config=config, dist_init_required=False)
    assert ckpt.settings().config.cpu_checkpointing and not is_configured()
    configure(None, profile=True)  # the script's own configure wins over a later initialize
    partita.initialize(model=torch.nn.Linear(4, 4), config=config, dist_init_required=False)
    assert ckpt.settings().config.profile and not ckpt.settings().config.cpu_checkpointing


class _WorldMpu:
    """A model-parallel unit whose model-parallel group is the whole (two-rank) world."""

    def get_model_parallel_world_size(self) -> int:
        return torch.distributed.get_world_size()

    def get_model_parallel_rank(self) -> int:
        return torch.distributed.get_rank()

    def get_model_parallel_group(self) -> Any:
        return None


def _partitioned_run(_: Any) -> dict[str, Any]:
    """On each rank: no checkpointing, then inputs partitioned over the two ranks."""
    plain_losses, plain = _train(Blocks(checkpointed=False), steps=2)
    ckpt.configure(_WorldMpu(), partition_activations=True)
    losses, parted = _train(Blocks(checkpointed=True), steps=2)
    return {
        "equal": _bitwise(plain_losses, losses) and _bitwise(plain["weights"], parted["weights"]),
        "peaks": parted["peaks"],
    }


def test_partitioned_inputs_keep_one_shard_per_rank_on_two_ranks() -> None:
    for result in run_distributed(_partitioned_run, 2, None, timeout=240):
        assert result["equal"]
        assert result["peaks"] == {"device": LAYERS * INPUT_BYTES // 2, "host": 0}


def test_deepspeed_names_under_the_stand_in() -> None:
    script = textwrap.dedent(
        """
        import json, torch
        import partita.as_deepspeed
        import deepspeed
        from deepspeed.runtime.activation_checkpointing import checkpointing
        from deepspeed.profiling.flops_profiler import FlopsProfiler, get_model_profile
        ds = deepspeed.checkpointing
        ds.configure(None, deepspeed_config={"activation_checkpointing": {"profile": True}},
                     checkpoint_in_cpu=True, num_checkpoints=3)
        ds.model_parallel_cuda_manual_seed(7)
        with ds.get_cuda_rng_tracker().fork():
            pass
        lin = torch.nn.Linear(4, 4)
        y = ds.checkpoint(lin, torch.randn(2, 4, requires_grad=True))
        y.sum().backward()
        flops, _, _ = get_model_profile(lin, input_shape=(2, 4), print_profile=False,
                                        as_string=False)
        from partita.activations.checkpointing import settings
        c = settings().config
        print(json.dumps({
            "same_module": ds is checkpointing, "configured": ds.is_configured(),
            "cpu": c.cpu_checkpointing, "profile": c.profile, "n": c.number_checkpoints,
            "flops": flops, "log_summary": callable(deepspeed.comm.log_summary),
        }))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=240, check=True)  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {
        "same_module": True, "configured": True, "cpu": True, "profile": True, "n": 3,
        "flops": 2 * 2 * 4 * 4, "log_summary": True,
    }  # fmt: skip


class _Dropouts(torch.nn.Module):
    """Linear-dropout-GELU layers, checkpointed when asked."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.2), torch.nn.GELU())
            for _ in range(3)
        )
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = checkpoint(layer, x) if self.checkpointed else layer(x)
        return x


def _engine_losses(checkpointed: bool) -> tuple[list[float], dict[str, int]]:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "activation_checkpointing": {"cpu_checkpointing": True},
    }
    engine, *_ = partita.initialize(
        model=_Dropouts(checkpointed), config=config, dist_init_required=False
    )
    data = torch.Generator().manual_seed(1)
    torch.manual_seed(5)
    losses = []
    for _ in range(3):
        loss = engine(torch.randn(2, 16, generator=data)).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.memory_report()


def test_zero3_engine_with_cpu_checkpointing_trains_as_without_checkpointing() -> None:
    """Recomputation re-gathers stage-3 parameters; the config's section reaches checkpoint."""
    plain, _ = _engine_losses(checkpointed=False)
    STATS.reset_peaks()
    losses, report = _engine_losses(checkpointed=True)
    assert losses == plain
    assert STATS.peak_host_bytes == 3 * 2 * 16 * 4 and STATS.peak_device_bytes == 0
    # memory_report itemises what checkpointing keeps: the 3 layer inputs, on the host.
    assert (report["ckpt_inputs"], report["ckpt_inputs_host"]) == (0, 3 * 2 * 16 * 4)
