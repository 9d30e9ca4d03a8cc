"""Compatibility with other libraries' APIs: the DeepSpeed stand-in (`partita.compat.deepspeed`)
and the import alias that makes ``import deepspeed`` resolve to it on request (`alias`)."""
