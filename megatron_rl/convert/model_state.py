"""Put a converted rank state dict into a live Megatron model, and read one back out.

Converted shards use megatron's **local-spec** names. A model built with the Transformer Engine
spec fuses norms into linears and may group experts; :func:`adapt_names_to_model` renames:

    input_layernorm.weight                      -> self_attention.linear_qkv.layer_norm_weight
    pre_mlp_layernorm.weight (dense MLP)        -> mlp.linear_fc1.layer_norm_weight
    mlp.experts.local_experts.E.linear_fcK.weight -> mlp.experts.linear_fcK.weightE   (TEGroupedMLP)

choosing, per tensor, the name the model actually has. ``_extra_state`` entries (TE fp8 metadata) are
never required. :func:`canonical_state_dict` does the reverse for export.

Usage (on every rank, after building the model for that rank)::

    sd = load_rank_state_dict(ckpt_dir, layout, tp_rank=..., pp_rank=..., ep_rank=..., etp_rank=...)
    load_state_dict_into_model(model, sd)
"""
from __future__ import annotations

import re
from typing import Dict, Iterable, List, Mapping

import torch

from megatron_rl.convert.checks import check_state_dict

Tensor = torch.Tensor

_TO_TE = [
    (re.compile(r"^(.*decoder\.layers\.\d+\.)input_layernorm\.weight$"),
     r"\1self_attention.linear_qkv.layer_norm_weight"),
    (re.compile(r"^(.*decoder\.layers\.\d+\.)pre_mlp_layernorm\.weight$"), r"\1mlp.linear_fc1.layer_norm_weight"),
    (re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight$"), r"\1\3.weight\2"),
    # MLA: TE fuses the q / kv latent norms into the up-projections
    (re.compile(r"^(.*\.self_attention\.)q_layernorm\.weight$"), r"\1linear_q_up_proj.layer_norm_weight"),
    (re.compile(r"^(.*\.self_attention\.)kv_layernorm\.weight$"), r"\1linear_kv_up_proj.layer_norm_weight"),
]
_FROM_TE = (
    # Transformer Engine spec fuses the pre-attention / pre-MLP norms into the following linear
    (re.compile(r"^(.*\.)self_attention\.linear_qkv\.layer_norm_(weight|bias)$"), r"\1input_layernorm.\2"),
    (re.compile(r"^(.*\.)mlp\.linear_fc1\.layer_norm_(weight|bias)$"), r"\1pre_mlp_layernorm.\2"),
    (re.compile(r"^(.*\.self_attention\.)linear_q_up_proj\.layer_norm_weight$"), r"\1q_layernorm.weight"),
    (re.compile(r"^(.*\.self_attention\.)linear_kv_up_proj\.layer_norm_weight$"), r"\1kv_layernorm.weight"),
    # grouped-GEMM experts (TEGroupedMLP) -> SequentialMLP names
    (re.compile(r"^(.*\.)mlp\.experts\.linear_fc([12])\.(weight|bias)(\d+)$"),
     r"\1mlp.experts.local_experts.\4.linear_fc\2.\3"),
)


def _is_extra_state(name: str) -> bool:
    return name.endswith("_extra_state")


def canonical_name(name: str) -> str:
    """The local-spec / SequentialMLP name of a model parameter: TE-spec fused norm names and grouped-GEMM
    expert names map to it; other names are unchanged (inverse of :func:`adapt_names_to_model`)."""
    for pattern, repl in _FROM_TE:
        if pattern.match(name):
            return pattern.sub(repl, name)
    return name


def adapt_names_to_model(sd: Mapping[str, Tensor], model_keys: Iterable[str]) -> Dict[str, Tensor]:
    """Rename local-spec keys to the names present in ``model_keys`` (TE spec, ``module.`` wrappers)."""
    keys = set(model_keys)
    prefix = ""
    while keys and all(k.startswith(prefix + "module.") for k in keys):
        prefix += "module."
    out: Dict[str, Tensor] = {}
    for k, v in sd.items():
        cand = [prefix + k] + [prefix + pat.sub(rep, k) for pat, rep in _TO_TE if pat.match(k)]
        hit = next((c for c in cand if c in keys), cand[0])
        out[hit] = v
    return out


def canonical_state_dict(sd: Mapping[str, Tensor]) -> Dict[str, Tensor]:
    """A model's state dict with local-spec names: ``module.`` prefixes and ``_extra_state`` / None entries
    dropped, TE fused and grouped-GEMM names mapped back (:func:`canonical_name`)."""
    out: Dict[str, Tensor] = {}
    for k, v in sd.items():
        if _is_extra_state(k) or v is None:
            continue
        while k.startswith("module."):
            k = k[len("module."):]
        out[canonical_name(k)] = v
    return out


def load_state_dict_into_model(model: torch.nn.Module, sd: Mapping[str, Tensor], where: str = "") -> List[str]:
    """Copy ``sd`` into the model's parameters/buffers in place (dtype converted), strictly.

    Raises CheckpointMismatchError (``checks.check_state_dict``) listing every missing, unexpected or
    mis-shaped tensor (and ``where``, e.g. the rank coordinates) before anything is copied. Returns the
    loaded model keys.
    """
    target = model.state_dict(keep_vars=True)
    renamed = adapt_names_to_model(sd, target.keys())
    check_state_dict(renamed, {k: v.shape for k, v in target.items() if v is not None},
                     f"loading into model{' (' + where + ')' if where else ''}",
                     optional=[k for k in target if _is_extra_state(k)], expected_name="model")
    with torch.no_grad():
        for k, v in renamed.items():
            target[k].copy_(v.to(device=target[k].device))
    return sorted(renamed)
