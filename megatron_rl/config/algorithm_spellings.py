"""verl's spellings of ``algorithm:`` keys accepted beside this project's: ``adv_estimator`` for
``advantage_estimator`` and ``norm_adv_by_std_in_grpo`` for ``norm_adv_by_std``. The rule: one key, two spellings --
the verl one is moved onto the project's before the section is built, and both given with different values is an
error naming both (never a silent pick)."""
from __future__ import annotations

import copy
from typing import Any, Dict, List

#: verl's key -> this project's (both under ``algorithm:``).
VERL_SPELLINGS = {"adv_estimator": "advantage_estimator", "norm_adv_by_std_in_grpo": "norm_adv_by_std"}


def merge_verl_spellings(tree: Dict[str, Any], errors: List[str]) -> Dict[str, Any]:
    """``tree`` with ``algorithm.<verl key>`` moved onto ``algorithm.<project key>`` (a copy when anything moves);
    a conflict appends one error naming both keys and keeps the project's key."""
    algo = tree.get("algorithm")
    if not isinstance(algo, dict) or not any(k in algo for k in VERL_SPELLINGS):
        return tree
    tree = copy.deepcopy(tree)
    algo = tree["algorithm"]
    for verl_key, ours in VERL_SPELLINGS.items():
        if verl_key not in algo:
            continue
        value = algo.pop(verl_key)
        if ours in algo and algo[ours] != value:
            errors.append(f"algorithm.{verl_key}: {value!r} conflicts with algorithm.{ours}: {algo[ours]!r} (two "
                          f"spellings of one key; give one of them)")
            continue
        algo[ours] = value
    return tree
