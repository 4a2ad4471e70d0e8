"""The optimizer part of an actor checkpoint across optimizer kinds, and whose settings a resume runs with.

Kinds (megatron's optimizer as ``actor/optimizer.py`` builds it), told apart by a checkpoint's tensor keys:

=============== ============================================ ======================================================
kind            tensors (per model weight ``<w>``)           param groups and Adam's step
=============== ============================================ ======================================================
``distributed`` ``optimizer.state.{param,exp_avg,exp_avg_sq}.<w>`` ``optimizer.param_groups`` (no params), ``step``
                (``actor.use_distributed_optimizer``)        in each group
``mixed``       ``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<w>`` ``optimizer.param_groups``,
                (``actor.bf16`` without it)                  ``optimizer.state.common_step``
``fp32``        ``optimizer.state.{exp_avg,exp_avg_sq}.<w>``  ``param_groups``, ``state.common_step`` (top level)
                (the fp32 model weight ``<w>`` is the main
                parameter)
=============== ============================================ ======================================================

All three hold the same fp32 values (main parameter, both moments, the step), so a checkpoint of one kind loads
into another exactly: ``redirect_main_params`` points each requested main parameter at the saved one (the other
kind's key, or an fp32 model weight), ``convert_loaded_state`` moves the param groups and the step to where the
loading optimizer reads them. A main parameter that exists only as a bf16 model weight is never used in its place.

Settings: torch's ``load_state_dict`` restores every param-group key (betas, eps, lr, weight decay, megatron's
max_lr / min_lr ...). ``group_settings`` before loading and ``impose_group_settings`` on the loaded state dict keep
the values this run's config built; what differed is reported by name (``settings_line``).
"""
from __future__ import annotations

import copy
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from megatron_rl.actor.chained import sub_optimizers, torch_optimizers

__all__ = ["KINDS", "saved_kind", "optimizer_kind", "redirect_main_params", "convert_loaded_state",
           "group_settings", "impose_group_settings", "group_changes", "settings_changes", "settings_line"]

KINDS = ("distributed", "mixed", "fp32")
#: a main parameter's key: (prefix, its spelling — fp32_param: mixed, param: distributed —, model weight)
_MAIN_KEY = re.compile(r"^((?:chained_\d+\.)?optimizer\.state\.)(fp32_param|param)\.(.+)$")
_OTHER = {"fp32_param": "param", "param": "fp32_param"}
#: param-group keys the schedule sets (reported as actor.lr / actor.weight_decay by ``settings_changes``)
_SCHEDULED = ("lr", "weight_decay")
#: megatron's param-group identity that no actor setting changes (``param_group_identifier_keys`` of megatron-core 0.16)
_GROUP_ID = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
#: param-group keys -> the actor keys they come from
_GROUP_NAMES = {"max_lr": "actor.lr", "min_lr": "actor.min_lr", "eps": "adam_eps (megatron's OptimizerConfig)"}


def saved_kind(saved_keys) -> str:
    """The optimizer kind a checkpoint was written by, from its tensor keys."""
    spellings = {m.group(2) for m in map(_MAIN_KEY.match, saved_keys) if m}
    if "param" in spellings:
        return "distributed"
    return "mixed" if "fp32_param" in spellings else "fp32"


def optimizer_kind(optimizer) -> str:
    """The kind of a (chained) megatron optimizer built by ``actor/optimizer.py``."""
    inner = sub_optimizers(optimizer)[0]
    if hasattr(inner, "shard_fp32_from_float16_groups"):
        return "distributed"
    return "mixed" if hasattr(inner, "fp32_from_float16_groups") else "fp32"


def _map_sharded(fn, obj) -> None:
    """Apply ``fn`` to every leaf of a nested dict / list (megatron's sharded state dict), in place."""
    if isinstance(obj, dict):
        for v in obj.values():
            _map_sharded(fn, v)
    elif isinstance(obj, list):
        for v in obj:
            _map_sharded(fn, v)
    else:
        fn(obj)


