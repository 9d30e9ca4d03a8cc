"""DeepSpeed's public module paths and ZeRO-3 parameter attributes under partita's stand-in.

- Every public module path of DeepSpeed 0.19.8 imports under ``import partita.as_deepspeed``
  (a real module or a stub); a name partita lacks raises one error naming it, the feature and
  what partita offers instead: an AttributeError for ``getattr``/``hasattr``, an ImportError
  with the same words for ``from X import name``. A path DeepSpeed lacks still fails to import.
- Every (module, name) pair DeepSpeed's users and unit tests import resolves, or refuses on use
  naming what partita offers.
- ZeRO-3 parameters answer ``ds_id``, ``ds_status``, ``ds_numel``, ``ds_shape``, ``ds_tensor``
  and ``ds_persist`` as views of partita's state (built under ``zero.Init`` and held by an
  engine); other parameters have none of them, so ``hasattr`` probes tell them apart.
- A deep copy of a parameter ``zero.Init`` holds stands for the same values (PEFT copies
  modules that way); a parameter read directly inside ``GatheredParameters`` during forward
  (TRL's fused LM head) gets its gradient.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from partita.testing import run_distributed

# (module, name) pairs that must import and work under the stand-in.
RESOLVE = [
    ("deepspeed.runtime.config", "DeepSpeedConfig"),
    ("deepspeed.runtime.config", "DeepSpeedConfigError"),
    ("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.runtime.zero.partition_parameters", "ZeroParamStatus"),
    ("deepspeed.runtime.zero.partition_parameters", "GatheredParameters"),
    ("deepspeed.runtime.zero.partition_parameters", "Init"),
    ("deepspeed.runtime.zero", "ZeroParamStatus"),
    ("deepspeed.zero", "ZeroParamStatus"),
    ("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer"),
    ("deepspeed.ops.op_builder", "CPUAdamBuilder"),
    ("deepspeed.ops.op_builder", "FusedAdamBuilder"),
    ("deepspeed.ops.op_builder", "AsyncIOBuilder"),
    ("deepspeed.utils", "set_z3_leaf_modules"),
    ("deepspeed.utils", "set_z3_leaf_modules_by_name"),
    ("deepspeed.utils", "set_z3_leaf_modules_by_suffix"),
    ("deepspeed.utils", "z3_leaf_parameter"),
    ("deepspeed.utils", "safe_get_full_fp32_param"),
    ("deepspeed.runtime.lr_schedules", "LR_RANGE_TEST_MIN_LR"),
    ("deepspeed.runtime.lr_schedules", "WARMUP_NUM_STEPS"),
    ("deepspeed.runtime.lr_schedules", "TOTAL_NUM_STEPS"),
    ("deepspeed.runtime.lr_schedules", "WarmupLR"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine"),
    ("deepspeed.runtime.zero.stage3", "estimate_zero3_model_states_mem_needs_all_live"),
    ("deepspeed.accelerator", "get_accelerator"),
    ("deepspeed.checkpoint.utils", "clone_tensors_for_torch_save"),
    ("deepspeed.runtime.zero.offload_config", "OffloadDeviceEnum"),
    ("deepspeed.runtime.zero.offload_config", "OffloadStateTypeEnum"),
    ("deepspeed.runtime.zero.offload_config", "DeepSpeedZeroOffloadParamConfig"),
    ("deepspeed.utils.zero_to_fp32", "get_fp32_state_dict_from_zero_checkpoint"),
    ("deepspeed.utils.zero_to_fp32", "convert_zero_checkpoint_to_fp32_state_dict"),
    ("deepspeed.utils.zero_to_fp32", "load_state_dict_from_zero_checkpoint"),
    ("deepspeed.runtime.utils", "see_memory_usage"),
    ("deepspeed.runtime.utils", "move_to_device"),
    ("deepspeed.runtime.engine", "DeepSpeedOptimizerCallable"),
    ("deepspeed.git_version_info", "version"),
    ("deepspeed.utils", "get_z3_leaf_modules"),
    ("deepspeed.utils", "z3_leaf_module"),
    ("deepspeed.runtime.zero.utils", "ZeRORuntimeException"),
    ("deepspeed.pipe", "PipelineModule"),
    ("deepspeed.moe.layer", "MoE"),
    ("deepspeed.accelerator", "is_current_accelerator_supported"),
]
# Names that exist but refuse on use, with a word of what partita offers instead.
REFUSE_ON_USE = [
    ("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer", "bf16"),
    ("deepspeed.ops.op_builder", "CPUAdamBuilder", "CPUAdamW"),
]

SCRIPT = textwrap.dedent(
    """
    import importlib, json, sys
    import partita.as_deepspeed
    pairs, refuse = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    out = {"missing": [], "refused": {}}
    for module, name in pairs:
        try:
            getattr(importlib.import_module(module), name)
        except Exception as e:
            out["missing"].append(f"{module}.{name}: {type(e).__name__}: {e}")
    for module, name, _ in refuse:
        obj = getattr(importlib.import_module(module), name)
        try:
            made = obj()
            made.load() if hasattr(made, "load") else None
            out["refused"][name] = None
        except Exception as e:
            out["refused"][name] = f"{type(e).__name__}: {e}"
    import deepspeed.ops.op_builder as ob
    out["compatible"] = ob.CPUAdamBuilder().is_compatible()
    try:
        ob.NotABuilderName
    except AttributeError as e:
        out["unknown"] = str(e)
    from deepspeed.runtime.config import DeepSpeedConfig
    cfg = DeepSpeedConfig({"train_batch_size": 4, "zero_optimization": {"stage": 2}})
    out["stage"] = cfg.zero_optimization.stage
    import torch
    from deepspeed.utils import set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    found, missing = set_z3_leaf_modules_by_name(m, ["1.0", "9"], raise_if_not_found=False)
    out["by_name"] = [found == [m[1][0]], missing]
    found, missing = set_z3_leaf_modules_by_suffix(m, ["0"])
    out["by_suffix"] = sorted(n for n, x in m.named_modules() if any(x is f for f in found))
    from deepspeed.utils import get_z3_leaf_modules, z3_leaf_module
    out["leaves"] = [len(get_z3_leaf_modules(m)), z3_leaf_module(m[0]), z3_leaf_module(m[1])]
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
    import partita.engine.offload_states as eo
    out["enums"] = [OffloadDeviceEnum is eo.OffloadDeviceEnum,
                    OffloadStateTypeEnum.optim_states.value]
    from deepspeed.runtime.utils import move_to_device
    t = torch.ones(2)
    moved = move_to_device({"a": [t, (t, 3)]}, "cpu")
    out["moved"] = [moved["a"][1][1], torch.equal(moved["a"][0], t)]
    from partita.compat.deepspeed._stubs import module_paths
    failed = []
    for path in sorted(module_paths()):
        try:
            importlib.import_module("deepspeed." + path)
        except Exception as e:
            failed.append(f"{path}: {type(e).__name__}: {e}")
    out["paths"] = [len(module_paths()), failed]
    import deepspeed.compression.helper as layer
    out["stub_hasattr"] = hasattr(layer, "recursive_getattr")
    try:
        layer.recursive_getattr
    except AttributeError as e:
        out["stub_getattr"] = str(e)
    try:
        from deepspeed.compression.helper import recursive_getattr
    except ImportError as e:
        out["stub_from"] = str(e)
    try:
        from deepspeed.runtime.engine import NoSuchName
    except ImportError as e:
        out["real_from"] = str(e)
    try:
        import deepspeed.runtime.zero.no_such_module
    except ModuleNotFoundError as e:
        out["typo"] = str(e)
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def names() -> dict[str, Any]:
    """What `SCRIPT` found, in one fresh interpreter with the stand-in installed."""
    import json

    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(RESOLVE), json.dumps(REFUSE_ON_USE)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_deepspeed_module_paths_resolve_or_name_what_partita_offers(
    names: dict[str, Any],
) -> None:
    out = names
    assert out["missing"] == []
    for _, name, offered in REFUSE_ON_USE:
        message = out["refused"][name]
        assert message is not None and name in message and offered in message, message
    assert out["compatible"] is False
    assert "deepspeed.ops.op_builder.NotABuilderName" in out["unknown"]
    assert out["stage"] == 2
    assert out["by_name"] == [True, ["9"]]
    assert out["by_suffix"] == ["0", "1.0"]
    assert out["leaves"] == [2, True, False]  # m[0] and m[1][0], not m[1]
    assert out["enums"] == [True, "optim_states"]
    assert out["moved"] == [3, True]


