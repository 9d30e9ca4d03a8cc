"""``deepspeed.launcher.runner``: the environment-file name Accelerate imports on every
``accelerate launch --use_deepspeed`` (DeepSpeed's launcher exports that file's variables to
remote nodes; partita's launcher is ``partita``)."""

from __future__ import annotations

import os

from partita.compat.deepspeed._missing import module_getattr

DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")

__getattr__ = module_getattr("deepspeed.launcher.runner")

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME"]
