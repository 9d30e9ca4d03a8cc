"""``deepspeed.initialize`` and friends, as Hugging Face Accelerate and TRL call them.

Accelerate passes ``model=`` and ``config_params=`` (a dict whose ``"auto"`` values it filled),
plus either ``model_parameters=`` (the config has an ``optimizer`` block), ``optimizer=`` (a torch
optimizer), or neither: an engine for evaluation or generation only, with no optimizer.

Two habits of callers written for DeepSpeed are read the way DeepSpeed reads them (see
`as_deepspeed_reads`): TRL's ``prepare_deepspeed`` builds its reference-model engine from the
Trainer's config before the Trainer has filled the ``"auto"`` values it fills from the model
(DeepSpeed's section models drop a leftover ``"auto"`` and use their default), and it adds
dotted top-level keys (``"zero_optimization.reduce_bucket_size"``) that DeepSpeed never reads.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

from partita import api as _api
from partita.compat.deepspeed._cpu_world import with_cpu_world_hint
from partita.config.auto import AUTO
from partita.config.errors import ConfigError
from partita.engine import Engine

add_config_arguments = _api.add_config_arguments
init_distributed = _api.init_distributed

_log = logging.getLogger("partita")
_announced = False


def _drop_auto(section: dict[str, Any], path: str, dropped: list[str]) -> None:
    for key in list(section):
        value = section[key]
        if isinstance(value, dict):
            _drop_auto(value, f"{path}.{key}", dropped)
        elif value == AUTO:
            del section[key]
            dropped.append(f"{path}.{key}")


def as_deepspeed_reads(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a config dict as DeepSpeed reads it: a top-level key ``"a.b"`` whose ``a`` is
    a section is left out (DeepSpeed never reads it; TRL writes bucket sizes such as
    ``0.9 * hidden**2`` there, which no section would accept as a whole number), and a
    ``"auto"`` left inside a section is dropped, so the section's default applies (DeepSpeed's
    section models drop it too). Both are logged naming the keys, never silently; a top-level
    ``"auto"`` stays and fails in `partita.config.load_config` naming the key."""
    out = copy.deepcopy(dict(config))
    ignored = [
        k
        for k in out
        if isinstance(k, str) and "." in k and isinstance(out.get(k.split(".")[0]), dict)
    ]
    for key in ignored:
        del out[key]
    dropped: list[str] = []
    for key, value in out.items():
        if isinstance(value, dict):
            _drop_auto(value, key, dropped)
    if ignored:
        _log.warning(
            "deepspeed config: dotted top-level keys %s are not read (DeepSpeed does not read "
            "them either); set the nested key instead",
            ignored,
        )
    if dropped:
        _log.warning(
            'deepspeed config: %s left "auto" (not filled by the trainer yet); using partita\'s '
            "defaults for them, as DeepSpeed uses its own",
            ", ".join(dropped),
        )
    return out


def initialize(*args: Any, **kwargs: Any) -> tuple[Engine, Any, Any, Any]:
    """`partita.initialize` with DeepSpeed's signature: returns ``(engine, optimizer,
    dataloader, lr_scheduler)``. A config dict is read as DeepSpeed reads it
    (`as_deepspeed_reads`). The first call says in the log (rank 0) that partita stands in,
    so a run launched for DeepSpeed shows which engine trained it."""
    global _announced
    for name in ("config", "config_params"):
        if isinstance(kwargs.get(name), Mapping):
            kwargs[name] = as_deepspeed_reads(kwargs[name])
    try:
        result = _api.initialize(*args, **kwargs)
    except ConfigError as error:
        # A Trainer on a CPU-only torch without use_cpu=True: say so instead of the bare
        # batch arithmetic (_cpu_world.py).
        hinted = with_cpu_world_hint(error)
        if hinted is None:
            raise
        raise hinted from error
    if not _announced:
        _announced = True
        from partita.compat.alias import _package_version

        _log.info(
            "partita stands in for deepspeed (%s): `import deepspeed` is partita.compat.deepspeed "
            "and this engine is partita's",
            _package_version(),
        )
    return result
