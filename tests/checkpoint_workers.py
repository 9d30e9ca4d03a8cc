"""Per-rank bodies for checkpoint tests (module level so spawned ranks can import them).

One spawn per world size runs many cases: `save_phase` trains, saves and keeps training (the
uninterrupted reference); `load_phase` starts fresh engines in new processes, loads and
continues. Together they give the exact-resume checks (same world size) and the reshard
matrix (every saved world size and stage into every loading stage).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn

import partita
from models import VOCAB, TinyLM, global_batches, make_model, rank_micro_batch
from partita import comm
from partita.compat import accessors

STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")


class DropoutLM(TinyLM):
    """TinyLM with dropout on the embeddings and before the head (random masks per step)."""

    def __init__(self) -> None:
        super().__init__(dim=16, layers=2)
        self.drop = nn.Dropout(0.2)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(tokens))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.drop(self.norm(x)))
        return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def resume_config(stage: int) -> dict[str, Any]:
    """fp16 with dynamic loss scaling, warmup schedule, accumulation 2."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-3, "warmup_num_steps": 8},
        },
        "fp16": {"enabled": True, "initial_scale_power": 10, "hysteresis": 1},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
        "steps_per_print": 1000,
    }


def resume_dataset(n: int = 40) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The resume runs' training data: `n` random token rows and their targets."""
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (n, 8), generator=gen)
    return [(t, (t * 5 + 1) % VOCAB) for t in tokens]


def _inject_inf(engine: Any, steps: set[int]) -> None:
    """An inf in one gradient element on rank 0 at the given global steps (a skipped step)."""
    if comm.get_rank() != 0:
        return

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if engine.global_steps in steps:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad

    next(engine.module.parameters()).register_hook(hook)


def _resume_engine(stage: int, seed: int) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = DropoutLM()
    engine, _, loader, _ = partita.initialize(
        model=model, config=resume_config(stage), training_data=resume_dataset()
    )
    _inject_inf(engine, {2, 6})
    return engine, loader


def _batches(loader: Any) -> Any:
    """Endless batches: a new pass (epoch) whenever one ends."""
    while True:
        yield from loader


def _train_steps(
    engine: Any, batches: Any, steps: int, seen: list[torch.Tensor] | None = None
) -> list[float]:
    """`steps` optimizer steps; per-micro-step losses (each micro-batch's tokens appended to
    `seen`)."""
    losses = []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        tokens, targets = next(batches)
        if seen is not None:
            seen.append(tokens.clone())
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def resume_full(stage: int, folder: str, total: int, save_at: int) -> dict[str, Any]:
    """The uninterrupted run: saves after `save_at` steps and trains on to `total`."""
    engine, loader = _resume_engine(stage, seed=0)
    batches = _batches(loader)
    before = _train_steps(engine, batches, save_at)
    engine.save_checkpoint(folder, client_state={"save_at": save_at, "note": "resume"})
    rng, position = torch.get_rng_state(), engine.training_dataloader.state_dict()
    seen: list[torch.Tensor] = []
    after = _train_steps(engine, batches, total - save_at, seen)
    out = {"before": before, "after": after, "skipped": engine.skipped_steps}
    out.update(rng=rng, position=position, tokens=seen)
    out["scale"] = engine.cur_scale
    engine.destroy()
    return out


def resume_load(stage: int, folder: str, total: int, save_at: int) -> dict[str, Any]:
    """A fresh engine (other initial weights) loads and trains to `total`."""
    engine, loader = _resume_engine(stage, seed=123)
    path, client = engine.load_checkpoint(folder)
    after = _train_steps(engine, _batches(loader), total - save_at)
    out = {"after": after, "skipped": engine.skipped_steps, "client": client, "path": path}
    out["scale"] = engine.cur_scale
    engine.destroy()
    return out