def test_every_deepspeed_module_path_resolves_and_missing_names_say_so(
    names: dict[str, Any],
) -> None:
    """All of DeepSpeed 0.19.8's public module paths import; a stub's name raises naming the
    name and the feature, for getattr (AttributeError, so hasattr is False) and for
    ``from X import name`` (ImportError with the same words); a real module's missing name says
    what partita offers; a path DeepSpeed lacks fails naming it."""
    out = names
    count, failed = out["paths"]
    assert count > 700 and failed == []
    assert out["stub_hasattr"] is False
    for key in ("stub_getattr", "stub_from"):
        assert (
            "deepspeed.compression.helper.recursive_getattr" in out[key]
            and "DeepSpeed compression" in out[key]
        )
    assert "deepspeed.runtime.engine.NoSuchName" in out["real_from"]
    assert "partita offers" in out["real_from"] and "DeepSpeedEngine" in out["real_from"]
    assert "deepspeed.runtime.zero.no_such_module" in out["typo"]


def _zero3_attributes_worker(swap: str) -> dict[str, Any]:
    """Runs on each rank: zero.Init parameters, a stage-3 engine's, a stage-2 engine's, a
    stage-3 engine's with its shards in NVMe swap files under `swap`."""
    import partita
    from partita.compat.deepspeed.runtime.zero.param_attrs import ZeroParamStatus

    out: dict[str, Any] = {}
    plain = torch.nn.Linear(3, 3)
    out["plain_has"] = hasattr(plain.weight, "ds_id")
    torch.manual_seed(0)
    with partita.zero.Init():
        built = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    w = built[0].weight
    out["init"] = [w.ds_status is ZeroParamStatus.NOT_AVAILABLE, w.ds_numel, list(w.ds_shape)]
    out["init_local"] = w.ds_tensor.numel()
    with partita.zero.GatheredParameters([w]):
        out["init_gathered"] = w.ds_status is ZeroParamStatus.AVAILABLE
        original = w.detach().clone()
    # PEFT's modules_to_save copies a module of a model built under zero.Init.
    twin = copy.deepcopy(built[0])
    with partita.zero.GatheredParameters([twin.weight]):
        out["copy_equal"] = bool(torch.equal(twin.weight.detach(), original))
    out["copy_is_managed"] = hasattr(twin.weight, "ds_id") and twin.weight.ds_id != w.ds_id
    return out | _engine_attributes(partita, ZeroParamStatus, swap)


