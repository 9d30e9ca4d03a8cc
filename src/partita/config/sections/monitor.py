"""Monitor sections: ``tensorboard``, ``csv_monitor`` and ``wandb``; defaults as in DeepSpeed."""

from __future__ import annotations

from pydantic import Field, StrictStr

from .base import Bool, Section

__all__ = ["CSVMonitorConfig", "TensorBoardConfig", "WandbConfig"]


class _FileMonitorConfig(Section):
    """A monitor that writes files: whether it runs, and where and under which run name."""

    # Each subclass declares `enabled` again to say what it writes; pydantic keeps it first.
    enabled: Bool = False
    output_path: StrictStr = Field(
        default="",
        description="Directory the logs are written under; empty means under the launch directory.",
    )
    job_name: StrictStr = Field(
        default="DeepSpeedJobName",
        description="Name of this run; becomes a sub-directory of output_path.",
    )


class TensorBoardConfig(_FileMonitorConfig):
    """``tensorboard``: write training scalars as TensorBoard event files."""

    enabled: Bool = Field(default=False, description="Write TensorBoard event files.")


class CSVMonitorConfig(_FileMonitorConfig):
    """``csv_monitor``: write training scalars as CSV files."""

    enabled: Bool = Field(default=False, description="Write CSV files.")


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
