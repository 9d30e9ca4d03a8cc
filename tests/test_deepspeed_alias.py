"""``import deepspeed`` is partita only when asked: the launcher's switch (through the start-up
hook installed with the package) or ``import partita.as_deepspeed``; a real DeepSpeed is never
shadowed otherwise. Each case runs in a fresh interpreter (the alias changes ``sys.meta_path``)."""

from __future__ import annotations

import importlib.util
import json
import os
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PROBE = textwrap.dedent(
    """
    import importlib.metadata, importlib.util, json, sys
    {before}
    spec = importlib.util.find_spec("deepspeed")
    try:
        version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        version = None
    print(json.dumps({{
        "found": spec is not None,
        "origin": None if spec is None else spec.origin,
        "alias": spec is not None and type(spec.loader).__name__ == "_AliasLoader",
        "version": version,
    }}))
    """
)
REAL_DEEPSPEED = "partita" not in str(
    getattr(importlib.util.find_spec("deepspeed"), "origin", "partita")
)


def _probe(before: str = "", switch: str | None = None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "PARTITA_AS_DEEPSPEED"}
    if switch is not None:
        env["PARTITA_AS_DEEPSPEED"] = switch
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(before=before)],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_start_up_hook_is_installed_with_the_package() -> None:
    hooks = [Path(d) / "partita-as-deepspeed.pth" for d in site.getsitepackages()]
    assert any(h.is_file() for h in hooks), hooks


@pytest.mark.parametrize("switch", [None, "", "0", "false"])
def test_without_the_switch_deepspeed_is_not_shadowed(switch: str | None) -> None:
    got = _probe(switch=switch)
    assert not got["alias"]
    if REAL_DEEPSPEED:  # the dev set-up installs DeepSpeed 0.19.8 beside partita
        assert got["found"] and "site-packages" in str(got["origin"])
        assert not str(got["version"]).endswith("partita.0.1.0")


def test_the_switch_and_the_import_make_deepspeed_partita() -> None:
    for got in (_probe(switch="1"), _probe(before="import partita.as_deepspeed")):
        assert got["alias"] and got["found"]
        assert got["version"] == "0.18.2+partita.0.1.0"
    # Transformers' and Accelerate's own detection agree, and the names they import resolve.
    script = textwrap.dedent(
        """
        import partita.as_deepspeed
        from accelerate.utils import is_deepspeed_available as accelerate_sees
        from transformers.integrations.deepspeed import is_deepspeed_available as hf_sees
        from transformers.utils.versions import require_version
        require_version("deepspeed>=0.9.3")
        import deepspeed
        from deepspeed import DeepSpeedEngine, comm, zero
        from deepspeed.accelerator import get_accelerator
        from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
        from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.runtime.zero import partition_parameters as pp
        from deepspeed.utils import logger, set_z3_leaf_modules
        import partita
        assert accelerate_sees() and hf_sees()
        assert deepspeed.__name__ == "partita.compat.deepspeed"
        assert DeepSpeedEngine is partita.Engine and zero.GatheredParameters is partita.zero.GatheredParameters
        assert deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES[0] == "LRRangeTest"
        import torch
        assert pp._orig_torch_arange is torch.arange
        print("ok", get_accelerator().current_device_name(), DEEPSPEED_ENVIRONMENT_NAME)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-3000:]


def test_names_partita_lacks_fail_naming_the_feature() -> None:
    script = textwrap.dedent(
        """
        import partita.as_deepspeed, deepspeed
        try:
            deepspeed.DeepSpeedHybridEngine
        except AttributeError as e:
            print("attr:", e)
        import deepspeed.compression.helper  # every DeepSpeed module path resolves (a stub here)
        try:
            from deepspeed.compression.helper import recursive_getattr
        except ImportError as e:
            print("module:", e)
        print("hasattr:", hasattr(deepspeed, "no_such_name"))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=180, check=True
    )
    lines = out.stdout.splitlines()
    assert any(
        "DeepSpeedHybridEngine" in ln and "hybrid engine" in ln.split("DeepSpeedHybridEngine")[1]
        for ln in lines
    )
    assert any(
        ln.startswith("module:") and "DeepSpeed compression" in ln for ln in lines
    )
    assert "hasattr: False" in lines


def test_a_real_deepspeed_already_imported_is_refused_by_name() -> None:
    script = textwrap.dedent(
        """
        import sys, types
        fake = types.ModuleType("deepspeed")
        fake.__file__ = "/somewhere/site-packages/deepspeed/__init__.py"
        sys.modules["deepspeed"] = fake
        from partita.compat.alias import AliasError, install
        try:
            install()
        except AliasError as e:
            print("refused:", e)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert "refused:" in out.stdout and "/somewhere/site-packages/deepspeed" in out.stdout
    assert "PARTITA_AS_DEEPSPEED=1" in out.stdout
