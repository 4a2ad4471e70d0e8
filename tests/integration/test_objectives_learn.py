"""Slow: the quickstart job learns with the GSPO and CISPO objectives too.

``configs/tiny_cpu.yaml`` (embedded bf16 engine, the copy task on a model trained from scratch; 32 prompts per step,
no dynamic sampling: ``SMALLER_STEP``) with ``algorithm.rollout_correction.loss_type`` set to gspo / cispo, launched
with ``launch/torchrun.sh`` for ``STEPS`` steps on ONE rank (TP1 x PP1: the same job and the same math as the config's
4-rank TP2 x PP2 layout, which only adds gloo traffic on a 2-core machine; the layout is tested by the quickstart
test), its metrics read with ``tools/quickstart_results.py``'s ``run_facts``: the mean sampled reward of the last
quarter of the steps must exceed the first quarter's by ``MIN_RISE`` (an untrained start earns about 0.01), and every
logged metric must be finite. Measured (seed 0; first / last quarter): 1 rank, 40 steps, gspo 0.013 -> 0.132, cispo
0.013 -> 0.116 (48 s each on a loaded 2-core machine); the 4-rank layout, 40 steps: gspo 0.013 -> 0.138, cispo 0.013
-> 0.116; 60 steps: gspo 0.018 -> 0.236, cispo 0.017 -> 0.215. The bound 0.05 is below half of every 40-step rise.
(Held-out greedy copies are still 0 % here; the 200-step quickstart reaches them.)

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_objectives_learn.py -m slow``
"""
from __future__ import annotations

import json
import math

import pytest

from tests.integration.quickstart_run import launch_config, results_tool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
STEPS = 40
#: The quickstart's earlier step (32 prompts, lengths as the strings occur, one generation round per step): the
#: shipped one's dynamic sampling (more rounds as groups are solved), which the per-length greedy bounds of the
#: 200-step quickstart need, this test does not; the rises below were measured without it.
SMALLER_STEP = ("data.prompts_per_step=32", "data.task_kwargs.length_floor=0.0",
                "algorithm.filter_groups.enable=false")
#: last-quarter mean reward minus first-quarter mean reward must reach this.
MIN_RISE = 0.05
#: One rank (see the module docstring).
ONE_RANK = ("parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1")


@pytest.mark.parametrize("loss_type", ["gspo", "cispo"])
def test_quickstart_learns_with_objective(tmp_path, task_model, loss_type):
    model = task_model(task="copy", seed=0, hidden_size=128, num_layers=2)
    run = launch_config(tmp_path, "tiny_cpu.yaml", model, STEPS, 1,
                        f"algorithm.rollout_correction.loss_type={loss_type}", *SMALLER_STEP, *ONE_RANK)
    tool = results_tool()
    records = tool.read_metrics(str(run / "metrics.jsonl"))
    out = tool.run_facts(records)
    for rec in records:
        bad = {k: v for k, v in rec.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (rec.get("step"), bad)
    summary = json.dumps(out, indent=1)
    assert out["steps"] == STEPS, summary
    assert out["last_quarter"] - out["first_quarter"] >= MIN_RISE, summary
