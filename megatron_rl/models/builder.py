"""Build megatron-core ``GPTModel`` chunks for this rank from ``ModelConfig`` + ``ParallelConfig``.

Megatron's parallel state must exist first (``megatron_rl.parallel.initialize_model_parallel``). Always a list
of chunks (VPP or 1), the Transformer Engine spec when TE and CUDA are there and megatron's local spec otherwise,
dropout 0 (the log-prob recompute must be deterministic). The rule to keep: MLA's q / kv down-projections are
replicated over TP in both specs (a column-parallel one loses half the RoPE-key gradient at TP2 in
megatron-core 0.16-0.19, Megatron-LM #1699). Every design decision with its reason: docs/models.md.

    chunks = build_gpt_model(model_cfg, parallel_cfg)       # list: one chunk, or VPP chunks
    logits = chunks[0](input_ids, position_ids, attention_mask=None)  # [b, s, vocab/TP] on last stage
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F

from megatron_rl.models.config import ModelConfig
from megatron_rl.parallel.config import ParallelConfig
from megatron_rl.platform.cpu_compat import cpu_patches_applied
from megatron_rl.platform.mcore_version import check_supported_mcore
from megatron_rl.platform.select import Platform, apply_platform_patches

__all__ = ["make_transformer_config", "build_gpt_model", "transformer_engine_available", "transformer_config_fields",
           "EXTRA_OWNED"]

#: TransformerConfig fields the builder sets from a project key (``model.extra`` may not override them)
EXTRA_OWNED = {
    "bf16": "actor.bf16", "fp16": "actor.bf16", "params_dtype": "actor.bf16", "pipeline_dtype": "actor.bf16",
    "tensor_model_parallel_size": "parallel.tensor_model_parallel_size",
    "pipeline_model_parallel_size": "parallel.pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size": "parallel.virtual_pipeline_model_parallel_size",
    "context_parallel_size": "parallel.context_parallel_size",
    "expert_model_parallel_size": "parallel.expert_model_parallel_size",
    "expert_tensor_parallel_size": "parallel.expert_tensor_parallel_size",
    "sequence_parallel": "parallel.sequence_parallel",
    "num_layers_in_first_pipeline_stage": "parallel.num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage": "parallel.num_layers_in_last_pipeline_stage",
    "recompute_granularity": "actor.recompute_granularity", "recompute_method": "actor.recompute_method",
    "recompute_num_layers": "actor.recompute_num_layers", "recompute_modules": "actor.recompute_modules",
}

#: TransformerConfig fields the builder sets from the ``model:`` key of the same name that fix a tensor shape: the
#: model: key is what ``check`` plans and the checkpoint loader / exporter read, so ``model.extra`` may not set them
EXTRA_SHAPES = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "num_query_groups",
                "kv_channels", "add_qkv_bias", "qk_layernorm", "multi_latent_attention", "q_lora_rank", "kv_lora_rank",
                "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "num_moe_experts", "moe_ffn_hidden_size",
                "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_layer_freq")

#: ``ModelConfig`` fields of multi-latent attention that megatron's ``MLATransformerConfig`` takes as they are,
#: under the same name
_MLA_SAME_NAMES = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
                   "rotary_base", "rotary_scaling_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
#: ``ModelConfig`` fields of MoE models that megatron's ``TransformerConfig`` takes as they are, under the same name
_MOE_SAME_NAMES = ("num_moe_experts", "moe_router_topk", "moe_shared_expert_intermediate_size",
                   "moe_shared_expert_gate", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
                   "moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
                   "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_router_num_groups",
                   "moe_router_group_topk")


def _same_names(model: ModelConfig, names) -> Dict[str, Any]:
    """``{name: model.<name>}``: fields megatron takes under the project's (Megatron's) names."""
    return {name: getattr(model, name) for name in names}


def transformer_config_fields() -> frozenset:
    """Names of megatron-core's ``MLATransformerConfig`` fields (a superset of ``TransformerConfig``'s): what
    ``model.extra`` may set."""
    import dataclasses

    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return frozenset(f.name for f in dataclasses.fields(MLATransformerConfig))


def transformer_engine_available() -> bool:
    """True when Transformer Engine is installed and CUDA is there to run it (``Platform.detect``)."""
    return Platform.detect().has_te


def make_transformer_config(model: ModelConfig, parallel: ParallelConfig,
                            params_dtype: Optional[torch.dtype] = None, variable_seq_lengths: bool = True,
                            **overrides: Any):
    """Megatron ``TransformerConfig`` for ``model`` under ``parallel``; ``overrides`` win (and
    ``model.extra`` is applied before them)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    model.validate()
    if params_dtype is None:
        params_dtype = torch.float32
    on_gpu = torch.cuda.is_available()
    tp = parallel.tensor_model_parallel_size
    kw: Dict[str, Any] = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.dense_ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.query_groups,
        kv_channels=model.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.etp,
        sequence_parallel=parallel.sequence_parallel and tp > 1,
        variable_seq_lengths=variable_seq_lengths,
        use_cpu_initialization=not on_gpu,
        perform_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        moe_token_dispatcher_type=model.moe_token_dispatcher_type,
    )
    first, last = parallel.num_layers_in_first_pipeline_stage, parallel.num_layers_in_last_pipeline_stage
    if first is not None or last is not None:
        kw.update(num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    config_cls = TransformerConfig
    if model.multi_latent_attention:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config_cls = MLATransformerConfig
        kw.update(_same_names(model, _MLA_SAME_NAMES))
        kw.update(
            multi_latent_attention=True, qk_layernorm=True, kv_channels=model.v_head_dim,
            num_query_groups=model.num_attention_heads,
            original_max_position_embeddings=(model.original_max_position_embeddings
                                              or model.max_position_embeddings),
        )
    if model.moe_token_dispatcher_type == "allgather":
        kw["variable_seq_lengths"] = False
    if parallel.interleaved:
        # megatron-core 0.16's interleaved schedule is not symmetric in its shape handshake: with
        # variable_seq_lengths=True ranks wait for shapes their peer never sends (observed on gloo: hang
        # at PP4xVPP2). With fixed shapes PP4xVPP2 matches PP1 exactly; pad to the schedule's seq_length.
        # (PP2xVPP2 is rejected by validate_parallel_config.)
        kw["variable_seq_lengths"] = False
    if model.is_moe:
        pattern = model.moe_layer_pattern()
        kw.update(_same_names(model, _MOE_SAME_NAMES))
        kw.update(
            moe_ffn_hidden_size=model.moe_ffn_hidden_size or model.dense_ffn_hidden_size,
            moe_grouped_gemm=model.moe_grouped_gemm and on_gpu,
            moe_layer_freq=pattern,
            moe_permute_fusion=False,
            moe_router_dtype="fp32",
        )
    kw.update(model.extra)
    kw.update(overrides)
    return config_cls(**kw)


def _layer_spec(tcfg, use_te: bool, vp_stage: Optional[int]):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=use_te, normalization="RMSNorm",
                                      vp_stage=vp_stage)
    if not use_te:
        # the final norm: megatron picks apex's fused norm when apex imports, which is LayerNorm only
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        spec.layer_norm = WrappedTorchNorm
    if not use_te and getattr(tcfg, "multi_latent_attention", False):
        # replicated q / kv down-projections, as TE's spec has them (see the module docstring)
        from megatron.core.post_training.modelopt.layers import Linear

        for layer in spec.layer_specs:
            attn = layer.submodules.self_attention.submodules
            attn.linear_q_down_proj = Linear
            attn.linear_kv_down_proj = Linear
    return spec


