"""Small deterministic models and data for parity tests (nothing downloaded)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn

VOCAB = 64
SEQ = 8


class Block(nn.Module):
    """A residual MLP block with a norm: enough structure for realistic gradients."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, residual blocks, norm and head; returns the mean token cross-entropy."""

    def __init__(
        self, dim: int = 32, layers: int = 2, tie: bool = False, checkpoint: bool = False
    ) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.norm(x))
        # 16-bit logits are scored in fp32; fp32 and float64 ones in their own precision.
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM (random init from a tiny config) behind the tests' interface."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        import transformers

        if kind in ("gpt2", "gpt2-lora"):
            cfg = transformers.GPT2Config(
                vocab_size=VOCAB,
                n_positions=SEQ,
                n_embd=32,
                n_layer=2,
                n_head=2,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
            self.model = transformers.GPT2LMHeadModel(cfg)
        elif kind == "llama":
            cfg = transformers.LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=SEQ,
            )
            self.model = transformers.LlamaForCausalLM(cfg)
        else:
            raise ValueError(kind)
        self.model.config.use_cache = False
        if kind == "gpt2-lora":
            import peft

            lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0)
            self.model = peft.get_peft_model(self.model, lora)
            # LoRA's B starts at zero; give it values so every trainable weight gets gradients
            # from the first step.
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0.0, 0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, labels=targets).loss


def make_model(
    seed: int = 0,
    kind: str = "tiny",
    frozen: bool = False,
    dtype: torch.dtype = torch.float32,
    **kwargs: object,
) -> nn.Module:
    """The same weights for every caller with the same seed; `frozen` freezes one sub-module
    (the first block of TinyLM, the first layer of HF models), as LoRA-style runs do. The
    weights are drawn in fp32 and then converted, so a float64 model starts from exactly the
    fp32 model's values."""
    torch.manual_seed(seed)
    model: nn.Module = TinyLM(**kwargs) if kind == "tiny" else HFCausalLM(kind)  # type: ignore[arg-type]
    model.to(dtype)
    if frozen:
        first = model.blocks[0] if kind == "tiny" else _first_layer(model)
        for p in first.parameters():
            p.requires_grad_(False)
    return model


def _first_layer(model: nn.Module) -> nn.Module:
    inner = model.model  # type: ignore[attr-defined]
    return inner.transformer.h[0] if hasattr(inner, "transformer") else inner.model.layers[0]


