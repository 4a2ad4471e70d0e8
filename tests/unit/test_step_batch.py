"""``StepBatch``: the rows of a step as one unit -- its rollouts.jsonl records, its summary metrics against
direct formulas, and resume of async checkpoints (drained rollouts stored as plain fields, and those written
before the ``StepRollouts`` -> ``StepBatch`` rename; reused only with the schedule and prompt groups they were
made with)."""
import json
import pickle

import pytest

from megatron_rl.testing.jobs import named_job, setting
from megatron_rl.trainer.rollout_source import _fields, _resumed_rollouts, async_schedule
from megatron_rl.trainer.step_batch import StepBatch


def _batch():
    return StepBatch(prompt_ids=[[1, 2], [1, 2], [3], [3]], response_ids=[[5], [6, 7], [8, 9, 4], []],
                     rollout_log_probs=[[-0.1], [-0.2, -0.3], [-1.0, -2.0, -0.5], []], rewards=[1.0, 0.0, 0.5, -1.0],
                     weight_version="step-4", token_versions=[[4], [3, 4], [4, 4, 4], []],
                     metrics={"reward/failed": 1.0})


def test_summary_and_records_match_direct_formulas():
    b = _batch()
    s = b.summary(failed_frac=0.25)
    assert s["reward/mean"] == sum(b.rewards) / 4 and s["reward/max"] == 1.0 and s["reward/min"] == -1.0
    assert s["response_length/mean"] == (1 + 2 + 3 + 0) / 4 and s["response_length/max"] == 3
    assert s["reward/failed_frac"] == 0.25
    assert b.num_tokens == (2 + 1) + (2 + 2) + (1 + 3) + (1 + 0)
    recs = [json.loads(line) for line in b.records(7)]
    assert [r["response_ids"] for r in recs] == b.response_ids
    assert all(r["step"] == 7 and r["weight_version"] == "step-4" for r in recs)
    assert [r["token_versions"] for r in recs] == b.token_versions


def test_drained_rollouts_round_trip_as_plain_fields():
    b = _batch()
    made = named_job("async_groups")
    saved = pickle.loads(pickle.dumps({"async_rollouts": {5: _fields(b)}, "async_schedule": async_schedule(made)}))
    assert isinstance(saved["async_rollouts"][5], dict)  # no class reference in the checkpoint
    back = _resumed_rollouts(saved, made)
    assert back == {5: b}
    other = _resumed_rollouts(saved, named_job("async_groups", "rollout.max_staleness=2"))
    assert other == {}  # another schedule: regenerated


@pytest.mark.parametrize("change, key", [(("rollout.n_samples_per_prompt=4", "data.prompts_per_step=1"),
                                          "rollout.n_samples_per_prompt=2 (this run: 4)"),
                                         (("rollout.n_samples_per_prompt=1", "data.prompts_per_step=4"),
                                          "rollout.n_samples_per_prompt=2 (this run: 1)"),
                                         (("data.prompts_per_step=3",), "data.prompts_per_step=2 (this run: 3)"),
                                         (("rollout.partial_rollout=interrupt",), "rollout.partial_rollout='finish'"),
                                         (("algorithm.filter_groups={enable: true}",),
                                          "algorithm.filter_groups.metric not recorded"),
                                         (("algorithm.advantage_estimator=remax",),
                                          "algorithm.adv_estimator not recorded"),
                                         (("algorithm.advantage_estimator=gdpo", "algorithm.gdpo_reward_keys=[acc]"),
                                          "algorithm.adv_estimator not recorded")])
def test_drained_rollouts_of_other_prompt_groups_are_regenerated(change, key, capsys):
    """Rows are grouped by the current n_samples_per_prompt (row // n): rollouts made with other groups -- even
    with the same number of rows per step -- are not reused, and the line says which key differs. Rollouts drawn
    without dynamic sampling are not reused by a run with it (their groups were never filtered)."""
    b = _batch()                      # 2 prompts x 2 samples
    saved = {"async_rollouts": {5: _fields(b)}, "async_schedule": async_schedule(named_job("async_groups"))}
    assert _resumed_rollouts(saved, named_job("async_groups", *change)) == {}
    assert key in capsys.readouterr().out


@pytest.mark.parametrize("now, key", [
    (None, "algorithm.filter_groups.metric='seq_reward' (this run: not set)"),
    ({"enable": True, "on_exhausted": "train"}, "algorithm.filter_groups.on_exhausted='skip' (this run: 'train')")])
def test_drained_rollouts_of_dynamic_sampling_are_regenerated_for_other_settings(now, key, capsys):
    """Rollouts drained by a run with dynamic sampling carry its decisions (filtered groups, the skip flag of an
    exhausted step): a run without it, or with another on_exhausted, regenerates them."""
    b = _batch()
    b.metrics["filter_groups/skipped"] = 1.0
    made = named_job("async_groups", "algorithm.filter_groups={enable: true, on_exhausted: skip}")
    saved = {"async_rollouts": {5: _fields(b)}, "async_schedule": async_schedule(made)}
    assert _resumed_rollouts(saved, made) == {5: b}
    assert _resumed_rollouts(saved, named_job("async_groups", setting("algorithm.filter_groups", now))) == {}
    assert key in capsys.readouterr().out


