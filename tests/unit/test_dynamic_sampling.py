"""Dynamic sampling's selection and rounds (``trainer/dynamic_sampling.py``), in process:

* the rule: a group is dropped exactly when GRPO and RLOO give every one of its samples advantage 0 (checked
  against ``compute_advantages`` on random rewards with many alike groups);
* rounds over a scripted step generator whose rewards per round the test chooses: the batch is the first
  ``prompts_per_step`` groups with signal in draw order, the rounds stop as soon as it is full and never exceed
  the bound, the counts match the script, the data metrics cover every generated row;
* exhausted: the named warning, then "train" (topped up with alike groups), "skip" (the skip flag) or "error";
* round r draws fresh prompts with its own seed and round 0 is the draw of a run without dynamic sampling;
* the reward-failure fraction counts every generated row; ``megatron-rl report`` warns about exhausted steps;
* the config keys' errors name the key.
"""
import random
import warnings

import pytest
import torch

from megatron_rl.algo.advantages import compute_advantages
from megatron_rl.config.sections import FilterGroupsConfig
from megatron_rl.trainer.dynamic_sampling import (
    DynamicSampling, FilterGroupsExhaustedError, FilterGroupsExhaustedWarning, groups_with_signal,
)
from megatron_rl.trainer.reward_failures import RewardFailureError
from megatron_rl.trainer.rollout_phase import sample_prompts
from megatron_rl.trainer.step_batch import StepBatch


def test_dropped_exactly_when_every_advantage_is_zero():
    rng = random.Random(0)
    n, groups = 4, 300
    # rewards on a coarse grid: many groups alike, many not
    # ... and rewards that differ only beyond float32 (0.1 + 0.2 vs 0.3): alike to the trainer, which reads
    # rewards as float32 (StepRows.shard)
    grid = [0.0, 0.5, 1.0, 0.3, 0.1 + 0.2]
    values = [rng.choice(grid) if g % 3 else 0.25 for g in range(groups - 1) for _ in range(n)]
    values += [0.3, 0.1 + 0.2, 0.3, 0.3]
    keep = groups_with_signal(values, n)
    index = torch.arange(groups * n) // n
    for estimator in ("grpo", "rloo"):
        adv = compute_advantages(torch.tensor(values, dtype=torch.float32), index, torch.ones(groups * n, 1),
                                 estimator=estimator)
        zero = (adv.view(groups, n) == 0).all(dim=1).tolist()
        assert keep == [not z for z in zero], estimator
    assert 0 < sum(keep) < groups and not keep[-1]
    assert groups_with_signal([1.0, 1.0, 2.0], 1) == [True] * 3      # one sample per prompt: nothing to compare
    with pytest.raises(ValueError, match="groups of 4"):
        groups_with_signal([1.0] * 6, 4)


class _Cfg:
    """The keys ``DynamicSampling`` reads."""

    def __init__(self, prompts=3, n=2, rounds=4, on_exhausted="train", metric="seq_reward"):
        self.rollout = type("R", (), {"n_samples_per_prompt": n})()
        self.data = type("D", (), {"prompts_per_step": prompts, "max_reward_failure_frac": 0.5})()
        self.algorithm = type("A", (), {"filter_groups": FilterGroupsConfig(True, metric, rounds, on_exhausted)})()


class Scripted:
    """A step generator whose round ``r`` has the rewards ``script[r]`` (one list per group); a row's prompt is
    ``[step, round, group]`` and its response ``[row]``. Records its calls."""

    def __init__(self, script, n=2, scores=None, failed=None):
        self.script, self.n, self.scores, self.calls, self.closed = script, n, scores, [], False
        self.failed = failed or [1.0] * len(script)   # reward/failed per round

    def generate(self, engine, step, version, rnd=0):
        self.calls.append((step, version, rnd))
        groups = self.script[rnd]
        rows = [(g, i) for g in range(len(groups)) for i in range(self.n)]
        return StepBatch(prompt_ids=[[step, rnd, g] for g, _ in rows], response_ids=[[i] for _, i in rows],
                         rollout_log_probs=[[-1.0] for _ in rows], rewards=[groups[g][i] for g, i in rows],
                         scores=[self.scores[rnd][g][i] for g, i in rows] if self.scores else [],
                         truncated=[False] * len(rows), weight_version=version,
                         metrics={"reward/failed": self.failed[rnd], "reward/raw_mean": float(rnd), "data/prompt_length_max": rnd,
                                  "data/rows": 7.0})

    def close(self):
        self.closed = True


