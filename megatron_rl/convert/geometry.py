"""Tensor geometry of a HF causal-LM checkpoint: the shapes that decide how tensors are named, split and
concatenated (layers, heads, KV groups, head dim, FFN sizes, experts, biases, norms, tied embeddings).

It is a view of the one reading of ``config.json`` (``hf_config.model_config_from_hf``) plus the HF
architecture and the unpadded vocab — config.json is never parsed here. Converted checkpoint directories
store it (``to_dict`` / ``from_dict``). Independent of megatron.

Usage::

    geom = HFGeometry.from_hf_config(json.load(open("hf_dir/config.json")))
    geom.is_moe_layer(3), geom.num_heads_per_group

Supported ``architectures``: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, DeepseekV3ForCausalLM (multi-latent attention, shared experts,
router expert bias; the checkpoint's MTP layers are recorded in ``num_mtp_layers`` and dropped).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from megatron_rl.convert.hf_config import ARCHITECTURES, hf_architecture, hf_mtp_layers, model_config_from_hf
from megatron_rl.models.config import ModelConfig

#: Supported HF ``architectures[0]`` -> family (HF model_type).
SUPPORTED_ARCHITECTURES = {arch: model_type for model_type, arch in ARCHITECTURES.items()}


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
    moe_router_expert_bias: bool = False
    """The router has a per-expert selection bias (DeepSeek-V3 ``gate.e_score_correction_bias``)."""
    multi_latent_attention: bool = False
    """Multi-latent attention (DeepSeek-V3): the q_lora / kv_lora / head-dim fields below apply."""
    q_lora_rank: Optional[int] = None
    """MLA query down-projection rank (None: full-rank ``q_proj``)."""
    kv_lora_rank: Optional[int] = None
    """MLA key/value latent rank."""
    qk_head_dim: Optional[int] = None
    """MLA per-head query/key dim without RoPE (``qk_nope_head_dim``)."""
    qk_pos_emb_head_dim: Optional[int] = None
    """MLA per-head RoPE dim (``qk_rope_head_dim``)."""
    v_head_dim: Optional[int] = None
    """MLA per-head value dim."""
    num_mtp_layers: int = 0
    """Multi-token-prediction layers stored after the decoder layers in the checkpoint (dropped on import;
    not a tensor of the model)."""

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
    def from_model_config(cls, mc: ModelConfig, architecture: str, vocab_size: int) -> "HFGeometry":
        """The tensor geometry of ``mc`` saved as HF ``architecture`` with ``vocab_size`` (unpadded) rows."""
        family = SUPPORTED_ARCHITECTURES[architecture]
        moe: Dict[str, Any] = {}
        if mc.is_moe:
            moe = dict(num_moe_experts=mc.num_moe_experts,
                       moe_ffn_hidden_size=mc.moe_ffn_hidden_size or mc.dense_ffn_hidden_size,
                       moe_router_topk=mc.moe_router_topk, moe_layers=[bool(x) for x in mc.moe_layer_pattern()],
                       moe_shared_expert_intermediate_size=mc.moe_shared_expert_intermediate_size,
                       moe_shared_expert_gate=mc.moe_shared_expert_gate,
                       moe_router_expert_bias=mc.moe_router_enable_expert_bias)
        if mc.multi_latent_attention:
            moe.update(multi_latent_attention=True, q_lora_rank=mc.q_lora_rank, kv_lora_rank=mc.kv_lora_rank,
                       qk_head_dim=mc.qk_head_dim, qk_pos_emb_head_dim=mc.qk_pos_emb_head_dim,
                       v_head_dim=mc.v_head_dim)
        return cls(architecture=architecture, family=family, num_layers=mc.num_layers, hidden_size=mc.hidden_size,
                   num_attention_heads=mc.num_attention_heads, num_query_groups=mc.query_groups,
                   kv_channels=mc.head_dim, ffn_hidden_size=mc.dense_ffn_hidden_size, vocab_size=int(vocab_size),
                   tie_word_embeddings=not mc.untie_embeddings_and_output_weights, add_qkv_bias=mc.add_qkv_bias,
                   qk_layernorm=mc.qk_layernorm, **moe)

    @classmethod
    def from_hf_config(cls, cfg: Dict[str, Any]) -> "HFGeometry":
        """The geometry of a HF ``config.json`` dict, derived from its one reading
        (:func:`megatron_rl.convert.hf_config.model_config_from_hf`); unsupported options raise there."""
        geom = cls.from_model_config(model_config_from_hf(cfg), hf_architecture(cfg), cfg["vocab_size"])
        return dataclasses.replace(geom, num_mtp_layers=hf_mtp_layers(cfg))