def two_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay for matrices, none for biases and norms (the usual no-decay split)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def global_batches(
    steps: int, batch: int, seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches of (tokens, targets), each `batch` sequences long."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
        # A learnable mapping (a fixed permutation of the vocabulary) so losses fall and
        # precision differences show up in the trajectory.
        targets = (tokens * 5 + 1) % VOCAB
        out.append((tokens, targets))
    return out


def rank_micro_batch(
    batch: tuple[torch.Tensor, torch.Tensor], rank: int, world: int, micro: int, index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch `index` of `rank`: the global batch is split rank-major, then by micro step."""
    per_rank = batch[0].shape[0] // world
    start = rank * per_rank + index * micro
    return batch[0][start : start + micro], batch[1][start : start + micro]


STEPS = 10
"""Optimizer steps of the parity runs."""
LR = 1e-3
"""AdamW's learning rate in the parity runs (the bound below scales with it)."""
ADAM_EPS = 1e-8
"""AdamW's epsilon (torch's and DeepSpeed's default), the floor of Adam's normaliser."""
TERMS = 256
"""Most terms any gradient element is summed from: 32 sequences x 8 tokens (4 ranks x 8)."""
LOSS_RTOL = 1e-6
"""Per-step loss tolerance, in fp32 and float64 alike (the project's parity standard)."""


def weight_atol_float64(steps: int = STEPS, lr: float = LR) -> float:
    """Final-weight tolerance of a float64 run of `steps` AdamW steps at `lr` (5.7e-8 for the
    parity runs); see [Note: parity bound]."""
    return steps * lr * (2 * TERMS * 2.0**-53) / ADAM_EPS


# [Note: parity bound]
# The engine and the single-process reference add the same per-token gradient terms in
# different orders: one process sums a whole batch in one matmul, N ranks sum their parts and
# then reduce across ranks in the backend's order (gloo's ring for 4 ranks), and which order a
# matmul uses depends on the CPU's vector width (AVX2 vs AVX-512). Two orders of the same n
# terms differ by at most 2 n u sum|t_k| (u: unit roundoff). Adam then divides by
# sqrt(v_hat) + eps, so one step moves a weight by at most lr * |dg| / eps more or less: an
# amplification of lr / eps = 1e5 for a weight whose gradient is near zero (GPT-2's key bias
# has an identically zero true gradient, and a few elements of any model sit near zero).
# - fp32 (u = 6e-8): the bound is 10 * 1e-3 * 2 * 256 * 6e-8 / 1e-8 = 31, i.e. none. Such a
#   weight may legitimately differ by up to about 2 lr per step, which is what a fresh clone
#   on an AVX2-only CPU showed (one weight 2e-6 apart at world size 4). fp32 runs are therefore
#   held to per-step losses (rtol 1e-6: the loss averages every weight's effect) and to
#   bitwise determinism, not to elementwise weights.
# - float64 (u = 1.1e-16): with the per-token terms of these models summing to at most 1 in
#   magnitude (mean cross-entropy over the batch, unit-scale activations after LayerNorm),
#   the bound is 10 * 1e-3 * 2 * 256 * 1.1e-16 / 1e-8 = 5.7e-8 for every weight, whatever the
#   ISA, world size or reduction order; that is weight_atol_float64(). This is a first-order
#   bound (it leaves out how a weight difference feeds back into later gradients, a term of
#   the same tiny order). Measured here: 4.4e-16 after 20 steps at world size 4, all stages.
# So every parity case runs twice, in fp32 and in float64 (partita trains a float64 module in
# float64, as DeepSpeed does without fp16/bf16), and the float64 twin carries the weight check.


@dataclass
class Reference:
    """A single-process run in both precisions: per-step losses and final weights."""

    losses: list[float]
    params: list[torch.Tensor]
    losses64: list[float]
    params64: list[torch.Tensor]

    @classmethod
    def of_pair(cls, pair: tuple[dict, dict]) -> Reference:
        """Another engine run (its fp32 and float64 twins) used as the reference."""
        fp32, fp64 = pair
        return cls(fp32["losses"], fp32["params"], fp64["losses"], fp64["params"])


def with_float64(cases: list[dict]) -> list[dict]:
    """`cases`, then each of them again with a float64 model (its twin, same order)."""
    twins = []
    for case in cases:
        kwargs = {**case.get("model_kwargs", {}), "dtype": torch.float64}
        twins.append({**case, "model_kwargs": kwargs})
    return cases + twins


def pairs(results: list[dict]) -> list[tuple[dict, dict]]:
    """Results of `with_float64` cases as (fp32, float64) pairs in the original order."""
    half = len(results) // 2
    assert len(results) == 2 * half
    return list(zip(results[:half], results[half:], strict=True))


def reference_run(
    steps: int,
    batch: int,
    lr: float = LR,
    clip: float = 0.0,
    weight_decay: float = 0.01,
    model_kwargs: dict | None = None,
    groups: bool = False,
) -> Reference:
    """Single-process torch.optim.AdamW on whole global batches, in fp32 and in float64."""
    args = (steps, batch, lr, clip, weight_decay, groups)
    losses, params = _reference_once(*args, model_kwargs or {})
    losses64, params64 = _reference_once(*args, {**(model_kwargs or {}), "dtype": torch.float64})
    return Reference(losses, params, losses64, params64)


def _reference_once(
    steps: int,
    batch: int,
    lr: float,
    clip: float,
    weight_decay: float,
    groups: bool,
    model_kwargs: dict,
) -> tuple[list[float], list[torch.Tensor]]:
    """One precision of `reference_run`.

    It uses torch's fused AdamW kernel, the implementation the config's "AdamW" selects on this
    device, so any difference left is the engine's, not two kernels' rounding.
    """
    model = make_model(**model_kwargs)
    params = (
        two_groups(model, weight_decay)
        if groups
        else [p for p in model.parameters() if p.requires_grad]
    )
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    losses = []
    for tokens, targets in global_batches(steps, batch):
        loss = model(tokens, targets)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def assert_losses(got: list[float], want: list[float], rtol: float = LOSS_RTOL) -> None:
    """Per-step losses within `rtol` of the reference's."""
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64),
        torch.tensor(want, dtype=torch.float64),
        rtol=rtol,
        atol=0.0,
    )


def assert_parity(pair: tuple[dict, dict], ref: Reference, rtol: float = LOSS_RTOL) -> None:
    """An engine run (fp32 and float64 twins) against the reference, per [Note: parity bound]:
    per-step losses within `rtol` in both precisions, and every final float64 weight within
    `weight_atol_float64` of the run's length (at lr `LR`: every parity run's)."""
    fp32, fp64 = pair
    assert fp32["dtype"] == "torch.float32" and fp64["dtype"] == "torch.float64"
    assert_losses(fp32["losses"], ref.losses, rtol)
    assert_losses(fp64["losses"], ref.losses64, rtol)
    for got, want in zip(fp64["params"], ref.params64, strict=True):
        assert got.dtype == want.dtype == torch.float64
        atol = weight_atol_float64(len(fp64["losses"]))
        torch.testing.assert_close(got, want, rtol=0.0, atol=atol)
