"""Translate a user's ``rollout_correction`` dict (verl's latest block or seed-era keys) into config kwargs.

``TRANSLATORS`` is the table: each entry names the keys it reads and a function from those present to config
kwargs, run in table order; keys no entry reads are current keys, applied last, so an explicit current key wins
over a translated seed-era one. This module knows nothing of the config class (presets are
``RolloutCorrectionConfig.from_dict``'s), so there is no import circle. Every seed-era key and what it
becomes: docs/migration.md.
"""
from __future__ import annotations

import difflib
import logging
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

log = logging.getLogger("megatron_rl.correction")

IGNORED_VERL_KEYS = ("debug_rollout_actor_probs",)
"""verl keys accepted and ignored (verl-only diagnostics)."""

_SEED_RS_LEVELS = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}
_IS_MODES = ("truncate", "mask")

Kwargs = Dict[str, Any]


def _hint(old: str, new: str) -> None:
    log.warning("rollout_correction: seed-era key %s -> write %s", old, new)


def _lo_hi(upper: Any, lower: Optional[Any]) -> str:
    """``"lo_hi"`` from an upper bound and an optional lower one (default 1/upper)."""
    upper = float(upper)
    return f"{(1.0 / upper) if lower is None else float(lower)}_{upper}"


# ---------------------------------------------------------------------- one translator per key group
def _is_level(given: Kwargs, out: Kwargs) -> None:
    """rollout_is_level: L and rollout_is: <bool> -> rollout_is: L / None; a string rollout_is passes."""
    level = given.get("rollout_is_level")
    if level is not None:
        _hint("rollout_is_level", f"rollout_is: {level}")
    if "rollout_is" in given:
        value = given["rollout_is"]
    elif level is not None:
        value = True  # seed era: a level alone switched IS on
    else:
        return
    if isinstance(value, bool):
        _hint("rollout_is: <bool>", "rollout_is: <level> (or null for metrics only)")
        out["rollout_is"] = (level or "token") if value else None
    else:
        out["rollout_is"] = value


def _tis_cap(given: Kwargs, out: Kwargs) -> None:
    """Actor-era tis_imp_ratio_cap: C -> token TIS at C (null: nothing)."""
    cap = given["tis_imp_ratio_cap"]
    _hint("tis_imp_ratio_cap", f"rollout_is: token, rollout_is_threshold: {cap}")
    if cap is not None:
        out["rollout_is"] = "token"
        out["rollout_is_threshold"] = float(cap)


def _is_threshold(given: Kwargs, out: Kwargs) -> None:
    """rollout_is_threshold (null switched IS off), rollout_is_mode, rollout_is_threshold_lower."""
    if "rollout_is_threshold" in given:
        if given["rollout_is_threshold"] is None:
            _hint("rollout_is_threshold: null", "rollout_is: null")
            out["rollout_is"] = None
        else:
            out["rollout_is_threshold"] = given["rollout_is_threshold"]
    mode, lower = given.get("rollout_is_mode"), given.get("rollout_is_threshold_lower")
    if mode is not None:
        if mode not in _IS_MODES:
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


def _veto(given: Kwargs, out: Kwargs) -> None:
    """rollout_is_veto_threshold: v -> rollout_token_veto_threshold: v."""
    v = given["rollout_is_veto_threshold"]
    _hint("rollout_is_veto_threshold", f"rollout_token_veto_threshold: {v}")
    out["rollout_token_veto_threshold"] = v


def _rs(given: Kwargs, out: Kwargs) -> None:
    """rollout_rs seed levels (token / sequence / geometric) with a separate lower bound -> k1 options."""
    lower = given.get("rollout_rs_threshold_lower")
    if "rollout_rs_threshold" in given:
        out["rollout_rs_threshold"] = given["rollout_rs_threshold"]
    if "rollout_rs" not in given:
        if lower is not None:
            raise ValueError("rollout_rs_threshold_lower: set without rollout_rs")
        return
    rs = given["rollout_rs"]
    if not (isinstance(rs, str) and rs.strip() in _SEED_RS_LEVELS):
        out["rollout_rs"] = rs
        return
    new = _SEED_RS_LEVELS[rs.strip()]
    thr = given.get("rollout_rs_threshold")
    spec = _lo_hi(thr, lower) if thr is not None and not isinstance(thr, str) else thr
    _hint(f"rollout_rs: {rs}", f'rollout_rs: {new}, rollout_rs_threshold: "{spec}"')
    out["rollout_rs"] = new
    if spec is not None:
        out["rollout_rs_threshold"] = spec


