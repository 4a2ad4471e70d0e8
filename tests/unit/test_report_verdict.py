"""The run report's verdict points the right way: a learned run whose late steps are solved is HEALTHY (dynamic
sampling running out of groups with signal there is INFO, a k3 KL of 1e-4 is no alarm), a run whose reward
plateaued below its ceiling with a collapsed policy is STALLED -- in metric series shaped like the quickstart's
and the tiny MoE run's of issue 52 (real runs' metrics: tests/integration/test_report.py)."""
import math
import os
import random

from megatron_rl.ops.report import health_checks, read_metrics, summary_markdown


def _run(n, reward, entropy, raw=True, exhausted=lambda s, r: False, grad=lambda s: 1.0, k3=lambda s: 1e-6):
    rng = random.Random(0)
    out = []
    for s in range(1, n + 1):
        r = reward(s) + rng.uniform(-0.005, 0.005)
        rec = {"step": s, "reward/mean": r, "actor/entropy": entropy(s), "actor/grad_norm": grad(s),
               "rollout_corr/k3_kl": k3(s)}
        if raw:
            ex = exhausted(s, r)
            rec.update({"reward/raw_mean": r, "filter_groups/exhausted": float(ex), "filter_groups/skipped": 0.0,
                        "filter_groups/rounds": 6.0 if ex else 2.0})
        out.append(rec)
    return out


def _status(records):
    text = summary_markdown(records, health_checks(records), [], "runs/x")
    return text.splitlines()[2].split("**")[1].replace("Status: ", ""), health_checks(records)


def test_a_learned_run_is_healthy_even_when_its_solved_groups_exhaust_dynamic_sampling():
    rec = _run(200, lambda s: min(0.97, 0.1 + 0.9 * s / 120), lambda s: max(0.03, 1.0 - s / 100),
               exhausted=lambda s, r: s > 169, k3=lambda s: 1e-6 + 1e-4 * s / 200)
    status, found = _status(rec)
    assert status == "HEALTHY", found
    assert [(f.severity, f.check) for f in found] == [("INFO", "dynamic sampling exhausted")]
    assert "solved" in found[0].message and "31 step(s)" in found[0].message


def test_a_stalled_run_is_stalled():
    rec = _run(200, lambda s: min(0.38, 0.1 + 0.28 * s / 50), lambda s: max(0.029, 1.0 - s / 40),
               exhausted=lambda s, r: s > 60 and s % 3 == 0, grad=lambda s: 0.0 if s > 100 and s % 5 == 0 else 0.4)
    status, found = _status(rec)
    assert status == "STALLED", found
    stalled = [f for f in found if f.check == "stalled"][0]
    assert "sat at 0.38" in stalled.message and "no upward trend" in stalled.message
    assert "entropy below 0.1" in stalled.message and "zero gradient" in stalled.message
    assert ("WARN", "dynamic sampling exhausted") in [(f.severity, f.check) for f in found]   # low reward: a warning


def test_no_stall_while_the_policy_still_explores_or_the_reward_still_moves():
    flat_exploring = _run(200, lambda s: 0.4, lambda s: 0.8)
    assert "stalled" not in [f.check for f in health_checks(flat_exploring)]
    rising = _run(200, lambda s: 0.1 + 0.6 * s / 200, lambda s: 0.02)
    assert "stalled" not in [f.check for f in health_checks(rising)]
    short = _run(12, lambda s: 0.3, lambda s: 0.01)
    assert "stalled" not in [f.check for f in health_checks(short)]


def test_a_slow_steady_learner_is_not_stalled_whatever_its_entropy():
    """0.2 -> 0.5 over 200 steps: its last quarter still gains; low entropy (0.08, usual for an LLM) or a single
    zero-gradient step does not make it a stall."""
    for entropy, grad in ((0.08, lambda s: 1.0), (0.5, lambda s: 0.0 if s == 180 else 1.0)):
        rec = _run(200, lambda s: 0.2 + 0.3 * s / 200, lambda s: entropy, grad=grad)
        assert "stalled" not in [f.check for f in health_checks(rec)], (entropy, health_checks(rec))


def test_negative_rewards_stall_and_solve_by_their_span():
    # [-1, 0] rewards stuck at -0.6 with a collapsed policy: STALLED (the old ceiling rule called it healthy)
    stuck = _run(200, lambda s: min(-1.0 + s / 100, -0.6), lambda s: 0.01)
    assert "stalled" in [f.check for f in health_checks(stuck)]
    # a solved penalty-style task (best -0.02): its exhaustion is INFO
    solved = _run(200, lambda s: min(-0.02, -1.0 + s / 80), lambda s: 0.02, exhausted=lambda s, r: s > 150)
    assert [f.severity for f in health_checks(solved) if f.check == "dynamic sampling exhausted"] == ["INFO"]
    assert "stalled" not in [f.check for f in health_checks(solved)]


def test_the_ceiling_of_rewards_outside_0_1_is_the_highest_logged():
    # rewards in [0, 10]: 9.5 of a best 10 is solved; a plateau at 3 with zero entropy is a stall
    solved = _run(200, lambda s: min(9.5, 1 + 9 * s / 100), lambda s: 0.02, exhausted=lambda s, r: s > 150)
    solved[10]["reward/raw_mean"] = 10.0
    assert [f.severity for f in health_checks(solved) if f.check == "dynamic sampling exhausted"] == ["INFO"]
    stuck = _run(200, lambda s: 3.0 if s > 20 else 9.0 * (s == 1) + 0.5, lambda s: 0.01)
    assert "stalled" in [f.check for f in health_checks(stuck)]


def test_a_k3_kl_of_1e_4_is_no_alarm_and_1e_2_rising_is():
    quiet = _run(40, lambda s: 0.5 + s / 100, lambda s: 0.5, raw=False, k3=lambda s: 1e-6 * math.exp(s / 9))
    assert max(r["rollout_corr/k3_kl"] for r in quiet) < 1e-3
    assert "k3 KL rising" not in [f.check for f in health_checks(quiet)]
    loud = _run(40, lambda s: 0.5 + s / 100, lambda s: 0.5, raw=False, k3=lambda s: 1e-3 * s / 4)
    assert "k3 KL rising" in [f.check for f in health_checks(loud)]


DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "runs")


def test_real_runs_learned_quickstart_and_stalled_tiny_moe():
    """Two real 200-step runs' metrics (trimmed to the keys the report reads): the quickstart as shipped at the
    commit of this test (every length learned; dynamic sampling exhausted on 35 late, solved steps; k3 KL ~1e-4)
    and configs/tiny_moe_cpu.yaml as shipped before it took the quickstart's recipe (sampled reward ~0.43 from step
    ~130, entropy 0.013, 35 zero-gradient steps)."""
    learned = read_metrics(os.path.join(DATA, "quickstart_learned", "metrics.jsonl"))
    status, found = _status(learned)
    assert status == "HEALTHY", found
    assert {(f.severity, f.check) for f in found} == {("INFO", "dynamic sampling exhausted")}
    stalled = read_metrics(os.path.join(DATA, "tiny_moe_stalled", "metrics.jsonl"))
    status, found = _status(stalled)
    assert status == "STALLED", found
    msg = [f.message for f in found if f.check == "stalled"][0]
    assert "sat at 0.425" in msg and "zero gradient" in msg