def resume_cross(stage: int, folder: str, micro_steps: int) -> dict[str, Any]:
    """A fresh engine at this world size loads a resume checkpoint saved at another; returns
    the torch RNG state right after the load and the next `micro_steps` micro-batches' tokens
    of this rank's loader."""
    engine, loader = _resume_engine(stage, seed=123)
    engine.load_checkpoint(folder)
    out: dict[str, Any] = {"rng": torch.get_rng_state()}
    batches = _batches(loader)
    out["tokens"] = [next(batches)[0].clone() for _ in range(micro_steps)]
    out["samples_per_epoch"] = loader.state_dict()["samples_per_epoch"]
    engine.destroy()
    return out


# --- reshard ---------------------------------------------------------------------------------
GLOBAL_BATCH = 4
RESHARD_STEPS, NEXT_STEPS = 3, 5


VARIANTS = ("fp32", "bf16", "offload")
"""Reshard configurations: fp32; bf16 modules (fp32 masters); fp32 with the optimizer
offloaded to the CPU (``offload_optimizer.device: cpu``, stages 1-3)."""


def reshard_config(stage: int, world: int, variant: str = "fp32") -> dict[str, Any]:
    """AdamW, global batch 4 at any world size; small buckets so layouts differ; `variant`
    one of `VARIANTS`."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 700},
        "steps_per_print": 1000,
    }
    if variant == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif variant == "offload":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    elif variant != "fp32":
        raise ValueError(f"variant {variant!r} is not one of {VARIANTS}")
    return cfg


def _reshard_engine(stage: int, seed: int, variant: str = "fp32") -> Any:
    model = make_model(seed=seed, frozen=True)
    engine, _, _, _ = partita.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=reshard_config(stage, comm.get_world_size(), variant),
    )
    return engine


def full_states(engine: Any) -> dict[str, torch.Tensor]:
    """Every trainable parameter's fp32 master and optimizer state, gathered (collective)."""
    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            with partita.zero.GatheredParameters([p]):  # stage 3 shards frozen ones too
                out[f"frozen::{name}"] = p.detach().float().clone()
            continue
        out[f"param::{name}"] = accessors.safe_get_full_fp32_param(p)
        for key in STATE_KEYS:
            value = accessors.safe_get_full_optimizer_state(p, key)
            if value is not None:
                out[f"{key}::{name}"] = value.float()
    return out


def _global_losses(engine: Any, batches: list) -> list[float]:
    rank, world = comm.get_rank(), comm.get_world_size()
    micro = GLOBAL_BATCH // world
    losses = []
    for batch in batches:
        loss = engine(*rank_micro_batch(batch, rank, world, micro, 0))
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        comm.all_reduce(total, tag="test")
        losses.append(total.item() / world)
    return losses


def reshard_save(stage: int, folder: str, variant: str = "fp32") -> dict[str, Any]:
    """Trains 3 steps, saves, records the states, trains 5 more (the reference)."""
    engine = _reshard_engine(stage, seed=0, variant=variant)
    batches = global_batches(RESHARD_STEPS + NEXT_STEPS, GLOBAL_BATCH)
    _global_losses(engine, batches[:RESHARD_STEPS])
    engine.save_checkpoint(folder)
    states = full_states(engine)
    losses = _global_losses(engine, batches[RESHARD_STEPS:])
    engine.destroy()
    return {"states": states, "losses": losses}


def reshard_load(
    stage: int,
    folder: str,
    ref_states: dict[str, torch.Tensor],
    variant: str = "fp32",
    train: bool = True,
) -> dict[str, Any]:
    """A fresh engine at this world size, `stage` and `variant` loads `folder`; returns the
    states that differ from `ref_states` (exact comparison), the restored step counter and,
    with `train`, the next 5 steps' losses."""
    engine = _reshard_engine(stage, seed=99, variant=variant)
    engine.load_checkpoint(folder)
    states = full_states(engine)
    want = dict(ref_states)
    if variant == "bf16":  # a bf16 module holds frozen weights in bf16 (no fp32 master)
        want.update({k: v.bfloat16().float() for k, v in want.items() if k.startswith("frozen")})
    differ = sorted(k for k in want if k not in states or not torch.equal(states[k], want[k]))
    out: dict[str, Any] = {"differ": differ}
    if train:
        batches = global_batches(RESHARD_STEPS + NEXT_STEPS, GLOBAL_BATCH)
        out["losses"] = _global_losses(engine, batches[RESHARD_STEPS:])
    out["global_steps"] = engine.global_steps
    engine.destroy()
    return out


