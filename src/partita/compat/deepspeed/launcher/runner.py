"""``deepspeed.launcher.runner``: the environment-file name Accelerate imports on every
``accelerate launch --use_deepspeed`` (DeepSpeed's launcher exports that file's variables to
remote nodes; partita's launcher is ``partita``)."""

from __future__ import annotations

import os

DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME"]
