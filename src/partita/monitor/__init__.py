"""Training monitors: TensorBoard, CSV and Weights & Biases, with DeepSpeed's names and layout.

The engine builds one `Monitor` per process with `build_monitor` and writes
``(name, value, step)`` events whose names are the ``EVENT_*`` constants of
`partita.monitor.events`. Only global rank 0 writes.
"""

from __future__ import annotations

from partita.monitor.events import (
    EIGENVALUE_EVENT_PREFIX,
    EVENT_ELAPSED_BACKWARD_ALLREDUCE_MS,
    EVENT_ELAPSED_BACKWARD_INNER_MS,
    EVENT_ELAPSED_BACKWARD_MS,
    EVENT_ELAPSED_FORWARD_MS,
    EVENT_ELAPSED_STEP_MS,
    EVENT_EVAL_LOSS,
    EVENT_LOSS_SCALE,
    EVENT_LR,
    EVENT_SAMPLES_PER_SEC,
    EVENT_TRAIN_LOSS,
    TRAIN_SAMPLES_EVENTS,
    eigenvalue_event,
)
from partita.monitor.monitor import FileMonitorSection, Monitor, WandbSection, build_monitor

__all__ = [
    "EIGENVALUE_EVENT_PREFIX",
    "EVENT_ELAPSED_BACKWARD_ALLREDUCE_MS",
    "EVENT_ELAPSED_BACKWARD_INNER_MS",
    "EVENT_ELAPSED_BACKWARD_MS",
    "EVENT_ELAPSED_FORWARD_MS",
    "EVENT_ELAPSED_STEP_MS",
    "EVENT_EVAL_LOSS",
    "EVENT_LOSS_SCALE",
    "EVENT_LR",
    "EVENT_SAMPLES_PER_SEC",
    "EVENT_TRAIN_LOSS",
    "TRAIN_SAMPLES_EVENTS",
    "FileMonitorSection",
    "Monitor",
    "WandbSection",
    "build_monitor",
    "eigenvalue_event",
]