def redirect_main_params(optimizer_sd, saved_keys, weights_are_fp32: bool) -> Tuple[int, List[str]]:
    """Point every requested main parameter the checkpoint lacks at the saved fp32 tensor holding it: the other
    optimizer kind's main parameter, or — ``weights_are_fp32`` (an fp32 actor's checkpoint) — the model weight.
    Returns (main parameters now read from model weights, keys found nowhere in fp32)."""
    to_weights, missing = 0, []

    def redirect(x):
        nonlocal to_weights
        key = getattr(x, "key", None)
        m = _MAIN_KEY.match(key) if isinstance(key, str) else None
        if m is None or key in saved_keys:
            return
        prefix, spelling, weight = m.groups()
        other = f"{prefix}{_OTHER[spelling]}.{weight}"
        if other in saved_keys:
            x.key = other
        elif weights_are_fp32 and weight in saved_keys:
            x.key = weight
            to_weights += 1
        else:
            missing.append(key)

    _map_sharded(redirect, optimizer_sd)
    return to_weights, missing


def _per_optimizer(sd) -> list:
    """The state dicts of the optimizers in a loaded (possibly chained: {index: sd}) optimizer state dict."""
    if isinstance(sd, list):
        return sd
    if isinstance(sd, dict) and sd and all(isinstance(k, int) for k in sd):
        return [sd[k] for k in sorted(sd)]
    return [sd]


def _without(group: Mapping, *keys: str) -> Dict[str, Any]:
    return {k: v for k, v in group.items() if k not in keys}


def convert_loaded_state(optimizer_sd, saved: str, now: str) -> None:
    """Rewrite, in place, the non-tensor part of an optimizer state dict loaded from a checkpoint of kind ``saved``
    (param groups, Adam's step) into the layout an optimizer of kind ``now`` loads. The tensors are already
    where ``now`` wants them (``redirect_main_params``); param ids are this run's."""
    if saved == now:
        return
    for sd in _per_optimizer(optimizer_sd):
        _convert_one(sd, saved, now)


def _saved_step(groups: Sequence[Mapping], common_step) -> Optional[int]:
    """Adam's step a checkpoint holds: megatron's ``common_step`` (torch's AdamW keeps the step per parameter), else
    the param groups' (Transformer Engine / apex FusedAdam keep it there; a group without parameters is never
    stepped and does not count). None when it holds neither (saved before the first step)."""
    if common_step is not None:
        return int(round(float(common_step)))
    steps = {int(round(float(g["step"]))) for g in groups
             if g.get("step") is not None and g.get("params", [None]) != []}
    if len(steps) > 1:
        raise ValueError(f"optimizer checkpoint: param groups at different steps {sorted(steps)}")
    return steps.pop() if steps else None


def _convert_one(sd: dict, saved: str, now: str) -> None:
    # this run's param ids (non-persistent in megatron's checkpoints: where the loading optimizer requested them)
    here = sd.get("param_groups") if now == "fp32" else (sd.get("optimizer") or {}).get("param_groups")
    params = [g.get("params") for g in here or []]
    if saved == "fp32":
        groups, state = sd.pop("param_groups"), sd.pop("state", {})
    else:
        inner = sd.pop("optimizer") if now == "fp32" else sd["optimizer"]
        groups, state = inner["param_groups"], inner.get("state") or {}
    step = _saved_step(groups, state.get("common_step") if saved != "distributed" else None)
    for k in (("param_state", "param_state_sharding_type") if now != "distributed" else ()) + (
            ("fp32_from_fp16_params",) if now != "mixed" else ()):
        sd.pop(k, None)  # (the saving kind's entries the loading one does not read)
    # every kind gets the step in each group (FusedAdam's and the distributed optimizer's; torch's AdamW ignores it)
    groups = [{**_without(g, "params", "step"), **({} if step is None else {"step": step})} for g in groups]
    if now == "distributed":
        sd["optimizer"] = {"param_groups": [{**g, "step": g.get("step", 0)} for g in groups]}
        sd.setdefault("param_state_sharding_type", "fully_reshardable")
        return
    if len(params) != len(groups) or any(p is None for p in params):
        raise ValueError(f"optimizer checkpoint of kind {saved!r}: {len(groups)} param groups, the {now!r} optimizer "
                         f"loading it has {len(params)}")
    new_groups = [{**g, "params": p} for g, p in zip(groups, params)]
    target = sd if now == "fp32" else sd.setdefault("optimizer", {})
    target["param_groups"] = new_groups
    if step is not None:  # (megatron puts it into each parameter's state: torch's AdamW)
        target.setdefault("state", {})["common_step"] = torch.as_tensor(float(step), dtype=torch.float32)


