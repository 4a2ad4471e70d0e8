"""The ``sglang.launch_server`` flags of a job whose adapters reach SGLang alone (``rollout.lora_sync: adapter``).

Rule: the servers' LoRA layers are built at start-up for the target modules named here, in SGLang's (HF) module
names -- ``actor.lora.target_modules`` mapped through megatron-core's names, ``all-linear`` -> ``all`` -- with
``--max-lora-rank`` = ``actor.lora.rank``; a CPU server runs the ``torch_native`` LoRA backend (Triton / csgmv
need a GPU).
"""
from __future__ import annotations

from typing import List, Optional

from megatron_rl.lora.config import ALL_LINEAR

__all__ = ["SGLANG_LORA_NAMES", "adapter_lora", "sglang_lora_targets", "sglang_lora_args"]

#: megatron-core module name -> SGLang's (HF) module names of the same weights
SGLANG_LORA_NAMES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                     "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",),
                     "linear_q_proj": ("q_proj",), "linear_q_up_proj": ("q_b_proj",),
                     "linear_kv_up_proj": ("kv_b_proj",)}


def adapter_lora(lora, rollout):
    """``actor.lora`` when the job syncs its adapters alone to SGLang servers, else None."""
    on = lora is not None and bool(getattr(lora, "rank", 0))
    if on and rollout.engine == "sglang" and getattr(rollout, "lora_sync", "merged") == "adapter":
        return lora
    return None


def sglang_lora_targets(lora) -> List[str]:
    """``--lora-target-modules`` of ``actor.lora`` (``lora``): ``["all"]`` or the SGLang module names."""
    if ALL_LINEAR in lora.target_modules:
        return ["all"]
    out: List[str] = []
    for entry, name in lora.mcore_targets():
        if name not in SGLANG_LORA_NAMES:
            raise ValueError(f"actor.lora.target_modules: {entry!r} ({name}) has no SGLang LoRA module "
                             f"(rollout.lora_sync: adapter); use rollout.lora_sync: merged")
        out += [n for n in SGLANG_LORA_NAMES[name] if n not in out]
    return out


def sglang_lora_args(lora, device: Optional[str] = None) -> List[str]:
    """The ``sglang.launch_server`` flags serving ``actor.lora``'s adapters (``device`` "cpu": torch_native)."""
    args = ["--enable-lora", "--max-lora-rank", str(int(lora.rank)), "--lora-target-modules",
            *sglang_lora_targets(lora)]
    return args + (["--lora-backend", "torch_native"] if device == "cpu" else [])
