"""The job's LoRA choice (``actor.lora``), built once: a ``LoraSpec`` or None, and the combinations it refuses.

Rule: every refusal is decided here from the config alone, before any process group or model exists; what is
refused is what was not built (docs/lora.md lists each with its reason).
"""
from __future__ import annotations

from typing import List, Optional

from megatron_rl.lora.apply import LoraSpec
from megatron_rl.lora.config import ALL_LINEAR
from megatron_rl.plan.checks import Unbuilt

__all__ = ["lora_spec", "lora_errors", "model_linear_names"]

#: the MLA projections the adapter layer cannot wrap yet (megatron's local spec builds them as replicated Linear)
_UNSUPPORTED = ("linear_q_down_proj", "linear_kv_down_proj")


def model_linear_names(model) -> List[str]:
    """megatron-core names of the linear layers of a transformer block of ``model`` (a ``ModelConfig``)."""
    if not model.multi_latent_attention:
        attn = ["linear_qkv", "linear_proj"]
    elif model.q_lora_rank is None:
        attn = ["linear_q_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"]
    else:
        attn = ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"]
    return attn + ["linear_fc1", "linear_fc2"]


def lora_errors(cfg) -> List[str]:
    """Problems of ``actor.lora`` with the rest of the job, each naming its key (none when LoRA is off). The rollout
    side of a LoRA job (``rollout.lora_sync``) is checked with the weight-sync settings
    (``WeightSyncSettings.checked``), not here."""
    lc, ac, model, par = cfg.actor.lora, cfg.actor, cfg.model, cfg.parallel
    if not lc.enabled:
        return []
    errs = []
    if not ac.load_hf:
        errs.append("actor.lora: needs actor.load_hf (the base the adapters are trained on, named and fingerprinted "
                    "in every checkpoint)")
    if model is not None:
        have = model_linear_names(model)
        for entry, name in lc.mcore_targets():
            if entry == ALL_LINEAR:
                if any(n in have for n in _UNSUPPORTED):
                    errs.append(f"actor.lora.target_modules: all-linear on this MLA model includes "
                                f"{' / '.join(n for n in _UNSUPPORTED if n in have)}, which adapters are not built "
                                f"for yet: list the targets ({', '.join(n for n in have if n not in _UNSUPPORTED)})")
                break
        explicit = [(e, n) for e, n in lc.mcore_targets() if e != ALL_LINEAR]
        for entry, name in explicit:
            if name in _UNSUPPORTED and name in have:
                errs.append(f"actor.lora.target_modules: {entry} ({name}) is not supported yet (MLA's replicated "
                            f"down-projection)")
            elif name not in have:
                errs.append(f"actor.lora.target_modules: {entry!r} matches no module of the model (its linear "
                            f"layers: {', '.join(have)})")
        if model.is_moe and model.moe_grouped_gemm:
            errs.append("actor.lora: not with model.moe_grouped_gemm: true (adapters are built for the "
                        "sequential expert layer; set model.moe_grouped_gemm: false)")
    if par.context_parallel_size > 1:
        errs.append("actor.lora: not with parallel.context_parallel_size > 1 (the adapted layers are megatron's "
                    "local spec, whose attention has no context parallelism)")
    if model is not None and model.is_moe and par.etp > 1:
        errs.append(f"actor.lora: not with parallel.expert_tensor_parallel_size {par.etp} > 1 (expert adapters are "
                    f"built for unsplit experts: set parallel.expert_tensor_parallel_size: 1)")
    if ac.routing_replay != "none" and (ac.policy_loss.kl_loss_coef > 0 or cfg.algorithm.use_kl_in_reward):
        errs.append(f"actor.lora: not with actor.routing_replay {ac.routing_replay!r} and a KL reference "
                    f"(actor.policy_loss.kl_loss_coef > 0 or algorithm.use_kl_in_reward): the reference is the policy "
                    f"itself with its adapters off, and its log-prob pass would replace the policy's routing record")
    if ac.fp32_output_layer:
        errs.append("actor.lora: not with actor.fp32_output_layer (the output layer is frozen under LoRA)")
    if ac.optimizer_cpu_offload:
        errs.append("actor.lora: not with actor.optimizer_cpu_offload (the optimizer holds only the adapters)")
    if ac.ref_param_offload:
        errs.append("actor.ref_param_offload: with actor.lora the KL reference is the policy with its adapters off "
                    "(no separate weights to offload); remove it")
    return errs


def lora_spec(cfg) -> Optional[LoraSpec]:
    """``LoraSpec`` of ``actor.lora`` (seeded by ``trainer.seed``), None when off; ``Unbuilt`` with its problems."""
    errs = lora_errors(cfg)
    if errs:
        raise Unbuilt(errs)
    return LoraSpec(cfg.actor.lora, cfg.trainer.seed) if cfg.actor.lora.enabled else None
