"""Translate user dicts (verl's latest block, seed-era flat keys, presets) into config kwargs.

Accepted, in one dict:
  * verl's latest ``algorithm.rollout_correction`` keys, as is (``debug_rollout_actor_probs`` is
    accepted and ignored: it is a verl diagnostic with no effect here);
  * ``preset: <name>`` plus that preset's keyword arguments;
  * seed-era keys (verl PRs 2953 / 3694 / 3984 / 4070), each translated with a one-line hint:

    ======================================  ===================================================
    seed-era key                            today
    ======================================  ===================================================
    rollout_is_level: L                     rollout_is: L
    rollout_is: true / false (bool)         rollout_is: <level> / null (metrics only)
    rollout_is_mode: truncate | mask        rollout_is_threshold: C | "lo_hi"
    rollout_is_threshold_lower: lo          the lo of "lo_hi" (mask); truncate derives 1/C
    rollout_is_veto_threshold: v            rollout_token_veto_threshold: v
    rollout_rs: token|sequence|geometric    rollout_rs: token_k1 | seq_sum_k1 | seq_mean_k1
    rollout_rs_threshold_lower: lo          rollout_rs_threshold: "lo_hi"
    bypass_old_logprob_for_rollout: b       bypass_mode: b
    use_pure_rollout_correction: b          loss_type: reinforce (b true)
    use_policy_gradient: b                  loss_type: reinforce (b true)
    tis_imp_ratio_cap: C  (actor key)       rollout_is: token, rollout_is_threshold: C
    ======================================  ===================================================

Unknown keys raise ValueError naming the key and the nearest valid one.
"""
from __future__ import annotations

import difflib
import logging
from typing import Any, Dict, Iterable, Optional

log = logging.getLogger("megatron_rl.correction")

LEGACY_KEYS = (
    "rollout_is_level", "rollout_is_mode", "rollout_is_threshold_lower", "rollout_is_veto_threshold",
    "rollout_rs_threshold_lower", "bypass_old_logprob_for_rollout", "use_pure_rollout_correction",
    "use_policy_gradient", "tis_imp_ratio_cap",
)
IGNORED_VERL_KEYS = ("debug_rollout_actor_probs",)
_SEED_RS_LEVELS = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}


def _hint(old: str, new: str) -> None:
    log.warning("rollout_correction: seed-era key %s -> write %s", old, new)


def _lo_hi(upper: Any, lower: Optional[Any]) -> str:
    upper = float(upper)
    return f"{(1.0 / upper) if lower is None else float(lower)}_{upper}"


