"""Worker of ``bench_hf.py``: one Hugging Face Trainer run, timed step by step.

A Trainer script as users write it: ``TrainingArguments(deepspeed="ds_config.json")`` with
Hugging Face's all-``"auto"`` config (``ds_config`` of ``tests/hf_trainer_script.py``), the model
loaded with ``from_pretrained`` after the arguments (so ZeRO-3 builds it sharded). Nothing here
knows whether ``import deepspeed`` is DeepSpeed itself (``torch.distributed.run``) or partita
standing in for it (``partita --num_procs N``, which sets ``PARTITA_AS_DEEPSPEED=1``).

A `StepTimer` callback times each optimizer step from ``on_step_begin`` to ``on_step_end``:
forward, backward, gradient clipping, the engine's step and ``zero_grad`` (Accelerate runs the
engine's ``backward`` and ``step`` inside ``accelerator.backward``), but not the loading of the
batch (fetched before ``on_step_begin``) nor logging (after ``on_step_end``). Each rank writes
``OUT/rank{R}.json``: its step times, peak RSS at a few points, losses and which engine trained.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/common.py
sys.path.insert(1, str(HERE.parent / "tests"))  # hf_trainer_script.ds_config: HF's config
from transformers import TrainerCallback  # noqa: E402

import common  # noqa: E402
from hf_trainer_script import ds_config  # noqa: E402


def current_rss_mb() -> float:
    """This process's resident set size now, in MB (``/proc/self/statm``)."""
    with open("/proc/self/statm") as fh:
        resident_pages = int(fh.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / (1024 * 1024)


class StepTimer(TrainerCallback):
    """Wall time of every optimizer step and of its part before ``optimizer.step()``, plus peak
    RSS when training starts and after the warm-up steps."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.starts: list[float] = []
        self.step_s: list[float] = []
        self.to_pre_optimizer_s: list[float] = []
        self.peak_rss_mb: dict[str, float] = {}
        # Current RSS at each callback, to tell memory held between steps from transient peaks.
        self.rss_mb: dict[str, list[float]] = {"begin": [], "pre_optimizer": [], "end": []}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The engine is built by now (Accelerate's prepare runs before this callback)."""
        self.peak_rss_mb["train_begin"] = common.peak_rss_mb()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Start of an optimizer step, after its batch was fetched."""
        self.rss_mb["begin"].append(current_rss_mb())
        self.starts.append(time.perf_counter())

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Forward, backward (with the engine's step, under Accelerate's DeepSpeed path) done."""
        self.to_pre_optimizer_s.append(time.perf_counter() - self.starts[-1])
        self.rss_mb["pre_optimizer"].append(current_rss_mb())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """End of an optimizer step (after ``zero_grad``, before logging)."""
        self.step_s.append(time.perf_counter() - self.starts[-1])
        self.rss_mb["end"].append(current_rss_mb())
        if len(self.step_s) == self.warmup:
            self.peak_rss_mb["after_warmup"] = common.peak_rss_mb()


class Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences (labels = inputs), the same for every implementation."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def write_config(out: Path, stage: int, blocks: bool, rank: int) -> Path:
    """Rank 0 writes the ZeRO config; the others wait for it (read before any collective)."""
    path = out / "ds_config.json"
    if rank == 0:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(ds_config(stage, blocks)))
        os.replace(tmp, path)
    else:
        deadline = time.monotonic() + 120
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: rank 0 did not write {path} within 120 s")
            time.sleep(0.05)
    return path


def _optimizer_name(engine: Any) -> str:
    """The engine's optimizer class, with the class it wraps (DeepSpeed's ZeRO optimizers)."""
    optimizer = getattr(engine, "optimizer", None)
    inner = getattr(optimizer, "optimizer", None)
    return type(optimizer).__name__ + (f"({type(inner).__name__})" if inner is not None else "")


def train(a: argparse.Namespace, rank: int, world: int, imports_rss_mb: float) -> dict[str, Any]:
    """One Trainer run as `a` describes; returns this rank's measurements."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    out = Path(a.out)
    config_path = write_config(out, a.stage, a.optimizer == "config", rank)
    args = TrainingArguments(  # before the model: with ZeRO-3 the model is built sharded
        output_dir=str(out),
        per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=1,
        learning_rate=1e-4,
        max_steps=a.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        train_sampling_strategy="sequential",
        dataloader_drop_last=True,
        seed=7,
        deepspeed=str(config_path),
        disable_tqdm=True,
        log_level="warning",
    )
    # With use_cpu=True Accelerate starts torch's process group itself (lazily, on first use of
    # the arguments' device) and never calls deepspeed.init_distributed; DeepSpeed's zero.Init,
    # entered by from_pretrained at stage 3, then sizes the world from deepspeed.comm as 1 rank
    # and rejects the batch sizes. A CPU script starts deepspeed.comm on that group itself.
    if args.world_size != world:
        raise RuntimeError(f"Trainer sees {args.world_size} ranks, the launcher started {world}")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    model = AutoModelForCausalLM.from_pretrained(a.init)
    timer = StepTimer(a.warmup)
    data = Tokens(a.micro_batch * world * a.steps, a.seq, model.config.vocab_size)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[timer])
    trainer.train()
    engine = trainer.model_wrapped
    report = getattr(engine, "memory_report", None)
    return {
        "rank": rank,
        "world": world,
        "step_s": timer.step_s,
        "to_pre_optimizer_s": timer.to_pre_optimizer_s,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "peak_rss_mb": {
            "imports": imports_rss_mb,
            **timer.peak_rss_mb,
            "end": common.peak_rss_mb(),
        },
        "rss_end_mb": current_rss_mb(),
        "rss_at_callbacks_mb": timer.rss_mb,
        # partita's own accounting of the bytes it holds (DeepSpeed's engine has no such call)
        "memory_report": report() if callable(report) else None,
        "engine": f"{type(engine).__module__}.{type(engine).__name__}",
        "optimizer": _optimizer_name(engine),
        "deepspeed_module": getattr(deepspeed, "__name__", None),
        "deepspeed_file": getattr(deepspeed, "__file__", None),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The worker's command line (``bench_hf.py`` builds it)."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--init", required=True, help="save_pretrained folder of the starting model")
    p.add_argument("--out", required=True, help="folder for ds_config.json and rank{R}.json")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--micro_batch", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--optimizer", choices=("trainer", "config"), default="trainer")
    p.add_argument("--local_rank", type=int, default=-1)  # passed by DeepSpeed-style launchers
    return p.parse_args(argv)


def main() -> None:
    """Train, write this rank's JSON, and leave without interpreter teardown."""
    a = parse_args()
    import deepspeed  # noqa: F401  (the Trainer imports it anyway; counted in "imports")

    imports_rss_mb = common.peak_rss_mb()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    result = train(a, rank, world, imports_rss_mb)
    (Path(a.out) / f"rank{rank}.json").write_text(json.dumps(result))
    common.exit_worker()


if __name__ == "__main__":
    main()
