"""LoRA adapters of a full Megatron state dict -> a PEFT adapter directory, or merged into the HF model.

Rule: a fused megatron-core module's adapter becomes one PEFT adapter per HF module it holds -- B's rows are
split exactly as the base weight's rows (``mapping.hf_row_sources``: qkv's grouped rows to q / k / v, fc1's
[gate; up]) and the shared A is copied to each -- so PEFT's ``base + scale * B_part @ A`` is the fused layer's
delta row for row. Experts are written per expert under the HF checkpoint's names (``mlp.experts.E.gate_proj``).
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from safetensors.torch import save_file

from megatron_rl.convert.checks import CheckpointMismatchError
from megatron_rl.convert.geometry import HFGeometry
from megatron_rl.convert import storage
from megatron_rl.convert.mapping import hf_row_sources, hf_to_mcore, mcore_to_hf, param_rules
from megatron_rl.convert.torch_dist import read_torch_dist_model_state_dict
from megatron_rl.lora.base import base_fingerprint
from megatron_rl.lora.merge import LORA_A, LORA_B, adapted_modules, lora_scale, merged_items

Tensor = torch.Tensor

__all__ = ["LORA_CONFIG_FILE", "export_full", "export_adapter_checkpoint", "split_adapters", "peft_adapter_tensors",
           "fused_expert_tensors", "expert_params", "peft_adapter_config",
           "write_peft_adapter", "merged_hf_state_dict", "read_lora_config"]

#: The LoRA section (``actor.lora``: rank, alpha, dropout, target_modules, init) saved beside a checkpoint.
LORA_CONFIG_FILE = "lora_config.json"
#: PEFT's key prefix of a causal LM's adapter tensors (``PeftModelForCausalLM.base_model.model``).
PEFT_PREFIX = "base_model.model."


def split_adapters(full: Mapping[str, Tensor]) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    """(base tensors, adapter tensors) of a full state dict."""
    base = {n: t for n, t in full.items() if not n.endswith((LORA_A, LORA_B))}
    return base, {n: t for n, t in full.items() if n.endswith((LORA_A, LORA_B))}


def peft_adapter_tensors(adapters: Mapping[str, Tensor], geom: HFGeometry) -> Dict[str, Tensor]:
    """PEFT's ``{base_model.model.<HF module>.lora_A|B.weight: tensor}`` of full (unsharded, global-index)
    Megatron adapters; an adapter of a module without a HF counterpart raises, naming it. Routed experts take
    PEFT's ``target_parameters`` form on transformers' fused expert weights (``fused_expert_tensors``)."""
    rules = {r.mcore_name: r for r in param_rules(geom)}
    out: Dict[str, Tensor] = {}
    experts: Dict[Tuple[int, str], Dict[int, Tuple[Tensor, Tensor]]] = {}
    for path, (a_name, b_name) in sorted(adapted_modules(adapters).items()):
        rule = rules.get(path + ".weight")
        if rule is None:
            raise CheckpointMismatchError(f"LoRA adapter {path!r}: no HF tensor {path + '.weight'!r} in "
                                          f"{geom.architecture}")
        a, b = adapters[a_name], adapters[b_name]
        if b.shape[0] != rule.mcore_shape[0] or a.shape[1] != rule.mcore_shape[1] or a.shape[0] != b.shape[1]:
            raise CheckpointMismatchError(f"LoRA adapter {path!r}: A {tuple(a.shape)} / B {tuple(b.shape)} do not "
                                          f"fit the weight {tuple(rule.mcore_shape)}")
        if rule.expert is not None:
            kind = "gate_up_proj" if path.endswith("linear_fc1") else "down_proj"
            experts.setdefault((rule.layer, kind), {})[rule.expert] = (a, b)
            continue
        parts, rows = hf_row_sources(rule, geom)
        for i, hf_name in enumerate(rule.hf_names):
            module = PEFT_PREFIX + hf_name[: -len(".weight")]
            sel = (parts == i).nonzero().flatten()
            order = rows[sel].argsort()
            out[module + ".lora_A.weight"] = a.clone().contiguous()
            out[module + ".lora_B.weight"] = b.index_select(0, sel[order]).contiguous()
    out.update(fused_expert_tensors(experts, geom))
    return out


#: transformers' fused expert parameters, in the order PEFT wraps them (the first is the innermost wrapper)
FUSED_EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def fused_expert_tensors(experts: Mapping[Tuple[int, str], Mapping[int, Tuple[Tensor, Tensor]]],
                         geom: HFGeometry) -> Dict[str, Tensor]:
    """Per-expert adapters ``{(layer, "gate_up_proj" | "down_proj"): {expert: (A, B)}}`` as PEFT's
    ``target_parameters`` adapters on ``mlp.experts.<param>`` (transformers' ``[E, out, in]`` weights: fc1's
    rows are already [gate; up] per expert): A ``[E*r, in]`` (expert e's rows e*r..), B ``[out, r*E]`` (column
    k*E + e); with both parameters adapted, gate_up's keys carry the ``base_layer.`` of the wrapper around it."""
    out: Dict[str, Tensor] = {}
    for (layer, kind), by_e in sorted(experts.items()):
        ids = sorted(by_e)
        if ids != list(range(geom.num_moe_experts)):
            raise CheckpointMismatchError(f"LoRA adapters of layer {layer}'s {kind}: experts {ids} of "
                                          f"{geom.num_moe_experts} (a PEFT expert adapter needs every expert)")
        a = torch.cat([by_e[e][0] for e in ids], 0)
        r = by_e[0][0].shape[0]
        b = torch.stack([by_e[e][1] for e in ids], -1).reshape(by_e[0][1].shape[0], r * len(ids))
        both = all((layer, k) in experts for k in FUSED_EXPERT_PARAMS)
        pre = f"{PEFT_PREFIX}model.layers.{layer}.mlp.experts." + ("base_layer." if both and kind == "gate_up_proj"
                                                                 else "")
        out[pre + "lora_A.weight"], out[pre + "lora_B.weight"] = a.contiguous(), b.contiguous()
    return out