def build_gpt_model(model: ModelConfig, parallel: ParallelConfig, params_dtype: Optional[torch.dtype] = None,
                    use_transformer_engine: Optional[bool] = None, variable_seq_lengths: bool = True,
                    parallel_output: bool = True, **config_overrides: Any) -> List[torch.nn.Module]:
    """Build this rank's ``GPTModel`` chunk(s) (length = VPP or 1), on CPU or the current CUDA device.

    ``parallel_output=True`` keeps logits sharded over the vocab (TP) — what vocab-parallel log-prob
    code wants. Requires megatron's parallel state to match ``parallel``."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    check_supported_mcore()
    if not torch.cuda.is_available() and not cpu_patches_applied():
        raise RuntimeError("build_gpt_model: megatron's CPU patches are not applied (call "
                           "megatron_rl.parallel.initialize_model_parallel, or apply_cpu_patches() when setting up "
                           "megatron's parallel state yourself)")
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("build_gpt_model: megatron parallel state is not initialised "
                           "(call megatron_rl.parallel.initialize_model_parallel first)")
    expect = {"tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
              "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
              "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
              "context_parallel_size": parallel_state.get_context_parallel_world_size()}
    wrong = {k: (getattr(parallel, k), v) for k, v in expect.items() if getattr(parallel, k) != v}
    if wrong:
        raise ValueError("build_gpt_model: ParallelConfig disagrees with megatron's parallel state "
                         + ", ".join(f"{k}: config {a} vs initialised {b}" for k, (a, b) in wrong.items()))
    use_te = transformer_engine_available() if use_transformer_engine is None else use_transformer_engine
    if parallel.context_parallel_size > 1 and not use_te:
        raise ValueError(f"context_parallel_size={parallel.context_parallel_size} needs Transformer Engine "
                         f"attention (megatron's local DotProductAttention asserts context_parallel_size == 1; "
                         f"TE needs CUDA) — use context_parallel_size=1 on CPU")
    if not use_te:  # megatron's local spec: what it lacks (idempotent; on CPU already applied)
        apply_platform_patches(Platform(has_cuda=torch.cuda.is_available(), has_te=False))
    tcfg = make_transformer_config(model, parallel, params_dtype=params_dtype,
                                   variable_seq_lengths=variable_seq_lengths, **config_overrides)
    vp_stages = list(range(parallel.vpp)) if parallel.interleaved else [None]
    chunks = []
    for vp_stage in vp_stages:
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        chunk = GPTModel(
            config=tcfg,
            transformer_layer_spec=_layer_spec(tcfg, use_te, vp_stage),
            vocab_size=model.vocab_size,
            max_sequence_length=model.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            parallel_output=parallel_output,
            share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
            position_embedding_type="rope",
            rotary_base=int(model.rotary_base) if float(model.rotary_base).is_integer() else model.rotary_base,
            vp_stage=vp_stage,
        )
        if tcfg.params_dtype != torch.float32:  # every parameter in the model dtype, as megatron's Float16Module
            chunk.to(dtype=tcfg.params_dtype)
        if torch.cuda.is_available():
            chunk.cuda(torch.cuda.current_device())
        chunks.append(chunk)
    return chunks
