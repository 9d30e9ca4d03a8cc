"""Train a small GPT-2 on the Jane Austen novels in data/, written against the DeepSpeed API.

Run it with 2 CPU processes (``scripts/demo.sh`` does exactly this)::

    .venv/bin/partita --num_procs 2 examples/train_gpt.py --deepspeed_config examples/ds_config.json

``import partita as deepspeed`` is the whole port: pass ``--backend deepspeed`` (or set
``PARTITA_BACKEND=deepspeed``) to run the same loop on the real DeepSpeed for comparison,
launched the same way or with ``torchrun --nproc_per_node 2``.

Tokens are raw bytes (vocabulary 256), so nothing is downloaded; the model is a Hugging Face
GPT-2 built from a small ``GPT2Config`` with random weights.

Rank 0 writes the run's outputs, gathered from every rank, to ``--out_dir`` (default
``runs/demo-<UTC time>/`` in the repository, git-ignored): ``train.log`` (a line per step: each
rank's loss, the learning rate; the memory table; the sample), ``loss.png`` (the loss curve) and
``memory.png`` (each rank's ``engine.memory_report()`` items and peak RSS).
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

# Beside this script: Python puts the script's folder first on sys.path.
from demo_plots import write_loss_curve, write_memory_picture

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = ROOT / "data"
MB = 1024 * 1024  # MiB: what the table and the pictures call MB / MiB


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
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Outputs: rank 0 writes train.log, loss.png and memory.png to --out_dir.",
    )
    p.add_argument("--backend", choices=["partita", "deepspeed"], default="partita")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--seq_len", type=int, default=128, help="tokens (bytes) per sample")
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--print_every", type=int, default=10, help="steps between bar updates")
    p.add_argument("--sample_tokens", type=int, default=200, help="bytes to generate at the end")
    p.add_argument(
        "--out_dir", type=Path, default=None,
        help="folder for train.log, loss.png and memory.png (rank 0 writes them; default "
        "runs/demo-<UTC time>/ under the repository, which git ignores)",
    )  # fmt: skip
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


def gather(obj: Any) -> list[Any]:
    """``obj`` from every rank, in rank order (a collective: all ranks must call it)."""
    if not dist.is_initialized():
        return [obj]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def peak_rss_bytes() -> int:
    """This process's peak resident memory in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return int(peak if sys.platform == "darwin" else peak * 1024)


def shown(path: Path) -> str:
    """``path`` relative to the working directory when it is below it (shorter to read)."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


class RunLog:
    """Rank 0's record of the run: ``train.log`` written as it goes, and each rank's loss per
    step for the loss curve. On other ranks (``out_dir`` None) every method does nothing."""

    def __init__(self, out_dir: Path | None) -> None:
        self.out_dir = out_dir
        self.losses: list[list[float]] = []  # [rank][step - 1]
        self.file = None
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            self.file = (out_dir / "train.log").open("w", encoding="utf-8")

    def write(self, text: str) -> None:
        """Append ``text`` and a newline to the log, flushed (so ``tail -f`` follows it)."""
        if self.file is not None:
            self.file.write(text + "\n")
            self.file.flush()

    def add_steps(self, first: int, losses: list[list[float]], lrs: list[float]) -> None:
        """Record steps ``first, first + 1, ...``: ``losses[rank][i]`` and rank 0's ``lrs[i]``."""
        if self.file is None:
            return
        if not self.losses:
            self.losses = [[] for _ in losses]
        for i, lr in enumerate(lrs):
            per_rank = [row[i] for row in losses]
            ranks = " ".join(f"{x:.4f}" for x in per_rank)
            self.write(f"step {first + i:5d}  loss {sum(per_rank) / len(per_rank):.4f}  "
                       f"ranks {ranks}  lr {lr:.2e}")  # fmt: skip
        for mine, new in zip(self.losses, losses, strict=True):
            mine.extend(new)

    def close(self) -> None:
        """Close the log file."""
        if self.file is not None:
            self.file.close()


def memory_table(reports: list[dict[str, int]]) -> str:
    """Each rank's ``engine.memory_report()`` as a table in MiB, a column per rank."""
    width = max(len("memory (MB)"), *(len(key) for key in reports[0])) + 1
    rows = [f"{'memory (MB)':<{width}}" + "  ".join(f"rank {r:>2}" for r in range(len(reports)))]
    for key in reports[0]:
        rows.append(f"{key:<{width}}" + "  ".join(f"{rep[key] / MB:7.1f}" for rep in reports))
    return "\n".join(rows)


def report_memory(engine: Any, log: RunLog, title: str) -> None:
    """Gather every rank's memory report and peak RSS (a collective); rank 0 prints the table,
    logs it and draws the memory picture."""
    mine = engine.memory_report() if hasattr(engine, "memory_report") else None
    everyone = gather((mine if isinstance(mine, dict) else {}, peak_rss_bytes()))
    if log.out_dir is None:
        return
    reports = [rep for rep, _ in everyone]
    # memory_report()'s own peak RSS when the engine has one (the same figure, same source).
    peaks = [rep.get("peak_rss", peak) for rep, peak in everyone]
    if reports[0]:
        table = memory_table(reports)
        print(table)
        log.write(table)
    write_memory_picture(reports, peaks, log.out_dir / "memory.png", title)


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


