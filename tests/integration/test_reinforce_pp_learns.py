"""Slow: the quickstart job learns with ``algorithm.adv_estimator: reinforce_plus_plus`` on 4 CPU ranks.

``configs/tiny_cpu.yaml`` (embedded bf16 engine, the copy task on a model trained from scratch) with the smaller
step of ``test_objectives_learn.py`` (32 prompts, no dynamic sampling: REINFORCE++ whitens over the batch, so the
top-up with groups of advantage 0 is refused) and REINFORCE++ (gamma 1), launched with ``launch/torchrun.sh`` on 4
gloo ranks as TP2 x DP2 (PP1), so the whitening's statistics are reduced over the DP group every step. Bar: the mean
sampled reward of the last quarter of ``STEPS`` steps exceeds the first quarter's by ``MIN_RISE`` (seed 0; measured
values in docs/advantages.md), every logged metric finite.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_reinforce_pp_learns.py -m slow``
"""
from __future__ import annotations

import json
import math

import pytest

from tests.integration.quickstart_run import launch_config, results_tool
from tests.integration.test_objectives_learn import SMALLER_STEP

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
STEPS = 40
#: last-quarter mean reward minus first-quarter mean reward must reach this.
MIN_RISE = 0.05
#: 4 ranks with data parallelism 2 (the whitening's all-reduce runs).
TP2_DP2 = ("parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=1")


def test_quickstart_learns_with_reinforce_plus_plus(tmp_path, task_model):
    model = task_model(task="copy", seed=0, hidden_size=128, num_layers=2)
    run = launch_config(tmp_path, "tiny_cpu.yaml", model, STEPS, 4, "algorithm.adv_estimator=reinforce_plus_plus",
                        "algorithm.advantage_estimator=reinforce_plus_plus", *SMALLER_STEP, *TP2_DP2)
    tool = results_tool()
    records = tool.read_metrics(str(run / "metrics.jsonl"))
    out = tool.run_facts(records)
    for rec in records:
        bad = {k: v for k, v in rec.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (rec.get("step"), bad)
    summary = json.dumps(out, indent=1)
    print(summary)
    assert out["steps"] == STEPS, summary
    assert out["last_quarter"] - out["first_quarter"] >= MIN_RISE, summary


def test_quickstart_runs_remax_end_to_end(tmp_path, task_model):
    """ReMax through the whole job on 2 ranks (DP2): the greedy baseline is generated each step and logged, every
    metric finite."""
    model = task_model(task="copy", seed=0, hidden_size=128, num_layers=2)
    run = launch_config(tmp_path, "tiny_cpu.yaml", model, 3, 2, "algorithm.adv_estimator=remax",
                        "algorithm.advantage_estimator=remax", *SMALLER_STEP,
                        "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1")
    records = results_tool().read_metrics(str(run / "metrics.jsonl"))
    steps = [r for r in records if "reward/greedy_baseline_mean" in r]
    assert len(steps) == 3, records[-1]
    for rec in records:
        bad = {k: v for k, v in rec.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (rec.get("step"), bad)
