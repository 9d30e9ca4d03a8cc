"""Names that say one thing each: the clashes a review found stay fixed.

Two ``BufferPool`` classes (ZeRO's reusable gradient buffers and offload's bounded swap
buffers), two ``cpu_adam.py`` modules (the optimizer classes and offload's functional step) and
a stage 1-2 ``Unit`` beside ZeRO-3's unit made a reader ask which one was meant.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "partita"


def _classes(root: Path) -> dict[str, list[str]]:
    """Top-level class name -> the modules (relative paths) that define it."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                found[node.name].append(str(path.relative_to(root)))
    return found


def test_one_buffer_pool() -> None:
    """``BufferPool`` is ZeRO's gradient-buffer pool only; offload's is `SwapBufferPool`."""
    assert _classes(PACKAGE)["BufferPool"] == ["zero/buffer_pool.py"]


def test_one_cpu_adam_module() -> None:
    """``cpu_adam.py`` is the optimizer classes (optim/); offload's step is ``adam_step.py``."""
    modules = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("cpu_adam.py"))
    assert modules == ["optim/cpu_adam.py"]


def test_unit_means_zero3_gather_unit() -> None:
    """Classes named for a *unit* live in ZeRO-3 (a group of parameters gathered together) or
    name it; stages 1-2 reduce gradient buckets (`GradBucket`)."""
    units = {
        name: where
        for name, where in _classes(PACKAGE).items()
        if name.lstrip("_").startswith("Unit") or name == "Unit"
    }
    assert "Unit" not in units, units["Unit"]
    stray = {n: w for n, w in units.items() if any(not m.startswith("zero/") for m in w)}
    assert not stray, stray
