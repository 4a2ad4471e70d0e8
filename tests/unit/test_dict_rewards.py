"""Reward functions that return a dict, as verl's do: a DAPO-style verl reward file runs unchanged through the
rollout phase (its ``score`` is the reward, the overlong penalty added on that scale; its numeric keys are logged
as ``reward_extra/<key>/mean`` and travel per row for dynamic sampling; ``pred`` -- a string -- is dropped); a
dict without ``score`` or with a non-numeric one is a failed sample whose error names the function, the key and
the data row. Dynamic sampling filters by a reward key (``acc``) against a hand-computed selection, and a key the
reward never returns stops the first round naming the keys it did return. Expected values are written by hand
from the reward file's rule.

Run: ``OMP_NUM_THREADS=1 pytest tests/unit/test_dict_rewards.py -q``
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from megatron_rl.config.sections import AlgorithmConfig, DataConfig, FilterGroupsConfig, RolloutConfig
from megatron_rl.config.verl_keys import _filter_metric
from megatron_rl.tasks import build_task
from megatron_rl.tasks.char_tokenizer import build_char_tokenizer
from megatron_rl.tasks.datasets import FileTask
from megatron_rl.tasks.options import DataOptions
from megatron_rl.trainer.dynamic_sampling import DynamicSampling, FilterMetricError
from megatron_rl.trainer.rollout_phase import generate_step
from megatron_rl.actor.replay_modes import NoReplay
from megatron_rl.trainer.step_batch import StepBatch

from tests.unit.test_data_rollout_phase import FixedEngine

pytestmark = pytest.mark.timeout(300)

# A verl DAPO-style custom reward file, as a verl user has it (nothing of this project imported).
VERL_DAPO_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    pred = solution_str.strip()
    correct = pred == ground_truth
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred, "length": float(len(pred))}

def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}

def str_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": "1.0", "acc": 1.0}
'''


def _setup(tmp_path, fn="compute_score", workers=1, overlong=0):
    tok = build_char_tokenizer()
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"copy:{d}=", "answer": f"{d}"}) + "\n" for d in (7, 8)))
    (tmp_path / "dapo_reward.py").write_text(VERL_DAPO_REWARD)
    d = DataConfig(task="file", path=str(data), reward_fn=f"{tmp_path / 'dapo_reward.py'}:{fn}", prompts_per_step=2,
                   reward_workers=workers, overlong_buffer_len=overlong, overlong_penalty_factor=0.5)
    cfg = SimpleNamespace(data=d, rollout=RolloutConfig(max_new_tokens=4, n_samples_per_prompt=3),
                          trainer=SimpleNamespace(seed=0), algorithm=AlgorithmConfig())
    return tok, cfg, build_task("file", tok, path=d.path, reward_fn=d.reward_fn)


def test_verl_dict_reward_file_runs_unchanged_through_the_step(tmp_path):
    tok, cfg, task = _setup(tmp_path, overlong=2)
    # per prompt: "7", "8", "777" (3 tokens + EOS = 4 = max_new_tokens -> truncated, no EOS: 4 tokens)
    engine = FixedEngine(tok, ["7", "8", "7777"])
    try:
        out = generate_step(task, engine, cfg, step=0, expected_version="step-0", replay=NoReplay())
    finally:
        task.close()
    answers = [p[-2] for p in out.prompt_ids]          # the digit before "=" (row order: prompt-major)
    texts = ["7", "8", "7777"] * 2
    acc = [float(t == tok.decode([a])) for t, a in zip(texts, answers)]
    assert sorted(acc) == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    score = [1.0 if a else -1.0 for a in acc]
    lengths = [len(r) for r in out.response_ids]
    assert lengths == [2, 2, 4] * 2
    penalty = [min(0.0, -(n - (4 - 2)) / 2 * 0.5) for n in lengths]   # DAPO's buffer, on the +-1 scale
    assert out.rewards == pytest.approx([s + p for s, p in zip(score, penalty)])
    assert out.scores == pytest.approx(score)
    assert out.metrics["reward/failed"] == 0 and out.metrics["reward/raw_mean"] == pytest.approx(sum(score) / 6)
    assert out.reward_extras == [{"acc": a, "length": float(len(t))} for a, t in zip(acc, texts)]
    assert out.metrics["reward_extra/acc/mean"] == pytest.approx(2 / 6)
    assert out.metrics["reward_extra/length/mean"] == pytest.approx((1 + 1 + 4) / 3)
    assert not any(k.startswith("reward_extra/pred") for k in out.metrics)


@pytest.mark.parametrize("fn, needle", [
    ("no_score", "returned a dict without the key 'score' (keys: acc)"),
    ("str_score", "returned 'score': str '1.0'; it must be a float"),
])
def test_bad_dict_rewards_fail_naming_function_key_and_row(tmp_path, fn, needle):
    tok, cfg, _ = _setup(tmp_path, fn)
    task = FileTask(cfg.data.path, tok, reward_fn=cfg.data.reward_fn, options=DataOptions(reward_workers=0))
    res = task.score(task.prompts, [tok.encode("7", add_special_tokens=False)] * 2)
    assert res.rewards == [0.0, 0.0] and res.failed == 2 and res.extras == [None, None]
    assert needle in res.errors[0] and f"dapo_reward.py:{fn}" in res.errors[0]
    assert "data.path=" in res.errors[0] and "row 0 (line 1)" in res.errors[0]


class _Rounds:
    """A step generator whose round r has rewards and per-row extras ``script[r]`` (one (rewards, extras) per group)."""

    def __init__(self, script, n=2):
        self.script, self.n, self.calls = script, n, 0

    def generate(self, engine, step, version, rnd=0):
        self.calls += 1
        groups = self.script[rnd]
        rows = [(g, i) for g in range(len(groups)) for i in range(self.n)]
        return StepBatch(prompt_ids=[[rnd, g] for g, _ in rows], response_ids=[[i] for _, i in rows],
                         rollout_log_probs=[[-1.0] for _ in rows], rewards=[groups[g][0][i] for g, i in rows],
                         reward_extras=[groups[g][1][i] for g, i in rows], truncated=[False] * len(rows),
                         weight_version=version, metrics={"reward/failed": 0.0})

    def close(self):
        pass


def _cfg(metric, prompts=2, rounds=3):
    return SimpleNamespace(rollout=SimpleNamespace(n_samples_per_prompt=2),
                           data=SimpleNamespace(prompts_per_step=prompts, max_reward_failure_frac=0.5),
                           algorithm=SimpleNamespace(filter_groups=FilterGroupsConfig(True, metric, rounds, "train")))


def test_dynamic_sampling_filters_groups_by_acc():
    # rewards differ in every group (a length bonus), acc is what tells solved from unsolved
    right, wrong, failed = {"acc": 1.0}, {"acc": 0.0}, None
    script = [[([1.0, 0.9], [right, right]),     # (0, 0): acc alike -> dropped (seq_reward would keep it)
               ([1.0, -1.0], [right, wrong])],   # (0, 1): kept
              [([-1.0, -0.8], [wrong, wrong]),   # (1, 0): acc alike -> dropped
               ([0.0, 1.0], [failed, right])]]   # (1, 1): a failed reward reads acc 0 -> kept
    gen = DynamicSampling(_Rounds(script), _cfg("acc"))
    batch = gen.generate(None, 0, "step-0")
    assert [tuple(batch.prompt_ids[2 * g]) for g in range(2)] == [(0, 1), (1, 1)]
    m = batch.metrics
    assert (m["filter_groups/groups_kept"], m["filter_groups/groups_dropped"], m["filter_groups/rounds"]) == (2, 2, 2)
    by_reward = DynamicSampling(_Rounds(script), _cfg("seq_reward")).generate(None, 0, "step-0")
    assert [tuple(by_reward.prompt_ids[2 * g]) for g in range(2)] == [(0, 0), (0, 1)]   # the other signal differs


def test_a_key_the_reward_never_returns_stops_the_first_round():
    script = [[([1.0, 0.0], [{"acc": 1.0}, {"acc": 0.0}])]] * 3
    inner = _Rounds(script)
    with pytest.raises(FilterMetricError, match=r"metric='accuracy': the reward of 2 of the 2 samples of this round "
                                                r"returned no numeric 'accuracy' .* besides 'score': acc"):
        DynamicSampling(inner, _cfg("accuracy", prompts=1)).generate(None, 0, "step-0")
    assert inner.calls == 1
    no_acc = _Rounds([[([1.0, 0.0], [{"length": 3.0}, {"length": 2.0}])]])   # a dict reward without acc
    with pytest.raises(FilterMetricError, match="returned no numeric 'acc' .* besides 'score': length"):
        DynamicSampling(no_acc, _cfg("acc", prompts=1)).generate(None, 0, "step-0")


def test_acc_of_a_float_reward_is_its_score_as_verls_dapo_reward_manager_records_it():
    """verl 0.9.1's DAPO reward manager (verl/workers/reward_manager/dapo.py and the reward loop's
    reward_manager/dapo.py): ``else: score = result; reward_extra_info["acc"] = score`` -- a float reward's acc is
    its score (before the overlong penalty), so a DAPO job with a float reward (gsm8k, a float reward file) filters
    by it. Selection written by hand from that rule: groups whose float scores differ are kept."""
    script = [[([1.0, 1.0], [{}, {}]),          # (0, 0): scores alike -> dropped
               ([0.0, 1.0], [{}, {}])],         # (0, 1): kept
              [([0.0, 0.0], [{}, {}]),          # (1, 0): dropped
               ([1.0, 0.0], [{}, None])]]       # (1, 1): a failed reward (acc 0, score 0) next to a 1 -> kept
    batch = DynamicSampling(_Rounds(script), _cfg("acc")).generate(None, 0, "step-0")
    assert [tuple(batch.prompt_ids[2 * g]) for g in range(2)] == [(0, 1), (1, 1)]
    # the score before the overlong penalty: rewards alike after it, scores not -> kept (verl's acc is the score)
    penalised = _Rounds([[([0.5, 0.5], [{}, {}])]])
    orig = penalised.generate

    def with_scores(*a, **k):
        b = orig(*a, **k)
        b.scores = [1.0, 0.5]
        return b
    penalised.generate = with_scores
    kept = DynamicSampling(penalised, _cfg("acc", prompts=1, rounds=1)).generate(None, 0, "step-0")
    assert kept.metrics["filter_groups/groups_kept"] == 1


def test_bool_and_numpy_values_count_as_verl_counts_them():
    """verl's reward managers write a reward into a float32 tensor (``reward_tensor[i, last] = score``: True -> 1.0)
    and keep dict values as they are for the filter (``np.std`` of a group's ``acc``: numpy bools count as 0 / 1),
    so a verl reward file returning ``pred == gt`` or a numpy ``acc`` works there; here too."""
    import numpy as np
    import torch

    from megatron_rl.tasks.reward_fn import check_value

    for score in (True, False, 0.5):
        verl = torch.zeros(2, dtype=torch.float32)
        verl[1] = score   # what verl's naive / DAPO reward manager does with a non-dict result
        assert check_value("f", score).score == float(verl[1])
    v = check_value("f", {"score": np.float64(1.0), "acc": np.bool_(True), "n": np.int64(3), "pred": "x"})
    assert (v.score, v.extras, v.other_keys) == (1.0, {"acc": 1.0, "n": 3.0}, ("pred",))


def test_metric_config_and_migration():
    assert FilterGroupsConfig(True, "acc").errors() == []                         # a data file's reward may return it
    assert "needs a reward that returns a dict" in FilterGroupsConfig(True, "length").errors(dict_rewards=False)[0]
    assert FilterGroupsConfig(True, "acc").errors(dict_rewards=False) == []   # a float reward's acc: its score
    assert "is not one of" in FilterGroupsConfig(True, " acc").errors()[0]
    assert _filter_metric("acc") == "acc"                                          # verl's DAPO metric maps
