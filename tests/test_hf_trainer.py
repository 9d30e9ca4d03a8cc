"""Hugging Face's Trainer, Accelerate and PEFT run on partita unchanged.

The scripts (tests/hf_trainer_script.py, tests/hf_accelerate_script.py) are what users write:
``TrainingArguments(deepspeed="ds_config.json")`` with Hugging Face's all-``"auto"`` config, or a
plain Accelerate loop. They run under ``partita --num_procs N`` (which makes ``import deepspeed``
partita) or ``accelerate launch --use_deepspeed`` with ``PARTITA_AS_DEEPSPEED=1``, and are held to
one-process plain-torch runs of the same scripts over the same samples. Runs share process
start-ups: one launch runs a list of Trainer runs one after the other.

Tolerances: fp32 losses within 1e-5 relative (the acceptance bound; the runs agree to about 2e-7
here); a resumed run at the same world size and stage is bitwise; bf16 runs are held to DeepSpeed's
own bf16 runs within 2^-8 relative, one bf16 rounding of the loss (they agree to about 2e-5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from partita.launcher.launch import find_free_port

TESTS = Path(__file__).parent
TRAINER = TESTS / "hf_trainer_script.py"
ACCEL = TESTS / "hf_accelerate_script.py"
FP32_RTOL = 1e-5
BF16_RTOL = 2.0**-8
GUARD_S = 240  # hang guard for one launch
# DeepSpeed's own launch compiles its C++ ops on first use in a venv (about 2 minutes on an idle
# 2-core machine; a fresh clone's venv always builds them, since torch's extension cache keys
# them by the venv's include paths): with two test files running at a time a fresh clone's
# build took the launch past 240 s (00:35 UTC 2026-12-07). A compile, not a hang.
DEEPSPEED_GUARD_S = 600


def _run(cmd: list[str], env: dict[str, str] | None = None, guard_s: float = GUARD_S) -> None:
    start = time.perf_counter()
    full = {**os.environ, "PYTHONPATH": str(TESTS), **(env or {})}
    full.pop("PARTITA_AS_DEEPSPEED", None)  # each launch says what it wants
    # An earlier test's in-process group leaves MASTER_ADDR/PORT in this process's environment
    # while its store still listens there; a one-process run (Accelerate's PartialState) would
    # inherit the port and fail with EADDRINUSE. Launched runs get theirs from the launcher.
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        full.pop(name, None)
    full["MASTER_PORT"] = str(find_free_port())
    full.update(env or {})
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full, timeout=guard_s)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    print(f"{time.perf_counter() - start:6.1f} s  {' '.join(cmd[1:4])}")


def _runs(path: Path, specs: list[dict[str, Any]]) -> str:
    path.write_text(json.dumps(specs))
    return f"@{path}"


def _partita(nprocs: int, runs: str) -> list[str]:
    return [
        sys.executable, "-m", "partita.launcher.cli", "--num_procs", str(nprocs),
        str(TRAINER), "--runs", runs,
    ]  # fmt: skip


def _result(out: Path, rank: int = 0) -> dict[str, Any]:
    data = json.loads((out / f"result_rank{rank}.json").read_text())
    if "losses" in data:
        data["losses"] = {int(k): v for k, v in data["losses"].items()}
    return data


STAGES = (0, 1, 2, 3)
# The module fixture runs every launch (about two minutes on two cores); it counts against the
# first test's time.
pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every run of this module: references first (one process, plain torch), then partita on
    two ranks, partita on one rank, Accelerate, and DeepSpeed itself for the bf16 comparison."""
    d = tmp_path_factory.mktemp("hf")
    init = {m: str(d / f"init_{m}") for m in ("llama", "gpt2")}

    def spec(name: str, model: str = "llama", **kw: Any) -> dict[str, Any]:
        return {"model": model, "init": init[model], "out": str(d / name), **kw}

    refs = [
        spec("ref_llama", ds_schedule=True, eval_generate=True),
        spec("ref_gpt2", "gpt2"),
        spec("ref_lora", lora=True, ds_schedule=True),
        spec("ref_eval", eval_only=True),
    ]
    _run(
        [sys.executable, str(TRAINER), "--make_initial", "llama", init["llama"],
         "--make_initial", "gpt2", init["gpt2"], "--runs", _runs(d / "refs.json", refs)]
    )  # fmt: skip
    two = [
        # llama: optimizer and scheduler from the config blocks; gpt2: the Trainer's own
        *(spec(f"llama_s{s}", stage=s, blocks=True, save_steps=2, eval_generate=s == 3) for s in STAGES),
        *(spec(f"gpt2_s{s}", "gpt2", stage=s, blocks=False) for s in STAGES),
        spec("llama_s2_resumed", stage=2, blocks=True, resume=str(d / "llama_s2" / "checkpoint-2")),
        spec("llama_s3_resumed", stage=3, blocks=True, resume=str(d / "llama_s3" / "checkpoint-2")),
        spec("lora_s3", stage=3, blocks=True, lora=True),
        spec("eval_only_s3", stage=3, blocks=True, eval_only=True),
        *(spec(f"bf16_s{s}", stage=s, blocks=True, bf16=True, steps=6) for s in (2, 3)),
    ]  # fmt: skip
    _run(_partita(2, _runs(d / "two.json", two)))
    # Two ranks at stage 2 saved; one rank at stage 3 resumes (DeepSpeed refuses this).
    one = [spec("cross_w1_s3", stage=3, blocks=True, resume=str(d / "llama_s2" / "checkpoint-2"))]
    _run(_partita(1, _runs(d / "one.json", one)))
    _run([sys.executable, str(ACCEL), init["llama"], str(d / "acc_ref")])
    _run(
        [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--zero_stage", "3",
         "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
         "--dynamo_backend", "no", "--main_process_port", "0",
         str(ACCEL), init["llama"], str(d / "acc_s3")],
        env={"PARTITA_AS_DEEPSPEED": "1"},
    )  # fmt: skip
    # DeepSpeed runs torch's AdamW (the same update as its FusedAdam, which on CPU it would
    # compile from C++ first: a minute or two of the suite's CPU in every fresh venv).
    deepspeed_bf16 = [
        spec(f"ds_bf16_s{s}", stage=s, blocks=True, bf16=True, steps=6, torch_adam=True)
        for s in (2, 3)
    ]
    _run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--standalone", str(TRAINER), "--runs", _runs(d / "ds.json", deepspeed_bf16)],
        env={"DS_ACCELERATOR": "cpu"},
        guard_s=DEEPSPEED_GUARD_S,
    )  # fmt: skip
    return d