def translate(d: Optional[Dict[str, Any]], valid_keys: Iterable[str], presets: Iterable[str]) -> Dict[str, Any]:
    """Return keyword arguments for ``RolloutCorrectionConfig`` (validation happens there)."""
    if d is None:
        return {"rollout_is": None, "rollout_rs": None}
    if not isinstance(d, dict):
        raise ValueError(f"rollout_correction: expected a mapping, got {type(d).__name__}")
    d = dict(d)
    valid_keys = list(valid_keys)
    presets = list(presets)

    if "preset" in d:
        name = d.pop("preset")
        if name not in presets:
            near = difflib.get_close_matches(str(name), presets, n=1)
            raise ValueError(f"rollout_correction.preset: unknown preset {name!r}"
                             + (f" (did you mean {near[0]!r}?)" if near else "")
                             + f"; presets: {', '.join(presets)}")
        from megatron_rl.correction.config import RolloutCorrectionConfig

        overrides = {k: d.pop(k) for k in list(d) if k in valid_keys}
        try:
            cfg = getattr(RolloutCorrectionConfig, name)(**d)
        except TypeError as exc:
            raise ValueError(f"rollout_correction.preset={name}: bad preset arguments {sorted(d)}: {exc}") from None
        out = cfg.to_dict()
        out.update(overrides)
        return out

    unknown = [k for k in d if k not in valid_keys and k not in LEGACY_KEYS and k not in IGNORED_VERL_KEYS]
    if unknown:
        k = unknown[0]
        near = difflib.get_close_matches(k, valid_keys + list(LEGACY_KEYS), n=1)
        raise ValueError(f"rollout_correction: unknown key {k!r}"
                         + (f" (did you mean {near[0]!r}?)" if near else "")
                         + f"; valid keys: {', '.join(valid_keys)}")
    for k in IGNORED_VERL_KEYS:
        if d.pop(k, None):
            log.warning("rollout_correction: %s is a verl-only diagnostic; ignored", k)

    out: Dict[str, Any] = {}
    # --- IS level / on-off
    level = d.pop("rollout_is_level", None)
    if level is not None:
        _hint("rollout_is_level", f"rollout_is: {level}")
    is_value = d.pop("rollout_is", None) if "rollout_is" in d else ("unset" if level is None else True)
    if isinstance(is_value, bool):
        _hint("rollout_is: <bool>", "rollout_is: <level> (or null for metrics only)")
        out["rollout_is"] = (level or "token") if is_value else None
    elif is_value == "unset":
        pass
    else:
        out["rollout_is"] = is_value
    if "tis_imp_ratio_cap" in d:
        cap = d.pop("tis_imp_ratio_cap")
        _hint("tis_imp_ratio_cap", f"rollout_is: token, rollout_is_threshold: {cap}")
        if cap is not None:
            out["rollout_is"] = "token"
            out["rollout_is_threshold"] = float(cap)

    # --- IS threshold / mode
    mode = d.pop("rollout_is_mode", None)
    lower = d.pop("rollout_is_threshold_lower", None)
    if "rollout_is_threshold" in d:
        thr = d.pop("rollout_is_threshold")
        if thr is None:  # seed era: null threshold switched IS off
            _hint("rollout_is_threshold: null", "rollout_is: null")
            out["rollout_is"] = None
        else:
            out["rollout_is_threshold"] = thr
    if mode is not None:
        if mode not in ("truncate", "mask"):
            raise ValueError(f"rollout_is_mode: {mode!r} is not 'truncate' or 'mask'")
        upper = out.get("rollout_is_threshold", 2.0)
        if mode == "mask":
            spec = _lo_hi(upper, lower)
            _hint("rollout_is_mode: mask", f'rollout_is_threshold: "{spec}"')
            out["rollout_is_threshold"] = spec
        else:
            _hint("rollout_is_mode: truncate", f"rollout_is_threshold: {upper}")
    elif lower is not None:
        _hint("rollout_is_threshold_lower", '"lo_hi" in rollout_is_threshold (mask) — truncate derives 1/C')

    # --- veto
    if "rollout_is_veto_threshold" in d:
        v = d.pop("rollout_is_veto_threshold")
        _hint("rollout_is_veto_threshold", f"rollout_token_veto_threshold: {v}")
        out["rollout_token_veto_threshold"] = v

    # --- RS: seed-era level names and separate lower bound
    rs_lower = d.pop("rollout_rs_threshold_lower", None)
    rs = d.pop("rollout_rs", None) if "rollout_rs" in d else "unset"
    if rs != "unset":
        if isinstance(rs, str) and rs.strip() in _SEED_RS_LEVELS:
            new = _SEED_RS_LEVELS[rs.strip()]
            thr = d.get("rollout_rs_threshold")
            spec = _lo_hi(thr, rs_lower) if thr is not None and not isinstance(thr, str) else thr
            _hint(f"rollout_rs: {rs}", f'rollout_rs: {new}, rollout_rs_threshold: "{spec}"')
            out["rollout_rs"] = new
            if spec is not None:
                d["rollout_rs_threshold"] = spec
        else:
            out["rollout_rs"] = rs
    elif rs_lower is not None:
        raise ValueError("rollout_rs_threshold_lower: set without rollout_rs")

    # --- modes
    for old in ("bypass_old_logprob_for_rollout",):
        if old in d:
            val = d.pop(old)
            _hint(old, f"bypass_mode: {val}")
            out["bypass_mode"] = bool(val)
    for old in ("use_pure_rollout_correction", "use_policy_gradient"):
        if old in d:
            val = d.pop(old)
            _hint(old, "loss_type: reinforce" if val else "loss_type: ppo_clip")
            out["loss_type"] = "reinforce" if val else out.get("loss_type", "ppo_clip")

    out.update(d)  # remaining keys are current ones
    return out