def group_settings(optimizer) -> List[List[dict]]:
    """A copy of every param group's settings (all keys but params and step): what this run's config built; one
    list per sub-optimizer (``chained.sub_optimizers``, as its state dict's entries; empty without a torch one)."""
    return [[copy.deepcopy(_without(g, "params", "step")) for g in (o.param_groups if o is not None else [])]
            for o in torch_optimizers(optimizer)]


def _loaded_groups(sd: dict, kind: str) -> list:
    """The param groups of one optimizer's loaded state dict of ``kind`` (``convert_loaded_state`` done)."""
    return sd["param_groups"] if kind == "fp32" else sd["optimizer"]["param_groups"]


def impose_group_settings(optimizer_sd, kind: str, settings: List[List[dict]]) -> List[List[dict]]:
    """Write this run's settings (``group_settings``, taken before loading) into the param groups of a loaded
    optimizer state dict of ``kind``, so that loading it keeps them (megatron-core 0.19 also matches groups by
    max_lr / min_lr: a changed lr would not load otherwise). Groups pair by megatron's config-independent identity
    (wd_mult, lr_mult, expert-parallel, decoupled lr), else by position. Returns the checkpoint's settings, in the
    order of ``settings``, for ``group_changes``."""
    saved = []
    for sd, now_groups in zip(_per_optimizer(optimizer_sd), settings):
        if not now_groups:  # (a sub-optimizer without a torch optimizer on this rank)
            saved.append([])
            continue
        groups = _loaded_groups(sd, kind)
        ids = [tuple(g.get(k) for k in _GROUP_ID) for g in groups]
        by_id = dict(zip(ids, groups)) if len(set(ids)) == len(ids) else {}
        pairs = []
        for i, now in enumerate(now_groups):
            g = by_id.get(tuple(now.get(k) for k in _GROUP_ID)) if by_id else None
            pairs.append((g if g is not None else groups[i], now))
        saved.append([_without(g, "params", "step") for g, _ in pairs])
        for g, now in pairs:
            for k in [k for k in g if k not in now and k not in ("params", "step")]:
                del g[k]
            g.update(copy.deepcopy(now))
    return saved


def group_changes(loaded: List[List[dict]], now: List[List[dict]]) -> Dict[str, Tuple[Any, Any]]:
    """{name: (checkpoint's, this run's)} of the param-group settings that differ (Adam's betas as
    ``actor.adam_beta1`` / ``actor.adam_beta2``; the scheduled lr / weight decay left to ``settings_changes``)."""
    out: Dict[str, Tuple[Any, Any]] = {}
    for groups_l, groups_n in zip(loaded, now):
        for gl, gn in zip(groups_l, groups_n):
            for k in sorted(set(gl) | set(gn)):
                a, b = gl.get(k), gn.get(k)
                if k in _SCHEDULED or a == b:
                    continue
                if k == "betas" and a is not None and b is not None:
                    for i, (x, y) in enumerate(zip(a, b)):
                        if x != y:
                            out.setdefault(f"actor.adam_beta{i + 1}", (x, y))
                else:
                    out.setdefault(_GROUP_NAMES.get(k, f"param group key {k!r}"), (a, b))
    return out


def settings_changes(saved: Optional[Mapping[str, Any]], now: Mapping[str, Any]) -> Dict[str, Tuple[Any, Any]]:
    """{``actor.<key>``: (checkpoint's, this run's)} of the optimizer settings recorded at save (``saved``; None
    for a checkpoint written before they were) that differ from this run's."""
    if not saved:
        return {}
    return {f"actor.{k}": (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}


def settings_line(changes: Mapping[str, Tuple[Any, Any]], where: str) -> Optional[str]:
    """The one line a resume prints when optimizer settings differ from the checkpoint's, or None."""
    if not changes:
        return None
    diff = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in sorted(changes.items()))
    return (f"[megatron-rl] resumed {where} with this run's optimizer settings, which differ from the checkpoint's: "
            f"{diff}")
