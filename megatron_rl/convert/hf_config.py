"""HF ``config.json`` <-> ``ModelConfig``: the one reading of a HF config in the project.

Llama, Qwen2, Qwen3, Qwen3-MoE and Qwen2-MoE. Only what changes the forward pass or the tensor layout is
mapped; anything the Megatron model here cannot reproduce is refused with ``UnsupportedCheckpointError``
naming the config.json key (unsupported ``architectures`` / ``model_type``, RoPE scaling, sliding-window
attention, o_proj / MLP biases, activations other than SiLU). The converter's tensor geometry
(``HFGeometry``) is derived from this reading, never from config.json again.

Router equivalence (verified against HF's routing code): HF ``norm_topk_prob=True`` (softmax over all
experts, top-k, renormalise) == megatron softmax over the top-k logits (``moe_router_pre_softmax=False``);
``norm_topk_prob=False`` == ``moe_router_pre_softmax=True``. HF computes the load-balancing loss only when
``output_router_logits`` is true, so the aux loss is mapped only then (megatron's aux-loss formula is
its own; coefficients carry over, values are not bit-identical to HF's).

Usage::

    mcfg = model_config_from_hf(json.load(open("hf/config.json")), padded_vocab_size=None)
    arch = hf_architecture(cfg)                                  # e.g. "Qwen2ForCausalLM"
    cfg_json = megatron_to_hf_config(mcfg, model_type="qwen2", vocab_size=151936)
    cfg_json = megatron_to_hf_config(mcfg, infer_hf_model_type(mcfg))   # no source checkpoint
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from megatron_rl.convert.checks import UnsupportedCheckpointError
from megatron_rl.models.config import ModelConfig, ModelConfigError

__all__ = ["SUPPORTED_MODEL_TYPES", "ARCHITECTURES", "model_config_from_hf", "hf_architecture",
           "megatron_to_hf_config", "infer_hf_model_type"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe")
#: HF ``architectures[0]`` of each supported ``model_type``.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


def _model_type(cfg: Dict[str, Any]) -> str:
    """The supported model_type of ``cfg``; ``architectures`` (when given) must be one supported class that
    agrees with ``model_type`` (a config without one of them takes it from the other)."""
    archs = cfg.get("architectures") or []
    by_arch = {a: t for t, a in ARCHITECTURES.items()}
    if archs and (len(archs) != 1 or archs[0] not in by_arch):
        raise UnsupportedCheckpointError(f"config.json: unsupported architectures={archs!r}; supported: "
                                         f"{sorted(by_arch)}")
    mt = cfg.get("model_type") or (by_arch[archs[0]] if archs else None)
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
    if mt in ("llama", "qwen3", "qwen3_moe") and cfg.get("attention_bias"):
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
        rotary_base=_rope_theta(cfg),
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
    mc = ModelConfig(**kw)
    try:
        mc.validate()
    except ModelConfigError as err:
        raise UnsupportedCheckpointError(f"config.json ({mt}): {err}") from err
    return mc


def infer_hf_model_type(model_cfg: ModelConfig) -> str:
    """HF model_type for a ModelConfig without a source checkpoint: qwen3(_moe) with q/k norm,
    qwen2_moe with a shared expert, qwen2 with QKV bias, else llama / qwen3_moe."""
    if model_cfg.is_moe:
        return "qwen2_moe" if model_cfg.moe_shared_expert_intermediate_size else "qwen3_moe"
    if model_cfg.qk_layernorm:
        return "qwen3"
    return "qwen2" if model_cfg.add_qkv_bias else "llama"


def megatron_to_hf_config(mc: ModelConfig, model_type: str, vocab_size: Optional[int] = None,
                          torch_dtype: str = "float32", extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """HF config.json dict for ``mc`` as ``model_type``; ``vocab_size`` = the HF (unpadded) vocab
    (default ``mc.vocab_size``). Raises ``UnsupportedCheckpointError`` if ``mc`` does not fit that model type."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedCheckpointError(f"model_type={model_type!r} is not supported (supported: "
                                         f"{SUPPORTED_MODEL_TYPES})")
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