# --- one spawn per world size ------------------------------------------------------------------
def reshard_folder(root: str, world: int, stage: int, variant: str) -> str:
    """Where the reshard checkpoint of (world, stage, variant) is saved."""
    return os.path.join(root, f"reshard-n{world}-s{stage}-{variant}")


def save_phase(
    root: str, resume_stages: list[int], reshard: list[tuple[int, str]]
) -> dict[str, Any]:
    """Every save-side case of one world size (see the module docstring); `reshard`: the
    (stage, variant) checkpoints to save."""
    world = comm.get_world_size()
    out: dict[str, Any] = {"resume": {}, "reshard": {}}
    for s in resume_stages:
        folder = os.path.join(root, f"resume-w{world}-s{s}")
        out["resume"][s] = resume_full(s, folder, total=10, save_at=4)
    for s, v in reshard:
        out["reshard"][(s, v)] = reshard_save(s, reshard_folder(root, world, s, v), v)
    return out


CROSS_STAGE = 2
"""The stage of the resume checkpoints loaded at other world sizes."""


def load_phase(
    root: str,
    resume_stages: list[int],
    saved: dict[tuple[int, int, str], dict],
    loads: list[tuple[int, int, str, int, str, bool]],
    cross: tuple[int, ...] = (),
) -> dict[str, Any]:
    """Every load-side case of one world size: resumes (at the saving world size, and from
    each world size in `cross`), then the reshard loads: (N, s, v) saved at world N, stage s,
    variant v, loaded at stage t, variant w (with `train`: and trained 5 steps on)."""
    world = comm.get_world_size()
    out: dict[str, Any] = {"resume": {}, "reshard": {}, "cross": {}}
    for s in resume_stages:
        folder = os.path.join(root, f"resume-w{world}-s{s}")
        out["resume"][s] = resume_load(s, folder, total=10, save_at=4)
    for n in cross:
        folder = os.path.join(root, f"resume-w{n}-s{CROSS_STAGE}")
        out["cross"][n] = resume_cross(CROSS_STAGE, folder, micro_steps=12)
    for n, s, v, t, w, train in loads:
        folder = reshard_folder(root, n, s, v)
        out["reshard"][(n, s, v, t, w)] = reshard_load(t, folder, saved[(n, s, v)], w, train)
    return out


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """(result or the exception raised, seconds)."""
    start = time.perf_counter()
    try:
        result: Any = fn(*args, **kwargs)
    except Exception as e:
        result = e
    return result, time.perf_counter() - start


# --- corruption, partial calls, client state, export ------------------------------------------
def _small_engine(stage: int, seed: int = 0) -> Any:
    return _reshard_engine(stage, seed)


def _on_rank0(fn: Any) -> None:
    if comm.get_rank() == 0:
        fn()
    comm.barrier()


def _corruptions(base: str, tag: str) -> dict[str, Any]:
    """Each corruption applied to a fresh copy of `base`; what a load of the copy raises."""
    import shutil

    def truncate(d: str) -> None:
        path = os.path.join(d, tag, "rank00001-of-00002.safetensors")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)

    def flip(d: str) -> None:
        path = os.path.join(d, tag, "rank00000-of-00002.safetensors")
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))

    def write_latest(text: str) -> Any:
        def apply(d: str) -> None:
            with open(os.path.join(d, "latest"), "w") as f:
                f.write(text)

        return apply

    variants = {
        "truncated": truncate,
        "flipped": flip,
        "missing": lambda d: os.unlink(os.path.join(d, tag, "rank00001-of-00002.safetensors")),
        "empty_latest": write_latest(""),
        "latest_missing_tag": write_latest("global_step99"),
        "no_manifest": lambda d: os.unlink(os.path.join(d, tag, "manifest.json")),
    }
    out = {}
    for name, corrupt in variants.items():
        copy = f"{base}-{name}"
        _on_rank0(lambda c=copy, f=corrupt: (shutil.copytree(base, c), f(c)))
        engine = _small_engine(2, seed=5)
        result, seconds = timed(engine.load_checkpoint, copy)
        out[name] = (type(result).__name__, str(result), seconds)
        engine.destroy()
    return out


