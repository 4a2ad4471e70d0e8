"""Pure tensor mapping between HF state dicts and the *full* Megatron GPTModel state dict.

"Full" = the state dict of a TP1/PP1/EP1 ``GPTModel`` built with the local layer spec (global layer and expert
numbers, the HF vocab size); ``partition`` cuts it into shards, ``model_state`` renames it for the TE spec. Every
mismatch raises ``CheckpointMismatchError`` listing all missing / unexpected names and every shape mismatch
before any tensor is combined. ``hf_tensors`` maps one Megatron tensor at a time (what a streaming exporter
needs); ``mcore_to_hf`` is built on it. The per-tensor conventions (QKV grouping, [gate; up], MLA, DeepSeek-V3
MoE): docs/convert.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from megatron_rl.convert.checks import CheckpointMismatchError, check_state_dict
from megatron_rl.convert.geometry import HFGeometry

Tensor = torch.Tensor


@dataclass(frozen=True)
class ParamRule:
    """One Megatron tensor and the HF tensors it is made of."""

    mcore_template: str
    """Megatron name with ``{layer}`` / ``{expert}`` placeholders."""
    hf_names: Tuple[str, ...]
    """HF tensor names (global indices filled in), in combine order."""
    combine: str
    """'copy' (one HF tensor), 'qkv' (q, k, v -> grouped rows) or 'gated' (gate, up -> [gate; up])."""
    mcore_shape: Tuple[int, ...]
    """Shape of the full (unsharded, unpadded) Megatron tensor."""
    hf_shapes: Tuple[Tuple[int, ...], ...]
    """Shapes of the HF tensors (same order as hf_names)."""
    layer: Optional[int] = None
    """Global decoder layer index (None for embedding / final norm / output layer)."""
    expert: Optional[int] = None
    """Global routed-expert index (None for non-expert tensors)."""

    @property
    def mcore_name(self) -> str:
        """Full-state-dict name (global layer and expert indices)."""
        return self.mcore_template.format(layer=self.layer, expert=self.expert)


def _copy(mname: str, hname: str, shape: Tuple[int, ...], layer: int) -> ParamRule:
    return ParamRule(mname, (hname,), "copy", shape, (shape,), layer=layer)


def _mla_rules(g: HFGeometry, i: int) -> List[ParamRule]:
    H, n = g.hidden_size, g.num_attention_heads
    qk = g.qk_head_dim + g.qk_pos_emb_head_dim
    p, m = f"model.layers.{i}.self_attn.", "decoder.layers.{layer}.self_attention."
    rules = []
    if g.q_lora_rank:
        rules += [_copy(m + "linear_q_down_proj.weight", p + "q_a_proj.weight", (g.q_lora_rank, H), i),
                  _copy(m + "q_layernorm.weight", p + "q_a_layernorm.weight", (g.q_lora_rank,), i),
                  _copy(m + "linear_q_up_proj.weight", p + "q_b_proj.weight", (n * qk, g.q_lora_rank), i)]
    else:
        rules.append(_copy(m + "linear_q_proj.weight", p + "q_proj.weight", (n * qk, H), i))
    return rules + [
        _copy(m + "linear_kv_down_proj.weight", p + "kv_a_proj_with_mqa.weight",
              (g.kv_lora_rank + g.qk_pos_emb_head_dim, H), i),
        _copy(m + "kv_layernorm.weight", p + "kv_a_layernorm.weight", (g.kv_lora_rank,), i),
        _copy(m + "linear_kv_up_proj.weight", p + "kv_b_proj.weight",
              (n * (g.qk_head_dim + g.v_head_dim), g.kv_lora_rank), i),
        _copy(m + "linear_proj.weight", p + "o_proj.weight", (H, n * g.v_head_dim), i),
    ]


def _attn_rules(g: HFGeometry, i: int) -> List[ParamRule]:
    H, d, ng, hpg = g.hidden_size, g.kv_channels, g.num_query_groups, g.num_heads_per_group
    p, m = f"model.layers.{i}.", "decoder.layers.{layer}."
    if g.multi_latent_attention:
        return [_copy(m + "input_layernorm.weight", p + "input_layernorm.weight", (H,), i),
                _copy(m + "pre_mlp_layernorm.weight", p + "post_attention_layernorm.weight", (H,), i)] \
            + _mla_rules(g, i)
    qkv_rows = ng * (hpg + 2) * d
    rules = [
        ParamRule(m + "input_layernorm.weight", (p + "input_layernorm.weight",), "copy", (H,), ((H,),), layer=i),
        ParamRule(m + "self_attention.linear_qkv.weight",
                  (p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"),
                  "qkv", (qkv_rows, H), ((ng * hpg * d, H), (ng * d, H), (ng * d, H)), layer=i),
        ParamRule(m + "self_attention.linear_proj.weight", (p + "self_attn.o_proj.weight",), "copy",
                  (H, ng * hpg * d), ((H, ng * hpg * d),), layer=i),
        ParamRule(m + "pre_mlp_layernorm.weight", (p + "post_attention_layernorm.weight",), "copy",
                  (H,), ((H,),), layer=i),
    ]
    if g.add_qkv_bias:
        rules.append(ParamRule(
            m + "self_attention.linear_qkv.bias",
            (p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"),
            "qkv", (qkv_rows,), ((ng * hpg * d,), (ng * d,), (ng * d,)), layer=i))
    if g.qk_layernorm:
        rules += [ParamRule(m + f"self_attention.{x}_layernorm.weight", (p + f"self_attn.{x}_norm.weight",), "copy",
                            (d,), ((d,),), layer=i) for x in "qk"]
    return rules


def _swiglu_rules(mpre: str, hpre: str, H: int, F: int, layer: int, expert: Optional[int]) -> List[ParamRule]:
    return [
        ParamRule(mpre + "linear_fc1.weight", (hpre + "gate_proj.weight", hpre + "up_proj.weight"), "gated",
                  (2 * F, H), ((F, H), (F, H)), layer=layer, expert=expert),
        ParamRule(mpre + "linear_fc2.weight", (hpre + "down_proj.weight",), "copy", (H, F), ((H, F),),
                  layer=layer, expert=expert),
    ]


def _mlp_rules(g: HFGeometry, i: int) -> List[ParamRule]:
    H = g.hidden_size
    p, m = f"model.layers.{i}.mlp.", "decoder.layers.{layer}.mlp."
    if not g.is_moe_layer(i):
        return _swiglu_rules(m, p, H, g.ffn_hidden_size, i, None)
    E = g.num_moe_experts
    rules = [ParamRule(m + "router.weight", (p + "gate.weight",), "copy", (E, H), ((E, H),), layer=i)]
    if g.moe_router_expert_bias:
        rules.append(_copy(m + "router.expert_bias", p + "gate.e_score_correction_bias", (E,), i))
    for e in range(E):
        rules += _swiglu_rules(m + "experts.local_experts.{expert}.", p + f"experts.{e}.", H,
                               g.moe_ffn_hidden_size, i, e)
    if g.moe_shared_expert_intermediate_size:
        hf_shared = "shared_experts." if g.family == "deepseek_v3" else "shared_expert."
        rules += _swiglu_rules(m + "shared_experts.", p + hf_shared, H,
                               g.moe_shared_expert_intermediate_size, i, None)
        if g.moe_shared_expert_gate:
            rules.append(ParamRule(m + "shared_experts.gate_weight", (p + "shared_expert_gate.weight",), "copy",
                                   (1, H), ((1, H),), layer=i))
    return rules


def param_rules(g: HFGeometry) -> List[ParamRule]:
    """Every tensor of the full Megatron state dict, with its HF sources."""
    H, V = g.hidden_size, g.vocab_size
    rules = [ParamRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "copy", (V, H),
                       ((V, H),))]
    for i in range(g.num_layers):
        rules += _attn_rules(g, i) + _mlp_rules(g, i)
    rules.append(ParamRule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", (H,), ((H,),)))
    if not g.tie_word_embeddings:
        rules.append(ParamRule("output_layer.weight", ("lm_head.weight",), "copy", (V, H), ((V, H),)))
    return rules


def _qkv_merge(q: Tensor, k: Tensor, v: Tensor, g: HFGeometry) -> Tensor:
    ng, d, hpg = g.num_query_groups, g.kv_channels, g.num_heads_per_group
    rest = q.shape[1:]
    return torch.cat([q.reshape(ng, hpg * d, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)],
                     dim=1).reshape(ng * (hpg + 2) * d, *rest)


def _qkv_split(t: Tensor, g: HFGeometry) -> List[Tensor]:
    ng, d, hpg = g.num_query_groups, g.kv_channels, g.num_heads_per_group
    rest = t.shape[1:]
    q, k, v = t.reshape(ng, (hpg + 2) * d, *rest).split([hpg * d, d, d], dim=1)
    return [q.reshape(ng * hpg * d, *rest).contiguous(), k.reshape(ng * d, *rest).contiguous(),
            v.reshape(ng * d, *rest).contiguous()]


def drop_mtp_layers(hf_sd: Mapping[str, Tensor], g: HFGeometry) -> Mapping[str, Tensor]:
    """``hf_sd`` without the checkpoint's multi-token-prediction layers (``model.layers.{L..L+n-1}.*``,
    n = ``g.num_mtp_layers``); tensors of layers beyond those stay (and are then reported unexpected)."""
    if not g.num_mtp_layers:
        return hf_sd
    mtp = tuple(f"model.layers.{i}." for i in range(g.num_layers, g.num_layers + g.num_mtp_layers))
    return {k: v for k, v in hf_sd.items() if not k.startswith(mtp)}


def hf_to_mcore(hf_sd: Mapping[str, Tensor], g: HFGeometry) -> Dict[str, Tensor]:
    """HF state dict -> full Megatron state dict (local spec names, global indices, unpadded vocab).

    A tied checkpoint may still carry ``lm_head.weight``; it is accepted only if it equals the embedding.
    """
    rules = param_rules(g)
    expected = {n: s for r in rules for n, s in zip(r.hf_names, r.hf_shapes)}
    hf_sd = drop_mtp_layers(hf_sd, g)
    extra = ()
    if g.tie_word_embeddings and "lm_head.weight" in hf_sd:
        if not torch.equal(hf_sd["lm_head.weight"], hf_sd.get("model.embed_tokens.weight", torch.empty(0))):
            raise CheckpointMismatchError(
                "HF checkpoint: tie_word_embeddings=True but lm_head.weight differs from model.embed_tokens.weight")
        extra = ("lm_head.weight",)
    check_state_dict(hf_sd, expected, f"HF checkpoint ({g.architecture})", optional=extra)
    return {r.mcore_name: combine(r, [hf_sd[n] for n in r.hf_names], g) for r in rules}


def combine(rule: ParamRule, parts: Sequence[Tensor], g: HFGeometry) -> Tensor:
    """The Megatron tensor of ``rule`` from its HF tensors ``parts`` (in ``rule.hf_names`` order), or the same
    positions of it from the same positions (rows of each part: dim 0 is where the parts interleave)."""
    if rule.combine == "copy":
        return parts[0]
    if rule.combine == "qkv":
        return _qkv_merge(*parts, g)
    return torch.cat(list(parts), dim=0)  # gated


def hf_row_sources(rule: ParamRule, g: HFGeometry) -> Tuple[Tensor, Tensor]:
    """(part, row) of every row of the full Megatron tensor of ``rule``: which HF tensor (index into
    ``rule.hf_names``) and which row of it each row is (:func:`combine` applied to row numbers)."""
    parts = [torch.full((s[0],), i, dtype=torch.long) for i, s in enumerate(rule.hf_shapes)]
    rows = [torch.arange(s[0]) for s in rule.hf_shapes]
    return combine(rule, parts, g), combine(rule, rows, g)


def hf_tensors(rule: ParamRule, t: Tensor, g: HFGeometry) -> Iterator[Tuple[str, Tensor]]:
    """(HF name, tensor) pairs of one full Megatron tensor ``t`` of ``rule`` (its shape is checked)."""
    if tuple(t.shape) != tuple(rule.mcore_shape):
        check_state_dict({rule.mcore_name: t}, {rule.mcore_name: rule.mcore_shape},
                         f"Megatron tensor ({g.architecture})")
    if rule.combine == "copy":
        parts = [t]
    elif rule.combine == "qkv":
        parts = _qkv_split(t, g)
    else:
        parts = [p.contiguous() for p in t.chunk(2, dim=0)]
    return zip(rule.hf_names, parts)


def mcore_to_hf(mcore_sd: Mapping[str, Tensor], g: HFGeometry) -> Dict[str, Tensor]:
    """Full Megatron state dict (as produced by :func:`hf_to_mcore` / unsharding) -> HF state dict."""
    rules = param_rules(g)
    check_state_dict(mcore_sd, {r.mcore_name: r.mcore_shape for r in rules},
                     f"Megatron state dict ({g.architecture})")
    out: Dict[str, Tensor] = {}
    for r in rules:
        out.update(hf_tensors(r, mcore_sd[r.mcore_name], g))
    return out