def _close(ref: dict[int, float], got: dict[int, float], rtol: float, steps: list[int]) -> None:
    assert set(steps) <= set(ref) and set(steps) <= set(got), (ref, got)
    for k in steps:
        assert abs(got[k] - ref[k]) <= rtol * abs(ref[k]), (k, ref[k], got[k], rtol)


def _trained_by_partita(result: dict[str, Any]) -> None:
    assert result["engine"] == "partita.engine.Engine", result["engine"]
    assert result["deepspeed"]["module"] == "partita.compat.deepspeed", result["deepspeed"]
    assert result["deepspeed"]["version"].endswith("+partita.0.1.0"), result["deepspeed"]


@pytest.mark.parametrize("model", ["llama", "gpt2"])
@pytest.mark.parametrize("stage", STAGES)
def test_trainer_matches_plain_torch_and_saves_trained_weights(
    runs: Path, model: str, stage: int
) -> None:
    """All-"auto" configs, 2 ranks, stages 0-3: trained by partita's engine, per-step losses
    within 1e-5 of the one-process Trainer, and save_model() writes the engine's weights."""
    from transformers import AutoModelForCausalLM

    ref = _result(runs / f"ref_{model}")
    got = [_result(runs / f"{model}_s{stage}", r) for r in (0, 1)]
    for r in got:
        _trained_by_partita(r)
        assert r["world"] == 2 and r["global_step"] == 4
    # ZeRO-3 builds the model sharded under deepspeed.zero.Init (partita's), others whole.
    assert got[0]["built_sharded"] == (stage == 3)
    _close(ref["losses"], got[0]["losses"], FP32_RTOL, [1, 2, 3, 4])
    assert got[0]["losses"] == got[1]["losses"]  # every rank logs the same global loss
    # save_model() then from_pretrained gives exactly the weights the engine trained (at stage
    # 3 with stage3_gather_16bit_weights_on_model_save false: DeepSpeed writes no weights then).
    engine_weights = torch.load(runs / f"{model}_s{stage}" / "engine_weights.pt")
    loaded = AutoModelForCausalLM.from_pretrained(runs / f"{model}_s{stage}" / "final").state_dict()
    for name, value in engine_weights.items():
        assert torch.equal(loaded[name], value), name
    reference = AutoModelForCausalLM.from_pretrained(runs / f"ref_{model}" / "final").state_dict()
    assert set(loaded) == set(reference)


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_from_checkpoint_at_the_same_world_size_is_bitwise(runs: Path, stage: int) -> None:
    full = _result(runs / f"llama_s{stage}")
    resumed = _result(runs / f"llama_s{stage}_resumed")
    _trained_by_partita(resumed)
    assert resumed["global_step"] == 4
    assert (runs / f"llama_s{stage}" / "checkpoint-2" / "global_step2").is_dir()
    assert (
        runs / f"llama_s{stage}" / "checkpoint-2" / "latest"
    ).read_text().strip() == "global_step2"
    assert [resumed["losses"][k] for k in (3, 4)] == [full["losses"][k] for k in (3, 4)]