def train(engine: Any, loader: DataLoader[torch.Tensor], sampler: DistributedSampler[torch.Tensor],
          args: argparse.Namespace, log: RunLog) -> None:  # fmt: skip
    """Run ``args.steps`` optimizer steps; every ``--print_every`` steps gather each rank's
    losses and peak RSS (one collective) for the bar and the log."""
    rank, world = engine.global_rank, engine.world_size
    grad_accum = engine.gradient_accumulation_steps()
    # A disabled tqdm (ranks > 0) does not count, so the step counter is our own.
    bar = tqdm(total=args.steps, disable=rank != 0, unit="step")
    tokens_per_step = engine.train_micro_batch_size_per_gpu() * args.seq_len * world * grad_accum
    micro: list[torch.Tensor] = []  # this step's micro-batch losses (no sync until reported)
    pending: list[torch.Tensor] = []  # this rank's loss per step since the last report
    lrs: list[float] = []  # rank 0's learning rate per step since the last report
    step, epoch, t0 = 0, 0, time.perf_counter()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = batch.to(engine.device)
            loss = engine(batch, labels=batch).loss  # the model shifts labels by one itself
            engine.backward(loss)
            engine.step()  # DeepSpeed style: called every micro-step, steps at the boundary
            micro.append(loss.detach().float())
            if len(micro) < grad_accum:
                continue
            pending.append(torch.stack(micro).mean())
            micro.clear()
            lrs.append(engine.get_lr()[0])
            step += 1
            bar.update(1)
            if step % args.print_every == 0 or step == args.steps:
                everyone = gather((peak_rss_bytes(), torch.stack(pending).tolist()))
                losses = [row for _, row in everyone]
                log.add_steps(step - len(pending) + 1, losses, lrs)
                tok_s = tokens_per_step * step / (time.perf_counter() - t0)
                mean = sum(row[-1] for row in losses) / world
                postfix = {"loss": f"{mean:.3f}", "lr": f"{lrs[-1]:.1e}"}
                postfix["tok_s"] = f"{tok_s:,.0f}"  # all ranks' tokens; the loss their mean
                postfix["rss_mb"] = "/".join(f"{peak / MB:.0f}" for peak, _ in everyone)
                bar.set_postfix(postfix)
                log.write(
                    f"step {step:5d}  {tok_s:,.0f} tokens/s  peak RSS MiB {postfix['rss_mb']}"
                )
                pending.clear()
                lrs.clear()
            if step == args.steps:
                break
        epoch += 1
    bar.close()


def main() -> None:
    """Build the model, hand it to the engine, train for ``--steps`` optimizer steps, and write
    the log and the pictures."""
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
    # Each rank reads its own 1/world of the windows, reshuffled every epoch (seeded).
    dataset = ByteChunks(load_corpus(), args.seq_len)
    sampler: DistributedSampler[torch.Tensor] = DistributedSampler(
        dataset, world, rank, shuffle=True, seed=args.seed, drop_last=True
    )
    loader = DataLoader(dataset, batch_size=micro_bs, sampler=sampler, drop_last=True)
    # Only rank 0 writes, so only its clock names the folder.
    out_dir = args.out_dir or ROOT / "runs" / time.strftime("demo-%Y%m%d-%H%M%S", time.gmtime())
    log = RunLog(out_dir if rank == 0 else None)
    n_params = sum(p.numel() for p in model.parameters())
    stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else "?"
    title = (f"demo GPT-2, {n_params / 1e6:.2f}M parameters, {deepspeed.__name__}, "
             f"{world} ranks, ZeRO stage {stage}")  # fmt: skip
    if rank == 0:
        print(f"{deepspeed.__name__}: {world} ranks, {n_params / 1e6:.2f}M parameters, "
              f"{len(dataset)} windows of {args.seq_len} bytes, micro-batch {micro_bs}")  # fmt: skip
        print(f"log: {shown(out_dir / 'train.log')}")
        log.write(f"{title}\nargs: {' '.join(sys.argv[1:])}")

    train(engine, loader, sampler, args, log)
    report_memory(engine, log, f"memory per rank after {args.steps} steps: {title}")
    if rank == 0:
        write_loss_curve(log.losses, out_dir / "loss.png", f"training loss: {title}")
    if args.sample_tokens > 0:
        text = sample(engine, b"It is a truth ", args.sample_tokens, args.seq_len, args.seed)
        if rank == 0:
            print("sample:", text)
            log.write(f"sample: {text}")
    if rank == 0:
        log.close()
        print(
            f"wrote {shown(out_dir)}/: train.log (the log), loss.png (loss curve), "
            "memory.png (memory per rank)"
        )


if __name__ == "__main__":
    main()
