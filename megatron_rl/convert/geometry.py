"""Tensor geometry of a HF causal-LM checkpoint, read from its ``config.json``.

The converter only needs the shapes that decide how tensors are named, split and concatenated
(layers, heads, KV groups, head dim, FFN sizes, experts, biases, norms, tied embeddings). This module
extracts them from a HF config dict, validates them, and says clearly when an architecture or an
option is not supported. It is independent of megatron and of the model builder.

Usage::

    geom = HFGeometry.from_hf_config(json.load(open("hf_dir/config.json")))
    geom.is_moe_layer(3), geom.num_heads_per_group

Supported ``architectures``: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
Qwen2MoeForCausalLM, Qwen3MoeForCausalLM.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


class UnsupportedCheckpointError(ValueError):
    """The HF checkpoint uses an architecture or an option the converter does not handle."""


@dataclass(frozen=True)
class HFGeometry:
    """Shapes and options of a decoder-only HF checkpoint that decide the Megatron tensor layout."""

    architecture: str
    """HF ``architectures[0]``, e.g. ``Qwen2ForCausalLM``."""
    family: str
    """Short family name: llama, qwen2, qwen3, qwen2_moe, qwen3_moe."""
    num_layers: int
    """``num_hidden_layers``."""
    hidden_size: int
    """``hidden_size``."""
    num_attention_heads: int
    """Number of query heads."""
    num_query_groups: int
    """Number of key/value heads (``num_key_value_heads``); Megatron's ``num_query_groups``."""
    kv_channels: int
    """Head dimension (``head_dim``, default hidden_size / num_attention_heads)."""
    ffn_hidden_size: int
    """``intermediate_size``: FFN width of dense layers."""
    vocab_size: int
    """``vocab_size`` (rows of the embedding / lm_head in the HF checkpoint)."""
    tie_word_embeddings: bool
    """The output layer reuses the input embedding (no ``lm_head.weight`` / ``output_layer.weight``)."""
    add_qkv_bias: bool
    """q/k/v projections have biases (Qwen2 always; Megatron ``add_qkv_bias``)."""
    qk_layernorm: bool
    """Per-head RMSNorm on queries and keys (Qwen3 ``q_norm``/``k_norm``)."""
    num_moe_experts: Optional[int] = None
    """Routed experts per MoE layer (None for dense models)."""
    moe_ffn_hidden_size: Optional[int] = None
    """FFN width of one routed expert (``moe_intermediate_size``)."""
    moe_router_topk: Optional[int] = None
    """Experts per token (``num_experts_per_tok``)."""
    moe_layers: List[bool] = field(default_factory=list)
    """Per layer: True when the layer's MLP is a MoE block (else a dense MLP of ffn_hidden_size)."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """FFN width of the shared expert (Qwen2-MoE), None when there is none."""
    moe_shared_expert_gate: bool = False
    """The shared expert output is scaled by sigmoid(gate(x)) (Qwen2-MoE ``shared_expert_gate``)."""

    @property
    def num_heads_per_group(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_attention_heads // self.num_query_groups

    @property
    def is_moe(self) -> bool:
        """True when at least one layer is a MoE layer."""
        return any(self.moe_layers)

    def is_moe_layer(self, layer: int) -> bool:
        """True when global layer ``layer`` has a MoE MLP."""
        return bool(self.moe_layers) and self.moe_layers[layer]

    def to_dict(self) -> Dict[str, Any]:
        """JSON-serialisable form (inverse of :meth:`from_dict`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "HFGeometry":
        """Rebuild from :meth:`to_dict` output."""
        return cls(**d)

    @classmethod
    def from_hf_config(cls, cfg: Dict[str, Any]) -> "HFGeometry":
        """Read the geometry from a HF ``config.json`` dict; raise a clear error on anything unsupported."""
        archs = cfg.get("architectures") or []
        if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedCheckpointError(
                f"config.json: unsupported architectures={archs!r}; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES)}")
        arch = archs[0]
        family = SUPPORTED_ARCHITECTURES[arch]

        def req(key):
            if key not in cfg:
                raise UnsupportedCheckpointError(f"config.json ({arch}): missing required key {key!r}")
            return cfg[key]

        hidden = int(req("hidden_size"))
        heads = int(req("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = cfg.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise UnsupportedCheckpointError(
                    f"config.json: hidden_size={hidden} not divisible by num_attention_heads={heads} "
                    f"and no head_dim given")
            head_dim = hidden // heads
        if heads % kv_heads:
            raise UnsupportedCheckpointError(
                f"config.json: num_attention_heads={heads} not divisible by num_key_value_heads={kv_heads}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedCheckpointError(f"config.json: hidden_act={act!r} unsupported (only 'silu' / SwiGLU)")

        attention_bias = bool(cfg.get("attention_bias", False))
        if family == "llama":
            if attention_bias:
                raise UnsupportedCheckpointError(
                    "config.json (LlamaForCausalLM): attention_bias=True (bias on o_proj) is unsupported")
            if cfg.get("mlp_bias", False):
                raise UnsupportedCheckpointError("config.json (LlamaForCausalLM): mlp_bias=True is unsupported")
            qkv_bias, qk_norm = False, False
        elif family in ("qwen2", "qwen2_moe"):
            qkv_bias, qk_norm = True, False
        else:  # qwen3, qwen3_moe
            if attention_bias:
                raise UnsupportedCheckpointError(
                    f"config.json ({arch}): attention_bias=True (bias on o_proj) is unsupported")
            qkv_bias, qk_norm = False, True

        num_layers = int(req("num_hidden_layers"))
        moe = {}
        if family in ("qwen2_moe", "qwen3_moe"):
            n_exp = cfg.get("num_experts", cfg.get("num_local_experts"))
            if n_exp is None:
                raise UnsupportedCheckpointError(f"config.json ({arch}): missing 'num_experts'")
            n_exp = int(n_exp)
            step = int(cfg.get("decoder_sparse_step", 1) or 1)
            dense_only = set(cfg.get("mlp_only_layers") or [])
            layers = [n_exp > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(num_layers)]
            moe = dict(num_moe_experts=n_exp, moe_ffn_hidden_size=int(req("moe_intermediate_size")),
                       moe_router_topk=int(req("num_experts_per_tok")), moe_layers=layers)
            if family == "qwen2_moe":
                shared = int(cfg.get("shared_expert_intermediate_size", 0) or 0)
                moe["moe_shared_expert_intermediate_size"] = shared or None
                moe["moe_shared_expert_gate"] = bool(shared)
        return cls(
            architecture=arch, family=family, num_layers=num_layers, hidden_size=hidden,
            num_attention_heads=heads, num_query_groups=kv_heads, kv_channels=int(head_dim),
            ffn_hidden_size=int(req("intermediate_size")), vocab_size=int(req("vocab_size")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            add_qkv_bias=qkv_bias, qk_layernorm=qk_norm, **moe)
