"""Many sub-cases in one spawn: spawning ranks costs seconds (each imports torch), a case
costs milliseconds.

`run_distributed_grid(fn, world_size, cases)` calls `fn(**case)` for every case, in order,
inside the same `world_size` processes and returns ``results[case][rank]``. Before each case
the ranks reset `partita.comm.COUNTERS`, so a case's byte counts are its own. The first case
that fails on any rank ends the run (the ranks would otherwise desynchronise their
collectives); the error names that case, and keeps the results of the cases before it.

`GridCache` serves one grid to many pytest test ids with a single spawn (the `distributed_grid`
fixture in tests/conftest.py holds one per session)::

    CASES = [{"numel": 1}, {"numel": 1000}]

    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_sum(distributed_grid, case):
        per_rank = distributed_grid.case(check_sum, 2, CASES, case)
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from partita.platform import env as env_vars
from partita.testing._child import RunFiles, write_atomic
from partita.testing.distributed import DistributedTestError, execute, fn_name


class GridCaseError(RuntimeError):
    """Raised inside a rank when a grid case raises; names the case (the cause is chained)."""


def run_distributed_grid(
    fn: Callable[..., Any],
    world_size: int,
    cases: Sequence[Mapping[str, Any]],
    *,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[list[Any]]:
    """Runs `fn(**case)` for each case in one spawn of `world_size` ranks.

    Returns ``results[case_index][rank]``. `timeout` bounds the whole grid after start-up.
    On failure raises `DistributedTestError` (or its timeout subclass) whose message starts with
    the failed case; its `case_index` and `completed_cases` say which case failed and what the
    cases before it returned.
    """
    plain = [dict(case) for case in cases]
    run_dir = tempfile.mkdtemp(prefix="partita-grid-")
    try:
        per_rank = execute(
            _grid_runner,
            world_size,
            (fn, plain),
            {},
            timeout=timeout,
            env=env,
            run_dir=run_dir,
            name=f"grid of {len(plain)} cases of {fn_name(fn)}",
        )
    except DistributedTestError as err:
        _annotate(err, plain, world_size, RunFiles(run_dir))
        raise
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return [[per_rank[rank][i] for rank in range(world_size)] for i in range(len(plain))]


def _grid_runner(fn: Callable[..., Any], cases: list[dict[str, Any]]) -> list[Any]:
    """Runs inside each rank: every case in order, each result saved as soon as it exists."""
    from partita.comm import COUNTERS

    rank = int(os.environ["RANK"])
    files = RunFiles(env_vars.harness_run_dir())
    results = []
    for index, case in enumerate(cases):
        COUNTERS.reset()
        try:
            result = fn(**case)
        except Exception as exc:
            raise GridCaseError(f"grid case {index} {case!r} raised on rank {rank}") from exc
        # Saved per case so the parent keeps earlier cases' results if a later one fails.
        write_atomic(files.case_result(index, rank), pickle.dumps(result))
        results.append(result)
    return results


def _annotate(
    err: DistributedTestError, cases: list[dict[str, Any]], world_size: int, files: RunFiles
) -> None:
    """Adds the failed case and the completed cases' results to a grid run's error."""
    completed: list[list[Any]] = []
    for index in range(len(cases)):
        paths = [files.case_result(index, rank) for rank in range(world_size)]
        if not all(os.path.exists(path) for path in paths):
            break
        row = []
        for path in paths:
            with open(path, "rb") as fh:
                row.append(pickle.load(fh))
        completed.append(row)
    err.completed_cases = completed
    if len(completed) < len(cases):
        index = len(completed)
        err.case_index = index
        err.args = (f"grid case {index} {cases[index]!r} failed: {err}", *err.args[1:])


@dataclass
class _GridOutcome:
    results: list[list[Any]]
    error: DistributedTestError | None


class GridCache:
    """Runs each distinct grid once and hands its cases' results to separate tests.

    A grid is identified by (fn, world_size, cases, timeout, env); the first test that asks
    for any of its cases spawns the ranks and runs them all.
    """

    def __init__(self) -> None:
        self._outcomes: dict[tuple[Any, ...], _GridOutcome] = {}
        self.spawns = 0
        """How many grids were actually run (each is one spawn)."""

    def case(
        self,
        fn: Callable[..., Any],
        world_size: int,
        cases: Sequence[Mapping[str, Any]],
        case: int | Mapping[str, Any],
        *,
        timeout: float = 120.0,
        env: dict[str, str] | None = None,
    ) -> list[Any]:
        """Per-rank results of one case (given as its index or the case itself) of the grid.

        Raises the grid's `DistributedTestError` for the case that failed, and a
        `DistributedTestError` saying so for cases after it (they never ran).
        """
        index = case if isinstance(case, int) else list(cases).index(case)
        key = (
            fn,
            world_size,
            pickle.dumps(list(cases)),
            timeout,
            tuple(sorted((env or {}).items())),
        )
        outcome = self._outcomes.get(key)
        if outcome is None:
            outcome = self._run(fn, world_size, cases, timeout, env)
            self._outcomes[key] = outcome
        if index < len(outcome.results):
            return outcome.results[index]
        err = outcome.error
        assert err is not None  # results are complete when no error was recorded
        if err.case_index is None or err.case_index == index:
            raise _clone(err)
        raise DistributedTestError(
            f"grid case {index} {cases[index]!r} of {fn_name(fn)} did not run: case "
            f"{err.case_index} failed before it in the same spawn (see that case's failure)",
            err.failed_ranks,
            err.reports,
        )

    def _run(
        self,
        fn: Callable[..., Any],
        world_size: int,
        cases: Sequence[Mapping[str, Any]],
        timeout: float,
        env: dict[str, str] | None,
    ) -> _GridOutcome:
        self.spawns += 1
        try:
            return _GridOutcome(
                run_distributed_grid(fn, world_size, cases, timeout=timeout, env=env), None
            )
        except DistributedTestError as err:
            return _GridOutcome(err.completed_cases, err)


def _clone(err: DistributedTestError) -> DistributedTestError:
    """A fresh copy, so each test raising it gets its own traceback."""
    cls, args, state = err.__reduce__()
    new: DistributedTestError = cls(*args)
    new.__dict__.update(state)
    return new
