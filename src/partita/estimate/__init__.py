"""Know before you launch: per-rank memory of every ZeRO configuration, itemised from
partita's own storage layout, and a planner that picks the fastest one that fits.

- `ModelShape` (``model.py``): a model by parameter count, module or Hugging Face config, with
  activations traced once on meta/fake tensors (``activations.py``).
- `estimate` (``memory.py``): one configuration's itemised bytes on device, host and NVMe;
  stage 3's at the moment of a step that holds the most (``stage3.py``).
- ``plan.py``: step time from the engine's schedule, the comm model, compute and offload rates;
  ``ds_config.json``. ``calibrate.py``: the model's own compute rate and the CPU Adam rate on
  the threads one rank gets.
- ``ulysses.py``: one rank of a Ulysses group (``sequence_parallel_size``) traced as it runs;
  ``longest.py``: its activations fitted over the sequence length, and the longest sequence
  each configuration fits (``partita estimate --sp N --longest``).
- ``cli.py``: ``partita estimate`` and ``partita plan``; ``plot.py``: ``--plot FILE.png``.
"""

from partita.estimate.activations import ActivationProfile, trace_activations
from partita.estimate.memory import (
    MODEL_STATES,
    Candidate,
    Estimate,
    Hardware,
    Item,
    Settings,
    candidates,
    estimate,
)
from partita.estimate.model import ModelShape, describe_module, from_hf_config
from partita.estimate.units import EstimateError, format_bytes, parse_bytes, parse_count

__all__ = [
    "MODEL_STATES",
    "ActivationProfile",
    "Candidate",
    "Estimate",
    "EstimateError",
    "Hardware",
    "Item",
    "ModelShape",
    "Settings",
    "candidates",
    "describe_module",
    "estimate",
    "format_bytes",
    "from_hf_config",
    "parse_bytes",
    "parse_count",
    "trace_activations",
]
