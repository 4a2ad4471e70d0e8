"""DAPO's dynamic sampling (``algorithm.filter_groups``, verl's names): a step trains the prompt groups whose
samples did not all score alike, and draws more prompts until ``data.prompts_per_step`` such groups fill its batch.

    gen = DynamicSampling(inner, cfg)               # build_step_generator wraps SingleTurn / MultiTurn when enabled
    batch = gen.generate(engine, step, version)     # rank 0: rounds of inner.generate(engine, step, version, rnd)
    keep = groups_with_signal(values, n)            # the selection rule, a pure function

Rule: values are compared exactly, in float32 as the trainer reads rewards (verl's ``std > 0`` on floats can keep
an alike group through rounding); a step exhausted with ``on_exhausted: skip`` is ``StepBatch.skipped``. Rounds,
exhaustion and the ``filter_groups/*`` metrics: docs/trainer.md.
"""
from __future__ import annotations

import sys
import warnings
from array import array
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_rl.rollout.base import RolloutError
from megatron_rl.rollout.versions import parse_version, version_tag
from megatron_rl.trainer.reward_failures import RewardFailureError, reward_failure_error
from megatron_rl.trainer.step_batch import StepBatch

__all__ = ["DynamicSampling", "FilterGroupsExhaustedWarning", "FilterGroupsExhaustedError", "FilterMetricError",
           "groups_with_signal", "SKIPPED", "merge_round_metrics"]

SKIPPED = "filter_groups/skipped"
"""The metric every rank reads to skip a step's training (1.0: skipped)."""

#: Step metrics that are counts (and the reward model's time): summed over the rounds (every other one is a
#: row-weighted mean, or max / min).
COUNT_METRICS = ("reward/failed", "reward/timed_out", "response/truncated_count", "routing/missing_rows",
                 "reward/judge_failures", "reward/rm_failures", "reward/rm_batches", "reward/rm_latency_s")

#: Per-row fields of a ``StepBatch`` (lists with one entry per row, or empty / None when the batch has none).
ROW_FIELDS = ("prompt_ids", "response_ids", "rollout_log_probs", "rewards", "routing", "truncated",
              "token_versions", "loss_masks", "scores", "reward_extras", "reward_baselines",
              "reward_components")
#: ``algorithm.filter_groups.metric`` values that are not reward keys (``metric_values``).
BATCH_METRICS = ("seq_reward", "seq_final_reward", "score")
#: The reward key a float reward has too: its score, as verl's DAPO reward manager records it
#: (``reward_extra_info["acc"] = score`` for a non-dict result, verl/workers/reward_manager/dapo.py).
FLOAT_ACC = "acc"


class FilterGroupsExhaustedWarning(UserWarning):
    """``algorithm.filter_groups.max_num_gen_batches`` rounds found fewer groups with signal than the batch needs."""


class FilterGroupsExhaustedError(RolloutError):
    """The same, with ``algorithm.filter_groups.on_exhausted: error`` (raised on every rank; the step is not trained)."""


class FilterMetricError(RolloutError):
    """``algorithm.filter_groups.metric`` names a reward key that the rewards of a round did not return."""