def test_checkpoint_without_recorded_groups_is_regenerated(capsys):
    """A checkpoint that recorded only (max_staleness, partial_rollout) cannot show its prompt groups."""
    saved = {"async_rollouts": {5: _fields(_batch())}, "async_schedule": (1, "finish")}
    assert _resumed_rollouts(saved, named_job("async_groups")) == {}
    assert "rollout.n_samples_per_prompt not recorded" in capsys.readouterr().out


def test_checkpoint_written_before_the_rename_resumes():
    """An async checkpoint of the previous version pickled ``rollout_phase.StepRollouts`` objects (without the
    fields added since); they must load and become the same StepBatch."""
    b = _batch()
    old = StepBatch(**_fields(b))
    fresh = {f for f in vars(old) if f not in ("prompt_ids", "response_ids", "rollout_log_probs", "rewards",
                                               "weight_version", "routing", "truncated", "metrics",
                                               "token_versions")}
    for name in fresh:  # fields the old class did not have
        delattr(old, name)
    made = named_job("async_groups")
    raw = pickle.dumps({"async_rollouts": {3: old}, "async_schedule": async_schedule(made)}, protocol=2)
    assert b"megatron_rl.trainer.step_batch\nStepBatch\n" in raw
    raw = raw.replace(b"megatron_rl.trainer.step_batch\nStepBatch\n", b"megatron_rl.trainer.rollout_phase\nStepRollouts\n")
    saved = pickle.loads(raw)
    back = _resumed_rollouts(saved, made)
    assert back == {3: b}


def _long_tailed_step(groups=6, n=2, seed=0):
    import random

    rng = random.Random(seed)
    prompts, responses, versions = [], [], []
    for g in range(groups):
        p = [rng.randrange(3, 20) for _ in range(rng.randint(1, 4))]
        for _ in range(n):
            r = [rng.randrange(3, 20) for _ in range(rng.choice([1, 2, 3, 20 * (g % 3 == 0)]) or 1)]
            prompts.append(p)
            responses.append(r)
            versions.append([7 - (i % 2) for i in range(len(r))])
    return StepBatch(prompt_ids=prompts, response_ids=responses,
                     rollout_log_probs=[[-0.5] * len(r) for r in responses],
                     rewards=[float(i) for i in range(len(responses))], weight_version="step-7",
                     token_versions=versions)


def test_dp_shards_balanced_by_tokens_keep_whole_groups_and_their_rows():
    """``balance_tokens`` (with actor.max_tokens_per_micro_batch): the DP ranks' rows are disjoint whole prompt
    groups covering the step, the same number of groups each, the largest token sum no more than the best
    equal-count split (brute force) + the largest group; each shard's rewards, groups, token lags and tokens are
    those of its rows."""
    import itertools

    import torch

    from megatron_rl.trainer.async_rollout import token_lag_tensor

    n, dp = 2, 2
    sb = _long_tailed_step(groups=6, n=n)
    tokens = [len(p) + len(r) for p, r in zip(sb.prompt_ids, sb.response_ids)]
    group_tokens = [sum(tokens[g * n:(g + 1) * n]) for g in range(6)]
    shards = [sb.shard(7, n, 0, r, dp, torch.device("cpu"), balance_tokens=True) for r in range(dp)]
    rows = [list(s.rows) for s in shards]
    assert sorted(rows[0] + rows[1]) == list(range(sb.num_rows))
    for rr in rows:
        assert len(rr) == sb.num_rows // dp and all(rr[i] // n == rr[i + 1] // n for i in range(0, len(rr), n))
    best = min(max(sum(group_tokens[g] for g in c), sum(group_tokens) - sum(group_tokens[g] for g in c))
               for c in itertools.combinations(range(6), 3))
    got = max(sum(tokens[i] for i in rr) for rr in rows)
    assert got <= best + max(group_tokens)
    contiguous = max(sum(tokens[:6]), sum(tokens[6:]))
    assert got <= contiguous
    for s, rr in zip(shards, rows):
        assert s.rewards.tolist() == [sb.rewards[i] for i in rr]
        assert s.group_index.tolist() == [i // n for i in rr]
        for j, i in enumerate(rr):
            L = len(sb.prompt_ids[i]) + len(sb.response_ids[i])
            assert s.batch.tokens[j, :L].tolist() == sb.prompt_ids[i] + sb.response_ids[i]
        ref_lag = token_lag_tensor([len(sb.prompt_ids[i]) for i in rr], [sb.token_versions[i] for i in rr], 7,
                                   s.batch.max_length - 1)
        assert torch.equal(s.token_lag, ref_lag)
    plain = [sb.shard(7, n, 0, r, dp, torch.device("cpu")) for r in range(dp)]
    assert [list(s.rows) for s in plain] == [list(range(0, 6)), list(range(6, 12))]
