"""A plain Accelerate training loop, for the test of ``accelerate launch --use_deepspeed`` with
partita standing in (tests/test_hf_trainer.py). Run with ``python`` alone it is the one-process
reference; under ``accelerate launch --use_deepspeed`` Accelerate drives ``deepspeed``.

Usage: ``hf_accelerate_script.py INIT_DIR OUT_DIR [STEPS]``; writes ``OUT/result_rank{R}.json``
(per-step losses averaged over ranks, the engine class, which ``deepspeed`` ran) and, on rank 0,
``OUT/state_dict.pt`` (``accelerator.get_state_dict``).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from accelerate import Accelerator, PartialState
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_trainer_script import LR, Tokens


def main() -> int:
    init, out = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    os.makedirs(out, exist_ok=True)
    # A CPU-only torch gives Accelerate no backend, and it then treats every rank as the only
    # one; PartialState(cpu=True) makes it build a gloo group first (no effect on GPUs).
    PartialState(cpu=not torch.cuda.is_available())
    accelerator = Accelerator()
    global_batch = 4
    model = AutoModelForCausalLM.from_pretrained(init)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    loader = torch.utils.data.DataLoader(
        Tokens(global_batch * steps), batch_size=global_batch // accelerator.num_processes
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = {}
    model.train()
    for step, batch in enumerate(loader, start=1):
        loss = model(**batch).loss
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = accelerator.gather(loss.detach().reshape(1)).mean().item()
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        torch.save(state_dict, os.path.join(out, "state_dict.pt"))
    import deepspeed_probe

    result = {
        "losses": losses,
        "world": accelerator.num_processes,
        "engine": f"{type(model).__module__}.{type(model).__name__}",
        "deepspeed": deepspeed_probe.describe(),
    }
    with open(os.path.join(out, f"result_rank{accelerator.process_index}.json"), "w") as fh:
        json.dump(result, fh)
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