def _bypass(given: Kwargs, out: Kwargs) -> None:
    """bypass_old_logprob_for_rollout: b -> bypass_mode: b."""
    value = given["bypass_old_logprob_for_rollout"]
    _hint("bypass_old_logprob_for_rollout", f"bypass_mode: {value}")
    out["bypass_mode"] = bool(value)


def _policy_gradient(given: Kwargs, out: Kwargs) -> None:
    """use_pure_rollout_correction / use_policy_gradient: true -> loss_type: reinforce."""
    for old in ("use_pure_rollout_correction", "use_policy_gradient"):
        if old in given:
            value = given[old]
            _hint(old, "loss_type: reinforce" if value else "loss_type: ppo_clip")
            out["loss_type"] = "reinforce" if value else out.get("loss_type", "ppo_clip")


TRANSLATORS: Tuple[Tuple[Tuple[str, ...], Callable[[Kwargs, Kwargs], None]], ...] = (
    (("rollout_is_level", "rollout_is"), _is_level),
    (("tis_imp_ratio_cap",), _tis_cap),
    (("rollout_is_threshold", "rollout_is_mode", "rollout_is_threshold_lower"), _is_threshold),
    (("rollout_is_veto_threshold",), _veto),
    (("rollout_rs", "rollout_rs_threshold", "rollout_rs_threshold_lower"), _rs),
    (("bypass_old_logprob_for_rollout",), _bypass),
    (("use_pure_rollout_correction", "use_policy_gradient"), _policy_gradient),
)
"""(keys read, translator) in the order they run."""

LEGACY_KEYS = ("rollout_is_level", "rollout_is_mode", "rollout_is_threshold_lower", "rollout_is_veto_threshold",
               "rollout_rs_threshold_lower", "bypass_old_logprob_for_rollout", "use_pure_rollout_correction",
               "use_policy_gradient", "tis_imp_ratio_cap")
"""Seed-era keys that are not fields of today's config (accepted, translated with a hint)."""


def unknown_keys_message(keys: List[str], valid_keys: List[str]) -> str:
    """``rollout_correction: unknown key 'k' (did you mean ...?)`` for every key, then the valid keys."""
    parts = []
    for k in keys:
        near = difflib.get_close_matches(k, valid_keys + list(LEGACY_KEYS), n=1)
        parts.append(f"unknown key {k!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    return f"rollout_correction: {'; '.join(parts)}; valid keys: {', '.join(valid_keys)}"


def translate(d: Dict[str, Any], valid_keys: Iterable[str]) -> Kwargs:
    """Keyword arguments for ``RolloutCorrectionConfig`` from a user mapping (validation happens there).

    Raises ValueError naming every unknown key (with the nearest valid one)."""
    if not isinstance(d, dict):
        raise ValueError(f"rollout_correction: expected a mapping, got {type(d).__name__}")
    valid_keys = list(valid_keys)
    unknown = [k for k in d if k not in valid_keys and k not in LEGACY_KEYS and k not in IGNORED_VERL_KEYS]
    if unknown:
        raise ValueError(unknown_keys_message(unknown, valid_keys))
    for k in IGNORED_VERL_KEYS:
        if d.get(k):
            log.warning("rollout_correction: %s is a verl-only diagnostic; ignored", k)
    read = {k for keys, _ in TRANSLATORS for k in keys} | set(IGNORED_VERL_KEYS)
    out: Kwargs = {}
    for keys, translator in TRANSLATORS:
        given = {k: d[k] for k in keys if k in d}
        if given:
            translator(given, out)
    out.update({k: v for k, v in d.items() if k not in read})  # current keys, applied last
    return out
