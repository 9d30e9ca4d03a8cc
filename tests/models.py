"""Small deterministic models and data for parity tests (nothing downloaded)."""

from __future__ import annotations

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
        return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


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
    seed: int = 0, kind: str = "tiny", frozen: bool = False, **kwargs: object
) -> nn.Module:
    """The same weights for every caller with the same seed; `frozen` freezes one sub-module
    (the first block of TinyLM, the first layer of HF models), as LoRA-style runs do."""
    torch.manual_seed(seed)
    model: nn.Module = TinyLM(**kwargs) if kind == "tiny" else HFCausalLM(kind)  # type: ignore[arg-type]
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


def reference_run(
    steps: int,
    batch: int,
    lr: float = 1e-3,
    clip: float = 0.0,
    weight_decay: float = 0.01,
    model_kwargs: dict | None = None,
    groups: bool = False,
) -> tuple[list[float], list[torch.Tensor]]:
    """Single-process torch.optim.AdamW on whole global batches: the parity reference.

    It uses torch's fused AdamW kernel, the implementation the config's "AdamW" selects on this
    device, so any difference left is the engine's, not two kernels' rounding.
    """
    model = make_model(**(model_kwargs or {}))
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


def assert_parity(
    result: dict, ref_losses: list[float], ref_params: list[torch.Tensor], rtol: float = 1e-6
) -> None:
    """Per-step losses within `rtol` of the reference and final parameters allclose (1e-6)."""
    torch.testing.assert_close(
        torch.tensor(result["losses"], dtype=torch.float64),
        torch.tensor(ref_losses, dtype=torch.float64),
        rtol=rtol,
        atol=0.0,
    )
    for got, want in zip(result["params"], ref_params, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
