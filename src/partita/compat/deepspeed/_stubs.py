"""Every module path of DeepSpeed's public API resolves under the stand-in.

DeepSpeed 0.19.8 has about 750 public module paths (`DEEPSPEED_MODULES`, its package tree by
name only: no code of it is here). partita implements the ones Hugging Face, TRL, PEFT and
common training scripts use as real modules of this tree; every other path resolves to a stub
module (`StubFinder`, consulted after the real files), so a script or a test file that imports
one still loads, and each name read from a stub raises one error naming it, the feature behind
it and what partita offers instead (`partita.compat.deepspeed._missing.missing_attribute`): an
AttributeError for ``getattr``/``hasattr`` probes, an ImportError for ``from X import name``.
A path DeepSpeed does not have (a typo) still fails to import, naming it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from functools import cache

from partita.compat.deepspeed._missing import feature_of, module_getattr

PACKAGE = "partita.compat.deepspeed"

# DeepSpeed 0.19.8's public modules: parent package (dotted, without "deepspeed.") -> the names
# of its modules and subpackages. Regenerate from an installed DeepSpeed when the API level moves.
DEEPSPEED_MODULES: dict[str, str] = {
    "": (
        "accelerator autotuning checkpoint comm compat compile compression constants "
        "datastates env_report git_version_info git_version_info_installed inference io "
        "launcher linear model_implementations module_inject moe monitor nvme ops pipe "
        "profiling runtime sequence utils"
    ),
    "accelerator": (
        "abstract_accelerator cpu_accelerator cuda_accelerator hpu_accelerator "
        "klxpu_accelerator mlu_accelerator mps_accelerator npu_accelerator "
        "real_accelerator sdaa_accelerator supa_accelerator xpu_accelerator"
    ),
    "autotuning": "autotuner config constants scheduler tuner utils",
    "autotuning.tuner": "base_tuner cost_model index_based_tuner model_based_tuner utils",
    "checkpoint": (
        "affine affine_transfer autoep_affine autoep_universal autoep_zero3_metadata "
        "constants deepspeed_checkpoint ds_to_universal reshape_3d_utils reshape_meg_2d "
        "reshape_utils universal_checkpoint utils zero_checkpoint"
    ),
    "comm": "backend ccl comm config constants mori pg_utils reduce_op torch utils",
    "compile": (
        "backend config constants custom_ops fx graph_param inductor init_sp init_tp "
        "init_z1_and_2 init_z3 input_storage list_schedule partitioner passes "
        "patch_compiled_func patch_fake_tensor profilers util z3_eager_fallback"
    ),
    "compile.custom_ops": "all_to_all sp_compat sp_dp_registry tp_collectives",
    "compile.passes": (
        "contract long_context_checkpointing offload_activation offload_adam_states "
        "offload_parameters prefetch selective_gather sp_compile tp_compile zero3_compile "
        "zero_1_and_2_compile"
    ),
    "compile.profilers": "comm_profile graph_profile",
    "compression": "helper",
    "datastates": "config",
    "inference": "config engine quantization v2",
    "inference.quantization": "layers quantization quantization_context utils",
    "inference.v2": (
        "allocator checkpoint config_v2 engine_factory engine_v2 inference_parameter "
        "inference_utils kernels logging model_implementations modules ragged "
        "scheduling_utils"
    ),
    "inference.v2.checkpoint": "base_engine huggingface_engine in_memory_engine",
    "inference.v2.kernels": "core_ops cutlass_ops ds_kernel ragged_ops",
    "inference.v2.kernels.core_ops": (
        "bias_activations blas_kernels cuda_layer_norm cuda_linear cuda_rms_norm gated_activations"
    ),
    "inference.v2.kernels.core_ops.bias_activations": "bias_activation",
    "inference.v2.kernels.core_ops.blas_kernels": "blas_linear",
    "inference.v2.kernels.core_ops.cuda_layer_norm": "cuda_fp_ln_base cuda_ln cuda_post_ln cuda_pre_ln",
    "inference.v2.kernels.core_ops.cuda_linear": "cuda_linear",
    "inference.v2.kernels.core_ops.cuda_rms_norm": "rms_norm rms_norm_base rms_pre_norm",
    "inference.v2.kernels.core_ops.gated_activations": "gated_activation",
    "inference.v2.kernels.cutlass_ops": "mixed_gemm moe_gemm",
    "inference.v2.kernels.cutlass_ops.mixed_gemm": "mixed_gemm",
    "inference.v2.kernels.cutlass_ops.moe_gemm": "mixed_moe_gemm moe_gemm",
    "inference.v2.kernels.ragged_ops": (
        "atom_builder blocked_flash embed linear_blocked_kv_rotary logits_gather "
        "moe_gather moe_scatter top_k_gating"
    ),
    "inference.v2.kernels.ragged_ops.atom_builder": "atom_builder",
    "inference.v2.kernels.ragged_ops.blocked_flash": "blocked_flash",
    "inference.v2.kernels.ragged_ops.embed": "embed",
    "inference.v2.kernels.ragged_ops.linear_blocked_kv_rotary": "blocked_kv_rotary blocked_trained_kv_rotary linear_blocked_kv_copy",
    "inference.v2.kernels.ragged_ops.logits_gather": "logits_gather",
    "inference.v2.kernels.ragged_ops.moe_gather": "moe_gather",
    "inference.v2.kernels.ragged_ops.moe_scatter": "moe_scatter",
    "inference.v2.kernels.ragged_ops.top_k_gating": "top_k_gating",
    "inference.v2.model_implementations": (
        "common_parameters exaone4 exaone4_5 falcon flat_model_helpers "
        "inference_model_base inference_policy_base inference_transformer_base "
        "layer_container_base llama_v2 mistral mixtral opt parameter_base phi phi3 qwen "
        "qwen_v2 qwen_v2_moe sharding"
    ),
    "inference.v2.model_implementations.common_parameters": (
        "attn_output_parameters embedding_parameters invfreq_parameters mlp_parameters "
        "moe_parameters norm_parameters qkv_parameters unembed_parameters"
    ),
    "inference.v2.model_implementations.exaone4": "container model policy",
    "inference.v2.model_implementations.exaone4_5": "container model policy",
    "inference.v2.model_implementations.falcon": "container model policy",
    "inference.v2.model_implementations.llama_v2": "container model policy",
    "inference.v2.model_implementations.mistral": "container model policy",
    "inference.v2.model_implementations.mixtral": "container model policy",
    "inference.v2.model_implementations.opt": "container model policy",
    "inference.v2.model_implementations.phi": "containers model policy",
    "inference.v2.model_implementations.phi3": "containers model policy",
    "inference.v2.model_implementations.qwen": "container model policy",
    "inference.v2.model_implementations.qwen_v2": "container model policy",
    "inference.v2.model_implementations.qwen_v2_moe": "container model policy",
    "inference.v2.model_implementations.sharding": "attn attn_out embedding mlp qkv types unembed utils",
    "inference.v2.modules": "configs ds_module heuristics implementations interfaces module_registry",
    "inference.v2.modules.configs": (
        "attention_configs embedding_config linear_config moe_config norm_config unembed_config"
    ),
    "inference.v2.modules.implementations": "attention embedding linear moe post_norm pre_norm unembed",
    "inference.v2.modules.implementations.attention": "dense_blocked_attention",
    "inference.v2.modules.implementations.embedding": "ragged_embedding",
    "inference.v2.modules.implementations.linear": "blas_fp_linear quantized_linear",
    "inference.v2.modules.implementations.moe": "cutlass_multi_gemm",
    "inference.v2.modules.implementations.post_norm": "cuda_post_ln",
    "inference.v2.modules.implementations.pre_norm": "cuda_pre_ln cuda_pre_rms",
    "inference.v2.modules.implementations.unembed": "ragged_unembed",
    "inference.v2.modules.interfaces": (
        "attention_base embedding_base linear_base moe_base post_norm_base pre_norm_base "
        "unembed_base"
    ),
    "inference.v2.ragged": (
        "blocked_allocator kv_cache manager_configs ragged_manager ragged_wrapper "
        "sequence_descriptor"
    ),
    "io": (
        "base_file_writer base_io_buffer constants double_io_buffer fast_file_writer "
        "mock_file_writer py_file_writer single_io_buffer utils"
    ),
    "launcher": "constants launch launcher_helper multinode_runner runner",
    "linear": "config context_manager optimized_linear quantization",
    "model_implementations": "diffusers features transformers",
    "model_implementations.diffusers": "unet vae",
    "model_implementations.features": "cuda_graph",
    "model_implementations.transformers": (
        "clip_encoder ds_base ds_bert ds_bloom ds_gpt ds_llama2 ds_megatron_gpt ds_opt "
        "ds_transformer"
    ),
    "module_inject": (
        "auto_ep auto_ep_comm auto_ep_config auto_ep_folding auto_ep_layer "
        "auto_ep_preset_adapters auto_ep_presets auto_tp auto_tp_model_utils "
        "autotp_config containers fusedqkv_utils inject layers load_checkpoint "
        "module_quantize policy replace_module replace_policy tp_plan_converter tp_shard "
        "utils"
    ),
    "module_inject.auto_ep_presets": "base deepseek_v2 deepseek_v3 minimax_m3 mixtral qwen3_5_moe qwen3_moe registry",
    "module_inject.containers": (
        "base base_moe bert bloom clip distil_bert features gpt2 gptj gptneo gptneox "
        "internlm llama llama2 megatron_gpt megatron_gpt_moe opt unet vae"
    ),
    "module_inject.containers.features": "gated_mlp hybrid_engine hybrid_megatron megatron meta_tensor split_qkv",
    "moe": (
        "ep_count ep_experts ep_kernels ep_repack ep_router ep_tp_dispatch experts "
        "fused_expert_layout layer mappings sharded_moe utils"
    ),
    "monitor": "comet config csv_monitor monitor tensorboard utils wandb",
    "nvme": (
        "ds_aio_args ds_aio_basic ds_aio_constants ds_aio_handle ds_aio_job io_engine "
        "parse_nvme_stats perf_generate_param perf_run_sweep perf_sweep_utils test_ds_aio "
        "test_ds_aio_utils torch_fastio_engine torch_io validate_async_io"
    ),
    "ops": (
        "adagrad adam aio compile deepspeed4science fp_quantizer gds lamb lion op_builder "
        "pin_memory quantizer random_ltd transformer triton_ops"
    ),
    "ops.adagrad": "cpu_adagrad",
    "ops.adam": "cpu_adam fused_adam multi_tensor_apply zenflow_cpu_adam zenflow_torch_adam",
    "ops.deepspeed4science": "evoformer_attn",
    "ops.fp_quantizer": "fp8_gemm fp8_gemm_triton quantize",
    "ops.lamb": "fused_lamb",
    "ops.lion": "cpu_lion fused_lion multi_tensor_apply",
    "ops.op_builder": (
        "all_ops async_io builder cpu dc evoformer_attn fp_quantizer fused_adam "
        "fused_lamb fused_lion gds hpu inference_core_ops inference_cutlass_builder klxpu "
        "mlu mps npu pin_memory pin_memory_load quantizer ragged_ops ragged_utils "
        "random_ltd sdaa spatial_inference stochastic_transformer supa transformer "
        "transformer_inference utils xpu"
    ),
    "ops.op_builder.cpu": (
        "async_io builder comm cpu_adagrad cpu_adam cpu_lion fused_adam no_impl pin_memory"
    ),
    "ops.op_builder.hpu": "builder cpu_adam fp_quantizer fused_adam no_impl transformer_inference",
    "ops.op_builder.klxpu": (
        "async_io builder cpu_adagrad cpu_adam cpu_lion fused_adam no_impl pin_memory utils"
    ),
    "ops.op_builder.mlu": "builder cpu_adagrad cpu_adam fused_adam no_impl",
    "ops.op_builder.mps": "builder cpu_adam fused_adam no_impl",
    "ops.op_builder.npu": (
        "async_io builder cpu_adagrad cpu_adam cpu_lion fused_adam fused_lamb fused_lion "
        "inference no_impl pin_memory quantizer"
    ),
    "ops.op_builder.sdaa": "builder cpu_adam fused_adam no_impl",
    "ops.op_builder.supa": (
        "async_io builder cpu_adagrad cpu_adam cpu_lion fused_adam fused_lamb fused_lion "
        "inference no_impl pin_memory quantizer"
    ),
    "ops.op_builder.xpu": "async_io builder cpu_adagrad cpu_adam flash_attn fused_adam no_impl pin_memory",
    "ops.random_ltd": "dropping_utils",
    "ops.transformer": "inference transformer",
    "ops.transformer.inference": (
        "bias_add config diffusers_2d_transformer diffusers_attention "
        "diffusers_transformer_block ds_attention ds_mlp moe_inference op_binding triton "
        "triton_ops"
    ),
    "ops.transformer.inference.op_binding": (
        "base bias_add bias_gelu bias_relu bias_residual einsum_sec_sm_ecm "
        "gated_activation gelu_gemm layer_norm linear mlp_gemm moe_res_matmul "
        "pad_transform pre_rms_norm qkv_gemm residual_add rms_norm softmax "
        "softmax_context vector_add vector_matmul workspace"
    ),
    "ops.transformer.inference.triton": (
        "attention gelu layer_norm matmul_ext mlp ops residual_add softmax triton_matmul_kernel"
    ),
    "ops.triton_ops": (
        "autoep_fused_token_ops fused_rms_norm fused_rotary_pos_emb group_gemm_triton swiglu_triton"
    ),
    "profiling": "config constants flops_profiler",
    "profiling.flops_profiler": "profiler",
    "runtime": (
        "activation_checkpointing base_optimizer bf16_optimizer checkpoint_engine "
        "chunked_cross_entropy comm compiler config config_utils constants data_pipeline "
        "dataloader domino engine fp16 hybrid_engine hybrid_engine_graph keep_in_fp32 "
        "lr_schedules model_checkpointing pipe precision_config python_gc rollout "
        "sequence_parallel sparse_tensor state_dict_factory superoffload swap_tensor "
        "tensor_parallel torch_autocast utils weight_quantizer zenflow zero"
    ),
    "runtime.activation_checkpointing": "checkpointing config offload_activations",
    "runtime.checkpoint_engine": (
        "checkpoint_engine datastates_checkpoint_engine decoupled_checkpoint_engine "
        "fast_checkpoint_engine torch_checkpoint_engine utils"
    ),
    "runtime.comm": "coalesced_collectives",
    "runtime.data_pipeline": "config constants curriculum_scheduler data_routing data_sampling",
    "runtime.data_pipeline.data_routing": "basic_layer helper scheduler utils",
    "runtime.data_pipeline.data_sampling": "data_analyzer data_sampler indexed_dataset utils variable_batch_size_and_lr",
    "runtime.domino": "async_linear transformer",
    "runtime.fp16": "fused_optimizer loss_scaler unfused_optimizer",
    "runtime.model_checkpointing": "config constants data_parallel_writer_factory utils writer_factory",
    "runtime.pipe": "dualpipev engine module p2p schedule topology",
    "runtime.rollout": "base continuous_batching hybrid_engine_rollout opsd",
    "runtime.sequence_parallel": "parallel_state_sp ulysses_sp",
    "runtime.superoffload": "superoffload_stage3 superoffload_utils",
    "runtime.swap_tensor": (
        "aio_config async_swapper constants optimizer_utils partitioned_optimizer_swapper "
        "partitioned_param_swapper pipelined_optimizer_swapper utils"
    ),
    "runtime.tensor_parallel": "config init_utils tp_manager",
    "runtime.zenflow": "engine engine_stage3 zenflow_config zenflow_stage_1_and_2 zenflow_utils",
    "runtime.zero": (
        "config contiguous_memory_allocator leaf_module_config linear muon offload_config "
        "offload_states parameter_offload partition_parameters "
        "partitioned_param_coordinator partitioned_param_profiler stage3 stage_1_and_2 "
        "test tiling utils"
    ),
    "runtime.zero.muon": "muon_optimizer original_muon",
    "sequence": (
        "auto_sp autosp_detector autosp_fusion autosp_vit cross_entropy fpdt_layer layer "
        "linear_cross_entropy test_autosp vocab_parallel_ops"
    ),
    "utils": (
        "bwc comms_logging config debug exceptions groups init_on_device logging "
        "mixed_precision_linkage module_utils numa nvtx pin_memory pin_memory_tracker "
        "static_cache tensor_fragment timer torch types z3_leaf_module zero_to_fp32 "
        "zero_to_torch"
    ),
}


@cache
def module_paths() -> frozenset[str]:
    """Every public DeepSpeed module path, dotted, without the leading ``deepspeed.``."""
    return frozenset(
        f"{parent}.{leaf}" if parent else leaf
        for parent, leaves in DEEPSPEED_MODULES.items()
        for leaf in leaves.split()
    )


class _StubLoader(importlib.abc.Loader):
    """Creates the stub module of one DeepSpeed path partita does not implement."""

    def __init__(self, dotted: str) -> None:
        self.dotted = dotted

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        feature = feature_of(self.dotted)
        module.__doc__ = (
            f"Stub of deepspeed.{self.dotted}: partita does not implement it"
            + (f" ({feature})" if feature else "")
            + "; every name read from it raises naming what partita offers instead."
        )
        module.__getattr__ = module_getattr(f"deepspeed.{self.dotted}")  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the stub is complete when created."""


class StubFinder(importlib.abc.MetaPathFinder):
    """Answers ``partita.compat.deepspeed.X`` for a DeepSpeed module path X that has no real
    module here (placed after the path finders, so real modules always win)."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(PACKAGE + "."):
            return None
        dotted = fullname[len(PACKAGE) + 1 :]
        if dotted not in module_paths():
            return None
        return importlib.machinery.ModuleSpec(
            fullname, _StubLoader(dotted), is_package=dotted in DEEPSPEED_MODULES
        )


def install() -> None:
    """Puts `StubFinder` at the end of ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, StubFinder) for f in sys.meta_path):
        sys.meta_path.append(StubFinder())


__all__ = ["DEEPSPEED_MODULES", "StubFinder", "install", "module_paths"]
