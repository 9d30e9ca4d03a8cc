"""TRL training scripts as users write them, for the tests of partita standing in for DeepSpeed
under TRL (tests/test_trl.py). Nothing partita-specific: a run with a ZeRO stage passes
``SFTConfig/DPOConfig(deepspeed="ds.json")`` with Hugging Face's all-``"auto"`` config; a run
without one is the one-process plain-torch reference.

Everything is built here: a tiny Llama (random weights, saved once so every run starts from the
same ones), a word-level tokenizer, and in-memory datasets (``datasets.Dataset.from_dict``).
One process runs a list of runs (``--runs JSON`` or ``@FILE``) one after the other; each writes
``OUT/result_rank{R}.json`` with the per-step losses from the trainer's log, the engine class
that trained, which ``deepspeed`` was imported, and what the run measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from hf_trainer_script import _reset_accelerate
from hf_trainer_script import ds_config as trainer_ds_config

WORDS = [f"w{i}" for i in range(60)]
SPECIAL = ["<pad>", "<eos>", "<unk>"]
VOCAB = len(SPECIAL) + len(WORDS)
LR = 1e-3


def make_tokenizer() -> Any:
    """A word-level tokenizer over `WORDS` (nothing downloaded): one token per word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def make_initial(path: str) -> None:
    """Writes the starting weights and the tokenizer every run loads."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(1234)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    make_tokenizer().save_pretrained(path)


def _sentence(g: torch.Generator, n: int) -> str:
    return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g))


def sft_dataset(n: int) -> Any:
    """`n` texts of 12 words each: every sample has the same number of tokens, so the mean over
    two ranks' batches is the mean over their union."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    return Dataset.from_dict({"text": [_sentence(g, 12) for _ in range(n)]})


def dpo_dataset(n: int) -> Any:
    """`n` preference pairs (prompt, chosen, rejected) of a few words, lengths varying."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)
    rows: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    for i in range(n):
        rows["prompt"].append(_sentence(g, 4 + i % 3))
        # A leading space: the completion's first word stays a word of its own after the prompt.
        rows["chosen"].append(" " + _sentence(g, 3 + i % 2))
        rows["rejected"].append(" " + _sentence(g, 2 + i % 4))
    return Dataset.from_dict(rows)


def ds_config(stage: int) -> dict[str, Any]:
    """Hugging Face's documented all-``"auto"`` config for `stage` with the trainer's own AdamW
    and schedule (hf_trainer_script's), saving gathered 16-bit weights at stage 3 so that
    ``save_model`` writes the full model."""
    cfg = trainer_ds_config(stage, blocks=False)
    if stage == 3:
        cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    return cfg


def _write_config(out: str, stage: int | None) -> str | None:
    if stage is None:
        return None
    path = os.path.join(out, "ds_config.json")
    if int(os.environ.get("RANK", "0")) == 0:
        with open(path + ".tmp", "w") as fh:
            json.dump(ds_config(stage), fh)
        os.replace(path + ".tmp", path)
    else:  # written by rank 0; the trainer reads it before any collective
        import time

        while not os.path.exists(path):
            time.sleep(0.05)
    return path


def _common_args(spec: dict[str, Any], out: str, ds_path: str | None) -> dict[str, Any]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return {
        "output_dir": out,
        "per_device_train_batch_size": spec.get("global_batch", 4) // world,
        "learning_rate": LR,
        "max_steps": spec.get("steps", 4),
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": not torch.cuda.is_available(),
        "train_sampling_strategy": "sequential",
        "dataloader_drop_last": True,
        "seed": 7,
        "deepspeed": ds_path,
        "disable_tqdm": True,
        # TRL's configs default to bf16=True (transformers' to False): fp32 runs are compared.
        "bf16": False,
    }


def _peft_config(spec: dict[str, Any]) -> Any:
    if not spec.get("lora"):
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        modules_to_save=spec.get("modules_to_save"),
        task_type="CAUSAL_LM",
    )


def ds_attributes(model: torch.nn.Module) -> dict[str, Any]:
    """DeepSpeed's ZeRO-3 parameter attributes of each parameter (None where it has none), as
    TRL, PEFT and Transformers read them."""
    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        if not hasattr(p, "ds_id"):
            out[name] = None
            continue
        out[name] = {
            "id": p.ds_id,
            "status": p.ds_status.name,
            "numel": p.ds_numel,
            "shape": list(p.ds_shape),
            "local": p.ds_tensor.numel(),
            "persist": p.ds_persist,
        }
    return out


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """One SFT or DPO run described by `spec` (see the test for the keys)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    out = spec["out"]
    os.makedirs(out, exist_ok=True)
    ds_path = _write_config(out, spec.get("stage"))
    common = _common_args(spec, out, ds_path)
    n = spec.get("global_batch", 4) * spec.get("steps", 4)
    if spec["trainer"] == "sft":
        args: Any = SFTConfig(max_length=32, **common)
    else:
        args = DPOConfig(max_length=32, beta=0.1, **common)
    # After the config: with ZeRO-3 the model is built sharded (deepspeed.zero.Init).
    model = AutoModelForCausalLM.from_pretrained(spec["init"])
    tokenizer = AutoTokenizer.from_pretrained(spec["init"])
    import deepspeed_probe  # tests/ is on sys.path (the script's folder)

    result: dict[str, Any] = {
        "world": int(os.environ.get("WORLD_SIZE", "1")),
        "built_sharded": deepspeed_probe.built_sharded(model),
    }
    if spec["trainer"] == "sft":
        trainer: Any = SFTTrainer(
            model=model,
            args=args,
            train_dataset=sft_dataset(n),
            processing_class=tokenizer,
            peft_config=_peft_config(spec),
        )
    else:
        trainer = DPOTrainer(
            model=model,
            args=args,
            train_dataset=dpo_dataset(n),
            processing_class=tokenizer,
            peft_config=_peft_config(spec),
        )
    trainer.train()
    result["losses"] = {int(e["step"]): e["loss"] for e in trainer.state.log_history if "loss" in e}
    result["global_step"] = trainer.state.global_step
    trainer.save_model(os.path.join(out, "final"))
    consolidate = getattr(trainer.model_wrapped, "consolidated_16bit_state_dict", None)
    if consolidate is not None:  # partita: what the engine holds, to compare with the file
        weights = consolidate(exclude_frozen_parameters=bool(spec.get("lora")))
        if weights is not None:
            torch.save(weights, os.path.join(out, "engine_weights.pt"))
    engine = trainer.model_wrapped
    if spec.get("stage") is not None:
        result["ds_attributes"] = ds_attributes(engine.module)
    result["engine"] = f"{type(engine).__module__}.{type(engine).__name__}"
    result["deepspeed"] = deepspeed_probe.describe()
    trainer.accelerator.free_memory()
    _reset_accelerate()
    return result


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", required=True, help="JSON list of run specs, or @FILE")
    p.add_argument("--make_initial", metavar="DIR")
    p.add_argument("--local_rank", type=int, default=-1)  # passed by DeepSpeed-style launchers
    a = p.parse_args()
    if a.make_initial:
        make_initial(a.make_initial)
    text = Path(a.runs[1:]).read_text() if a.runs.startswith("@") else a.runs
    rank = int(os.environ.get("RANK", "0"))
    for spec in json.loads(text):
        result = run(spec)
        with open(os.path.join(spec["out"], f"result_rank{rank}.json"), "w") as fh:
            json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
