"""Shared pytest set-up: CPU-only tests and the session-wide distributed grid cache."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator

import pytest
import torch

from partita.testing import GridCache, rank_threads

# Set at import, before any test module imports partita.platform.accelerator (its choice is cached):
# tests run on CPU even on a GPU machine. An explicit PARTITA_ACCELERATOR in the caller's
# environment wins. Ranks spawned by partita.testing always get PARTITA_ACCELERATOR=cpu.
os.environ.setdefault("PARTITA_ACCELERATOR", "cpu")

# Under pytest-xdist the workers share the CPUs: this process's own torch work (the one-process
# references) gets its share, as the ranks it starts do (`partita.testing.rank_threads`).
torch.set_num_threads(rank_threads(1))


# The longest test files, longest first (per-file wall times of the fresh-clone rehearsal of
# 0b1b60b, 2026-12-07: test_hf_trainer's fixture alone 397 s, test_launcher_two_nodes ~370 s,
# test_zero12 and test_zero3 each several minutes). pytest-xdist hands whole files to its
# workers in collection order (scripts/test.sh passes --no-loadscope-reorder, which would
# otherwise order them by test count): started first, the long ones do not leave one worker
# running alone at the end. Only the order changes, never what runs.
_LONGEST_FIRST = (
    "test_hf_trainer.py",
    "test_launcher_two_nodes.py",
    "test_zero12.py",
    "test_zero3.py",
    "test_checkpoint_resume.py",
    "test_deepspeed_checkpoints.py",
    "test_zero_offload.py",
    "test_estimate_plan.py",
    "test_checkpoint_crash.py",
    "test_launcher.py",
    "test_trl.py",
    # Today's files with a long spawn (fresh-clone rehearsal of 2026-12-07 06:25, --durations).
    "test_ulysses.py",
    "test_tp_trainer.py",
    "test_ulysses_accelerate.py",
    "test_zeropp.py",
    "test_pipe_engine.py",
    "test_tp_training.py",
    "test_moe_deepspeed.py",
    "test_checkpoint_tp_slices.py",
    "test_engine_deepspeed_methods.py",
    "test_trainer_cpu_hint.py",
    "test_parallel_dims.py",
    "test_engine_stage0.py",
    "test_gpu_check.py",
    "test_checkpoint_async.py",
    # Added on 2026-12-07 afternoon (30-55 s each on 2 shared cores).
    "test_moe_checkpoints.py",
    "test_estimate_sequence.py",
    "test_activation_offload.py",
    "test_hf_moe.py",
    "test_tp_checkpoints.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Moves the files of `_LONGEST_FIRST` to the front, in its order (a stable sort: each
    file's own tests, and every other file, keep their order)."""
    place = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(item.path.name, len(place)))


@pytest.fixture(scope="session")
def distributed_grid() -> GridCache:
    """One `GridCache` per session: a grid's ranks are spawned once, by the first test that
    asks for one of its cases, and serve every parametrized test id of that grid."""
    return GridCache()


_NOT_THE_TESTS = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"})
"""Set by pytest in each phase of a test, and by torch in the first call that asks inductor
for its cache folder (its default path, the same every time): not a test's doing; kept."""


@pytest.fixture(autouse=True)
def _restore_process_state() -> Iterator[None]:
    """Puts back this process's environment and ``sys.excepthook`` after every test.

    Tests that start a process group, a launcher or a library in the pytest process change
    both (MASTER_PORT, TORCHELASTIC_*, torch's "[rank0]: " excepthook wrapper). Left in place
    they reach whatever test this worker runs next: a variable that torch reads at import makes
    the harness spawn ranks instead of forking them from its server (the fork-server tests of
    test_harness.py failed so in CI, 2026-12-07, after another file ran on the same xdist
    worker), and a leaked MASTER_PORT made a later one-process reference fail with EADDRINUSE.
    Module- and session-scoped fixtures are set up before this one, so what they set stays.
    """
    environ = dict(os.environ)
    hook = sys.excepthook
    yield
    changed = sorted(
        name
        for name in set(environ) | set(os.environ)
        if environ.get(name) != os.environ.get(name) and name not in _NOT_THE_TESTS
    )
    if changed:
        kept = {name: os.environ[name] for name in _NOT_THE_TESTS if name in os.environ}
        os.environ.clear()
        os.environ.update(environ)
        os.environ.update(kept)
        warnings.warn(
            f"the test changed the environment ({', '.join(changed)}); restored", stacklevel=1
        )
    sys.excepthook = hook
