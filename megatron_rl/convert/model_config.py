"""The project's ``ModelConfig`` for a checkpoint, so converted shards can be built and loaded:
``build_gpt_model(model_config_from_hf(cfg, padded_vocab_size=...), parallel)``.

The HF config.json -> ModelConfig mapping itself lives in ``megatron_rl.models.hf_config`` (one mapping
for the whole project); this wrapper turns its errors into the converter's
``UnsupportedCheckpointError`` and cross-checks the result against the converter's own tensor
geometry (``HFGeometry``), so a disagreement between the two readings of config.json fails loudly
instead of producing a model the shards do not fit.

Usage::

    mcfg = model_config_from_hf(json.load(open("hf/config.json")), padded_vocab_size=meta["padded_vocab_size"])
    mcfg = model_config_for_checkpoint("hf_or_converted_dir", tensor_model_parallel_size=2)
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from megatron_rl.convert.geometry import HFGeometry, UnsupportedCheckpointError


def _geometry_mismatches(g: HFGeometry, mc) -> list:
    pairs = [("num_layers", g.num_layers, mc.num_layers), ("hidden_size", g.hidden_size, mc.hidden_size),
             ("num_attention_heads", g.num_attention_heads, mc.num_attention_heads),
             ("num_query_groups", g.num_query_groups, mc.query_groups), ("kv_channels", g.kv_channels, mc.head_dim),
             ("ffn_hidden_size", g.ffn_hidden_size, mc.dense_ffn_hidden_size),
             ("add_qkv_bias", g.add_qkv_bias, mc.add_qkv_bias), ("qk_layernorm", g.qk_layernorm, mc.qk_layernorm),
             ("tied embeddings", g.tie_word_embeddings, not mc.untie_embeddings_and_output_weights),
             ("num_moe_experts", g.num_moe_experts if g.is_moe else None, mc.num_moe_experts)]
    if g.is_moe:
        pairs += [("moe_ffn_hidden_size", g.moe_ffn_hidden_size, mc.moe_ffn_hidden_size),
                  ("moe_router_topk", g.moe_router_topk, mc.moe_router_topk),
                  ("moe layers", [int(x) for x in g.moe_layers], mc.moe_layer_pattern()),
                  ("shared expert size", g.moe_shared_expert_intermediate_size, mc.moe_shared_expert_intermediate_size),
                  ("shared expert gate", g.moe_shared_expert_gate, mc.moe_shared_expert_gate)]
    return [f"{n}: tensor geometry {a!r} vs ModelConfig {b!r}" for n, a, b in pairs if a != b]


def model_config_from_hf(cfg: Dict[str, Any], padded_vocab_size: Optional[int] = None):
    """``ModelConfig`` for the HF config dict ``cfg``; ``padded_vocab_size`` (>= vocab_size) sets the
    embedding rows the Megatron model is built with (the converter's padded vocab)."""
    from megatron_rl.models.hf_config import HFConfigError
    from megatron_rl.models.hf_config import model_config_from_hf as _models_mapping

    g = HFGeometry.from_hf_config(cfg)
    try:
        mc = _models_mapping(cfg, padded_vocab_size=padded_vocab_size)
    except HFConfigError as e:
        raise UnsupportedCheckpointError(str(e)) from e
    bad = _geometry_mismatches(g, mc)
    if bad:
        raise UnsupportedCheckpointError(f"config.json ({g.architecture}) is read differently by the converter and "
                                         f"megatron_rl.models.hf_config: " + "; ".join(bad))
    return mc


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
