"""Makes ``import deepspeed`` resolve to partita's DeepSpeed compatibility tree, on request.

Hugging Face Transformers, Accelerate and PEFT find DeepSpeed with
``importlib.util.find_spec("deepspeed")`` and ``importlib.metadata.metadata("deepspeed")`` and
then import about thirty of its names. `install` answers all three for this process:

- a meta-path finder placed first on ``sys.meta_path`` maps ``deepspeed`` and every
  ``deepspeed.X`` onto ``partita.compat.deepspeed.X`` (the same module objects under both
  names), and answers a missing ``deepspeed.X`` with a ModuleNotFoundError that says partita
  stands in and what it does not implement;
- the same finder reports a package record named ``deepspeed`` whose version is the DeepSpeed API
  level the tree implements, with partita's version as the local part
  (``0.18.2+partita.0.1.0``), so version gates pass and a log shows what runs.

Nothing happens unless asked: the ``partita`` launcher sets ``PARTITA_AS_DEEPSPEED=1`` for its
workers, a start-up hook (``partita-as-deepspeed.pth``, installed with the package) calls
`install_from_env` in every interpreter that sees that switch (``accelerate launch``,
``torchrun``, ``srun`` children), and ``import partita.as_deepspeed`` calls `install`. A real
DeepSpeed installed beside partita is never shadowed otherwise; one already imported makes
`install` fail rather than mix two implementations in one process.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Iterator, Sequence
from typing import Any

from partita.platform import env

# partita.platform.env imports only os and typing: cheap enough for a module that runs at
# interpreter start (see install_from_env).
ALIAS = "deepspeed"
TARGET = "partita.compat.deepspeed"
# The DeepSpeed release whose API the compatibility tree follows. Transformers and Accelerate gate
# features on DeepSpeed's version; the highest gate in transformers 5.24 / accelerate 1.16 is 0.18.2.
API_LEVEL = "0.18.2"

_log = logging.getLogger("partita")


class AliasError(ImportError):
    """The alias cannot be installed in this process (a real DeepSpeed is already imported)."""


def _package_version() -> str:
    from partita import __version__

    return f"{API_LEVEL}+partita.{__version__}"


def _target_name(fullname: str) -> str:
    return TARGET + fullname[len(ALIAS) :]


class _AliasLoader(importlib.abc.Loader):
    """Loads ``deepspeed.X`` as the already-importable ``partita.compat.deepspeed.X``."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        # The module keeps its own __name__ and __spec__; only sys.modules gains the alias, so
        # pickles and tracebacks name partita's module, and both names are one object.
        return importlib.import_module(self.target)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: `create_module` returned an executed module."""


class _Distribution(importlib.metadata.Distribution):
    """The package record of the stand-in: name ``deepspeed``, version `_package_version`."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return (
                "Metadata-Version: 2.1\n"
                f"Name: {ALIAS}\n"
                f"Version: {_package_version()}\n"
                "Summary: partita standing in for DeepSpeed (partita.compat.deepspeed)\n"
                "Author: partita\n"
            )
        if filename == "top_level.txt":
            return f"{ALIAS}\n"
        return None

    def locate_file(self, path: Any) -> Any:
        import pathlib

        return pathlib.Path(__file__).parent / "deepspeed" / str(path)


class AliasFinder(importlib.abc.MetaPathFinder):
    """Maps ``deepspeed[.X]`` imports and the ``deepspeed`` package record onto partita."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        real = _target_name(fullname)
        try:
            found = importlib.util.find_spec(real)
        except ModuleNotFoundError:
            found = None
        if found is None:
            from partita.compat.deepspeed._missing import missing_module_message

            raise ModuleNotFoundError(missing_module_message(fullname), name=fullname)
        return importlib.machinery.ModuleSpec(
            fullname, _AliasLoader(real), is_package=found.submodule_search_locations is not None
        )

    def find_distributions(
        self, context: importlib.metadata.DistributionFinder.Context | None = None
    ) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.replace("_", "-").lower() == ALIAS:
            yield _Distribution()


def installed() -> bool:
    """True when this process resolves ``deepspeed`` to partita."""
    return any(isinstance(f, AliasFinder) for f in sys.meta_path)


def _real_deepspeed_loaded() -> str | None:
    module = sys.modules.get(ALIAS)
    if module is None:
        return None
    if getattr(module, "__name__", "") == TARGET:
        return None
    return getattr(module, "__file__", None) or repr(module)


def install() -> None:
    """Resolves ``deepspeed`` to partita in this process (idempotent); logs it once.

    Raises `AliasError` when a DeepSpeed that is not partita's is already imported: the two
    cannot share one process, and mixing them would train with whichever got there first.
    """
    if installed():
        return
    loaded = _real_deepspeed_loaded()
    if loaded is not None:
        raise AliasError(
            f"partita cannot stand in for deepspeed: DeepSpeed is already imported in this "
            f"process (from {loaded}). Install the alias before anything imports deepspeed: "
            f"set {env.AS_DEEPSPEED.name}=1 in the environment, or `import partita.as_deepspeed` first."
        )
    # A cached negative or real lookup of 'deepspeed' in importlib's path caches would not
    # consult the finder again for already-imported names; nothing is imported yet (checked).
    sys.meta_path.insert(0, AliasFinder())
    importlib.invalidate_caches()
    _log.debug(
        "partita stands in for deepspeed in this process (deepspeed %s, API level %s): "
        "`import deepspeed` is partita.compat.deepspeed",
        _package_version(),
        API_LEVEL,
    )


def requested(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Whether the environment asks partita to stand in for DeepSpeed."""
    return env.as_deepspeed(environ)


def install_from_env() -> None:
    """The start-up hook's entry: installs the alias when ``PARTITA_AS_DEEPSPEED`` asks for it.

    Runs in every interpreter of an environment with partita installed, so it must be cheap and
    must never break start-up: a failure is printed, not raised.
    """
    if not requested():
        return
    try:
        install()
    except Exception as exc:  # a start-up hook must not stop the interpreter
        print(
            f"partita: {env.AS_DEEPSPEED.name} is set but the alias failed: {exc}", file=sys.stderr
        )
