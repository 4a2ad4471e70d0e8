"""GDPO's reward components per row (``algorithm.gdpo_reward_keys``): the named keys of each row's dict reward, as
verl reads them from ``non_tensor_batch`` (the reward manager's ``reward_extra_info``). The rule: built on rank 0
before the rows are split, so a missing key is one error naming the key (on every rank, as rank 0's failures are);
a row whose reward failed (no dict) gets 0.0 for every component, as its reward is 0.0; "score" is the reward
before the overlong penalty."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence


def reward_components(extras: Sequence[Optional[Dict[str, float]]], scores: Sequence[float],
                      keys: Sequence[str]) -> List[List[float]]:
    """Per row, ``[value of each key]`` (see the module docstring); ValueError naming the key and the row."""
    out = []
    for i, (e, s) in enumerate(zip(extras, scores)):
        if e is None:
            out.append([0.0] * len(keys))
            continue
        have = {"score": float(s), **e}
        missing = [k for k in keys if k not in have]
        if missing:
            raise ValueError(f"algorithm.gdpo_reward_keys: {missing} not in the reward of row {i}; the reward "
                             f"function returned {sorted(have)} (return a dict with these keys)")
        out.append([float(have[k]) for k in keys])
    return out
