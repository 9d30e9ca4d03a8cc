"""``import partita.as_deepspeed`` makes ``import deepspeed`` resolve to partita in this process.

Import it before anything imports ``deepspeed`` (Transformers, Accelerate and PEFT look for it when
they are imported). The same switch for processes you do not write: ``PARTITA_AS_DEEPSPEED=1``.
"""

from partita.compat.alias import install

install()
