"""Finish reasons: a response whose last token is a stop token finished with ``"stop"``, whatever else is true.

When the token that reaches ``max_new_tokens`` is itself EOS or a stop id, two conditions hold at once. An
engine that checks the length first (older SGLang schedulers, the embedded engine before this module) says
``"length"``; in async interrupt mode a ``"length"`` row is continued in the next segment, so the response
would get an EOS in the middle followed by new tokens, and reward, log-probs and advantages would be computed
on it. The rule here (what a user expects and what SGLang >= 0.5 does): a stop token at the last position
wins, the reason is ``"stop"``. Both engines normalise their rollouts with it, and the segmented view of
``trainer/async_rollout`` applies it again before deciding which rows continue (a third-party engine that
still reports ``"length"`` is then harmless too).

* ``stop_ids(sampling, eos_ids)``: the ids that end a response — ``sampling.stop_token_ids`` plus the
  model's ``eos_ids``; none at all with ``sampling.ignore_eos`` ("keep generating past EOS / stop ids":
  SGLang 0.5.23's ``Req._check_token_based_finish`` returns before it looks at ``stop_token_ids`` when
  ``ignore_eos`` is set, and the embedded engine follows the same rule).
* ``normalised_finish(reason, response_ids, stops)``: ``"stop"`` when the last response token is in
  ``stops``, else ``reason`` unchanged.

Usage::

    stops = stop_ids(sampling, engine_eos_ids)
    reason = normalised_finish(reason, response_ids, stops)
"""
from __future__ import annotations

from typing import Iterable, Sequence

__all__ = ["stop_ids", "normalised_finish"]


def stop_ids(sampling, eos_ids: Iterable[int] = ()) -> frozenset:
    """The token ids that end a response under ``sampling`` (a ``SamplingParams``) for a model whose EOS ids
    are ``eos_ids``: the stop ids plus ``eos_ids``; empty with ``sampling.ignore_eos`` (as SGLang: it then
    ignores ``stop_token_ids`` too)."""
    if sampling.ignore_eos:
        return frozenset()
    return frozenset(int(t) for t in sampling.stop_token_ids) | frozenset(int(t) for t in eos_ids)


def normalised_finish(reason: str, response_ids: Sequence[int], stops: frozenset) -> str:
    """``"stop"`` if the last of ``response_ids`` is one of ``stops`` (a stop token at the length limit
    ends the response), else ``reason``."""
    if len(response_ids) and int(response_ids[-1]) in stops:
        return "stop"
    return reason
