"""partita.offload.checks: each NVMe misconfiguration gives its own clear error before training."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

import partita.offload.checks as checks
from partita.config import AioConfig, ConfigError, ZeroConfig
from partita.offload import DirectoryProbe, check_offload_config, probe_directory

OPT = "zero_optimization.offload_optimizer.nvme_path"
PARAM = "zero_optimization.offload_param.nvme_path"


def _zero(opt_path: Any = None, param_path: Any = None) -> ZeroConfig:
    data: dict[str, Any] = {"stage": 3}
    if opt_path is not None:
        data["offload_optimizer"] = {"device": "nvme", "nvme_path": str(opt_path)}
    if param_path is not None:
        data["offload_param"] = {"device": "nvme", "nvme_path": str(param_path)}
    return ZeroConfig.model_validate(data)


def _problems(zero: ZeroConfig, aio: AioConfig | None = None, **kw: Any) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        check_offload_config(zero, aio or AioConfig(), rank=1, **kw)
    return {p.path: p.message for p in info.value.problems}


def test_good_paths_pass_and_cpu_offload_is_not_checked(tmp_path: Path) -> None:
    assert probe_directory(tmp_path).write_error is None
    assert (
        check_offload_config(
            _zero(tmp_path, tmp_path),
            AioConfig(),
            rank=0,
            required_bytes={"offload_optimizer": 1 << 20},
        )
        == []
    )
    cpu = ZeroConfig.model_validate(
        {"stage": 2, "offload_optimizer": {"device": "cpu", "nvme_path": "/nonexistent"}}
    )
    assert check_offload_config(cpu, AioConfig(block_size=1000), rank=0) == []
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_missing_path_and_not_a_directory(tmp_path: Path) -> None:
    missing, a_file = tmp_path / "nope", tmp_path / "file"
    a_file.write_text("x")
    problems = _problems(_zero(missing, a_file))
    assert (
        problems[OPT]
        == f"rank 1: nvme_path '{missing}' does not exist; create it or point nvme_path at a directory"
    )
    assert problems[PARAM] == f"rank 1: nvme_path '{a_file}' is not a directory"


def test_directory_not_writable() -> None:
    # sysfs refuses new files for every user, root included (chmod would not stop root).
    problems = _problems(_zero("/sys/kernel"))
    assert problems[OPT].startswith(
        "rank 1: nvme_path '/sys/kernel' is not writable by this process ([errno"
    )


def test_not_enough_space_alone_and_summed_over_blocks_on_one_filesystem(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    problems = _problems(_zero(tmp_path), required_bytes={"offload_optimizer": 4 * free})
    assert "free, swap files need" in problems[OPT] and f"({4 * free} bytes)" in problems[OPT]
    # Each block fits alone; together they do not.
    sub = tmp_path / "sub"
    sub.mkdir()
    each = int(free * 0.6)
    problems = _problems(
        _zero(tmp_path, sub), required_bytes={"offload_optimizer": each, "offload_param": each}
    )
    assert f"({2 * each} bytes, shared with {PARAM})" in problems[OPT]


def test_direct_io_is_a_warning_unless_required(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No filesystem here refuses O_DIRECT, so the probe result is substituted.
    monkeypatch.setattr(checks, "probe_directory", lambda path: DirectoryProbe(None, False))
    (warning,) = check_offload_config(_zero(tmp_path), AioConfig(), rank=2)
    assert warning.startswith(
        f"rank 2: nvme_path '{tmp_path}' does not support direct I/O (O_DIRECT)"
    )
    assert "(aio.use_gds)" in _problems(_zero(tmp_path), AioConfig(use_gds=True))[OPT]
    assert "(direct I/O was required)" in _problems(_zero(tmp_path), require_direct_io=True)[OPT]


def test_block_size_and_several_problems_reported_together(tmp_path: Path) -> None:
    problems = _problems(_zero(tmp_path / "missing", tmp_path), AioConfig(block_size=1000))
    assert problems["aio.block_size"] == "must be a multiple of 4096 bytes for direct I/O, got 1000"
    assert "does not exist" in problems[OPT] and PARAM not in problems