def expert_params(adapters: Mapping[str, Tensor]) -> List[str]:
    """The ``target_parameters`` of the routed-expert adapters among ``adapters`` (``FUSED_EXPERT_PARAMS`` order)."""
    kinds = {"gate_up_proj" if n.split(".lora_")[0].endswith("linear_fc1") else "down_proj"
             for n in adapters if ".mlp.experts.local_experts." in n}
    return [f"mlp.experts.{k}" for k in FUSED_EXPERT_PARAMS if k in kinds]


def peft_adapter_config(peft_tensors: Mapping[str, Tensor], rank: int, alpha: float, dropout: float = 0.0,
                        base_model: Optional[str] = None, target_parameters: Sequence[str] = ()) -> dict:
    """PEFT's ``adapter_config.json`` for ``peft_tensors`` (target modules: the HF module leaf names; routed
    experts: ``target_parameters``, from ``expert_params``)."""
    targets = sorted({k[: -len(".lora_A.weight")].rsplit(".", 1)[-1] for k in peft_tensors
                      if k.endswith(".lora_A.weight") and ".mlp.experts.lora_" not in k
                      and ".mlp.experts.base_layer." not in k})
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(rank), "lora_alpha": alpha,
           "lora_dropout": dropout, "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
           "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
           "base_model_name_or_path": base_model}
    if target_parameters:
        cfg["target_parameters"] = list(target_parameters)
    return cfg