class _GatheredMatmul(torch.autograd.Function):
    """``h @ w.t()`` that gathers `w` again in its backward, as TRL's chunked log-prob does."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h, w)
        return h @ w.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        import partita

        h, w = ctx.saved_tensors
        with partita.zero.GatheredParameters([w]):
            return grad @ w, grad.t() @ h


class _DirectHead(torch.nn.Module):
    """A body whose forward reads the head's weight directly, inside GatheredParameters, as
    TRL's fused LM-head loss does: the head module itself never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import partita

        h = self.body(x)
        with partita.zero.GatheredParameters([self.head.weight]):
            return _GatheredMatmul.apply(h, self.head.weight).square().mean()


def _engine_attributes(partita: Any, status: Any, swap: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    torch.manual_seed(1)
    model = _DirectHead()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 9}  # body.bias (8) persists
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": zero,
    }
    engine, *_ = partita.initialize(model=model, config=config)
    head, bias = model.head.weight, model.body.bias
    out["ids"] = [p.ds_id for p in model.parameters()]
    out["status"] = [head.ds_status is status.NOT_AVAILABLE, bias.ds_status is status.AVAILABLE]
    out["persist"] = [head.ds_persist, bias.ds_persist]
    out["local"] = head.ds_tensor.numel()
    before = partita.utils.safe_get_full_fp32_param(head).clone()
    # Transformers and PEFT read a partitioned parameter inside GatheredParameters: full data.
    with partita.zero.GatheredParameters([head]):
        out["gathered"] = [
            head.ds_status is status.AVAILABLE,
            head.shape == head.ds_shape,
            bool(torch.equal(head.detach(), before)),
        ]
    out["after_gather"] = head.ds_status is status.NOT_AVAILABLE
    loss = engine(torch.randn(2, 8, generator=torch.Generator().manual_seed(2)))
    engine.backward(loss)
    engine.step()
    out["head_moved"] = not torch.equal(partita.utils.safe_get_full_fp32_param(head), before)
    engine.destroy()
    stage2 = torch.nn.Linear(4, 4)
    config["zero_optimization"] = {"stage": 2}
    engine, *_ = partita.initialize(model=stage2, config=config)
    out["stage2_has"] = hasattr(stage2.weight, "ds_id")
    engine.destroy()
    # Parameter shards in NVMe swap files: ds_tensor reads a copy and leaves the file as found.
    swapped = torch.nn.Linear(6, 6)
    config["zero_optimization"] = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "offload_param": {"device": "nvme", "nvme_path": swap},
    }
    engine, *_ = partita.initialize(model=swapped, config=config)
    w = swapped.weight
    unit = partita.zero.registry.find(w, sharded=True).gatherer.unit_of(w)
    local = partita.utils.safe_get_local_fp32_param(w)
    out["nvme"] = [
        unit.shard_swap is not None and not unit.shard_swap.resident,
        bool(torch.equal(w.ds_tensor, local)),
        w.ds_tensor.numel(),
        unit.shard_swap is not None and not unit.shard_swap.resident,
    ]
    engine.destroy()
    return out


