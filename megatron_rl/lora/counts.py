"""Adapter parameter counts of one transformer layer on one rank (``adapter_counts``), for the memory plan.

Rule: the same shapes as ``layers.LoraLinear.attach`` -- column: A ``[r, in]`` whole, B ``[out/TP, r]``; row: A
``[r, in/TP]``, B ``[out, r]`` whole; experts ``E/EP`` local ones, unsplit (ETP 1).
"""
from __future__ import annotations

from typing import Tuple

from megatron_rl.lora.config import LoraConfig

__all__ = ["adapter_counts"]


def _column(r: int, n_in: int, n_out: int, tp: int) -> int:
    return r * n_in + (n_out // tp) * r


def _row(r: int, n_in: int, n_out: int, tp: int) -> int:
    return r * (n_in // tp) + n_out * r


def adapter_counts(m, cfg: LoraConfig, tp: int, ep: int, is_moe: bool) -> Tuple[int, int]:
    """(dense adapter params, expert adapter params) of one layer of model ``m`` (``ModelConfig``) on one rank."""
    r, want = cfg.rank, {name for _, name in cfg.mcore_targets()}
    h = m.hidden_size
    dense = 0
    if m.multi_latent_attention:
        n, qk = m.num_attention_heads, m.qk_head_dim + m.qk_pos_emb_head_dim
        if "linear_q_proj" in want and m.q_lora_rank is None:
            dense += _column(r, h, n * qk, tp)
        if "linear_q_up_proj" in want and m.q_lora_rank is not None:
            dense += _column(r, m.q_lora_rank, n * qk, tp)
        if "linear_kv_up_proj" in want:
            dense += _column(r, m.kv_lora_rank, n * (m.qk_head_dim + m.v_head_dim), tp)
        attn_out = n * m.v_head_dim
    else:
        a, g, d = m.num_attention_heads, m.query_groups, m.head_dim
        if "linear_qkv" in want:
            dense += _column(r, h, (a + 2 * g) * d, tp)
        attn_out = a * d
    if "linear_proj" in want:
        dense += _row(r, attn_out, h, tp)

    def mlp(f: int, tp_: int) -> int:
        return ((_column(r, h, 2 * f, tp_) if "linear_fc1" in want else 0)
                + (_row(r, f, h, tp_) if "linear_fc2" in want else 0))

    expert = 0
    if is_moe:
        expert = (m.num_moe_experts // ep) * mlp(m.moe_ffn_hidden_size or m.dense_ffn_hidden_size, 1)
        if m.moe_shared_expert_intermediate_size:
            dense += mlp(m.moe_shared_expert_intermediate_size, tp)
    else:
        dense += mlp(m.dense_ffn_hidden_size, tp)
    return dense, expert
