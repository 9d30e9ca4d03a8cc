"""Host offload of Hugging Face gradient checkpointing's layer inputs
(`partita.activations.offload_checkpoints`, and ``activation_checkpointing.cpu_checkpointing``
through the engine) trains bit for bit as without it, and takes exactly the checkpointed inputs
(LAYERS x B x S x HIDDEN x dtype bytes) off the device between forward and backward.

On CPU the "device" and the "host" are the same memory, so memory is asserted on the accounting,
not on an allocator: a census of every tensor autograd saves outside the checkpointed regions
(a saved-tensor hook around the engine's forward, counting each storage once) says what stays
on the device, and ``STATS``/``memory_report`` say what the offload holds on the host. On CPU
the offload still makes the same copies out and back (and the one-layer-ahead prefetch), only
without streams, so the bitwise checks exercise the copy path a GPU run takes.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import partita
from partita.activations import (
    STATS,
    get_checkpoint_hidden_states_offloading_ctx_manager,
    offload_checkpoints,
)
from partita.activations import checkpointing as ckpt
from partita.activations import offload as offload_module
from partita.config.sections.runtime import ActivationCheckpointingConfig
from partita.testing import run_distributed
from partita.utils import safe_get_full_grad

B, S, HIDDEN, LAYERS, VOCAB = 2, 16, 32, 3, 64
OFFLOADED_BYTES = LAYERS * B * S * HIDDEN * 4  # one float32 hidden state per layer
STEPS = 3


@pytest.fixture(autouse=True)
def _default_settings() -> Iterator[None]:
    ckpt.apply_config(ActivationCheckpointingConfig())
    yield
    ckpt.apply_config(ActivationCheckpointingConfig())


def _llama(reentrant: bool = False, handle_first: bool = False) -> LlamaForCausalLM:
    """The tiny Llama with gradient checkpointing on (`handle_first`: offload installed before
    ``gradient_checkpointing_enable``)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=S,
        attention_dropout=0.0,
    )
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config)
    if handle_first:
        offload_checkpoints(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated name HF scripts call
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}
        )
    return model


class _Census:
    """Saved-tensor hooks counting the bytes of distinct storages autograd saves."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


def _train(offload: bool, stage: int = 2, bf16: bool = False) -> dict[str, Any]:
    """STEPS steps of the tiny Llama through the engine, ``cpu_checkpointing`` on or off: the
    losses, each step's full gradients, the saved bytes between forward and backward."""
    config: dict[str, Any] = {
        "bf16": {"enabled": bf16},
        "train_micro_batch_size_per_gpu": B,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": stage},
        "activation_checkpointing": {"cpu_checkpointing": offload},
    }
    model = _llama()
    engine, *_ = partita.initialize(model=model, config=config, dist_init_required=False)
    rank = partita.comm.get_rank() if partita.comm.is_initialized() else 0
    data = torch.Generator().manual_seed(1 + rank)
    out: dict[str, Any] = {"losses": [], "grads": [], "census": [], "host": [], "report": []}
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (B, S), generator=data)
        census = _Census()
        STATS.reset_peaks()
        with torch.autograd.graph.saved_tensors_hooks(census.pack, lambda t: t):
            loss = engine(input_ids=ids, labels=ids).loss
        out["census"].append(census.nbytes)
        out["host"].append(STATS.host_bytes)
        out["report"].append(engine.memory_report().get("ckpt_inputs_host", 0))
        engine.backward(loss)
        grads = [safe_get_full_grad(p) for p in model.parameters()]
        out["grads"].append([g.clone() for g in grads if g is not None])
        engine.step()
        out["losses"].append(loss.detach())
    out["host_after"] = STATS.host_bytes
    installed = offload_module._INSTALLED.get(model)
    out["counts"] = installed.counts if installed is not None else None
    return out


def _compare(stage: int = 2, bf16: bool = False) -> dict[str, Any]:
    plain, offloaded = _train(False, stage, bf16), _train(True, stage, bf16)
    same_grads = all(
        torch.equal(a, b)
        for step_a, step_b in zip(plain["grads"], offloaded["grads"], strict=True)
        for a, b in zip(step_a, step_b, strict=True)
    )
    return {
        "losses": all(map(torch.equal, plain["losses"], offloaded["losses"])),
        "grads": same_grads,
        "plain": plain,
        "offloaded": offloaded,
    }


