"""Shared pytest set-up: CPU-only tests and the session-wide distributed grid cache."""

from __future__ import annotations

import os

import pytest

from partita.testing import GridCache

# Set at import, before any test module imports partita.accelerator (its choice is cached):
# tests run on CPU even on a GPU machine. An explicit PARTITA_ACCELERATOR in the caller's
# environment wins. Ranks spawned by partita.testing always get PARTITA_ACCELERATOR=cpu.
os.environ.setdefault("PARTITA_ACCELERATOR", "cpu")


@pytest.fixture(scope="session")
def distributed_grid() -> GridCache:
    """One `GridCache` per session: a grid's ranks are spawned once, by the first test that
    asks for one of its cases, and serve every parametrized test id of that grid."""
    return GridCache()