def groups_with_signal(values: Sequence[float], n: int) -> List[bool]:
    """Per prompt group (``n`` consecutive values): True when its values are not all equal, compared exactly in
    float32 -- the precision the trainer's advantages read rewards in (``StepRows.shard``): values that differ
    only beyond it (``0.1 + 0.2`` and ``0.3``) are alike there and get advantage 0; a group of one sample is
    kept (nothing to compare, as verl does)."""
    if n < 1 or len(values) % n:
        raise ValueError(f"groups_with_signal: {len(values)} values do not split into groups of {n}")
    values = array("f", values)  # float32, as the trainer's reward tensor
    groups = [values[g * n:(g + 1) * n] for g in range(len(values) // n)]
    return [n == 1 or max(v) != min(v) for v in groups]


def newest_version(batch: StepBatch) -> str:
    """The tag of the newest weight version any token of ``batch`` carries (its ``weight_version`` when newer or
    when no row carries per-token versions)."""
    newest = max((v for row in batch.token_versions for v in row), default=parse_version(batch.weight_version))
    return version_tag(max(newest, parse_version(batch.weight_version)))


def metric_values(batch: StepBatch, metric: str) -> List[float]:
    """The per-row values ``algorithm.filter_groups.metric`` compares: "score" -> the scores before the overlong
    penalty (the rewards when there was none); "seq_reward" / "seq_final_reward" -> the rewards; any other name ->
    that key of each row's dict reward (``StepBatch.reward_extras``; 0.0 where the reward failed); "acc" of a row
    whose reward returned no other numeric key (a float) -> its score (``FLOAT_ACC``).
    ``FilterMetricError`` when a row whose reward succeeded did not return the key."""
    scores = list(batch.scores) if batch.scores else list(batch.rewards)
    if metric in BATCH_METRICS:
        return scores if metric == "score" else list(batch.rewards)
    extras = batch.reward_extras or [{}] * batch.num_rows
    if metric == FLOAT_ACC:
        extras = [{FLOAT_ACC: s} if e == {} else e for e, s in zip(extras, scores)]
    missing = [i for i, e in enumerate(extras) if e is not None and metric not in e]
    if missing:
        keys = sorted({k for e in extras if e for k in e})
        returned = (f"the numeric keys it returned besides 'score': {', '.join(keys)}" if keys else
                    "it returned a float (or a dict with no other numeric key)")
        raise FilterMetricError(
            f"algorithm.filter_groups.metric={metric!r}: the reward of {len(missing)} of the {len(extras)} samples "
            f"of this round returned no numeric {metric!r} (first: row {missing[0]}); {returned}. Use one of "
            f"{', '.join(BATCH_METRICS)} or a key the reward returns in every sample")
    return [0.0 if e is None else e[metric] for e in extras]


def merge_round_metrics(rounds: Sequence[Tuple[Dict[str, float], int]]) -> Dict[str, float]:
    """One step's data metrics from those of its rounds (``(metrics, rows)`` each): counts (``COUNT_METRICS``)
    summed, ``*_max`` / ``*_min`` the max / min, every other value the row-weighted mean."""
    total = sum(rows for _, rows in rounds)
    out: Dict[str, float] = {}
    for key in dict.fromkeys(k for m, _ in rounds for k in m):
        have = [(float(m[key]), rows) for m, rows in rounds if key in m]
        if key in COUNT_METRICS:
            out[key] = sum(v for v, _ in have)
        elif key.endswith("_max"):
            out[key] = max(v for v, _ in have)
        elif key.endswith("_min"):
            out[key] = min(v for v, _ in have)
        else:
            weight = sum(rows for _, rows in have) or total
            out[key] = sum(v * rows for v, rows in have) / weight if weight else have[-1][0]
    return out


def take_groups(rounds: Sequence[StepBatch], picks: Sequence[Tuple[int, int]], n: int) -> StepBatch:
    """A batch of the prompt groups ``picks`` (``(round, group)`` pairs, in batch order) of ``rounds``, every
    per-row field with them; a field that some picked round lacks (routing, token versions, loss masks, scores)
    is left out for the whole batch, except scores, which default to the rewards. ``weight_version`` is round 0's."""
    rows = [(r, g * n + i) for r, g in picks for i in range(n)]
    fields = {}
    used = sorted({r for r, _ in picks})
    for name in ROW_FIELDS:
        per_round = [getattr(b, name) for b in rounds]
        if name == "scores" and any(per_round[r] for r in used):
            per_round = [b.scores or b.rewards for b in rounds]
        if all(per_round[r] for r in used):
            fields[name] = [per_round[r][i] for r, i in rows]
        else:
            fields[name] = None if name == "routing" else []
    return StepBatch(weight_version=rounds[0].weight_version, **fields)


class DynamicSampling:
    """A step generator (``rollout_phase.SingleTurn`` / ``MultiTurn``'s interface) that filters the prompt groups of
    ``inner`` and draws more rounds until the batch is full (see the module docstring)."""

    def __init__(self, inner, cfg):
        self.inner, self.cfg = inner, cfg
        fg = cfg.algorithm.filter_groups
        self.metric, self.max_rounds, self.on_exhausted = fg.metric, fg.max_num_gen_batches, fg.on_exhausted
        self.n, self.prompts = cfg.rollout.n_samples_per_prompt, cfg.data.prompts_per_step
        self.max_failed = cfg.data.max_reward_failure_frac
        self._first_exhausted: Optional[int] = None   # the step of the one long warning; later ones are one line
        self._exhausted_count = 0

    def generate(self, engine, step: int, version: str) -> StepBatch:
        rounds: List[StepBatch] = []
        kept: List[Tuple[int, int]] = []
        dropped: List[Tuple[int, int]] = []
        for rnd in range(self.max_rounds):
            # interrupt mode may have loaded newer weights during the previous round: start from those
            tag = newest_version(rounds[-1]) if rnd else version
            batch = self.inner.generate(engine, step, tag, rnd)
            failure = reward_failure_error(batch.metrics, batch.num_rows, self.max_failed, step + 1)
            if failure is not None:  # failed rewards score alike: more rounds would only fail alike
                raise RewardFailureError(f"{failure} (dynamic sampling: generation round {rnd + 1}; no further "
                                         f"round is drawn)")
            rounds.append(batch)
            for g, signal in enumerate(groups_with_signal(metric_values(batch, self.metric), self.n)):
                (kept if signal else dropped).append((rnd, g))
            if len(kept) >= self.prompts:
                break
        exhausted = len(kept) < self.prompts
        if exhausted:
            self._exhausted(step, len(rounds), len(kept), len(kept) + len(dropped))
        filled = dropped[:max(0, self.prompts - len(kept))]
        out = take_groups(rounds, kept[:self.prompts] + filled, self.n)
        out.metrics = merge_round_metrics([(b.metrics, b.num_rows) for b in rounds])
        out.metrics.update({
            "filter_groups/rounds": float(len(rounds)), "filter_groups/groups_drawn": float(len(kept) + len(dropped)),
            "filter_groups/groups_kept": float(len(kept)), "filter_groups/groups_dropped": float(len(dropped)),
            "filter_groups/groups_filled": float(len(filled)), "filter_groups/exhausted": float(exhausted),
            SKIPPED: float(exhausted and self.on_exhausted == "skip")})
        out.rows_generated = sum(b.num_rows for b in rounds)
        out.skipped = exhausted and self.on_exhausted == "skip"
        return out

    def _exhausted(self, step: int, rounds: int, kept: int, drawn: int) -> None:
        """Warn (rank 0) and raise with ``on_exhausted: error``."""
        what = {"train": "training on them, the batch topped up with groups without signal (advantage 0)",
                "skip": "the step is skipped (nothing trained; the weights are published unchanged)",
                "error": "ending the job (algorithm.filter_groups.on_exhausted: error)"}[self.on_exhausted]
        self._exhausted_count += 1
        if self._first_exhausted is None or self.on_exhausted == "error":
            self._first_exhausted = step + 1
            msg = (f"step {step + 1}: dynamic sampling found {kept} of the {self.prompts} prompt groups with reward "
                   f"signal the batch needs in {rounds} round(s) ({drawn} groups drawn; algorithm.filter_groups."
                   f"max_num_gen_batches={self.max_rounds}): {what}. The samples of most groups score alike: the "
                   f"task may be too easy or too hard for the model, or the reward may not vary (later steps: "
                   f"counted in the summary lines, filter_groups/exhausted in the metrics)")
        else:   # the same condition again (a solved task reaches it every step): counted, not repeated
            return
        if self.on_exhausted == "error":
            raise FilterGroupsExhaustedError(msg)
        warnings.warn(msg, FilterGroupsExhaustedWarning, stacklevel=2)
        sys.stderr.flush()

    def close(self) -> None:
        self.inner.close()
