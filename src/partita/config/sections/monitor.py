"""Monitor sections: ``tensorboard``, ``csv_monitor`` and ``wandb``; defaults as in DeepSpeed."""

from __future__ import annotations

from pydantic import Field, StrictStr

from .base import Bool, Section

__all__ = ["CSVMonitorConfig", "TensorBoardConfig", "WandbConfig"]

_OUTPUT_PATH = "Directory the logs are written under; empty means under the launch directory."
_JOB_NAME = "Name of this run; becomes a sub-directory of output_path."


class TensorBoardConfig(Section):
    """``tensorboard``: write training scalars as TensorBoard event files."""

    enabled: Bool = Field(default=False, description="Write TensorBoard event files.")
    output_path: StrictStr = Field(default="", description=_OUTPUT_PATH)
    job_name: StrictStr = Field(default="DeepSpeedJobName", description=_JOB_NAME)


class CSVMonitorConfig(Section):
    """``csv_monitor``: write training scalars as CSV files."""

    enabled: Bool = Field(default=False, description="Write CSV files.")
    output_path: StrictStr = Field(default="", description=_OUTPUT_PATH)
    job_name: StrictStr = Field(default="DeepSpeedJobName", description=_JOB_NAME)


class WandbConfig(Section):
    """``wandb``: log training scalars to Weights & Biases."""

    enabled: Bool = Field(
        default=False, description="Log to Weights & Biases (needs the wandb package)."
    )
    team: StrictStr | None = Field(default=None, description="W&B team (entity).")
    group: StrictStr | None = Field(
        default=None, description="W&B group that collects related runs."
    )
    project: StrictStr = Field(default="deepspeed", description="W&B project.")
