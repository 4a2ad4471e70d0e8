"""HF ``config.json`` <-> ``ModelConfig``: the one reading of a HF config in the project.

Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE and DeepSeek-V3 (also R1 and Kimi-K2). Only what changes the forward
pass or the tensor layout is mapped; anything the Megatron model cannot reproduce is refused with
``UnsupportedCheckpointError`` naming the config.json key. The converter's tensor geometry (``HFGeometry``) is
derived from this reading, never from config.json again. Router equivalences, DeepSeek-V3's routing / MLA / YaRN
conditions and what is refused: docs/convert.md.

    mcfg = model_config_from_hf(json.load(open("hf/config.json")), padded_vocab_size=None)
    cfg_json = megatron_to_hf_config(mcfg, model_type="qwen2", vocab_size=151936)
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

from megatron_rl.convert.checks import UnsupportedCheckpointError
from megatron_rl.models.config import ModelConfig, ModelConfigError

__all__ = ["SUPPORTED_MODEL_TYPES", "ARCHITECTURES", "MODEL_TYPE_ALIASES", "model_config_from_hf",
           "hf_architecture", "hf_mtp_layers", "megatron_to_hf_config", "infer_hf_model_type"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "deepseek_v3")
#: HF ``architectures[0]`` of each supported ``model_type``.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}
#: model_type values that are another supported family's layout (Kimi-K2 ships DeepseekV3ForCausalLM).
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


def _model_type(cfg: Dict[str, Any]) -> str:
    """The supported model_type of ``cfg``; ``architectures`` (when given) must be one supported class that
    agrees with ``model_type`` (a config without one of them takes it from the other)."""
    archs = cfg.get("architectures") or []
    by_arch = {a: t for t, a in ARCHITECTURES.items()}
    if archs and (len(archs) != 1 or archs[0] not in by_arch):
        raise UnsupportedCheckpointError(f"config.json: unsupported architectures={archs!r}; supported: "
                                         f"{sorted(by_arch)}")
    mt = cfg.get("model_type") or (by_arch[archs[0]] if archs else None)
    mt = MODEL_TYPE_ALIASES.get(mt, mt)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedCheckpointError(f"config.json model_type={mt!r} is not supported (supported: "
                                         f"{SUPPORTED_MODEL_TYPES})")
    if archs and by_arch[archs[0]] != mt:
        raise UnsupportedCheckpointError(f"config.json: architectures={archs!r} does not match model_type={mt!r}")
    return mt


def hf_architecture(cfg: Dict[str, Any]) -> str:
    """HF ``architectures[0]`` of a supported config (from ``model_type`` when the list is absent)."""
    return ARCHITECTURES[_model_type(cfg)]


def _required(cfg: Dict[str, Any], key: str, mt: str) -> Any:
    if cfg.get(key) is None:
        raise UnsupportedCheckpointError(f"config.json ({mt}): missing required key {key!r}")
    return cfg[key]


def _rope_theta(cfg: Dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise UnsupportedCheckpointError(f"config.json rope_scaling/rope_parameters rope_type={rope_type!r}: only "
                                         f"default RoPE is supported")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def hf_mtp_layers(cfg: Dict[str, Any]) -> int:
    """Multi-token-prediction layers a checkpoint stores after its decoder layers (``num_nextn_predict_layers``,
    DeepSeek-V3 / R1); their tensors ``model.layers.{L..L+n-1}.*`` are dropped on import."""
    return int(cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0)) or 0)


def _yarn_fields(cfg: Dict[str, Any], mt: str) -> Dict[str, Any]:
    """ModelConfig RoPE fields of a DeepSeek-V3 config (plain RoPE or YaRN, see the module docstring)."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return dict(rotary_base=theta)
    if rope_type != "yarn":
        raise UnsupportedCheckpointError(f"config.json ({mt}) rope_type={rope_type!r}: only default and yarn RoPE "
                                         f"are supported")
    if params.get("truncate", True) is False:
        raise UnsupportedCheckpointError(f"config.json ({mt}) rope_scaling.truncate=false: megatron's YaRN always "
                                         f"rounds the correction range")
    orig = params.get("original_max_position_embeddings")
    if not orig:
        raise UnsupportedCheckpointError(f"config.json ({mt}) yarn RoPE without original_max_position_embeddings")
    factor = params.get("factor")
    factor = float(factor) if factor else float(cfg["max_position_embeddings"]) / float(orig)
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if bool(mscale) != bool(mscale_all):
        raise UnsupportedCheckpointError(
            f"config.json ({mt}) rope_scaling mscale={mscale!r} mscale_all_dim={mscale_all!r}: HF's YaRN attention "
            f"factor matches megatron's only with both set or both unset")
    mscale, mscale_all = (float(mscale), float(mscale_all)) if mscale else (1.0, 0.0)

    def get_mscale(scale: float, m: float) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    derived = get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
    given = params.get("attention_factor")
    if given is not None and abs(float(given) - derived) > 1e-12:
        raise UnsupportedCheckpointError(f"config.json ({mt}) rope_scaling.attention_factor={given}: megatron derives "
                                         f"{derived} from factor / mscale / mscale_all_dim")
    return dict(rotary_base=theta, rope_type="yarn", rotary_scaling_factor=factor,
                original_max_position_embeddings=int(orig), beta_fast=float(params.get("beta_fast") or 32),
                beta_slow=float(params.get("beta_slow") or 1), mscale=mscale, mscale_all_dim=mscale_all)


