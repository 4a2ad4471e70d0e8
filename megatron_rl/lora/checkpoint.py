"""What a LoRA checkpoint records (its ``actor.lora`` and base) and when a resume must refuse it.

Rule: the settings that change what the adapters mean -- ``rank``, ``alpha``, ``target_modules`` (the modules it
adapts, however spelled) -- and the base fingerprint must be the checkpoint's; ``dropout`` / ``init`` may change on
resume (training-only / first-step settings).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from megatron_rl.lora.config import mcore_targets
from megatron_rl.lora.merge import LORA_A, LORA_B

__all__ = ["is_adapter_key", "lora_meta_problem", "MEANING_KEYS"]

#: ``actor.lora`` keys a resume may not change
MEANING_KEYS = ("rank", "alpha", "target_modules")


def is_adapter_key(key: str) -> bool:
    """A state-dict key of an adapter parameter (``...lora_A.weight`` / ``...lora_B.weight``)."""
    return key.endswith((LORA_A, LORA_B))


def _meaning(key: str, value: Any) -> Any:
    """What a saved ``actor.lora`` value means: ``target_modules`` as the set of megatron-core modules it adapts
    (order and HF aliases do not matter), the others as they are."""
    if key != "target_modules" or not isinstance(value, (list, tuple)):
        return value
    return sorted({name for _, name in mcore_targets(value)})


def lora_meta_problem(saved: Optional[Dict[str, Any]], now: Optional[Dict[str, Any]]) -> Optional[str]:
    """Why a checkpoint with LoRA record ``saved`` cannot resume an actor with record ``now`` (None: it can). A
    record is {"config": actor.lora as a dict, "base": {"path", "sha256"}}."""
    if saved is None and now is None:
        return None
    if saved is None:
        return ("written without actor.lora (a full model); this actor has adapters: start it from that checkpoint "
                "exported (megatron-rl convert mcore-to-hf) as actor.load_hf")
    if now is None:
        return "written by a LoRA actor (actor.lora.rank > 0); set the same actor.lora to resume it"
    diff = [k for k in MEANING_KEYS if _meaning(k, saved["config"].get(k)) != _meaning(k, now["config"].get(k))]
    if diff:
        return "actor.lora differs from the checkpoint's in " + ", ".join(
            f"{k} (saved {saved['config'].get(k)!r}, now {now['config'].get(k)!r})" for k in diff)
    a, b = saved["base"], now["base"]
    if a.get("sha256") != b.get("sha256"):
        return (f"its adapters were trained on another base: saved actor.load_hf {a.get('path')!r} sha256 "
                f"{a.get('sha256')}, now {b.get('path')!r} sha256 {b.get('sha256')}")
    return None