def write_peft_adapter(out_dir: str, adapters: Mapping[str, Tensor], geom: HFGeometry, lora: Mapping,
                       base_model: Optional[str] = None) -> List[str]:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (``lora``: rank / alpha / dropout, the
    ``actor.lora`` section); returns the files written."""
    tensors = peft_adapter_tensors(adapters, geom)
    rank = {t.shape[0] for k, t in adapters.items() if k.endswith(LORA_A)}
    if rank != {int(lora["rank"])}:
        raise CheckpointMismatchError(f"LoRA adapters of rank {sorted(rank)} but the saved actor.lora.rank is "
                                      f"{lora['rank']}")
    os.makedirs(out_dir, exist_ok=True)
    cfg = peft_adapter_config(tensors, lora["rank"], lora["alpha"], lora.get("dropout", 0.0), base_model,
                              expert_params(adapters))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    path = os.path.join(out_dir, "adapter_model.safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})
    return [os.path.join(out_dir, "adapter_config.json"), path]


def merged_hf_state_dict(full: Mapping[str, Tensor], geom: HFGeometry, lora: Mapping) -> Dict[str, Tensor]:
    """The HF state dict of ``full`` with its adapters merged (``lora.merge``: fp32, cast once to the base
    weight's dtype)."""
    scale = lora_scale(int(lora["rank"]), lora["alpha"])
    merged = {n: t.to(full[n].dtype) for n, t in merged_items(full, scale)}
    return mcore_to_hf(merged, geom)


def read_lora_config(ckpt_dir: str) -> Optional[dict]:
    """The ``actor.lora`` section saved beside a checkpoint (``LORA_CONFIG_FILE``), None when there is none."""
    path = os.path.join(ckpt_dir, LORA_CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        return json.load(fh)




def export_full(full: Mapping[str, Tensor], geom: HFGeometry, out_dir: str, lora: Optional[Mapping] = None,
                merge: bool = False, assets_dir: Optional[str] = None, config: Optional[dict] = None,
                max_shard_bytes: int = storage.DEFAULT_MAX_SHARD_BYTES) -> List[str]:
    """Write a full state dict: without adapters the HF model; with adapters a PEFT adapter (``merge`` False)
    or the merged HF model (``merge``). ``lora``: the ``actor.lora`` section the adapters were trained with
    (rank / alpha / dropout); required when there are adapters. Returns the files written."""
    base, adapters = split_adapters(full)
    if not adapters:
        if merge:
            raise CheckpointMismatchError("--merge: the checkpoint has no LoRA adapters (lora_A / lora_B tensors)")
        return storage.write_hf_model_dir(out_dir, mcore_to_hf(base, geom), assets_dir, config, max_shard_bytes)
    if not lora or not lora.get("rank"):
        raise CheckpointMismatchError(f"the checkpoint has {len(adapters)} LoRA tensors but no actor.lora section "
                                      f"(rank / alpha) was saved with it ({LORA_CONFIG_FILE} or the run's config)")
    if merge:
        return storage.write_hf_model_dir(out_dir, merged_hf_state_dict(full, geom, lora), assets_dir, config,
                                          max_shard_bytes)
    return write_peft_adapter(out_dir, adapters, geom, lora, base_model=assets_dir)


def export_adapter_checkpoint(dist_dir: str, geom: HFGeometry, out_dir: str, record: Mapping, merge: bool = False,
                              base_dir: Optional[str] = None, assets_dir: Optional[str] = None,
                              config: Optional[dict] = None,
                              max_shard_bytes: int = storage.DEFAULT_MAX_SHARD_BYTES) -> List[str]:
    """Export a LoRA actor's checkpoint, which holds the adapters alone (``dist_dir``, torch_dist) and names its
    base (``record``: {"config": actor.lora, "base": {"path", "sha256"}}): the PEFT adapter, or with ``merge`` the
    base (``base_dir``, default the recorded path, its fingerprint checked) with the adapters merged."""
    adapters = read_torch_dist_model_state_dict(dist_dir, geom, prefix="")
    base = None
    if merge:
        path = base_dir or record["base"]["path"]
        if not os.path.isdir(path):
            raise CheckpointMismatchError(f"--merge: the LoRA run's base {path!r} is not a directory (pass the base "
                                          f"HF directory as --hf-assets-dir)")
        sha = base_fingerprint(path)
        if sha != record["base"]["sha256"]:
            raise CheckpointMismatchError(f"--merge: {path!r} is not the base the adapters were trained on (sha256 "
                                          f"{sha}, the run's {record['base']['sha256']} of {record['base']['path']!r})")
        base = hf_to_mcore(storage.read_hf_state_dict(path), geom)
    return export_full({**(base or {}), **adapters}, geom, out_dir, record["config"], merge,
                       assets_dir or base_dir, config, max_shard_bytes)