def _deepseek_fields(cfg: Dict[str, Any], layers: int) -> Dict[str, Any]:
    """ModelConfig fields of a DeepSeek-V3 (R1, Kimi-K2) config: MLA, YaRN, DeepSeekMoE routing."""
    mt = "deepseek_v3"
    if cfg.get("quantization_config"):
        raise UnsupportedCheckpointError("config.json quantization_config is set (FP8 DeepSeek checkpoint): "
                                         "dequantize to bf16 first (weight_scale_inv tensors are not read)")
    if cfg.get("attention_bias"):
        raise UnsupportedCheckpointError("config.json attention_bias=true (deepseek_v3): MLA biases are not supported")
    if cfg.get("rope_interleave", True) is False:
        raise UnsupportedCheckpointError("config.json rope_interleave=false (deepseek_v3): megatron's MLA applies RoPE "
                                         "to interleaved pairs (the DeepSeek layout) only")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid" or cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise UnsupportedCheckpointError(f"config.json scoring_func={cfg.get('scoring_func')!r} topk_method="
                                         f"{cfg.get('topk_method')!r}: only sigmoid / noaux_tc (DeepSeek-V3) routing")
    q_lora = cfg.get("q_lora_rank")
    kw: Dict[str, Any] = dict(
        multi_latent_attention=True, q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(_required(cfg, "kv_lora_rank", mt)), qk_head_dim=int(_required(cfg, "qk_nope_head_dim", mt)),
        qk_pos_emb_head_dim=int(_required(cfg, "qk_rope_head_dim", mt)),
        v_head_dim=int(_required(cfg, "v_head_dim", mt)), num_query_groups=None, kv_channels=None)
    kw.update(_yarn_fields(cfg, mt))
    experts = int(cfg.get("n_routed_experts") or 0)
    if not experts:
        return kw
    topk = int(_required(cfg, "num_experts_per_tok", mt))
    n_group, topk_group = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if n_group > 1 and topk // topk_group != 2:
        raise UnsupportedCheckpointError(
            f"config.json num_experts_per_tok={topk} / topk_group={topk_group} != 2: HF ranks expert groups by "
            f"their top-2 scores, megatron by their top-(num_experts_per_tok / topk_group)")
    if topk > 1 and not cfg.get("norm_topk_prob", True):
        raise UnsupportedCheckpointError("config.json norm_topk_prob=false (deepseek_v3): megatron's sigmoid router "
                                         "always renormalises the top-k scores")
    if int(cfg.get("moe_layer_freq") or 1) != 1:
        raise UnsupportedCheckpointError(f"config.json moe_layer_freq={cfg.get('moe_layer_freq')}: transformers' "
                                         f"DeepseekV3 makes every layer from first_k_dense_replace on MoE (freq 1)")
    moe_ffn = int(_required(cfg, "moe_intermediate_size", mt))
    shared = int(cfg.get("n_shared_experts") or 0)
    kw.update(
        num_moe_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn,
        moe_shared_expert_intermediate_size=shared * moe_ffn or None,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_pre_softmax=False,
        moe_router_topk_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0) or 1.0),
        moe_router_num_groups=n_group if n_group > 1 else None,
        moe_router_group_topk=topk_group if n_group > 1 else None,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_layer_freq=1, first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
    )
    return kw


