"""Transformers' Trainer with ``tensor_parallel.autotp_size: 2`` in its DeepSpeed config, run
by ``accelerate launch --use_deepspeed`` on partita (tests/test_tp_trainer.py): a tiny Llama,
SGD at a constant learning rate, 2 ranks (one tensor group: both read each batch). The Trainer
calls ``deepspeed.tp_model_init`` and ``deepspeed.initialize``; Accelerate shares the batches
over its "tp" mesh. Writes ``OUT/rank{R}.json`` with the loss of every step as the Trainer's
``compute_loss`` returns it."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist

from tp_training_workers import MICRO, SEQ, VOCAB, build_model

STEPS = 3
LR = 0.5


def samples() -> list[dict[str, torch.Tensor]]:
    """``STEPS * MICRO`` sequences, read in order (one batch of MICRO per step)."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (STEPS * MICRO, SEQ), generator=gen)
    return [{"input_ids": row, "labels": row} for row in ids]


def reference() -> list[float]:
    """One process, the whole model: torch SGD on the same batches."""
    model = build_model("llama")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    data = samples()
    for step in range(STEPS):
        batch = data[step * MICRO : (step + 1) * MICRO]
        ids = torch.stack([s["input_ids"] for s in batch])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main(out: str) -> None:
    from transformers import Trainer, TrainingArguments

    losses: list[float] = []

    class Recording(Trainer):
        def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
            result = super().compute_loss(*args, **kwargs)
            losses.append(float((result[0] if isinstance(result, tuple) else result).item()))
            return result

    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": 2},
    }
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=MICRO, max_steps=STEPS,
        learning_rate=LR, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        deepspeed=ds_config, dataloader_drop_last=True, seed=0,
        train_sampling_strategy="sequential", data_seed=0,
    )  # fmt: skip
    trainer = Recording(model=build_model("llama"), args=args, train_dataset=samples())
    trainer.train()
    engine = trainer.model_wrapped
    with open(f"{out}/rank{dist.get_rank()}.json", "w") as f:
        info = {"losses": losses, "engine": type(engine).__module__,
                "tp": engine.get_tensor_parallel_world_size()}  # fmt: skip
        json.dump(info, f)


if __name__ == "__main__":
    main(sys.argv[1])