def error_cases(root: str) -> dict[str, Any]:
    """World 2: corruption, bad client state, export, partial save/load calls (last: they leave
    the ranks' call counters out of step)."""
    from partita.checkpoint import export_checkpoint

    engine = _small_engine(2)
    batches = global_batches(2, GLOBAL_BATCH)
    _global_losses(engine, batches)
    base = os.path.join(root, "base")
    engine.save_checkpoint(base)
    tag = f"global_step{engine.global_steps}"
    out: dict[str, Any] = {"states": full_states(engine)}
    out["module"] = {n: p.detach().clone() for n, p in engine.module.state_dict().items()}
    bad = {"epoch": 1, "extra": {"tensor": torch.zeros(2)}}
    out["client_error"] = timed(engine.save_checkpoint, os.path.join(root, "bad"), None, bad)
    out["client_error"] = (type(out["client_error"][0]).__name__, str(out["client_error"][0]))
    if comm.get_rank() == 0:
        export_checkpoint(base, os.path.join(root, "export1"))
        export_checkpoint(base, os.path.join(root, "export3"), max_shard_size="20KB")
        export_checkpoint(base, os.path.join(root, "export_bf16"), dtype="bf16")
    comm.barrier()
    out["corrupt"] = _corruptions(base, tag)
    os.environ["PARTITA_CHECKPOINT_TIMEOUT_S"] = "2"
    if comm.get_rank() == 0:
        out["partial_save"] = timed(engine.save_checkpoint, os.path.join(root, "partial"))
        out["partial_load"] = timed(engine.load_checkpoint, base)
        out["partial_save"] = (str(out["partial_save"][0]), out["partial_save"][1])
        out["partial_load"] = (str(out["partial_load"][0]), out["partial_load"][1])
    return out