def _moe_pattern(cfg: Dict[str, Any], num_layers: int) -> List[int]:
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense_only = set(cfg.get("mlp_only_layers") or [])
    return [0 if (i in dense_only or (i + 1) % step) else 1 for i in range(num_layers)]


def model_config_from_hf(cfg: Dict[str, Any], padded_vocab_size: Optional[int] = None) -> ModelConfig:
    """``ModelConfig`` for a HF config dict. ``padded_vocab_size`` (>= vocab_size) sets the embedding
    rows of the Megatron model (pad so TP divides it; default: config.json's ``vocab_size``)."""
    mt = _model_type(cfg)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedCheckpointError(f"config.json hidden_act={act!r}: only 'silu' (SwiGLU) is supported")
    if cfg.get("mlp_bias"):
        raise UnsupportedCheckpointError("config.json mlp_bias=true: MLP biases are not supported")
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        raise UnsupportedCheckpointError("config.json use_sliding_window=true: sliding-window attention is not "
                                         "supported")
    if mt in ("llama", "qwen3", "qwen3_moe", "deepseek_v3") and cfg.get("attention_bias"):
        raise UnsupportedCheckpointError(f"config.json attention_bias=true ({mt}): q/k/v/o biases are not "
                                         f"supported (only Qwen2's q/k/v bias)")
    heads = int(_required(cfg, "num_attention_heads", mt))
    hidden = int(_required(cfg, "hidden_size", mt))
    layers = int(_required(cfg, "num_hidden_layers", mt))
    vocab = int(_required(cfg, "vocab_size", mt))
    if padded_vocab_size is not None and padded_vocab_size < vocab:
        raise UnsupportedCheckpointError(f"padded_vocab_size={padded_vocab_size} < config.json vocab_size={vocab}")
    head_dim = cfg.get("head_dim")
    kw: Dict[str, Any] = dict(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=int(cfg.get("num_key_value_heads") or heads),
        kv_channels=int(head_dim) if head_dim else None,
        ffn_hidden_size=int(_required(cfg, "intermediate_size", mt)),
        vocab_size=int(padded_vocab_size or vocab),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rotary_base=_rope_theta(cfg) if mt != "deepseek_v3" else 10000.0,
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        add_qkv_bias=mt in ("qwen2", "qwen2_moe"),
        qk_layernorm=mt in ("qwen3", "qwen3_moe"),
        untie_embeddings_and_output_weights=not bool(cfg.get("tie_word_embeddings", False)),
        init_method_std=float(cfg.get("initializer_range", 0.02)),
    )
    # newer transformers serialise num_experts as num_local_experts (attribute_map); hub files use num_experts
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
    if mt in ("qwen3_moe", "qwen2_moe") and experts > 0:
        aux = bool(cfg.get("output_router_logits", False))
        kw.update(
            num_moe_experts=experts,
            moe_router_topk=int(_required(cfg, "num_experts_per_tok", mt)),
            moe_ffn_hidden_size=int(_required(cfg, "moe_intermediate_size", mt)),
            moe_router_pre_softmax=not bool(cfg.get("norm_topk_prob", False)),  # HF default False
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="aux_loss" if aux else "none",
            moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0)) if aux else 0.0,
            moe_layer_freq=_moe_pattern(cfg, layers),
        )
        if mt == "qwen2_moe" and int(cfg.get("shared_expert_intermediate_size", 0) or 0) > 0:
            kw.update(moe_shared_expert_intermediate_size=int(cfg["shared_expert_intermediate_size"]),
                      moe_shared_expert_gate=True)
    if mt == "deepseek_v3":
        kw.update(_deepseek_fields(cfg, layers))
    mc = ModelConfig(**kw)
    try:
        mc.validate()
    except ModelConfigError as err:
        raise UnsupportedCheckpointError(f"config.json ({mt}): {err}") from err
    return mc


