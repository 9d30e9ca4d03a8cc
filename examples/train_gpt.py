"""Train a small GPT-2 on the Jane Austen novels in data/, written against the DeepSpeed API.

Run it with 2 CPU processes (``scripts/demo.sh`` does exactly this)::

    .venv/bin/partita --num_procs 2 examples/train_gpt.py --deepspeed_config examples/ds_config.json

``import partita as deepspeed`` is the whole port: pass ``--backend deepspeed`` (or set
``PARTITA_BACKEND=deepspeed``) to run the same loop on the real DeepSpeed for comparison,
launched the same way or with ``torchrun --nproc_per_node 2``.

Tokens are raw bytes (vocabulary 256), so nothing is downloaded; the model is a Hugging Face
GPT-2 built from a small ``GPT2Config`` with random weights.
"""

from __future__ import annotations

import argparse
import importlib
import os
import resource
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from tqdm import tqdm
from transformers import GPT2Config, GPT2LMHeadModel

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
MB = 1024 * 1024


def import_backend() -> ModuleType:
    """Import partita (default) or DeepSpeed under the name the rest of the script uses."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--backend", default=os.environ.get("PARTITA_BACKEND", "partita"))
    name = pre.parse_known_args()[0].backend
    if name == "deepspeed" and not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed assumes CUDA unless told
    return importlib.import_module(name)


deepspeed = import_backend()


def parse_args() -> argparse.Namespace:
    """Command-line arguments: model and run knobs plus DeepSpeed's --deepspeed_config."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["partita", "deepspeed"], default="partita")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--seq_len", type=int, default=128, help="tokens (bytes) per sample")
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--print_every", type=int, default=10, help="steps between bar updates")
    p.add_argument("--sample_tokens", type=int, default=200, help="bytes to generate at the end")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    return deepspeed.add_config_arguments(p).parse_args()


class ByteChunks(Dataset[torch.Tensor]):
    """The corpus as consecutive, non-overlapping windows of ``seq_len`` bytes."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return len(self.data) // self.seq_len

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.seq_len
        return self.data[start : start + self.seq_len].long()


def load_corpus() -> torch.Tensor:
    """Every ``data/*.txt`` file, concatenated, as a uint8 tensor of bytes."""
    raw = b"\n\n".join(p.read_bytes() for p in sorted(DATA_DIR.glob("*.txt")))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def peak_rss_per_rank() -> list[float]:
    """Peak resident memory of every rank in MB (a collective: all ranks must call it)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    mine = peak / (MB if sys.platform == "darwin" else 1024)
    if not dist.is_initialized():
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def print_memory(engine: Any) -> None:
    """Print each rank's memory breakdown (partita's ``engine.memory_report()``) on rank 0."""
    mine = engine.memory_report() if hasattr(engine, "memory_report") else None
    if not isinstance(mine, dict):
        return
    rows: list[Any] = [mine]
    if dist.is_initialized():
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, mine)
    if engine.global_rank == 0:
        print("memory (MB)      " + "  ".join(f"rank {r:>2}" for r in range(len(rows))))
        for key in rows[0]:
            print(f"{key:<16}" + "  ".join(f"{row[key] / MB:7.1f}" for row in rows))


@torch.no_grad()
def sample(engine: Any, prompt: bytes, n: int, seq_len: int, seed: int) -> str:
    """Generate ``n`` bytes after ``prompt``. Every rank runs it (ZeRO-3 forwards are
    collectives), with one shared generator so that all ranks draw the same bytes."""
    engine.eval()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    for _ in range(n):
        logits = engine(ids[:, -seq_len:].to(engine.device)).logits[0, -1].float().cpu()
        probs = torch.softmax(logits / 0.8, dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)[None]], dim=1)
    engine.train()
    return bytes(ids[0].tolist()).decode("utf-8", errors="replace")


def main() -> None:
    """Build the model, hand it to the engine, and train for ``--steps`` optimizer steps."""
    args = parse_args()
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    config = GPT2Config(
        vocab_size=256, n_positions=args.seq_len, n_embd=args.n_embd, n_layer=args.n_layer,
        n_head=args.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=None, eos_token_id=None,  # GPT-2's 50256 is outside a byte vocabulary
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    engine, _, _, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters()
    )
    rank, world = engine.global_rank, engine.world_size
    micro_bs = engine.train_micro_batch_size_per_gpu()
    grad_accum = engine.gradient_accumulation_steps()
    # Each rank reads its own 1/world of the windows, reshuffled every epoch (seeded).
    dataset = ByteChunks(load_corpus(), args.seq_len)
    sampler: DistributedSampler[torch.Tensor] = DistributedSampler(
        dataset, world, rank, shuffle=True, seed=args.seed, drop_last=True
    )
    loader = DataLoader(dataset, batch_size=micro_bs, sampler=sampler, drop_last=True)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{deepspeed.__name__}: {world} ranks, {n_params / 1e6:.2f}M parameters, "
              f"{len(dataset)} windows of {args.seq_len} bytes, micro-batch {micro_bs}")  # fmt: skip

    # A disabled tqdm (ranks > 0) does not count, so the step counter is our own.
    bar = tqdm(total=args.steps, disable=rank != 0, unit="step")
    tokens_per_step = micro_bs * args.seq_len * world * grad_accum
    step, micro_step, epoch, t0 = 0, 0, 0, time.perf_counter()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = batch.to(engine.device)
            loss = engine(batch, labels=batch).loss  # the model shifts labels by one itself
            engine.backward(loss)
            engine.step()  # DeepSpeed style: called every micro-step, steps at the boundary
            micro_step += 1
            if micro_step % grad_accum:
                continue
            step += 1
            bar.update(1)
            if step % args.print_every == 0 or step == args.steps:
                rss = peak_rss_per_rank()  # collective: every rank takes part
                tok_s = tokens_per_step * step / (time.perf_counter() - t0)
                postfix = {"loss": f"{loss.item():.3f}", "lr": f"{engine.get_lr()[0]:.1e}"}
                postfix["tok_s"] = f"{tok_s:,.0f}"  # all ranks' tokens; the loss is rank 0's
                postfix["rss_mb"] = "/".join(f"{mb:.0f}" for mb in rss)
                bar.set_postfix(postfix)
            if step == args.steps:
                break
        epoch += 1
    bar.close()

    print_memory(engine)
    if args.sample_tokens > 0:
        text = sample(engine, b"It is a truth ", args.sample_tokens, args.seq_len, args.seed)
        if rank == 0:
            print("sample:", text)


if __name__ == "__main__":
    main()