def test_resume_from_two_ranks_stage_2_into_one_rank_stage_3(runs: Path) -> None:
    full = _result(runs / "llama_s2")
    cross = _result(runs / "cross_w1_s3")
    _trained_by_partita(cross)
    assert cross["world"] == 1 and cross["global_step"] == 4 and cross["built_sharded"]
    _close(full["losses"], cross["losses"], FP32_RTOL, [3, 4])


def test_evaluate_and_generate_under_zero3(runs: Path) -> None:
    ref = _result(runs / "ref_llama")
    got = _result(runs / "llama_s3")
    assert abs(got["eval_loss"] - ref["eval_loss"]) <= FP32_RTOL * ref["eval_loss"]
    assert got["generated"] == ref["generated"]  # greedy decoding of the same trained weights


def test_eval_only_zero3_trainer_without_optimizer(runs: Path) -> None:
    ref = _result(runs / "ref_eval")
    got = [_result(runs / "eval_only_s3", r) for r in (0, 1)]
    for r in got:
        _trained_by_partita(r)
        assert r["built_sharded"]
        assert abs(r["eval_loss"] - ref["eval_loss"]) <= FP32_RTOL * ref["eval_loss"]


def test_peft_lora_under_zero3_saves_a_full_adapter(runs: Path) -> None:
    from safetensors.torch import load_file

    ref = _result(runs / "ref_lora")
    got = _result(runs / "lora_s3")
    _trained_by_partita(got)
    _close(ref["losses"], got["losses"], FP32_RTOL, [1, 2, 3, 4])
    adapter = load_file(runs / "lora_s3" / "final" / "adapter_model.safetensors")
    ref_adapter = load_file(runs / "ref_lora" / "final" / "adapter_model.safetensors")
    assert set(adapter) == set(ref_adapter) and adapter
    # Full tensors (DeepSpeed's ZeRO-3 path can write shape [0]), exactly the engine's trained
    # LoRA weights (PEFT names them without the adapter name "default").
    engine_weights = torch.load(runs / "lora_s3" / "engine_weights.pt")
    assert len(engine_weights) == len(adapter)
    for name, value in ref_adapter.items():
        assert adapter[name].shape == value.shape and value.numel() > 0, name
        trained = engine_weights[name.replace(".weight", ".default.weight")]
        assert torch.equal(adapter[name], trained), name
    # It reloads onto the base model (PEFT's own loader).
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(runs / "init_llama")
    PeftModel.from_pretrained(base, runs / "lora_s3" / "final")


def test_accelerate_launch_use_deepspeed_runs_on_partita(runs: Path) -> None:
    ref = _result(runs / "acc_ref")
    got = _result(runs / "acc_s3")
    _trained_by_partita(got)
    assert got["world"] == 2
    _close(ref["losses"], got["losses"], FP32_RTOL, [1, 2, 3, 4])
    state = torch.load(runs / "acc_s3" / "state_dict.pt")
    ref_state = torch.load(runs / "acc_ref" / "state_dict.pt")
    assert set(state) == set(ref_state)
    for name, value in ref_state.items():
        assert state[name].shape == value.shape, name


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_trainer_tracks_deepspeed(runs: Path, stage: int) -> None:
    ours = _result(runs / f"bf16_s{stage}")
    theirs = _result(runs / f"ds_bf16_s{stage}")
    _trained_by_partita(ours)
    assert theirs["engine"] == "deepspeed.runtime.engine.DeepSpeedEngine"
    _close(theirs["losses"], ours["losses"], BF16_RTOL, list(range(1, 7)))