def infer_hf_model_type(model_cfg: ModelConfig) -> str:
    """HF model_type for a ModelConfig without a source checkpoint: qwen3(_moe) with q/k norm,
    qwen2_moe with a shared expert, qwen2 with QKV bias, deepseek_v3 with MLA, else llama / qwen3_moe."""
    if model_cfg.multi_latent_attention:
        return "deepseek_v3"
    if model_cfg.is_moe:
        return "qwen2_moe" if model_cfg.moe_shared_expert_intermediate_size else "qwen3_moe"
    if model_cfg.qk_layernorm:
        return "qwen3"
    return "qwen2" if model_cfg.add_qkv_bias else "llama"


def _deepseek_hf_config(mc: ModelConfig, vocab_size: Optional[int], torch_dtype: str) -> Dict[str, Any]:
    """config.json of an MLA (DeepSeek-V3 layout) ModelConfig; refuses what HF's DeepseekV3 cannot express."""
    pattern = mc.moe_layer_pattern()
    first_dense = pattern.index(1) if 1 in pattern else mc.num_layers
    if mc.is_moe and pattern != [0] * first_dense + [1] * (mc.num_layers - first_dense):
        raise UnsupportedCheckpointError(f"deepseek_v3: MoE layers must be every layer from first_k_dense_replace on "
                                         f"(pattern {pattern})")
    out: Dict[str, Any] = {
        "architectures": [ARCHITECTURES["deepseek_v3"]], "model_type": "deepseek_v3",
        "hidden_size": mc.hidden_size, "intermediate_size": mc.dense_ffn_hidden_size,
        "num_hidden_layers": mc.num_layers, "num_attention_heads": mc.num_attention_heads,
        "num_key_value_heads": mc.num_attention_heads, "vocab_size": int(vocab_size or mc.vocab_size),
        "max_position_embeddings": mc.max_position_embeddings, "rms_norm_eps": mc.norm_epsilon,
        "hidden_act": "silu", "tie_word_embeddings": not mc.untie_embeddings_and_output_weights,
        "initializer_range": mc.init_method_std, "attention_dropout": 0.0, "attention_bias": False,
        "torch_dtype": torch_dtype, "q_lora_rank": mc.q_lora_rank, "kv_lora_rank": mc.kv_lora_rank,
        "qk_nope_head_dim": mc.qk_head_dim, "qk_rope_head_dim": mc.qk_pos_emb_head_dim,
        "v_head_dim": mc.v_head_dim, "rope_interleave": True, "num_nextn_predict_layers": 0,
        "rope_theta": float(mc.rotary_base),
    }
    if mc.rope_type == "yarn":
        out["rope_scaling"] = {"rope_type": "yarn", "factor": mc.rotary_scaling_factor,
                               "original_max_position_embeddings": mc.original_max_position_embeddings,
                               "beta_fast": mc.beta_fast, "beta_slow": mc.beta_slow}
        if mc.mscale_all_dim:
            out["rope_scaling"].update(mscale=mc.mscale, mscale_all_dim=mc.mscale_all_dim)
        elif mc.mscale != 1.0:
            raise UnsupportedCheckpointError(f"deepseek_v3: yarn mscale={mc.mscale} without mscale_all_dim")
    if not mc.is_moe:
        out.update(n_routed_experts=None, first_k_dense_replace=mc.num_layers)
        return out
    if mc.moe_router_score_function != "sigmoid" or not mc.moe_router_enable_expert_bias:
        raise UnsupportedCheckpointError("deepseek_v3: the router must be sigmoid with the expert bias "
                                         "(moe_router_score_function='sigmoid', moe_router_enable_expert_bias=True)")
    shared = mc.moe_shared_expert_intermediate_size or 0
    fm = mc.moe_ffn_hidden_size or mc.dense_ffn_hidden_size
    if shared % fm or mc.moe_shared_expert_gate:
        raise UnsupportedCheckpointError(f"deepseek_v3: shared experts are n_shared_experts x moe_intermediate_size "
                                         f"without a gate (moe_shared_expert_intermediate_size={shared}, "
                                         f"moe_ffn_hidden_size={fm})")
    out.update(n_routed_experts=mc.num_moe_experts, num_experts_per_tok=mc.moe_router_topk,
               moe_intermediate_size=fm, n_shared_experts=shared // fm, first_k_dense_replace=first_dense,
               routed_scaling_factor=mc.moe_router_topk_scaling_factor or 1.0, norm_topk_prob=True,
               n_group=mc.moe_router_num_groups or 1, topk_group=mc.moe_router_group_topk or 1,
               scoring_func="sigmoid", topk_method="noaux_tc")
    return out


