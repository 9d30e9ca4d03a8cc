"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: ALST's Ulysses for Hugging Face models
(``UlyssesSPAttentionHF``, its ``register_with_transformers``, ``UlyssesSPDataLoaderAdapter``)
over `partita.parallel.ulysses`; the sequence-tiled compute (``TiledMLP``,
``TiledFusedLogitsLoss``, ``sequence_tiled_compute``, ``SequenceTiledCompute``) over
`partita.tiling.sequence`."""

from __future__ import annotations

import logging
from typing import Any

import torch

from partita import comm
from partita.compat.deepspeed._missing import module_getattr
from partita.parallel.ulysses import SequenceShardingLoader, UlyssesHFAttention, check_heads
from partita.tiling.sequence import TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute

__getattr__ = module_getattr("deepspeed.runtime.sequence_parallel.ulysses_sp")

logger = logging.getLogger("partita")

UlyssesSPDataLoaderAdapter = SequenceShardingLoader


class UlyssesSPAttentionHF(torch.nn.Module):
    """DeepSpeed's Ulysses wrapper of a Hugging Face attention function (`attn`, from
    ``ALL_ATTENTION_FUNCTIONS``), with its arguments; `forward` takes and returns what a
    Hugging Face attention function does (``[b, h, s/sp, d]`` in, ``([b, s/sp, h*d], weights)``
    out). Head counts that cannot be split over the group raise ValueError naming them."""

    def __init__(
        self,
        attn: Any,
        batch_size: int,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        num_hidden_layers: int,
        process_group: Any,
        seq_length_is_variable: bool = False,
        local_seq_length: int | None = None,
        global_seq_length: int | None = None,
        disable_in_eval: bool = False,
    ) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = comm.get_world_size(process_group)
        self.sp_rank = comm.get_rank(process_group)
        self.batch_size = batch_size
        self.attn_head_count = attn_head_count
        self.attn_head_size = attn_head_size
        self.global_kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length = local_seq_length
        self.global_seq_length = global_seq_length
        self.disable_in_eval = disable_in_eval
        self.kv_replication_factor = check_heads(attn_head_count, kv_head_count, self.world_size)
        self.core_attn_implementation: str | None = None
        self._ulysses = UlyssesHFAttention(attn, process_group, disable_in_eval)

    def forward(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        """Attention of this rank's sequence slice over the whole sequence."""
        local = self.local_seq_length
        if not self.seq_length_is_variable and local is not None and query.shape[2] != local:
            raise ValueError(
                f"UlyssesSPAttentionHF: a local sequence of {query.shape[2]} tokens, but "
                f"seq_length gave {local} per rank"
            )
        out, weights = self._ulysses(module, query, key, value, attention_mask, *args, **kwargs)
        return out.reshape(*out.shape[:2], -1), weights

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path: Any,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
        max_length: int | None = None,
    ) -> Any:
        """Puts Ulysses in place of `core_attn_implementation` in Transformers' attention
        registry and returns the mpu (``parallel_state_sp``, groups built here; collective
        over the world); None when `sequence_parallel_size` is 1."""
        if sequence_parallel_size == 1:
            return None
        if max_length is not None:
            logger.warning("register_with_transformers: max_length is deprecated, use seq_length")
            seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError(
                "register_with_transformers: give seq_length or seq_length_is_variable"
            )
        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from partita.compat.deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu

        loaded = hasattr(model_name_or_path, "config")
        config = model_name_or_path.config if loaded else AutoConfig.from_pretrained(
            model_name_or_path
        )  # fmt: skip
        if loaded:
            have = getattr(config, "_attn_implementation", None)
            if have is not None and have != core_attn_implementation:
                raise ValueError(
                    f"core_attn_implementation='{core_attn_implementation}' does not match the "
                    f"model's attn_implementation='{have}'; set both to the same value"
                )
        if core_attn_implementation in ("eager", "paged|eager"):
            raise ValueError(
                f"{core_attn_implementation} attention needs a 4D attention mask, which Ulysses "
                "drops; use 'sdpa', 'flex_attention' or a flash attention"
            )
        if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(
                f"{core_attn_implementation} is not a valid attn_implementation; the choices "
                f"are {ALL_ATTENTION_FUNCTIONS.valid_keys()}"
            )
        text = config.get_text_config()
        heads, kv = text.num_attention_heads, text.num_key_value_heads
        check_heads(heads, kv, sequence_parallel_size)  # before any collective
        mpu.initialize_sequence_parallel(sequence_parallel_size=sequence_parallel_size)
        local = None if seq_length_is_variable else seq_length // sequence_parallel_size  # type: ignore[operator]
        uattn = cls(
            attn=ALL_ATTENTION_FUNCTIONS[core_attn_implementation],
            batch_size=micro_batch_size,
            attn_head_count=heads,
            attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // heads,
            kv_head_count=kv,
            num_hidden_layers=text.num_hidden_layers,
            process_group=mpu.get_sequence_parallel_group(),
            seq_length_is_variable=seq_length_is_variable,
            local_seq_length=local,
            global_seq_length=None if seq_length_is_variable else seq_length,
            disable_in_eval=disable_in_eval,
        )
        uattn.core_attn_implementation = core_attn_implementation
        # In place of the core implementation, so that Transformers' own branches on the
        # implementation's name still run (DeepSpeed does the same).
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = uattn
        return mpu


class SequenceTiledCompute:
    """DeepSpeed's positional form, ``SequenceTiledCompute.apply(fn, seqlen, shards,
    keys_to_shard, keys_to_pass, grad_requiring_tensor_key, compute_params,
    output_unshard_dimension, output_reduction, *values)`` (the sharded values, then the passed
    ones), over `sequence_tiled_compute`."""

    @staticmethod
    def apply(
        fn: Any,
        seqlen: int,
        shards: int,
        keys_to_shard: list[str],
        keys_to_pass: list[str],
        grad_requiring_tensor_key: str,
        compute_params: Any,
        output_unshard_dimension: int,
        output_reduction: str | None,
        *values: Any,
    ) -> torch.Tensor:
        """See the class docstring."""
        if len(values) != len(keys_to_shard) + len(keys_to_pass):
            raise ValueError(
                f"SequenceTiledCompute.apply: {len(values)} values for {len(keys_to_shard)} "
                f"keys to shard and {len(keys_to_pass)} keys to pass"
            )
        n = len(keys_to_shard)
        return sequence_tiled_compute(
            fn, seqlen, shards, dict(zip(keys_to_shard, values[:n], strict=True)),
            dict(zip(keys_to_pass, values[n:], strict=True)), grad_requiring_tensor_key,
            compute_params, output_unshard_dimension, output_reduction,
        )  # fmt: skip


__all__ = [
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "sequence_tiled_compute",
]
