"""The LoRA-vs-PEFT proof set-up: random layout-free adapters for a tiny HF model, the same adapters put into
PEFT's LoRA on the HF model (``peft_model``), and PEFT's gradients read back in megatron-core's layout.

The mapping is the converter's (``convert.mapping.param_rules``): a megatron-core module's adapter is PEFT's
adapters of the HF modules it is made of, with ONE A shared by q / k / v (gate / up) and B's rows split like the
weight's rows. Routed experts, fused in memory by transformers, go through PEFT's ``target_parameters`` (one
rank-r adapter per expert, PEFT's stacked layout).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple
from unittest import mock

import torch

from megatron_rl.convert.api import read_hf_checkpoint
from megatron_rl.convert.mapping import _qkv_merge, _qkv_split, param_rules

__all__ = ["adapted_rules", "random_full_adapters", "peft_model", "peft_grads"]

def adapted_rules(hf_dir: str, modules: Sequence[str]):
    """(geometry, [ParamRule of every ``<module>.weight`` the megatron-core module names in ``modules`` adapt])."""
    g, _, _ = read_hf_checkpoint(hf_dir)
    rules = [r for r in param_rules(g) if r.mcore_name.endswith(".weight")
             and r.mcore_name.rsplit(".", 2)[-2] in modules]
    return g, rules


def random_full_adapters(rules, rank: int, seed: int = 0, scale: float = 0.3) -> Dict[str, torch.Tensor]:
    """{``<module>.lora_A.weight`` / ``lora_B.weight``: random fp32} for every rule (B non-zero, so the delta is)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for r in rules:
        pre = r.mcore_name[:-len("weight")]
        out_f, in_f = r.mcore_shape
        out[pre + "lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * scale
        out[pre + "lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * scale
    return out


def _experts_wrappers(model) -> Dict[Tuple[str, str], torch.nn.Module]:
    """{(HF path of the experts module, parameter name): PEFT ParamWrapper}."""
    from peft.tuners.lora.layer import ParamWrapper

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, ParamWrapper):
            path = name.replace("base_model.model.", "", 1).replace(".base_layer", "")
            out[(path, m.parameter_name)] = m
    return out


def _linear_lora(model, hf_module: str):
    m = model.get_submodule("base_model.model." + hf_module)
    return m.lora_A["default"].weight, m.lora_B["default"].weight


def peft_model(hf_model, rules, g, full: Dict[str, torch.Tensor], rank: int, alpha: float):
    """``hf_model`` under PEFT's LoRA (every HF module / expert parameter the rules adapt) with the adapters of
    ``full`` copied in; fp32, eval mode."""
    from peft import LoraConfig, get_peft_model

    linear, params = set(), set()
    for r in rules:
        for n in r.hf_names:
            if r.expert is not None:
                params.add("mlp.experts.down_proj" if n.endswith("down_proj.weight") else "mlp.experts.gate_up_proj")
            else:
                linear.add(n.rsplit(".", 2)[-2])
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=sorted(linear) or None,
                     target_parameters=sorted(params) or None, init_lora_weights=False)
    # PEFT renames transformers-v4 MoE targets (gate_proj / up_proj / down_proj) to the fused v5 expert parameters,
    # which would take the dense and shared-expert modules of those names away: the experts are targeted by their
    # parameters here, so that renaming of the config is switched off (the LoRA math is PEFT's, untouched)
    with mock.patch("peft.utils.transformers_weight_conversion.convert_peft_config_for_transformers",
                    lambda *a, **k: None):
        model = get_peft_model(hf_model, cfg)
    wrappers = _experts_wrappers(model)
    with torch.no_grad():
        for r in rules:
            pre = r.mcore_name[:-len("weight")]
            a, b = full[pre + "lora_A.weight"], full[pre + "lora_B.weight"]
            for hf_name, part in _b_parts(r, b, g):
                if r.expert is None:
                    pa, pb = _linear_lora(model, hf_name.rsplit(".", 1)[0])
                    pa.copy_(a)
                    pb.copy_(part)
            if r.expert is not None:
                w, e, n_exp = _expert_wrapper(wrappers, r)
                w.lora_A["default"].weight[e * rank:(e + 1) * rank] = a
                w.lora_B["default"].weight.view(b.shape[0], rank, n_exp)[:, :, e] = b
    return model.eval()


def _b_parts(rule, b: torch.Tensor, g) -> List[Tuple[str, torch.Tensor]]:
    if rule.combine == "qkv":
        return list(zip(rule.hf_names, _qkv_split(b, g)))
    if rule.combine == "gated":
        return list(zip(rule.hf_names, b.chunk(2, 0)))
    return [(rule.hf_names[0], b)]


def _expert_wrapper(wrappers, rule):
    hf = rule.hf_names[0]  # model.layers.<i>.mlp.experts.<e>.<gate|down>_proj.weight
    path = hf.split(".experts.")[0] + ".experts"
    pname = "down_proj" if rule.mcore_name.endswith("linear_fc2.weight") else "gate_up_proj"
    w = wrappers[(path, pname)]
    return w, rule.expert, w.num_experts


def peft_grads(model, rules, g, rank: int) -> Dict[str, torch.Tensor]:
    """PEFT's gradients of every adapter, in megatron-core's layout and names (q / k / v's A gradients summed:
    megatron-core's module has one A)."""
    wrappers = _experts_wrappers(model)
    out = {}
    for r in rules:
        pre = r.mcore_name[:-len("weight")]
        if r.expert is not None:
            w, e, n_exp = _expert_wrapper(wrappers, r)
            ga = w.lora_A["default"].weight.grad[e * rank:(e + 1) * rank]
            gb_all = w.lora_B["default"].weight.grad
            gb = gb_all.view(gb_all.shape[0], rank, n_exp)[:, :, e]
        else:
            mods = [_linear_lora(model, n.rsplit(".", 1)[0]) for n in r.hf_names]
            ga = sum(a.grad for a, _ in mods)
            bs = [b.grad for _, b in mods]
            gb = _qkv_merge(*bs, g) if r.combine == "qkv" else torch.cat(bs, 0)
        out[pre + "lora_A.weight"], out[pre + "lora_B.weight"] = ga.clone(), gb.clone()
    return out
