"""The engine: `Engine` (forward, backward, step, save / load, with DeepSpeed's API) and what it
is built from. Composition, not algorithms.

Modules: `core` (the `Engine`), `setup` (its parts built from the config), `deepspeed_methods`
(the rest of ``DeepSpeedEngine``'s public methods, inherited), `offload_states` (DeepSpeed's
``offload_states()`` / ``reload_states()``), `experts` (mixture-of-experts groups and
families), `tensor_parallel` (AutoTP training: sizes, groups, the split model).
"""

from partita.engine.core import Engine

# `partita.engine.Engine` is the class's public home: scripts import it from here, and Hugging
# Face Trainer / Accelerate report ``type(engine).__module__``, as they did before the engine
# became a package.
Engine.__module__ = __name__

__all__ = ["Engine"]