def megatron_to_hf_config(mc: ModelConfig, model_type: str, vocab_size: Optional[int] = None,
                          torch_dtype: str = "float32", extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """HF config.json dict for ``mc`` as ``model_type``; ``vocab_size`` = the HF (unpadded) vocab
    (default ``mc.vocab_size``). Raises ``UnsupportedCheckpointError`` if ``mc`` does not fit that model type."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedCheckpointError(f"model_type={model_type!r} is not supported (supported: "
                                         f"{SUPPORTED_MODEL_TYPES})")
    if model_type == "deepseek_v3" or mc.multi_latent_attention:
        if model_type != "deepseek_v3" or not mc.multi_latent_attention:
            raise UnsupportedCheckpointError(f"multi_latent_attention={mc.multi_latent_attention} does not fit "
                                             f"model_type={model_type!r} (MLA is deepseek_v3)")
        out = _deepseek_hf_config(mc, vocab_size, torch_dtype)
        out.update(extra or {})
        return out
    want_bias = model_type in ("qwen2", "qwen2_moe")
    if mc.add_qkv_bias != want_bias:
        raise UnsupportedCheckpointError(f"add_qkv_bias={mc.add_qkv_bias} does not fit model_type={model_type!r}")
    want_qk = model_type in ("qwen3", "qwen3_moe")
    if mc.qk_layernorm != want_qk:
        raise UnsupportedCheckpointError(f"qk_layernorm={mc.qk_layernorm} does not fit model_type={model_type!r}")
    moe_type = model_type.endswith("_moe")
    if mc.is_moe != moe_type:
        raise UnsupportedCheckpointError(f"num_moe_experts={mc.num_moe_experts} does not fit model_type={model_type!r}")
    out: Dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "hidden_size": mc.hidden_size,
        "intermediate_size": mc.dense_ffn_hidden_size,
        "num_hidden_layers": mc.num_layers,
        "num_attention_heads": mc.num_attention_heads,
        "num_key_value_heads": mc.query_groups,
        "vocab_size": int(vocab_size or mc.vocab_size),
        "max_position_embeddings": mc.max_position_embeddings,
        "rope_theta": float(mc.rotary_base),
        "rms_norm_eps": mc.norm_epsilon,
        "hidden_act": "silu",
        "tie_word_embeddings": not mc.untie_embeddings_and_output_weights,
        "initializer_range": mc.init_method_std,
        "attention_dropout": 0.0,
        "torch_dtype": torch_dtype,
    }
    if mc.kv_channels is not None or want_qk:  # Qwen3 configs default head_dim to 128: always explicit
        out["head_dim"] = mc.head_dim
    if model_type in ("llama", "qwen3", "qwen3_moe"):
        out["attention_bias"] = False
    if model_type == "llama":
        out["mlp_bias"] = False
    if moe_type:
        pattern = mc.moe_layer_pattern()
        out.update(
            num_experts=mc.num_moe_experts, num_experts_per_tok=mc.moe_router_topk,
            moe_intermediate_size=mc.moe_ffn_hidden_size or mc.dense_ffn_hidden_size,
            norm_topk_prob=not mc.moe_router_pre_softmax, decoder_sparse_step=1,
            mlp_only_layers=[i for i, p in enumerate(pattern) if not p],
            output_router_logits=mc.moe_aux_loss_coeff > 0, router_aux_loss_coef=mc.moe_aux_loss_coeff,
        )
        if mc.moe_router_score_function != "softmax" or mc.moe_router_topk_scaling_factor:
            raise UnsupportedCheckpointError(f"{model_type}: router must be softmax without topk scaling")
        if model_type == "qwen2_moe":
            if not mc.moe_shared_expert_intermediate_size or not mc.moe_shared_expert_gate:
                raise UnsupportedCheckpointError("qwen2_moe needs a gated shared expert "
                                                 "(moe_shared_expert_intermediate_size, moe_shared_expert_gate=True)")
            out["shared_expert_intermediate_size"] = mc.moe_shared_expert_intermediate_size
        elif mc.moe_shared_expert_intermediate_size:
            raise UnsupportedCheckpointError("qwen3_moe has no shared expert "
                                             "(moe_shared_expert_intermediate_size is set)")
    out.update(extra or {})
    return out