def _groups(batch, n=2):
    return [tuple(batch.prompt_ids[g * n][1:]) for g in range(batch.num_rows // n)]


ALIKE, SIGNAL = [1.0, 1.0], [0.0, 1.0]
ONE_RANK = ("parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1")


def test_rounds_fill_the_batch_with_groups_with_signal_in_draw_order():
    script = [[ALIKE, SIGNAL, ALIKE], [SIGNAL, ALIKE, ALIKE], [ALIKE, SIGNAL, SIGNAL], [SIGNAL, SIGNAL, SIGNAL]]
    inner = Scripted(script)
    gen = DynamicSampling(inner, _Cfg())
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # no warning when the batch fills
        batch = gen.generate(None, 5, "step-5")
    assert inner.calls == [(5, "step-5", 0), (5, "step-5", 1), (5, "step-5", 2)]   # stopped once full
    assert _groups(batch) == [(0, 1), (1, 0), (2, 1)]                           # first 3 with signal, draw order
    for g in range(3):
        assert len(set(batch.rewards[2 * g:2 * g + 2])) == 2
    m = batch.metrics
    assert (m["filter_groups/rounds"], m["filter_groups/groups_drawn"], m["filter_groups/groups_kept"],
            m["filter_groups/groups_dropped"], m["filter_groups/groups_filled"]) == (3, 9, 4, 5, 0)
    assert m["filter_groups/exhausted"] == m["filter_groups/skipped"] == 0
    # data metrics over every generated row: counts summed, max over rounds, means row-weighted, constants kept
    assert m["reward/failed"] == 3.0 and m["data/prompt_length_max"] == 2 and m["data/rows"] == 7.0
    assert m["reward/raw_mean"] == pytest.approx((0 + 1 + 2) / 3)
    assert batch.rows_generated == 18 and batch.num_generated == 18 and batch.num_rows == 6
    assert batch.response_ids == [[0], [1]] * 3 and batch.weight_version == "step-5"
    gen.close()
    assert inner.closed


@pytest.mark.parametrize("mode", ["train", "skip"])
def test_exhausted_warns_then_trains_topped_up_or_skips(mode):
    script = [[ALIKE, ALIKE, ALIKE], [ALIKE, SIGNAL, ALIKE]]
    inner = Scripted(script)
    gen = DynamicSampling(inner, _Cfg(rounds=2, on_exhausted=mode))
    with pytest.warns(FilterGroupsExhaustedWarning, match=r"step 4: dynamic sampling found 1 of the 3 prompt groups "
                                                          r".* 2 round\(s\) \(6 groups drawn; .*max_num_gen_batches=2"):
        batch = gen.generate(None, 3, "step-3")
    assert len(inner.calls) == 2
    assert _groups(batch) == [(1, 1), (0, 0), (0, 1)]        # the one with signal, then alike ones in draw order
    m = batch.metrics
    assert (m["filter_groups/groups_kept"], m["filter_groups/groups_filled"], m["filter_groups/exhausted"]) == (1, 2, 1)
    assert m["filter_groups/skipped"] == (1.0 if mode == "skip" else 0.0)


def test_exhausted_with_error_raises_and_metric_score_ignores_the_penalty():
    gen = DynamicSampling(Scripted([[ALIKE, ALIKE]]), _Cfg(prompts=2, rounds=1, on_exhausted="error"))
    with pytest.raises(FilterGroupsExhaustedError, match="on_exhausted: error"):
        gen.generate(None, 0, "step-0")
    # rewards differ only by an overlong penalty, scores (before it) are alike: "score" drops the group
    script, scores = [[[1.0, 0.5], SIGNAL]], [[[1.0, 1.0], SIGNAL]]
    by_score = DynamicSampling(Scripted(script, scores=scores), _Cfg(prompts=1, rounds=1, metric="score"))
    assert _groups(by_score.generate(None, 0, "step-0")) == [(0, 1)]
    by_reward = DynamicSampling(Scripted(script, scores=scores), _Cfg(prompts=1, rounds=1))
    batch = by_reward.generate(None, 0, "step-0")
    assert _groups(batch) == [(0, 0)] and batch.scores == [1.0, 1.0]


@pytest.mark.parametrize("mode", ["train", "error"])
def test_a_round_whose_rewards_mostly_failed_ends_the_step_at_once(mode):
    """Failed rewards all score 0, so their groups are alike: a broken reward must end the step as a reward
    failure at its first round, not draw every round and end as an exhausted step (with on_exhausted: error,
    naming the wrong cause). A round at the limit goes on."""
    zeros = [0.0, 0.0]
    inner = Scripted([[zeros] * 3] * 4, failed=[6.0] * 4)
    gen = DynamicSampling(inner, _Cfg(rounds=4, on_exhausted=mode))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # no exhausted warning either
        with pytest.raises(RewardFailureError, match=r"step 3: 6 reward\(s\) failed .* of 6 samples .*round 1"):
            gen.generate(None, 2, "step-2")
    assert len(inner.calls) == 1
    at_limit = Scripted([[zeros, zeros, zeros], [SIGNAL] * 3], failed=[3.0, 0.0])   # 3 of 6 = the limit, 0.5
    batch = DynamicSampling(at_limit, _Cfg(rounds=4, on_exhausted=mode)).generate(None, 2, "step-2")
    assert len(at_limit.calls) == 2 and batch.metrics["reward/failed"] == 3.0


def test_each_round_draws_fresh_prompts_round_zero_unchanged(tiny_job):
    from megatron_rl.tasks.options import DataOptions
    from megatron_rl.trainer.job import build_task

    cfg = tiny_job(*ONE_RANK, "data.prompts_per_step=16")
    task, _ = build_task(cfg)
    draw = {r: [p.prompt_ids for p in sample_prompts(task, cfg, 7, r)] for r in range(3)}
    task.configure(DataOptions.from_config(cfg.data))
    task.begin_step(7)
    plain = [p.prompt_ids for p in task.sample(16, random.Random(cfg.trainer.seed * 1_000_003 + 7))]
    assert draw[0] == plain                                    # what a run without dynamic sampling draws
    assert draw[1] != draw[0] and draw[2] not in (draw[0], draw[1])
    assert [p.prompt_ids for p in sample_prompts(task, cfg, 7, 2)] == draw[2]   # a resumed run draws the same
    assert [p.prompt_ids for p in sample_prompts(task, cfg, 8, 1)] != draw[1]


@pytest.mark.parametrize("override, needle", [
    ("algorithm.filter_groups.metric=seq", "algorithm.filter_groups.metric: 'seq' is not one of"),
    ("algorithm.filter_groups.max_num_gen_batches=0", "algorithm.filter_groups.max_num_gen_batches: must be >= 1"),
    ("algorithm.filter_groups.on_exhausted=drop", "algorithm.filter_groups.on_exhausted: 'drop' is not one of"),
    ("algorithm.filter_groups.enabled=true", "algorithm.filter_groups.enabled: unknown key"),
])
def test_config_errors_name_the_key(tiny_job, override, needle):
    from megatron_rl.config import ConfigError

    with pytest.raises(ConfigError) as e:
        tiny_job(*ONE_RANK, "algorithm.filter_groups.enable=true", override)
    assert needle in str(e.value)


def test_verl_disabled_default_block_pastes_and_needs_a_metric_once_enabled(tiny_job):
    """verl's own default block (``enable: False, metric: null, max_num_gen_batches: 0``, its DAPO trainer config)
    pastes as is; enabled, both keys are errors naming them."""
    from megatron_rl.config import ConfigError

    block = ("algorithm.filter_groups={enable: false, metric: null, max_num_gen_batches: 0}",)
    assert not tiny_job(*ONE_RANK, *block).algorithm.filter_groups.enable
    with pytest.raises(ConfigError) as e:
        tiny_job(*ONE_RANK, *block, "algorithm.filter_groups.enable=true")
    assert "algorithm.filter_groups.metric: null" in str(e.value)
    assert "algorithm.filter_groups.max_num_gen_batches: must be >= 1" in str(e.value)


def test_failure_fraction_counts_every_generated_row_and_the_report_warns():
    from megatron_rl.ops.report import health_checks
    from megatron_rl.trainer.rollout_source import RowSplit

    gen = DynamicSampling(Scripted([[ALIKE, SIGNAL, ALIKE], [SIGNAL, ALIKE, ALIKE], [ALIKE, SIGNAL, SIGNAL]]), _Cfg())
    batch = gen.generate(None, 0, "step-0")
    pieces = RowSplit([0], 1, 2, False).pieces(batch)
    piece = pieces.make(pieces.keys[0])
    assert piece.summary["reward/failed_frac"] == pytest.approx(3 / 18)   # 1 failure per round of 6 rows
    assert piece.summary["reward/mean"] == pytest.approx(sum(batch.rewards) / 6)
    records = [{"step": 1, "filter_groups/exhausted": 0.0}, {"step": 2, "filter_groups/exhausted": 1.0,
                                                             "filter_groups/skipped": 1.0}]
    [finding] = health_checks(records)
    assert (finding.severity, finding.check) == ("WARN", "dynamic sampling exhausted")
    assert "first at step 2; 1 skipped" in finding.message
    assert health_checks(records[:1]) == []


def test_a_repeated_exhaustion_warns_once_and_is_counted_in_the_summary():
    """A solved task exhausts dynamic sampling every late step: the first warning says why, later steps are counted
    in the console's summary line (the quickstart printed 31 warnings of ~400 characters)."""
    from megatron_rl.trainer.sinks import format_summary
    script = [[ALIKE, ALIKE, ALIKE]] * 8
    gen = DynamicSampling(Scripted(script), _Cfg(rounds=2, on_exhausted="train"))
    with pytest.warns(FilterGroupsExhaustedWarning) as caught:
        for step in range(4):
            gen.generate(None, step, f"step-{step}")
    msgs = [str(w.message) for w in caught if w.category is FilterGroupsExhaustedWarning]
    assert len(msgs) == 1
    assert "too easy or too hard" in msgs[0] and msgs[0].startswith("step 1: dynamic sampling found 0 of the 3")
    rows = [(s, {"reward/mean": 0.5, "filter_groups/exhausted": float(s != 2)}) for s in range(1, 5)]
    assert "dynamic sampling short of groups with signal on 3 of 4 step(s)" in format_summary(rows)
    assert "dynamic sampling short" not in format_summary([(1, {"reward/mean": 0.5, "filter_groups/exhausted": 0.0})])
