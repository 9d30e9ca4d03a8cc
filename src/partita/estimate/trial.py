"""Trial runs for ``partita plan --trial``: measure what the headroom is unsure of.

The planner keeps `partita.estimate.plan.HEADROOM` of each memory free for what the estimate
misses, so a configuration predicted a little under the memory is refused even when it would
run: on 2 CPU ranks every configuration that keeps its activations was predicted 0.1-6% above
its measured peak, and under a cap between the two the planner chose a checkpointed one that
ran 4-14% slower (``benchmarks/results/plan_cap_10m.md``). DeepSpeed's autotuner settles such
questions by running a dozen trials; the planner runs only the configurations its headroom kept
out that it predicts faster than its choice, fastest first, each for a few steps on this node
in a fresh set of rank processes, and stops at the first whose measured peak fits with
`TRIAL_MARGIN` to spare.

Each rank builds the model from its Hugging Face config (random weights: memory does not depend
on their values), trains on random tokens at the planned micro-batch and sequence length, and
reports its peak over the baseline taken after imports: on CPU ranks resident memory
(``VmHWM``, reset first) less the file-backed pages mapped during the run (libraries' code:
clean, reclaimable, and 26 or 65 MiB for the same steps depending on the page cache, see
`partita.platform.accelerator.host_file_rss`), on a GPU the caching allocator's reserved bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from partita.estimate.memory import Candidate
from partita.platform import env as env_vars

__all__ = ["TRIAL_MARGIN", "TrialError", "TrialRun", "trial_peaks"]

TRIAL_MARGIN = 0.03
"""Fraction of each memory a configuration's measured peak must leave free to be taken. One
configuration's peak resident memory moved 0.7% between a quiet machine and a load of 10
(GPT-2 10m, stage 1, 2 CPU ranks: 347.6-350.0 MiB, ``benchmarks/results/peaks_under_load_10m.md``
and the planner runs 9-10); its two ranks differ by up to 3% in one run (308-318 MiB, file
pages left out, 2026-12-05). 3% covers the drift; the ranks' spread is why a trial takes the
larger rank."""


class TrialError(RuntimeError):
    """A trial could not run (not a configuration that failed: that is a result)."""


@dataclass(frozen=True)
class TrialRun:
    """What a trial measured: per rank its peak bytes over baseline, or why it failed."""

    peaks: tuple[int, ...]
    error: str | None = None

    @property
    def peak(self) -> int:
        """The largest rank's peak."""
        return max(self.peaks, default=0)


def trial_peaks(
    model_dir: str,
    candidate: Candidate,
    world: int,
    micro_batch: int,
    seq_len: int,
    accelerator: str,
    steps: int = 3,
    nvme_path: str | None = None,
    timeout_s: float = 900.0,
) -> TrialRun:
    """Trains `candidate` on `world` ranks of this node for `steps` steps and returns each
    rank's peak; a rank that fails (out of memory included) makes a `TrialRun` with ``error``.
    `TrialError` when the ranks cannot start or run past `timeout_s`."""
    import torch
    import torch.multiprocessing as mp

    from partita.launcher.launch import find_free_port

    if accelerator != "cpu" and torch.cuda.device_count() < world:
        raise TrialError(
            f"a trial runs {world} ranks on this node, one per GPU; "
            f"{torch.cuda.device_count()} visible"
        )

    port = find_free_port()
    with tempfile.TemporaryDirectory(prefix="partita-trial-") as out:
        args = (world, port, out, model_dir, candidate, micro_batch, seq_len, steps,
                accelerator, nvme_path)  # fmt: skip
        ctx = mp.start_processes(_rank, args=args, nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TrialError(f"trial of {candidate.label} ran past {timeout_s:.0f} s")
        except mp.ProcessRaisedException as err:
            return TrialRun((), error=str(err).strip().splitlines()[-1].strip(" -"))
        except mp.ProcessExitedException as err:
            return TrialRun((), error=f"a rank exited with status {err.exit_code}")
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
        peaks = []
        for rank in range(world):
            with open(os.path.join(out, f"rank{rank}.json"), encoding="utf-8") as f:
                peaks.append(int(json.load(f)["peak"]))
    return TrialRun(tuple(peaks))


def _rank(
    rank: int,
    world: int,
    port: int,
    out: str,
    model_dir: str,
    candidate: Candidate,
    micro_batch: int,
    seq_len: int,
    steps: int,
    accelerator: str,
    nvme_path: str | None,
) -> None:
    """One rank of a trial (module level: spawned processes import it)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
    )  # fmt: skip
    import torch

    if accelerator == "cpu":
        from partita.estimate.calibrate import rank_threads

        os.environ[env_vars.ACCELERATOR.name] = "cpu"
        torch.set_num_threads(rank_threads(world))  # the node's cores shared, as launched
    from transformers import AutoConfig, AutoModelForCausalLM

    import partita
    from partita.estimate.plan import ds_config
    from partita.platform.accelerator import host_file_rss, host_peak_rss, host_rss

    config = AutoConfig.from_pretrained(model_dir)
    _import_model_code(config)
    gpu = accelerator != "cpu"
    if gpu:
        torch.cuda.set_device(rank)
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:  # VmHWM from here on
            f.write("5")
    base = torch.cuda.memory_reserved() if gpu else host_rss()
    base_files = host_file_rss()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if candidate.checkpointing:
        model.gradient_checkpointing_enable()
    engine, *_ = partita.initialize(
        model=model, config=ds_config(candidate, micro_batch, nvme_path)
    )
    del model
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randint(0, config.vocab_size, (micro_batch, seq_len), generator=gen)
        x = x.to(engine.device)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    if gpu:
        peak = torch.cuda.max_memory_reserved() - base
    else:  # less the file pages mapped meanwhile: reclaimable, and not the same on every run
        peak = host_peak_rss() - base - (host_file_rss() - base_files)
    engine.destroy()
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump({"peak": peak}, f)


def _import_model_code(config: Any) -> None:
    """Loads the model's modelling module and what its first forward imports, before the
    baseline: code is not training memory (GPT-2's weighs ~100 MiB of resident memory)."""
    import importlib

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    with contextlib.suppress(KeyError):  # a model transformers does not map: built as is
        importlib.import_module(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__module__)
    for name in ("transformers.loss.loss_utils", "transformers.masking_utils"):
        with contextlib.suppress(ImportError):  # not in every transformers version
            importlib.import_module(name)
