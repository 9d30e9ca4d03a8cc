"""Config errors: every problem found, each with the dotted key path it concerns.

A user fixing a config wants the whole list at once, not one error per run, so validation
collects :class:`Problem` records and raises a single :class:`ConfigError` at the end.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["ConfigError", "PartitaUserError", "Problem", "did_you_mean", "join_path"]


class PartitaUserError(Exception):
    """An error the user fixes in what they asked for (a config, an option), not in code.

    Its message is the whole story: what is wrong, where (key, file, rank), and what to do. A
    traceback adds nothing, so the ``partita`` launcher prints the message once for the whole
    job, without one, and exits with status 2 (see `partita.launcher.failures`). Subclasses
    keep their own base (``ValueError`` ...) so existing ``except`` clauses still match.
    """


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config.

    Attributes:
        path: dotted key path of the offending entry (``"zero_optimization.stage"``); ``""``
            for the config as a whole.
        message: what is wrong and what to do about it.
    """

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(PartitaUserError, ValueError):
    """A DeepSpeed config that partita cannot run with.

    Holds every problem found (``.problems``); the message names each one with its dotted key
    path, prefixed by where the config came from (``.source``, a file path or ``"<dict>"``).
    A single problem is one line, so the last line of a traceback says everything.
    """

    def __init__(self, problems: Sequence[Problem], source: str | None = None) -> None:
        if not problems:
            raise ValueError("ConfigError needs at least one problem")
        self.problems: tuple[Problem, ...] = tuple(problems)
        self.source = source
        super().__init__(self._format())

    def _format(self) -> str:
        where = f" in {self.source}" if self.source else ""
        if len(self.problems) == 1:
            return f"DeepSpeed config{where}: {self.problems[0]}"
        count = len(self.problems)
        lines = [f"DeepSpeed config{where}: {count} problems:"]
        lines.extend(f"  - {problem}" for problem in self.problems)
        return "\n".join(lines)

    def with_source(self, source: str) -> ConfigError:
        """Return the same problems, attributed to ``source``."""
        return ConfigError(self.problems, source)


def join_path(parent: str, key: str | int) -> str:
    """Dotted path of ``key`` under ``parent`` (list indices print as ``[i]``)."""
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else key


def did_you_mean(key: str, candidates: Iterable[str]) -> str:
    """A ``"; did you mean 'x'?"`` suffix for a misspelt ``key``, or ``""`` if nothing is close."""
    matches = difflib.get_close_matches(key, sorted(set(candidates)), n=1, cutoff=0.6)
    return f"; did you mean '{matches[0]}'?" if matches else ""


def config_error(path: str, message: str) -> ConfigError:
    """A `ConfigError` with a single problem at dotted `path`."""
    return ConfigError([Problem(path, message)])