def test_zero3_parameters_carry_deepspeed_attributes_as_views(tmp_path: Path) -> None:
    ranks = run_distributed(_zero3_attributes_worker, 2, str(tmp_path), timeout=240)
    for r in ranks:
        assert r["plain_has"] is False and r["stage2_has"] is False
        assert r["init"] == [True, 64, [8, 8]] and r["init_gathered"]
        assert r["copy_equal"] and r["copy_is_managed"]
        assert r["status"] == [True, True] and r["persist"] == [False, True]
        assert r["gathered"] == [True, True, True] and r["after_gather"]
        assert r["head_moved"]
    assert ranks[0]["init_local"] + ranks[1]["init_local"] == 64
    assert ranks[0]["local"] + ranks[1]["local"] == 40
    assert all(r["nvme"][0] and r["nvme"][1] and r["nvme"][3] for r in ranks), [
        r["nvme"] for r in ranks
    ]
    assert ranks[0]["nvme"][2] + ranks[1]["nvme"][2] == 36
    assert ranks[0]["ids"] == ranks[1]["ids"] and len(set(ranks[0]["ids"])) == 3


# ---- names DeepSpeed's own unit-test helpers import (checked in-process, no alias needed) ----

CD = "partita.compat.deepspeed"


@pytest.mark.parametrize(
    ("module", "name", "words"),
    [
        ("pipe", "DualPipeVModule", "DualPipeV"),
        ("runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer", '"fp16" config section'),
    ],
)
def test_placeholder_classes_import_and_refuse_on_construction(
    module: str, name: str, words: str
) -> None:
    """DeepSpeed classes partita lacks import (so DeepSpeed's simple_model.py and scripts
    naming them load) and raise on construction naming the class and the feature."""
    import importlib

    from partita.compat.deepspeed._placeholder import FeatureNotInPartita

    cls = getattr(importlib.import_module(f"{CD}.{module}"), name)
    with pytest.raises(FeatureNotInPartita, match="is not in partita") as caught:
        cls(torch.nn.Linear(2, 2), num_stages=2)
    assert name in str(caught.value) and words in str(caught.value)
    assert isinstance(caught.value, NotImplementedError)


def test_placeholder_classes_keep_deepspeed_shapes() -> None:
    """PipelineModule and MoE (real) are nn.Module subclasses and TiedLayerSpec a LayerSpec, as in
    DeepSpeed, so isinstance checks read the same; names deepspeed.pipe lacks raise by name."""
    from partita.compat.deepspeed import pipe
    from partita.compat.deepspeed._missing import NotInPartita
    from partita.compat.deepspeed.moe.layer import MoE

    assert issubclass(pipe.PipelineModule, torch.nn.Module) and issubclass(MoE, torch.nn.Module)
    assert issubclass(pipe.TiedLayerSpec, pipe.LayerSpec)
    assert issubclass(pipe.DualPipeVModule, pipe.PipelineModule)
    assert not isinstance(torch.nn.Linear(2, 2), pipe.PipelineModule)
    with pytest.raises(NotInPartita):
        pipe.PipeModelDataParallelTopology  # noqa: B018


def test_is_current_accelerator_supported() -> None:
    from partita.compat.deepspeed.accelerator import (
        SUPPORTED_ACCELERATOR_LIST,
        get_accelerator,
        is_current_accelerator_supported,
    )

    assert is_current_accelerator_supported() is True
    assert get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST


