"""A Hugging Face Trainer script as users write it, for the tests of partita standing in for
DeepSpeed (tests/test_hf_trainer.py). Nothing partita-specific: ``--deepspeed CONFIG`` goes to
``TrainingArguments(deepspeed=...)``; without it the Trainer runs plain torch (the reference).

Each ``--case`` is one run; results go to ``OUT/result_rank{R}.json``: per-step losses from the
Trainer's log, the engine class that trained, and whatever the case measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

SEQ = 16
VOCAB = 128


def build_config(kind: str) -> Any:
    """A tiny Llama or GPT-2 config (random weights, nothing downloaded)."""
    from transformers import GPT2Config, LlamaConfig

    if kind == "llama":
        return LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
    return GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


class Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences (labels = inputs): every sample has SEQ tokens, so a mean
    over two ranks' batches equals the mean over their union."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_initial(kind: str, path: str) -> None:
    """Writes the starting weights every run loads (``save_pretrained``)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(build_config(kind))
    model.save_pretrained(path)


def deepspeed_warmup_decay(optimizer: Any, total: int, warmup: int) -> Any:
    """DeepSpeed's ``WarmupDecayLR`` (log warm-up over ``max(2, warmup)`` steps, then linear
    decay to 0 at `total`) written with torch alone, for the plain-torch reference of runs whose
    config has that scheduler block."""
    import math

    w = max(2, warmup)

    def ds_gamma(i: int) -> float:
        if i < w:
            return math.log(i + 1) / math.log(w)
        return max(0.0, (total - i) / max(1.0, total - w))

    # DeepSpeed's schedule starts at iteration -1 (the minimum lr) and the engine steps it after
    # each optimizer step, so optimizer step k (from 0) runs at iteration k - 1.
    def factor(k: int) -> float:
        return 0.0 if k == 0 else ds_gamma(k - 1)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def training_args(a: argparse.Namespace, out: str, per_device: int, **extra: Any) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=per_device,
        per_device_eval_batch_size=per_device,
        gradient_accumulation_steps=a.gas,
        learning_rate=1e-3,
        warmup_steps=1,
        max_steps=a.steps,
        logging_steps=1,
        save_strategy="steps" if a.save_steps else "no",
        save_steps=a.save_steps or 500,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        train_sampling_strategy="sequential",
        dataloader_drop_last=True,
        seed=7,
        max_grad_norm=float(os.environ.get("HFT_CLIP", "1.0")),
        bf16=a.bf16,
        deepspeed=a.deepspeed,
        disable_tqdm=True,
        **extra,
    )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--case", default="train", choices=["train", "init", "eval_only"])
    p.add_argument("--model", default="llama", choices=["llama", "gpt2"])
    p.add_argument("--init", required=True, help="save_pretrained folder to start from")
    p.add_argument("--out", required=True)
    p.add_argument("--deepspeed", default=None)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--gas", type=int, default=1)
    p.add_argument("--global_batch", type=int, default=4)
    p.add_argument("--save_steps", type=int, default=0)
    p.add_argument("--resume", default=None)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--lora", action="store_true")
    p.add_argument(
        "--ds_schedule",
        action="store_true",
        help="reference only: AdamW + DeepSpeed's WarmupDecayLR, as the config's blocks build",
    )
    p.add_argument("--eval_generate", action="store_true")
    p.add_argument("--local_rank", type=int, default=-1)  # passed by DeepSpeed-style launchers
    a = p.parse_args()

    if a.case == "init":
        make_initial(a.model, a.init)
        return 0

    from transformers import AutoModelForCausalLM, Trainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_device = a.global_batch // world // a.gas
    args = training_args(a, a.out, per_device)  # before the model: ZeRO-3 builds it sharded
    model = AutoModelForCausalLM.from_pretrained(a.init)
    if a.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        )
    n_samples = a.global_batch * a.steps
    optimizers: tuple[Any, Any] = (None, None)
    if a.ds_schedule:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        optimizers = (opt, deepspeed_warmup_decay(opt, a.steps, 1))
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(n_samples),
        eval_dataset=Tokens(8, seed=1),
        optimizers=optimizers,
    )
    result: dict[str, Any] = {"world": world}
    if a.case == "eval_only":
        result["eval_loss"] = trainer.evaluate()["eval_loss"]
        result["engine"] = (
            type(trainer.model_wrapped).__module__ + "." + type(trainer.model_wrapped).__name__
        )
    else:
        trainer.train(resume_from_checkpoint=a.resume)
        result["losses"] = {
            int(e["step"]): e["loss"] for e in trainer.state.log_history if "loss" in e
        }
        engine = trainer.model_wrapped
        result["engine"] = type(engine).__module__ + "." + type(engine).__name__
        result["global_step"] = trainer.state.global_step
        trainer.save_model(os.path.join(a.out, "final"))
        if a.eval_generate:
            result["eval_loss"] = trainer.evaluate()["eval_loss"]
            prompt = Tokens(2, seed=3).ids[:, :4]
            with torch.no_grad():
                generated = trainer.model.generate(
                    input_ids=prompt, max_new_tokens=4, do_sample=False, pad_token_id=0
                )
            result["generated"] = generated.tolist()
    import deepspeed_probe

    result["deepspeed"] = deepspeed_probe.describe()
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(a.out, f"result_rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
