"""``tools/quickstart_results.py``'s reward figures: the mean SAMPLED reward. With dynamic sampling a step's
``reward/mean`` covers only the trained groups (solved ones are dropped), so the tool reads ``reward/raw_mean``
(every generated sample of every round) there, and ``reward/mean`` otherwise; checked against means computed by
hand from the records."""
import pytest

from tests.integration.quickstart_run import results_tool


def _records(n, dynamic):
    recs = []
    for i in range(n):
        r = {"step": i + 1, "time": 100.0 + i, "reward/mean": 0.5 + 0.001 * i, "reward/raw_mean": 0.9 - 0.002 * i,
             "actor/entropy": 1.0, "actor/grad_norm": 1.0, "timing/step_s": 1.0}
        if dynamic:
            r["filter_groups/rounds"] = 2.0
        recs.append(r)
    return recs


@pytest.mark.parametrize("dynamic, key", [(True, "reward/raw_mean"), (False, "reward/mean")])
def test_quarters_first_last_and_curve_read_the_sampled_reward(dynamic, key):
    tool = results_tool()
    recs = _records(8, dynamic)
    facts = tool.run_facts(recs)
    ys = [r[key] for r in recs]
    assert abs(facts["first_quarter"] - (ys[0] + ys[1]) / 2) < 1e-12
    assert abs(facts["last_quarter"] - (ys[6] + ys[7]) / 2) < 1e-12
    assert facts["reward_first"] == ys[0] and facts["reward_last"] == ys[-1]
    curve = tool.curve_summary(recs, windows=2)
    assert [(a, b) for a, b, _ in curve] == [(1, 4), (5, 8)]
    assert abs(curve[1][2] - sum(ys[4:]) / 4) < 1e-12
