"""The GPU check's dry mode (benchmarks/gpu_check.py --dry-run): every case on CPU at tiny
sizes, so the script CI cannot run on a GPU still runs here and cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
HANG_GUARD_S = 900  # the machine is shared: a hang guard, not a timing claim


def run_check(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The dry run writing into ``out``."""
    cmd = [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)


@pytest.fixture(scope="module")
def dry_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("gpu_check")
    return run_check(out), out


@pytest.mark.timeout(HANG_GUARD_S + 60)
def test_dry_run_passes_and_writes_report(
    dry_run: tuple[subprocess.CompletedProcess[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    payload = json.loads((out / "gpu_check.json").read_text())
    assert payload["mode"] == "dry"
    assert payload["failed"] == []
    cases = {(c["section"], c["name"]): c for c in payload["cases"]}
    sections = {s for s, _ in cases}
    assert sections == {"1 correctness", "2 offload", "3 checkpoints", "4 speed"}
    statuses = {c["status"] for c in cases.values()}
    assert statuses <= {"pass", "skip"}, statuses
    for stage in range(4):
        assert cases[("1 correctness", f"bf16 stage {stage} vs torch")]["status"] == "pass"
    assert cases[("2 offload", "copy-back overlap")]["figures"]["weights_equal_masters"]
    # Every speed row but DeepSpeed's (GPU only) ran and produced a step time.
    for name in ("torch + fused AdamW", "partita stage 0", "partita stage 3",
                 "FSDP2 (fully_shard per block)", "partita stage 3 + CPU offload"):  # fmt: skip
        assert cases[("4 speed", name)]["figures"]["step_ms"] > 0
    md = (out / "gpu_check.md").read_text()
    assert "| section | case | status | detail | s |" in md
    assert "| configuration | micro-batch x seq | step (ms) |" in md
    assert "Goals (reported, not asserted):" in md
    with capsys.disabled():  # CI's log shows the table a GPU run would fill
        print(f"\n--- GPU check, dry run (CPU, tiny sizes): {out / 'gpu_check.md'}\n{md}")


@pytest.mark.timeout(HANG_GUARD_S + 60)
def test_broken_reference_fails_the_check(tmp_path: Path) -> None:
    """``--perturb parity`` trains the reference at lr x 1.001: every bf16 parity case must
    fail and the script must exit non-zero, with the other cases still passing."""
    proc = run_check(tmp_path, "--sections", "1", "--perturb", "parity")
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    payload = json.loads((tmp_path / "gpu_check.json").read_text())
    assert sorted(payload["failed"]) == [
        f"1 correctness / bf16 stage {s} vs torch" for s in range(4)
    ]
    assert (
        "| 1 correctness | bf16 stage 0 vs torch | fail |"
        in (tmp_path / "gpu_check.md").read_text()
    )


def test_unknown_section_is_refused(tmp_path: Path) -> None:
    proc = run_check(tmp_path, "--sections", "1,5")
    assert proc.returncode == 2
    assert "--sections: unknown ['5']" in proc.stderr


def test_hidden_fraction_counts_copy_time_inside_cpu_steps() -> None:
    """The overlap figure: the share of copy time that lies inside some slice's CPU step."""
    from benchmarks.gpu_check.offload import hidden_fraction

    steps = [(0.0, 1.0), (1.5, 2.5)]
    assert hidden_fraction([(0.5, 1.5)], steps) == 0.5  # half inside the first step
    assert hidden_fraction([(1.6, 2.0), (3.0, 3.4)], steps) == 0.5  # one hidden, one exposed
    assert hidden_fraction([(1.0, 1.5)], steps) == 0.0  # between steps: nothing hidden
    assert hidden_fraction([], steps) == 0.0


def test_first_step_bound_takes_rounding_and_refuses_a_wrong_update() -> None:
    """On a GPU an offloaded run (partita's CPU Adam) is held against no offload (torch's
    fused CUDA AdamW) by its first update: a few fp32 roundings pass, an update from wrong
    gradients (off by an lr-sized step) does not."""
    import torch
    from benchmarks.gpu_check.core import LR
    from benchmarks.gpu_check.trainers import Run, first_step_close

    ref = torch.tensor([0.5, -0.02, 0.0, 1e-3])
    rounded = ref + 4 * torch.finfo(torch.float32).eps * (ref.abs() + LR)
    stale = ref.clone()
    stale[1] += LR
    runs = [Run([], [], [], first_masters=[t]) for t in (ref, rounded, stale)]
    assert first_step_close(runs[1], runs[0])[0]
    ok, worst = first_step_close(runs[2], runs[0])
    assert not ok and worst > 100