def _check(result: dict[str, Any], dtype_bytes: int = 4) -> None:
    plain, offloaded = result["plain"], result["offloaded"]
    nbytes = OFFLOADED_BYTES * dtype_bytes // 4
    assert result["losses"] and result["grads"]
    assert plain["host"] == [0] * STEPS and plain["counts"] is None
    # What left the device is exactly the checkpointed inputs, and the offload holds them.
    dropped = [a - b for a, b in zip(plain["census"], offloaded["census"], strict=True)]
    assert dropped == [nbytes] * STEPS
    assert offloaded["host"] == offloaded["report"] == [nbytes] * STEPS
    assert offloaded["host_after"] == 0  # released with the graph by backward
    counts = offloaded["counts"]
    assert (counts.offloaded, counts.offloaded_bytes) == (STEPS * LAYERS, STEPS * nbytes)
    # Every input came back; all but the first one backward needs (the last layer's) were
    # already being copied back by the prefetch one layer ahead.
    assert (counts.restored, counts.prefetched) == (STEPS * LAYERS, STEPS * (LAYERS - 1))


@pytest.mark.parametrize(("stage", "bf16"), [(2, False), (3, True)])
def test_engine_cpu_checkpointing_offloads_hf_checkpoint_inputs_bitwise_on_one_rank(
    stage: int, bf16: bool
) -> None:
    """ZeRO-2 in fp32, and ZeRO-3 (recomputation gathers the parameters again) in bf16, where
    the layer inputs are half the bytes."""
    _check(_compare(stage, bf16), dtype_bytes=2 if bf16 else 4)


def _ranked() -> dict[str, Any]:
    result = _compare()
    for run in ("plain", "offloaded"):
        result[run]["grads"] = []  # compared in the rank; too large to send back for nothing
    return result


def test_engine_cpu_checkpointing_offloads_hf_checkpoint_inputs_bitwise_on_two_ranks() -> None:
    for result in run_distributed(_ranked, 2, timeout=240):
        _check(result)


@pytest.mark.parametrize("reentrant", [False, True])
def test_offload_by_hand_and_deepspeeds_context_match_plain_backward(reentrant: bool) -> None:
    """The function users call, on either of torch's checkpoint flavours, installed after
    ``gradient_checkpointing_enable`` or before it; and DeepSpeed's context manager, which
    leaves the layers unwrapped when it exits. STATS counts each input where it is held."""
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(3))
    runs = []
    for mode in ("plain", "after", "before", "context"):
        model = _llama(reentrant, handle_first=mode == "before")
        context = get_checkpoint_hidden_states_offloading_ctx_manager()
        with context if mode == "context" else contextlib.nullcontext():
            handle = offload_checkpoints(model) if mode in ("after", "before") else context
            loss = model(input_ids=ids, labels=ids).loss
            held = (STATS.device_bytes, STATS.host_bytes)
            loss.backward()
        assert (STATS.device_bytes, STATS.host_bytes) == (0, 0)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert len(grads) == len(list(model.parameters()))
        runs.append((loss.detach(), grads, held, handle, model))
    (plain_loss, plain_grads, plain_held, *_), *offloaded = runs
    assert plain_held == (0, 0)
    layer_bytes = OFFLOADED_BYTES // LAYERS
    # DeepSpeed's context keeps the newest input (keep_last_count=1) on the device.
    expected = [(0, OFFLOADED_BYTES)] * 2 + [(layer_bytes, OFFLOADED_BYTES - layer_bytes)]
    for (loss, grads, held, handle, _), bytes_held in zip(offloaded, expected, strict=True):
        assert torch.equal(loss, plain_loss)
        assert all(map(torch.equal, grads, plain_grads))
        assert held == bytes_held and handle.counts.restored == LAYERS
    for _, _, _, handle, model in offloaded[:2]:
        assert offload_checkpoints(model) is handle  # installed once
    layer = offloaded[2][4].model.layers[0]
    assert not isinstance(layer._gradient_checkpointing_func, offload_module._OffloadingCheckpoint)


def test_remove_restores_the_checkpoint_functions_and_non_hf_models_are_refused() -> None:
    model = _llama()
    layer = model.model.layers[0]
    original = layer._gradient_checkpointing_func
    handle = offload_checkpoints(model)
    assert layer._gradient_checkpointing_func is not original
    handle.remove()
    assert layer._gradient_checkpointing_func is original
    ids = torch.randint(0, VOCAB, (B, S))
    model(input_ids=ids, labels=ids).loss.backward()
    assert handle.counts.offloaded == 0
    with pytest.raises(ValueError, match="Sequential has no Hugging Face"):
        offload_checkpoints(torch.nn.Sequential(torch.nn.Linear(2, 2)))
