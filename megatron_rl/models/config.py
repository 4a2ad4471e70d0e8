"""Typed model shape (the YAML ``model:`` section) for Llama/Qwen2-style dense, Qwen3-MoE and the
DeepSeek-V3 family (multi-latent attention, shared experts, sigmoid group-limited routing), with
megatron-core's field names.

Usage::

    cfg = model_config_from_dict(yaml_dict["model"])     # unknown keys rejected by name
    cfg.validate()                                       # shape errors, before building anything

Fixed architecture choices (what this project supports): RMSNorm, SwiGLU MLP (gated linear unit +
SiLU), RoPE, GQA or multi-latent attention (MLA), no linear biases except the optional QKV bias, causal
attention.

DeepSeek-V3 decisions (documented in the README too):
  * ``e_score_correction_bias`` (megatron ``expert_bias``, aux-loss-free balancing) is loaded, used for
    expert *selection* exactly as HF does, exported unchanged and NOT trained or updated in RL:
    ``moe_router_bias_update_rate`` defaults to 0 here (megatron's default 1e-3 would move the bias every
    optimizer step from the RL batch's token counts, so the trained policy's routing would drift away from
    the rollout engine's for reasons unrelated to the policy gradient). Set it > 0 to re-enable updates.
  * Multi-token-prediction (MTP) layers of a checkpoint are dropped on import (their tensors are checked
    to be exactly the ``num_nextn_predict_layers`` extra layers) and never exported: RL trains the trunk
    only; a stale MTP head would not match the updated trunk anyway.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional, Union

__all__ = ["ModelConfig", "ModelConfigError", "model_config_from_dict"]


class ModelConfigError(ValueError):
    """An invalid model shape; the message lists each problem with the keys involved."""


@dataclass
class ModelConfig:
    """GPT model shape and architecture options (the YAML ``model:`` section)."""

    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width."""
    num_attention_heads: int
    """Query heads."""
    vocab_size: int
    """Vocabulary size (rows of the embedding / output layer); must be divisible by TP."""
    ffn_hidden_size: Optional[int] = None
    """Dense MLP intermediate size (default 4 x hidden_size)."""
    num_query_groups: Optional[int] = None
    """KV heads for GQA (None = num_attention_heads, i.e. MHA)."""
    kv_channels: Optional[int] = None
    """Head dim (None = hidden_size / num_attention_heads; Qwen3 sets it explicitly)."""
    max_position_embeddings: int = 4096
    """Longest sequence the RoPE tables are built for."""
    rotary_base: float = 10000.0
    """RoPE theta."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon."""
    add_qkv_bias: bool = False
    """Bias on the QKV projection (Qwen2)."""
    qk_layernorm: bool = False
    """RMSNorm on per-head queries and keys (Qwen3)."""
    untie_embeddings_and_output_weights: bool = False
    """True = separate output layer (Llama, big Qwen); False = tied to the input embedding."""
    init_method_std: float = 0.02
    """Std of the normal weight init (random init only; checkpoints overwrite it)."""
    # ---- multi-latent attention (DeepSeek-V2/V3, Kimi-K2)
    multi_latent_attention: bool = False
    """Multi-latent attention (megatron ``MLASelfAttention``) instead of GQA; needs kv_lora_rank,
    qk_head_dim, qk_pos_emb_head_dim, v_head_dim. num_query_groups / kv_channels are then unused."""
    q_lora_rank: Optional[int] = None
    """Rank of the query down-projection (HF q_lora_rank); None = a full-rank query projection."""
    kv_lora_rank: Optional[int] = None
    """Rank of the joint key/value latent (HF kv_lora_rank)."""
    qk_head_dim: Optional[int] = None
    """Per-head query/key dim without RoPE (HF qk_nope_head_dim)."""
    qk_pos_emb_head_dim: Optional[int] = None
    """Per-head decoupled RoPE dim of queries and the shared RoPE key (HF qk_rope_head_dim)."""
    v_head_dim: Optional[int] = None
    """Per-head value dim (HF v_head_dim)."""
    rope_type: str = "rope"
    """'rope' (plain RoPE) or 'yarn' (YaRN scaling; MLA only, as megatron implements it)."""
    rotary_scaling_factor: float = 1.0
    """YaRN: context extension factor (HF rope_scaling.factor)."""
    original_max_position_embeddings: Optional[int] = None
    """YaRN: pre-extension context length (HF rope_scaling.original_max_position_embeddings)."""
    beta_fast: float = 32.0
    """YaRN: high-frequency ramp boundary (HF beta_fast)."""
    beta_slow: float = 1.0
    """YaRN: low-frequency ramp boundary (HF beta_slow)."""
    mscale: float = 1.0
    """YaRN: attention-magnitude scale numerator (HF mscale)."""
    mscale_all_dim: float = 0.0
    """YaRN: attention-magnitude scale denominator, also squared into the softmax scale (HF mscale_all_dim;
    0 = none)."""
    # ---- MoE
    num_moe_experts: Optional[int] = None
    """Routed experts per MoE layer (None = dense model)."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_ffn_hidden_size: Optional[int] = None
    """Intermediate size of each routed expert (default ffn_hidden_size)."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Total intermediate size of the shared expert(s) (DeepSeek / Qwen2-MoE); None = no shared expert."""
    moe_shared_expert_gate: bool = False
    """Sigmoid gate on the shared expert output (Qwen2-MoE)."""
    moe_router_load_balancing_type: str = "aux_loss"
    """'aux_loss', 'seq_aux_loss', 'sinkhorn' or 'none'."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing loss weight (0 = off)."""
    moe_router_score_function: str = "softmax"
    """'softmax' (Qwen/Mixtral) or 'sigmoid' (DeepSeek-V3)."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before top-k (True = HF norm_topk_prob=False); False = softmax over the
    selected top-k scores (top-k probs renormalised, HF norm_topk_prob=True)."""
    moe_router_topk_scaling_factor: Optional[float] = None
    """Multiply routing weights by this (DeepSeek routed_scaling_factor)."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free expert bias (DeepSeek-V3 e_score_correction_bias; sigmoid score function only): added
    to the scores for expert selection only."""
    moe_router_bias_update_rate: float = 0.0
    """Per-step update of the expert bias from token counts (megatron's aux-loss-free balancing). 0 = the
    bias stays as loaded (the RL default, see the module docstring)."""
    moe_router_num_groups: Optional[int] = None
    """Group-limited routing: experts form this many equal groups (HF n_group); None = no groups."""
    moe_router_group_topk: Optional[int] = None
    """Group-limited routing: groups kept per token, ranked by the sum of their top-(topk/group_topk)
    scores (HF topk_group)."""
    moe_grouped_gemm: bool = False
    """Grouped GEMM experts (TEGroupedMLP on GPU); False = SequentialMLP (works on CPU)."""
    moe_token_dispatcher_type: str = "alltoall"
    """'alltoall' or 'allgather'. alltoall is needed for variable sequence lengths (even dense)."""
    moe_layer_freq: Union[int, List[int]] = 1
    """Which layers are MoE: int N = every N-th layer (from layer 0), or a 0/1 list per layer."""
    first_k_dense_replace: int = 0
    """DeepSeek style: the first k layers are dense (combined with moe_layer_freq)."""
    extra: dict = field(default_factory=dict)
    """Extra TransformerConfig overrides (advanced; passed through verbatim)."""

    # -------------------------------------------------------------------- derived
    @property
    def is_moe(self) -> bool:
        """True when the model has routed experts."""
        return bool(self.num_moe_experts)

    @property
    def head_dim(self) -> int:
        """Per-head dimension (kv_channels or hidden / heads)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Number of KV heads."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def dense_ffn_hidden_size(self) -> int:
        """Dense MLP intermediate size."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def q_head_dim(self) -> int:
        """MLA: per-head query/key width (qk_head_dim + qk_pos_emb_head_dim)."""
        return (self.qk_head_dim or 0) + (self.qk_pos_emb_head_dim or 0)

    def moe_layer_pattern(self) -> List[int]:
        """0/1 per layer (1 = MoE), combining moe_layer_freq and first_k_dense_replace."""
        if not self.is_moe:
            return [0] * self.num_layers
        if isinstance(self.moe_layer_freq, int):
            pattern = [1 if i % self.moe_layer_freq == 0 else 0 for i in range(self.num_layers)]
        else:
            pattern = [int(x) for x in self.moe_layer_freq]
        for i in range(min(self.first_k_dense_replace, self.num_layers)):
            pattern[i] = 0
        return pattern

    def validate(self) -> None:
        """Raise ``ModelConfigError`` listing every inconsistent field."""
        v = []
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size"):
            val = getattr(self, name)
            if not isinstance(val, int) or val < 1:
                v.append(f"{name}={val!r} must be an integer >= 1")
        if v:
            raise ModelConfigError("invalid model config:\n  - " + "\n  - ".join(v))
        if self.multi_latent_attention:
            for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
                val = getattr(self, name)
                if not isinstance(val, int) or val < 1:
                    v.append(f"multi_latent_attention=True needs {name} (an integer >= 1), got {val!r}")
            if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 1):
                v.append(f"q_lora_rank={self.q_lora_rank!r} must be None or an integer >= 1")
            if self.qk_pos_emb_head_dim and self.qk_pos_emb_head_dim % 2:
                v.append(f"qk_pos_emb_head_dim={self.qk_pos_emb_head_dim} must be even (RoPE rotates pairs)")
            if self.add_qkv_bias or self.qk_layernorm:
                v.append("multi_latent_attention=True excludes add_qkv_bias / qk_layernorm (MLA has its own "
                         "q / kv latent norms)")
        if self.rope_type not in ("rope", "yarn"):
            v.append(f"rope_type={self.rope_type!r} must be rope|yarn")
        elif self.rope_type == "yarn":
            if not self.multi_latent_attention:
                v.append("rope_type='yarn' needs multi_latent_attention=True (megatron applies YaRN in MLA only)")
            if not self.original_max_position_embeddings or self.rotary_scaling_factor <= 0:
                v.append("rope_type='yarn' needs original_max_position_embeddings and rotary_scaling_factor > 0")
        if self.num_attention_heads % self.query_groups:
            v.append(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                     f"num_query_groups={self.query_groups}")
        if not self.multi_latent_attention and self.kv_channels is None \
                and self.hidden_size % self.num_attention_heads:
            v.append(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                     f"{self.num_attention_heads}; set kv_channels")
        if self.is_moe:
            if self.moe_router_topk < 1 or self.moe_router_topk > self.num_moe_experts:
                v.append(f"moe_router_topk={self.moe_router_topk} must be in [1, num_moe_experts="
                         f"{self.num_moe_experts}]")
            if self.moe_router_score_function not in ("softmax", "sigmoid"):
                v.append(f"moe_router_score_function={self.moe_router_score_function!r} must be softmax|sigmoid")
            if self.moe_token_dispatcher_type not in ("alltoall", "allgather"):
                v.append(f"moe_token_dispatcher_type={self.moe_token_dispatcher_type!r} must be "
                         f"alltoall|allgather (flex needs DeepEP on GPU)")
            if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
                v.append("moe_router_enable_expert_bias=True needs moe_router_score_function='sigmoid'")
            if self.moe_router_bias_update_rate < 0:
                v.append(f"moe_router_bias_update_rate={self.moe_router_bias_update_rate} must be >= 0")
            ng, gk = self.moe_router_num_groups, self.moe_router_group_topk
            if (ng is None) != (gk is None):
                v.append("moe_router_num_groups and moe_router_group_topk must be set together")
            elif ng is not None:
                if ng < 1 or self.num_moe_experts % ng:
                    v.append(f"moe_router_num_groups={ng} must divide num_moe_experts={self.num_moe_experts}")
                if not 1 <= gk <= ng:
                    v.append(f"moe_router_group_topk={gk} must be in [1, moe_router_num_groups={ng}]")
                elif self.moe_router_topk % gk:
                    v.append(f"moe_router_topk={self.moe_router_topk} must be divisible by "
                             f"moe_router_group_topk={gk}")
            if not isinstance(self.moe_layer_freq, int) and len(self.moe_layer_freq) != self.num_layers:
                v.append(f"moe_layer_freq list has {len(self.moe_layer_freq)} entries, num_layers="
                         f"{self.num_layers}")
            elif isinstance(self.moe_layer_freq, int) and self.moe_layer_freq < 1:
                v.append(f"moe_layer_freq={self.moe_layer_freq} must be >= 1")
        elif self.moe_shared_expert_intermediate_size:
            v.append("moe_shared_expert_intermediate_size is set but num_moe_experts is not")
        if v:
            raise ModelConfigError("invalid model config:\n  - " + "\n  - ".join(v))

    def to_dict(self) -> dict:
        """Plain dict (YAML-serialisable)."""
        return dataclasses.asdict(self)


def model_config_from_dict(d: dict) -> ModelConfig:
    """Build a ``ModelConfig`` from a mapping; unknown or missing keys raise ``ModelConfigError``."""
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ModelConfigError(f"unknown model key(s) {unknown}; valid keys: {sorted(fields)}")
    required = [n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in d]
    if missing:
        raise ModelConfigError(f"model config is missing required key(s) {missing}")
    return ModelConfig(**d)
