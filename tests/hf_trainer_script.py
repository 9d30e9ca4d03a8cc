"""A Hugging Face Trainer script as users write it, for the tests of partita standing in for
DeepSpeed (tests/test_hf_trainer.py). Nothing partita-specific: a run with a ZeRO stage passes
``TrainingArguments(deepspeed="ds.json")`` with an all-``"auto"`` config; a run without one is the
plain-torch reference.

One process runs a list of runs (``--runs JSON``) one after the other, to share the start-up of
Python, torch and transformers; Accelerate's process-wide state is reset between runs, as a new
script would start it. Each run writes ``OUT/result_rank{R}.json``: per-step losses from the
Trainer's log, the engine class that trained, which ``deepspeed`` was imported, and whatever the
run measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

SEQ = 16
VOCAB = 128
LR = 1e-3


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


def ds_config(stage: int, blocks: bool) -> dict[str, Any]:
    """Hugging Face's documented all-``"auto"`` config for `stage`; with `blocks`, the
    optimizer and scheduler come from the config (AdamW, WarmupDecayLR), else the Trainer makes
    its own (torch AdamW, linear schedule) and hands them to the engine."""
    cfg: dict[str, Any] = {
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": "auto",
        },
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "steps_per_print": 2000,
        "wall_clock_breakdown": False,
    }
    if stage == 3:
        cfg["zero_optimization"].update(
            stage3_prefetch_bucket_size="auto",
            stage3_param_persistence_threshold="auto",
            stage3_gather_16bit_weights_on_model_save=False,  # partita gathers anyway
        )
    if blocks:
        cfg["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        }
        cfg["scheduler"] = {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        }
    return cfg


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
    """DeepSpeed's ``WarmupDecayLR`` (log warm-up over ``max(2, warmup)`` iterations, then
    linear decay to 0 at `total`) written with torch alone, for the plain-torch reference of runs
    whose config has that block."""
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


def _reset_accelerate() -> None:
    """Forget the previous run's Accelerator (a new script would start without one); the
    process group stays."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """One Trainer run described by `spec` (see the test for the keys)."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    out = spec["out"]
    os.makedirs(out, exist_ok=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    gas = spec.get("gas", 1)
    steps = spec.get("steps", 4)
    global_batch = spec.get("global_batch", 4)
    stage = spec.get("stage")
    ds_path = None
    if stage is not None:
        ds_path = os.path.join(out, "ds_config.json")
        if int(os.environ.get("RANK", "0")) == 0:
            with open(ds_path + ".tmp", "w") as fh:
                config = ds_config(stage, spec.get("blocks", True))
                if spec.get("torch_adam"):
                    config["optimizer"]["params"]["torch_adam"] = True
                json.dump(config, fh)
            os.replace(ds_path + ".tmp", ds_path)
        else:  # written by rank 0; wait for it (the Trainer reads it before any collective)
            import time

            while not os.path.exists(ds_path):
                time.sleep(0.05)
    args = TrainingArguments(  # before the model: with ZeRO-3 the model is built sharded
        output_dir=out,
        per_device_train_batch_size=global_batch // world // gas,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=gas,
        learning_rate=LR,
        warmup_steps=1,
        max_steps=steps,
        logging_steps=1,
        save_strategy="steps" if spec.get("save_steps") else "no",
        save_steps=spec.get("save_steps") or 500,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        train_sampling_strategy="sequential",
        dataloader_drop_last=True,
        seed=7,
        bf16=spec.get("bf16", False),
        deepspeed=ds_path,
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(spec["init"])
    import deepspeed_probe  # tests/ is on sys.path (the script's folder)

    result: dict[str, Any] = {"world": world, "built_sharded": deepspeed_probe.built_sharded(model)}
    if spec.get("lora"):
        from peft import LoraConfig, get_peft_model

        target = ["q_proj", "v_proj"] if spec["model"] == "llama" else ["c_attn"]
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=target))
    optimizers: tuple[Any, Any] = (None, None)
    if spec.get("ds_schedule"):  # reference of a config with optimizer and scheduler blocks
        opt = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0
        )
        optimizers = (opt, deepspeed_warmup_decay(opt, steps, 1))
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(global_batch * steps),
        eval_dataset=Tokens(4, seed=1),
        optimizers=optimizers,
    )
    if spec.get("eval_only"):
        result["eval_loss"] = trainer.evaluate()["eval_loss"]
    else:
        if spec.get("eval_first"):  # an eval-only engine first, then training on the same model
            result["eval_loss_before"] = trainer.evaluate()["eval_loss"]
        trainer.train(resume_from_checkpoint=spec.get("resume"))
        result["losses"] = {
            int(e["step"]): e["loss"] for e in trainer.state.log_history if "loss" in e
        }
        result["global_step"] = trainer.state.global_step
        trainer.save_model(os.path.join(out, "final"))
        consolidate = getattr(trainer.model_wrapped, "consolidated_16bit_state_dict", None)
        if consolidate is not None:  # partita: what the engine holds, to compare with the file
            weights = consolidate(exclude_frozen_parameters=bool(spec.get("lora")))
            if weights is not None:
                torch.save(weights, os.path.join(out, "engine_weights.pt"))
        if spec.get("eval_generate"):
            result["eval_loss"] = trainer.evaluate()["eval_loss"]
            prompt = Tokens(2, seed=3).ids[:, :4]
            with torch.no_grad():
                generated = trainer.model.generate(
                    input_ids=prompt, max_new_tokens=4, do_sample=False, pad_token_id=0
                )
            result["generated"] = generated.tolist()
    engine = trainer.model_wrapped
    result["engine"] = f"{type(engine).__module__}.{type(engine).__name__}"
    result["deepspeed"] = deepspeed_probe.describe()
    trainer.accelerator.free_memory()
    _reset_accelerate()
    return result


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", required=True, help="JSON list of run specs, or @FILE")
    p.add_argument("--make_initial", nargs=2, metavar=("MODEL", "DIR"), action="append")
    p.add_argument("--local_rank", type=int, default=-1)  # passed by DeepSpeed-style launchers
    a = p.parse_args()
    for kind, path in a.make_initial or []:
        make_initial(kind, path)
    text = Path(a.runs[1:]).read_text() if a.runs.startswith("@") else a.runs
    rank = int(os.environ.get("RANK", "0"))
    for spec in json.loads(text):
        result = run(spec)
        with open(os.path.join(spec["out"], f"result_rank{rank}.json"), "w") as fh:
            json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
