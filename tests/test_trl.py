"""TRL's SFTTrainer and DPOTrainer run on partita with ``--deepspeed`` at ZeRO 2 and 3.

The script (tests/trl_script.py) is what TRL users write: ``SFTConfig/DPOConfig(deepspeed=...)``
with Hugging Face's all-``"auto"`` config, a tiny Llama and a word-level tokenizer built in the
test, datasets built in memory. It runs under ``partita --num_procs 2`` (``import deepspeed`` is
partita) and is held to one-process plain-torch runs of the same script over the same samples.
What these runs exercise: TRL's fused LM-head loss reads ``lm_head.weight`` directly, gathering
it with ``GatheredParameters`` when ``p.ds_status != ZeroParamStatus.AVAILABLE`` (ZeRO-3), also
inside its backward; DPOTrainer builds its reference model's engine with TRL's
``prepare_deepspeed`` from a config that still holds ``"auto"`` and dotted top-level keys; PEFT
LoRA with ``modules_to_save`` copies the LM head of a model built sharded under ``zero.Init``.

Tolerance: fp32 per-step losses within 1e-6 relative, the design's fp32 parity bound (the runs
agree to 1.2e-7 or better here; tests/test_hf_trainer.py allows 1e-5). TRL's configs default to
``bf16=True``; the script sets it off.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from test_hf_trainer import _close, _result, _run, _runs, _trained_by_partita

TESTS = Path(__file__).parent
SCRIPT = TESTS / "trl_script.py"
STEPS = [1, 2, 3, 4]
FP32_RTOL = 1e-6  # the design's fp32 parity bound (shared/design.md, Tests)
# Two launches (one process, then two ranks running six runs) take about two minutes on two cores.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """References (one process, no DeepSpeed), then every partita run in one launch."""
    d = tmp_path_factory.mktemp("trl")
    init = str(d / "init")

    def spec(name: str, trainer: str, **kw: Any) -> dict[str, Any]:
        return {"trainer": trainer, "init": init, "out": str(d / name), **kw}

    mts = {"lora": True, "modules_to_save": ["lm_head"]}
    refs = [spec("ref_sft", "sft"), spec("ref_dpo", "dpo"), spec("ref_sft_mts", "sft", **mts)]
    _run([sys.executable, str(SCRIPT), "--make_initial", init, "--runs", _runs(d / "r.json", refs)])
    two = [
        *(spec(f"{t}_s{s}", t, stage=s) for t in ("sft", "dpo") for s in (2, 3)),
        spec("sft_mts_s3", "sft", stage=3, **mts),
    ]
    _run(
        [sys.executable, "-m", "partita.launcher.cli", "--num_procs", "2", str(SCRIPT),
         "--runs", _runs(d / "two.json", two)]
    )  # fmt: skip
    return d


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("trainer", ["sft", "dpo"])
def test_trl_trainer_matches_one_process(runs: Path, trainer: str, stage: int) -> None:
    """Per-step losses within 1e-6 of the one-process run; trained by partita's engine; at
    ZeRO-3 the model was built sharded and the saved model holds the engine's weights."""
    from transformers import AutoModelForCausalLM

    ref = _result(runs / f"ref_{trainer}")
    got = [_result(runs / f"{trainer}_s{stage}", r) for r in (0, 1)]
    for r in got:
        _trained_by_partita(r)
        assert r["world"] == 2 and r["global_step"] == 4
    assert got[0]["built_sharded"] == (stage == 3)
    _close(ref["losses"], got[0]["losses"], FP32_RTOL, STEPS)
    assert got[0]["losses"] == got[1]["losses"]
    # Every parameter moved, the LM head included (at ZeRO-3 TRL reads it outside its module).
    initial = AutoModelForCausalLM.from_pretrained(runs / "init").state_dict()
    saved = AutoModelForCausalLM.from_pretrained(
        runs / f"{trainer}_s{stage}" / "final"
    ).state_dict()
    engine = torch.load(runs / f"{trainer}_s{stage}" / "engine_weights.pt")
    for name, value in engine.items():
        assert torch.equal(saved[name], value), name
        assert not torch.equal(initial[name], value), name


