"""Names of the monitor events the engine writes.

The names are DeepSpeed's, character for character, because they are the public contract with
users' dashboards: they become TensorBoard tags, W&B keys and CSV file names
(``Train/Samples/lr`` -> ``Train_Samples_lr.csv``). Every ``Train/Samples/*`` event uses the
number of samples trained so far (DeepSpeed's ``global_samples``) as its step, so curves from
runs with different batch sizes line up on the x axis.
"""

from __future__ import annotations

EVENT_TRAIN_LOSS = "Train/Samples/train_loss"
"""Mean training loss of one optimizer step (the gradient-accumulation-scaled micro-batch losses
summed over the accumulation window), written at each accumulation boundary."""

EVENT_EVAL_LOSS = "Train/Samples/eval_loss"
"""Mean evaluation loss of one evaluation batch (DeepSpeed's pipeline engine writes it)."""

EVENT_LR = "Train/Samples/lr"
"""Learning rate of the first parameter group after the optimizer step."""

EVENT_LOSS_SCALE = "Train/Samples/loss_scale"
"""Current fp16 loss scale; written only when fp16 loss scaling is active."""

EVENT_ELAPSED_FORWARD_MS = "Train/Samples/elapsed_time_ms_forward"
"""Forward wall time of the step in milliseconds (with ``wall_clock_breakdown``)."""

EVENT_ELAPSED_BACKWARD_MS = "Train/Samples/elapsed_time_ms_backward"
"""Whole backward wall time of the step in milliseconds (with ``wall_clock_breakdown``)."""

EVENT_ELAPSED_BACKWARD_INNER_MS = "Train/Samples/elapsed_time_ms_backward_inner"
"""Backward wall time without gradient reduction, in milliseconds."""

EVENT_ELAPSED_BACKWARD_ALLREDUCE_MS = "Train/Samples/elapsed_time_ms_backward_allreduce"
"""Gradient reduction wall time of the step in milliseconds."""

EVENT_ELAPSED_STEP_MS = "Train/Samples/elapsed_time_ms_step"
"""Optimizer step wall time in milliseconds (with ``wall_clock_breakdown``)."""

EVENT_SAMPLES_PER_SEC = "Train/Samples/samples_per_sec"
"""Training throughput in samples per second over the last optimizer step.

A partita addition: DeepSpeed only prints throughput (``CurrSamplesPerSec`` in its log line)
and writes no monitor event for it. The name follows the ``Train/Samples/`` convention so it
lands next to the others in every backend.
"""

EIGENVALUE_EVENT_PREFIX = "Train/Eigenvalues/ModelBlockParam_"
"""Prefix of DeepSpeed's per-block Hessian eigenvalue events; see `eigenvalue_event`."""

TRAIN_SAMPLES_EVENTS: tuple[str, ...] = (
    EVENT_TRAIN_LOSS,
    EVENT_EVAL_LOSS,
    EVENT_LR,
    EVENT_LOSS_SCALE,
    EVENT_ELAPSED_FORWARD_MS,
    EVENT_ELAPSED_BACKWARD_MS,
    EVENT_ELAPSED_BACKWARD_INNER_MS,
    EVENT_ELAPSED_BACKWARD_ALLREDUCE_MS,
    EVENT_ELAPSED_STEP_MS,
    EVENT_SAMPLES_PER_SEC,
)
"""Every fixed ``Train/Samples/*`` event name, in the order above."""


def eigenvalue_event(block: int) -> str:
    """Return the event name of the eigenvalue of model block ``block`` (0-based)."""
    if block < 0:
        raise ValueError(f"eigenvalue block index must be >= 0, got {block}")
    return f"{EIGENVALUE_EVENT_PREFIX}{block}"
