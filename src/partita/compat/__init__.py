"""DeepSpeed compatibility, in one package, as thin adapters over partita's own API:

- ``deepspeed/``: the stand-in package, laid out as DeepSpeed's module tree;
- ``alias.py``: makes ``import deepspeed`` resolve to it on request;
- ``accessors.py``: DeepSpeed's ``safe_get_*`` / ``safe_set_*`` functions (``deepspeed.utils``,
  ``partita.utils``);
- ``estimator_names.py``: DeepSpeed's ``estimate_zero{2,3}_model_states_mem_needs_*`` names,
  answering with partita's estimator;
- ``checkpoint_reader.py``: reads DeepSpeed ZeRO checkpoint folders (``load_checkpoint`` and
  ``partita export`` of a DeepSpeed folder).

Each module here imports only the layer it adapts; the checkpoint layer imports the reader
inside the functions that need it (the reader imports the checkpoint package).
"""