def hf_export(root: str) -> dict[str, Any]:
    """World 2, stage 2: a tiny GPT-2 (tied embeddings) trains 2 steps and saves; rank 0
    exports it and compares `from_pretrained` logits with the engine's module."""
    import transformers

    from partita.checkpoint import export_checkpoint

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=8, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg)
    engine, *_ = partita.initialize(model=model, config=reshard_config(2, comm.get_world_size()))
    rank, world = comm.get_rank(), comm.get_world_size()
    for batch in global_batches(2, GLOBAL_BATCH):
        tokens, targets = rank_micro_batch(batch, rank, world, GLOBAL_BATCH // world, 0)
        loss = engine(input_ids=tokens, labels=targets).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(os.path.join(root, "gpt2"))
    out: dict[str, Any] = {}
    if rank == 0:
        export_dir = os.path.join(root, "gpt2-hf")
        export_checkpoint(os.path.join(root, "gpt2"), export_dir, max_shard_size="10KB")
        cfg.save_pretrained(export_dir)
        loaded = transformers.GPT2LMHeadModel.from_pretrained(export_dir).eval()
        engine.module.eval()
        prompt = torch.tensor([[1, 2, 3, 4, 5]])
        with torch.no_grad():
            out["logits"] = (engine.module(prompt).logits, loaded(prompt).logits)
        out["files"] = sorted(os.listdir(export_dir))
    engine.destroy()
    return out


def build_deepspeed_checkpoint(root: str, world: int = 2) -> dict[str, torch.Tensor]:
    """A DeepSpeed ZeRO-2 checkpoint of a TinyLM, made by hand with DeepSpeed's keys (single
    flat group, padded to 2*world, partitioned over `world` ranks; its loss scaler pickled
    as an object of a `deepspeed.*` class). Returns the expected fp32 values."""
    import math
    import sys
    import types
    from collections import OrderedDict

    model = make_model(seed=3)
    params = OrderedDict((n, p.detach().float()) for n, p in model.named_parameters())
    flat = torch.cat([p.reshape(-1) for p in params.values()])
    padded = 2 * world * math.ceil(flat.numel() / (2 * world))
    gen = torch.Generator().manual_seed(4)
    states = {
        "param": torch.cat([flat, torch.zeros(padded - flat.numel())]),
        "exp_avg": torch.randn(padded, generator=gen),
        "exp_avg_sq": torch.rand(padded, generator=gen),
    }
    size = padded // world
    names = ["deepspeed", "deepspeed.runtime", "deepspeed.runtime.fp16",
             "deepspeed.runtime.fp16.loss_scaler"]  # fmt: skip
    fake = {n: types.ModuleType(n) for n in names}
    scaler_cls = type("DynamicLossScaler", (), {"__module__": names[-1]})
    fake[names[-1]].DynamicLossScaler = scaler_cls  # type: ignore[attr-defined]
    scaler = scaler_cls()
    scaler.__dict__.update(cur_scale=1024.0, cur_iter=5, last_overflow_iter=2, cur_hysteresis=2)
    folder = os.path.join(root, "global_step5")
    os.makedirs(folder)
    sys.modules.update(fake)
    try:
        for r in range(world):
            part = {k: v[r * size : (r + 1) * size].clone() for k, v in states.items()}
            osd = {
                "zero_stage": 2, "partition_count": world, "loss_scaler": scaler,
                "dynamic_loss_scale": True, "overflow": False,
                "single_partition_of_fp32_groups": [part["param"]],
                "base_optimizer_state": {
                    "state": {0: {"step": torch.tensor(5.0), "exp_avg": part["exp_avg"],
                                  "exp_avg_sq": part["exp_avg_sq"]}},
                    "param_groups": [{"lr": 1e-3, "params": [0]}],
                },
            }  # fmt: skip
            path = os.path.join(folder, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
            torch.save({"optimizer_state_dict": osd, "ds_version": "0.14.0"}, path)
    finally:
        for n in names:
            sys.modules.pop(n, None)
    torch.save(
        {
            "module": {n: p.half() for n, p in params.items()}, "buffer_names": [],
            "param_shapes": [OrderedDict((n, p.shape) for n, p in params.items())],
            "shared_params": {}, "frozen_param_shapes": None, "frozen_param_fragments": None,
            "global_steps": 5, "global_samples": 20, "skipped_steps": 1, "lr_scheduler": None,
            "ds_config": {"gradient_accumulation_steps": 1}, "ds_version": "0.14.0",
            "dp_world_size": world, "mp_world_size": 1, "optimizer": None, "my_key": 42,
        },
        os.path.join(folder, "mp_rank_00_model_states.pt"),
    )  # fmt: skip
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("global_step5")
    expected = {f"param::{n}": p for n, p in params.items()}
    offset = 0
    for n, p in params.items():
        for k in ("exp_avg", "exp_avg_sq"):
            expected[f"{k}::{n}"] = states[k][offset : offset + p.numel()].view(p.shape)
        expected[f"step::{n}"] = torch.tensor(5.0)
        offset += p.numel()
    return expected


def load_deepspeed(root: str) -> dict[str, Any]:
    """Loads the hand-made DeepSpeed checkpoint into a stage-1 engine (opt-in per call: the
    process environment is left as it was, so later cases see no trust)."""
    model = make_model(seed=9)
    engine, *_ = partita.initialize(model=model, config=reshard_config(1, comm.get_world_size()))
    refused = timed(engine.load_checkpoint, root)[0]
    path, client = engine.load_checkpoint(root, trust_pickle=True)
    out = {"refused": (type(refused).__name__, str(refused)), "client": client}
    out.update(states=full_states(engine), steps=engine.global_steps, path=path)
    engine.destroy()
    return out


def misc_cases(root: str, ds_root: str) -> dict[str, Any]:
    """One world-2 spawn for the Hugging Face export, the DeepSpeed load and `error_cases`
    (last, since its partial calls leave the ranks' call counters out of step)."""
    return {
        "hf": hf_export(root),
        "ds": load_deepspeed(ds_root),
        "errors": error_cases(root),
    }
