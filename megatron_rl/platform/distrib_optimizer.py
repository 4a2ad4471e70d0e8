"""megatron's distributed optimizer: two fixes for loading its checkpoints with torch's Adam (no Transformer Engine
/ apex fused Adam), and one for groups mixing fp32 and bf16 parameters, on every device.

Why: torch's Adam keeps a ``step`` tensor in each parameter's state. megatron-core (0.16 through 0.19), loading:

* restores the step from the checkpoint's param groups as ONE tensor put into every parameter's state; torch's
  Adam then increments that shared tensor once per parameter, so every step after a resume uses a wrong bias
  correction (measured: resumed weights off by ~3e-4 at lr 1e-3 after one step);
* then copies every state tensor of a parameter from the checkpoint's per-parameter tensors, which hold no
  ``step`` (``KeyError: 'step'`` in ``_set_main_param_and_optimizer_states``).

With TE / apex the fused Adam keeps the step in its param groups and neither path is reached. ``install()``
wraps the two methods: a missing ``step`` is taken from the parameter's own (restored) state, so its copy is a
no-op, and after ``load_state_dict`` each parameter gets its own copy of the step. Idempotent.

A third fix, for param groups that mix fp32 and bf16 parameters (``actor.fp32_output_layer`` with ``actor.bf16``):
megatron records each parameter's position in its group in model order (``model_param_group_index_map``) but
gives the torch optimizer the group's fp32 shards first, then the bf16 parameters' fp32 main shards. Every
checkpoint path looks the main parameter and its Adam state up by that position, so with a mixed group saving
read another parameter's state (a size mismatch, or a silently wrong tensor when the sizes agree). After
construction the map is rebuilt in the optimizer's order (fp32 parameters, then bf16 ones); unmixed groups are
unchanged.
"""
from __future__ import annotations

from typing import Any, Dict

__all__ = ["install", "PATCHES"]

#: megatron-core symbol -> why it is patched (one line each).
PATCHES: Dict[str, str] = {}


def _keep_restored_step(original):
    def _set_main_param_and_optimizer_states(self, model_param, tensors: Dict[str, Any]):
        if "step" not in tensors and not getattr(self.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8",
                                                 False):
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state.get(main_param, {}).get("step")
            if step is not None:
                tensors = {**tensors, "step": step}
        return original(self, model_param, tensors)

    _set_main_param_and_optimizer_states.__wrapped__ = original
    return _set_main_param_and_optimizer_states


def _unshared_steps(original):
    def load_state_dict(self, state_dict):
        out = original(self, state_dict)
        seen = set()
        for st in self.optimizer.state.values():
            step = st.get("step") if isinstance(st, dict) else None
            if step is not None and hasattr(step, "clone"):
                if id(step) in seen:
                    st["step"] = step.clone()
                seen.add(id(st["step"]))
        return out

    load_state_dict.__wrapped__ = original
    return load_state_dict


def group_index_map_in_optimizer_order(model_fp32_groups, model_float16_groups) -> Dict[Any, tuple]:
    """{model parameter: (group index, position in the torch optimizer's param group)} for groups whose optimizer
    params are ``[*fp32 shards, *fp32 main shards of the bf16 / fp16 params]`` (megatron's order)."""
    out = {}
    for gi, (fp32, half) in enumerate(zip(model_fp32_groups, model_float16_groups)):
        for j, p in enumerate(list(fp32) + list(half)):
            out[p] = (gi, j)
    return out


def _ordered_group_index_map(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if not hasattr(self, "model_fp32_groups") or not hasattr(self, "model_param_group_index_map"):
            return  # (megatron's FSDP path builds neither)
        fixed = group_index_map_in_optimizer_order(self.model_fp32_groups, self.model_float16_groups)
        if set(fixed) != set(self.model_param_group_index_map):
            raise RuntimeError("distributed optimizer: the parameters of model_param_group_index_map differ from "
                               "its fp32 / fp16 groups; cannot order the map")
        self.model_param_group_index_map = fixed

    __init__.__wrapped__ = original
    __init__.orders_group_index_map = True  # (cpu_compat also wraps __init__: a marker of this wrapper's own)
    return __init__


def install() -> None:
    """Patch ``DistributedOptimizer`` (see the module docstring)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    name = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer."
    method = DistributedOptimizer._set_main_param_and_optimizer_states
    if not hasattr(method, "__wrapped__"):
        DistributedOptimizer._set_main_param_and_optimizer_states = _keep_restored_step(method)
    PATCHES[name + "_set_main_param_and_optimizer_states"] = (
        "copies torch Adam's per-parameter 'step' from checkpoint tensors that hold none (KeyError on load)")
    if not getattr(DistributedOptimizer.__init__, "orders_group_index_map", False):
        DistributedOptimizer.__init__ = _ordered_group_index_map(DistributedOptimizer.__init__)
    PATCHES[name + "__init__"] = (
        "indexes each parameter's main shard by model order, but a group mixing fp32 and bf16 parameters holds "
        "the fp32 ones first (checkpoints read the wrong parameter's state)")
    if not hasattr(DistributedOptimizer.load_state_dict, "__wrapped__"):
        DistributedOptimizer.load_state_dict = _unshared_steps(DistributedOptimizer.load_state_dict)
    PATCHES[name + "load_state_dict"] = (
        "puts one 'step' tensor into every parameter's torch Adam state; Adam increments it once per parameter")