def test_cpu_device_count_reads_local_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's CPU accelerator counts the node's ranks from LOCAL_SIZE (its tests skip
    4-rank cases when device_count() is below 4); without it, one device."""
    from partita.compat.deepspeed.accelerator import get_accelerator

    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    assert get_accelerator().device_count() == 1
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert get_accelerator().device_count() == 4
    monkeypatch.setenv("LOCAL_SIZE", "not-a-number")
    assert get_accelerator().device_count() == 1


def test_warmup_schedules_fall_back_to_log_on_unknown_warmup_type(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """DeepSpeed's WarmupLR / WarmupCosineLR warn on an unknown warmup_type and use 'log'."""
    from partita.optim.errors import SchedulerConfigError
    from partita.optim.schedulers import WarmupCosineLR, WarmupLR, build_scheduler

    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with caplog.at_level("WARNING", logger="partita.optim.schedulers"):
        cosine = WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=4, warmup_type="cosine")
    assert cosine.warmup_type == "log"
    assert "unknown warmup_type: 'cosine'" in caplog.text
    reference = WarmupCosineLR(
        torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
        total_num_steps=10,
        warmup_num_steps=4,
        warmup_type="log",
    )
    for _ in range(3):
        cosine.step()
        reference.step()
    assert cosine.get_last_lr() == reference.get_last_lr()
    assert WarmupLR(opt, warmup_type="lineer").warmup_type == "log"
    # A config file's typo is still refused, naming the key.
    with pytest.raises(SchedulerConfigError, match=r"scheduler\.params\.warmup_type"):
        build_scheduler("WarmupLR", {"warmup_type": "lineer"}, opt)


def test_required_torch_version() -> None:
    """Compared as versions (``2.10`` after ``2.9``), inclusive bounds, one bound needed."""
    from partita.compat.deepspeed.utils.torch import required_torch_version

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert required_torch_version(min_version=1.8)
    assert not required_torch_version(max_version=1.8)
    assert required_torch_version(min_version=f"{major}.{minor}")
    assert not required_torch_version(min_version=f"{major}.{minor + 1}")
    assert required_torch_version(min_version="1.0", max_version=f"{major + 1}.0")
    assert not required_torch_version(min_version=f"{major + 1}.0", max_version=f"{major + 2}.0")
    with pytest.raises(ValueError, match="min_version or max_version"):
        required_torch_version()


def test_bfloat16_config_and_optimizer_names() -> None:
    from partita.compat.deepspeed.runtime import config as ds_config
    from partita.compat.deepspeed.runtime.precision_config import (
        get_bfloat16_config,
        get_float16_config,
    )

    assert get_bfloat16_config({"bf16": {"enabled": True}}).enabled is True
    assert get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled is True
    assert get_bfloat16_config({}).enabled is False
    assert get_float16_config({"fp16": {"enabled": True}}).initial_scale_power == 16
    assert ds_config.ADAM_OPTIMIZER == "adam" and ds_config.ADAMW_OPTIMIZER == "adamw"
    assert "lion" in ds_config.DEEPSPEED_OPTIMIZERS


def test_deepspeed_config_model_base(caplog: pytest.LogCaptureFixture) -> None:
    """Extra keys refused, aliases and names accepted, "auto" dropped unless strict, a
    deprecated field forwarded to its replacement (both given: an AssertionError)."""
    from pydantic import Field, ValidationError

    from partita.compat.deepspeed.runtime.config_utils import (
        DeepSpeedConfigModel,
        DeprecatedFieldConflict,
        get_config_default,
    )

    class Conf(DeepSpeedConfigModel):
        param_1: int = 0
        param_2_old: str | None = Field(
            None,
            json_schema_extra={
                "deprecated": True,
                "new_param": "param_2",
                "new_param_fn": lambda x: [x],
            },
        )
        param_2: list[str] | None = None
        param_3: int = Field(0, alias="param_3_alias")

    assert Conf(param_1=42).param_1 == 42
    with caplog.at_level("WARNING"):
        assert Conf(param_2_old="DS").param_2 == ["DS"]
    assert "param_2_old is deprecated, use param_2 instead" in caplog.text
    assert Conf(param_3=10).param_3 == 10 and Conf(param_3_alias=10).param_3 == 10
    assert Conf(param_1="auto").param_1 == 0
    for bad in ({"param_1": "DS"}, {"param_2": "DS"}, {"param_1_typo": 0}):
        with pytest.raises(ValidationError):
            Conf(**bad)
    with pytest.raises(ValidationError):
        Conf(strict=True, param_1="auto")
    with pytest.raises(AssertionError, match="together"):
        Conf(param_2=["DS"], param_2_old="DS")
    assert issubclass(DeprecatedFieldConflict, ValueError)
    assert get_config_default(Conf, "param_1") == 0


