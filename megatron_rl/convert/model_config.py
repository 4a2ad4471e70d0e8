"""The project's ``ModelConfig`` (megatron_rl.models) for a HF ``config.json``, so a converted checkpoint
can be built and loaded: ``build_gpt_model(model_config_from_hf(cfg, padded_vocab_size=...), parallel)``.

Only what changes the forward pass is mapped: shapes, RoPE theta, RMSNorm epsilon, QKV bias, q/k norm,
tied embeddings, experts / top-k / router normalisation (HF ``norm_topk_prob=True`` == megatron softmax
over the selected top-k, ``moe_router_pre_softmax=False``), MoE layer pattern, shared expert + gate.
RoPE scaling (``rope_type`` other than ``default``) is refused with a clear error.

Usage::

    mcfg = model_config_from_hf(json.load(open("hf/config.json")), padded_vocab_size=meta["padded_vocab_size"])
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from megatron_rl.convert.geometry import HFGeometry, UnsupportedCheckpointError


def _rope_theta(cfg: Dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise UnsupportedCheckpointError(f"config.json: rope_type={rope_type!r} (RoPE scaling) is unsupported; "
                                         "only default RoPE")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def model_config_from_hf(cfg: Dict[str, Any], padded_vocab_size: Optional[int] = None):
    """``ModelConfig`` for the HF config dict ``cfg``; ``padded_vocab_size`` (>= vocab_size) sets the
    embedding rows the Megatron model is built with (the converter's padded vocab)."""
    from megatron_rl.models.config import ModelConfig

    g = HFGeometry.from_hf_config(cfg)
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        raise UnsupportedCheckpointError("config.json: use_sliding_window=true (sliding-window attention) is "
                                         "unsupported by the Megatron model")
    vocab = padded_vocab_size or g.vocab_size
    if vocab < g.vocab_size:
        raise ValueError(f"padded_vocab_size={vocab} is smaller than config.json vocab_size={g.vocab_size}")
    kw: Dict[str, Any] = dict(
        num_layers=g.num_layers, hidden_size=g.hidden_size, num_attention_heads=g.num_attention_heads,
        vocab_size=vocab, ffn_hidden_size=g.ffn_hidden_size, num_query_groups=g.num_query_groups,
        kv_channels=g.kv_channels, max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rotary_base=_rope_theta(cfg), norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        add_qkv_bias=g.add_qkv_bias, qk_layernorm=g.qk_layernorm,
        untie_embeddings_and_output_weights=not g.tie_word_embeddings,
    )
    if g.is_moe:
        kw.update(
            num_moe_experts=g.num_moe_experts, moe_router_topk=g.moe_router_topk,
            moe_ffn_hidden_size=g.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=g.moe_shared_expert_intermediate_size,
            moe_shared_expert_gate=g.moe_shared_expert_gate,
            moe_router_pre_softmax=not bool(cfg.get("norm_topk_prob", False)),
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_layer_freq=[int(x) for x in g.moe_layers],
        )
    return ModelConfig(**kw)


def model_config_for_checkpoint(ckpt_dir: str, tensor_model_parallel_size: int = 1,
                                make_vocab_size_divisible_by: int = 1):
    """``ModelConfig`` to build for a HF directory or a converted directory at this TP size: the vocab is
    padded like the converter pads it (multiple of make_vocab_size_divisible_by x TP)."""
    import os

    from megatron_rl.convert import storage
    from megatron_rl.convert.sharding import ShardLayout

    if os.path.isfile(os.path.join(ckpt_dir, storage.METADATA_FILE)):
        ckpt_dir = os.path.join(ckpt_dir, storage.ASSETS_DIR)
    cfg = storage.read_hf_config(ckpt_dir)
    lay = ShardLayout(tensor_model_parallel_size=tensor_model_parallel_size,
                      make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    return model_config_from_hf(cfg, padded_vocab_size=lay.padded_vocab(int(cfg["vocab_size"])))