def test_zero3_parameters_carry_deepspeeds_attributes_only_at_stage_3(runs: Path) -> None:
    """After training, each ZeRO-3 parameter answers ds_id (distinct, the same on both ranks),
    ds_status (NOT_AVAILABLE outside a gather, AVAILABLE when persistent), ds_numel/ds_shape
    (the full parameter), ds_tensor (this rank's elements: the two ranks' add up to ds_numel)
    and ds_persist; at stage 2 no parameter has them."""
    assert all(v is None for v in _result(runs / "sft_s2")["ds_attributes"].values())
    ranks = [_result(runs / "sft_s3", r)["ds_attributes"] for r in (0, 1)]
    from transformers import AutoModelForCausalLM

    shapes = {
        n: list(v.shape)
        for n, v in AutoModelForCausalLM.from_pretrained(runs / "init").state_dict().items()
    }
    assert set(ranks[0]) == set(shapes)
    ids = [a["id"] for a in ranks[0].values()]
    assert len(set(ids)) == len(ids)
    for name, a in ranks[0].items():
        b = ranks[1][name]
        assert a["id"] == b["id"] and a["shape"] == b["shape"] == shapes[name], name
        assert a["numel"] == b["numel"] == torch.Size(shapes[name]).numel(), name
        assert a["persist"] == b["persist"], name
        assert a["status"] == ("AVAILABLE" if a["persist"] else "NOT_AVAILABLE"), (name, a)
        if not a["persist"]:
            assert a["local"] + b["local"] == a["numel"], (name, a, b)
    assert any(a["persist"] for a in ranks[0].values())  # norms: below the threshold
    assert not ranks[0]["lm_head.weight"]["persist"]


def test_peft_modules_to_save_under_zero3_trains_and_saves(runs: Path) -> None:
    """LoRA with modules_to_save=["lm_head"] on a model built sharded: PEFT copies the LM head
    of a zero.Init model (the copy stands for the same values); losses within 1e-6 of one
    process; the saved adapter holds the trained copy of the head, equal to the engine's."""
    from safetensors.torch import load_file

    ref = _result(runs / "ref_sft_mts")
    got = _result(runs / "sft_mts_s3")
    _trained_by_partita(got)
    assert got["built_sharded"]
    _close(ref["losses"], got["losses"], FP32_RTOL, STEPS)
    adapter = load_file(runs / "sft_mts_s3" / "final" / "adapter_model.safetensors")
    ref_adapter = load_file(runs / "ref_sft_mts" / "final" / "adapter_model.safetensors")
    assert set(adapter) == set(ref_adapter)
    head = [k for k in adapter if "lm_head" in k]
    assert head, sorted(adapter)
    engine = torch.load(runs / "sft_mts_s3" / "engine_weights.pt")
    trained_head = [v for k, v in engine.items() if "lm_head" in k and "modules_to_save" in k]
    assert len(trained_head) == 1, sorted(engine)
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(runs / "init").state_dict()["lm_head.weight"]
    for k in head:
        assert adapter[k].shape == ref_adapter[k].shape == initial.shape, k
        assert torch.equal(adapter[k], trained_head[0]), k
        assert not torch.equal(adapter[k], initial), k  # the trained copy, not the original
        torch.testing.assert_close(adapter[k], ref_adapter[k], rtol=0, atol=1e-5)


def test_trl_reference_model_config_is_read_as_deepspeed_reads_it() -> None:
    """TRL's prepare_deepspeed hands initialize() a config with "auto" left in sections and
    dotted top-level keys: the first take the section defaults, the second are not read (as in
    DeepSpeed), both named in the log; a top-level "auto" still fails naming the key."""
    from partita.compat.deepspeed.api import as_deepspeed_reads

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "offload_param": {"pin_memory": "auto"},
        },
        "zero_optimization.stage3_prefetch_bucket_size": 921.6,
    }
    got = as_deepspeed_reads(cfg)
    assert got == {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "offload_param": {}},
    }
    assert cfg["zero_optimization"]["reduce_bucket_size"] == "auto"  # the input is not changed
    assert as_deepspeed_reads({"train_batch_size": "auto"}) == {"train_batch_size": "auto"}