def test_zero_config_names() -> None:
    from partita.compat.deepspeed.runtime.zero.config import (
        DeepSpeedZeroConfig,
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )
    from partita.compat.deepspeed.runtime.zero.leaf_module_config import (
        DEFAULT_LEAF_MODULE_CLASSES,
        DEFAULT_LEAF_MODULE_NAME_SUFFIXES,
        DEFAULT_LEAF_MODULE_NAMES,
    )

    config = DeepSpeedZeroConfig(offload_param={}, offload_optimizer={})
    assert isinstance(config.offload_param, DeepSpeedZeroOffloadParamConfig)
    assert isinstance(config.offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig)
    assert DeepSpeedZeroOffloadOptimizerConfig().pipeline is False
    assert DeepSpeedZeroOffloadOptimizerConfig(pipeline_write=True).pipeline is True
    assert DeepSpeedZeroConfig().leaf_module.classes == DEFAULT_LEAF_MODULE_CLASSES
    assert DEFAULT_LEAF_MODULE_NAMES == [] and DEFAULT_LEAF_MODULE_NAME_SUFFIXES == []


def test_partition_parameters_names() -> None:
    """MultipleAllGatherHandles waits on each handle by keyword; the partitioned-data shape,
    which partita does not have (shapes are kept), raises naming the difference on use."""
    from partita.compat.deepspeed._placeholder import FeatureNotInPartita
    from partita.compat.deepspeed.runtime.zero.partition_parameters import (
        MultipleAllGatherHandles,
        partitioned_param_data_shape,
    )

    seen: list[Any] = []

    class Handle:
        def wait(self, *, handle_dependency: bool = True) -> None:
            seen.append(handle_dependency)

    MultipleAllGatherHandles([Handle(), Handle()]).wait(handle_dependency=False)
    assert seen == [False, False]
    with pytest.raises(FeatureNotInPartita, match="keep their full shape"):
        torch.Size(partitioned_param_data_shape)


def test_zero_config_reads_deepspeed_unprefixed_names_and_no_op_is_compatible() -> None:
    """``config.prefetch_bucket_size`` etc. read the ``stage3_`` fields, as DeepSpeed's model
    names them; ``deepspeed.ops.__compatible_ops__`` answers False for any op."""
    from partita.compat.deepspeed import ops
    from partita.compat.deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    config = DeepSpeedZeroConfig(
        stage3_prefetch_bucket_size=12345, stage3_gather_fp16_weights_on_model_save=True
    )
    assert config.prefetch_bucket_size == 12345  # type: ignore[attr-defined]
    assert config.gather_16bit_weights_on_model_save is True  # type: ignore[attr-defined]
    assert "prefetch_bucket_size" not in config.model_dump()
    assert (
        ops.__compatible_ops__["fused_adam"] is False and "cpu_adam" not in ops.__compatible_ops__
    )


def test_disabled_zero_init_leaves_module_classes_alone() -> None:
    """``zero.Init(enabled=False)`` (DeepSpeed's tests pass ``enabled=zero_stage == 3``) exits
    without touching torch.nn.Module (it raised AttributeError deleting a hook it never set)."""
    import partita

    before = torch.nn.Module.__dict__.get("__init_subclass__")
    with partita.zero.Init(enabled=False):
        layer = torch.nn.Linear(2, 2)
    assert type(layer.weight) is torch.nn.Parameter
    assert torch.nn.Module.__dict__.get("__init_subclass__") is before


def test_submodules_resolve_as_attributes_right_after_import() -> None:
    """``deepspeed.moe.layer.MoE`` after a bare ``import deepspeed`` (DeepSpeed's package imports
    its submodules): the stand-in imports a submodule it has on first attribute access, and
    still names what it lacks. In a fresh interpreter, so no earlier import has loaded them."""
    code = (
        "import partita.compat.deepspeed as ds\n"
        "print(ds.moe.layer.MoE.__name__, ds.moe.utils.is_moe_param.__name__)\n"
        "try:\n    ds.moe.no_such_module\nexcept Exception as e:\n    print(type(e).__name__)\n"
        "from partita.compat.deepspeed.runtime.activation_checkpointing import offload_activations\n"
        "print(offload_activations.CheckpointHiddenStatesOffload.__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [
        "MoE",
        "is_moe_param",
        "NotInPartita",
        "partita.activations.offload",
    ]  # ALST's offload of checkpointed hidden states is partita's
