"""``megatron-rl report``: synthetic metrics.jsonl (healthy, unhealthy, sparse, malformed) generated here ->
PNGs, report.md and the documented health thresholds.

    pytest tests/integration/test_report.py
"""
import json
import math
import os

import numpy as np
import pytest

from megatron_rl.ops import report as R
from megatron_rl.testing.cli import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write(run_dir, records, extra_lines=()):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
        for line in extra_lines:
            fh.write(line + "\n")


def healthy_run(n=40, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for s in range(1, n + 1):
        kl = 1e-3 * (1 + 0.1 * rng.standard_normal())
        out.append({
            "step": s, "time": 1000.0 + 30 * s,
            "reward/mean": 0.2 + 0.6 * s / n + 0.02 * rng.standard_normal(),
            "response_length/mean": 300 + 5 * s,
            "actor/pg_loss": 0.01 * rng.standard_normal(), "actor/grad_norm": 0.5 + 0.1 * rng.random(),
            "actor/entropy": 1.2 - 0.01 * s,
            "rollout_corr/kl": kl, "rollout_corr/k3_kl": kl / 2, "rollout_corr/chi2_token": 2 * kl,
            "rollout_corr/chi2_seq": 0.05 + 0.01 * rng.random(),
            "rollout_corr/rollout_is_mean": 1.0 + 0.01 * rng.standard_normal(),
            "rollout_corr/rollout_is_p50": 1.0, "rollout_corr/rollout_is_p90": 1.05, "rollout_corr/rollout_is_p99": 1.3,
            "rollout_corr/rollout_is_eff_sample_size": 0.95, "rollout_corr/rollout_rs_masked_fraction": 0.01,
            "rollout_corr/rollout_is_veto_fraction": 0.0,
            "perf/tokens_per_s": 5000 + 100 * rng.standard_normal(),
            "timing/rollout_s": 20.0, "timing/logprob_s": 3.0, "timing/train_s": 7.0,
            "rollout/staleness_mean": 0.0 if s == 1 else 1.0, "rollout/staleness_max": 0.0 if s == 1 else 1.0,
            "rollout_corr/lag0_k3_kl": kl / 2, "rollout_corr/lagged_k3_kl": kl,
            "perf/rollout_overlap_frac": 0.0 if s == 1 else 0.6, "rollout_corr/router_agreement": 0.99,
        })
        if s % 10 == 0:  # validation every 10 steps, two data sources
            out[-1].update({"val/reward_mean": 0.1 + s / n / 2, "val/copy/reward_mean": s / n / 2,
                            "val/gsm8k/reward_mean": 0.2 + s / n / 2, "val/response_length_mean": 40.0,
                            "val/copy/response_length_mean": 30.0, "val/gsm8k/response_length_mean": 50.0})
    return out


def unhealthy_run(n=40):
    out = []
    for s in range(1, n + 1):
        k3 = 1e-3 * math.exp(s / 8)                      # rising mismatch
        out.append({
            "step": s, "time": 30.0 * s, "reward/mean": 0.3,  # flat reward
            "rollout_corr/k3_kl": k3, "rollout_corr/kl": 2 * k3,
            "rollout_corr/rollout_is_mean": 1.0 + 0.02 * s,       # drifts to 1.8
            "rollout_corr/rollout_is_p99": 2.0 + s,               # tail grows past 10
            "rollout_corr/rollout_is_eff_sample_size": 1.0 - s / n,
            "rollout_corr/rollout_is_veto_fraction": 0.004 * s,   # 0.16 at the end
            "rollout_corr/rollout_rs_masked_fraction": 0.02 * s,  # 0.8 at the end
            "actor/grad_norm": float("nan") if s == 33 else 1.0,
        })
    return out


def test_validation_plot_has_a_line_per_data_source():
    """validation.png: the overall val/* curves and one per data source, at the validated steps only."""
    import matplotlib.pyplot as plt

    figures = dict(R.build_figures(healthy_run()))
    reward, length = figures["validation.png"].axes
    for fig in figures.values():
        plt.close(fig)
    lines = {ln.get_label(): list(ln.get_xdata()) for ln in reward.get_lines()}
    assert lines == {k: [10, 20, 30, 40] for k in ("val/reward_mean", "val/copy/reward_mean", "val/gsm8k/reward_mean")}
    assert {ln.get_label() for ln in length.get_lines()} == {"val/response_length_mean", "val/copy/response_length_mean",
                                                             "val/gsm8k/response_length_mean"}


def test_healthy_run_has_no_findings_and_all_plots(tmp_path):
    run = str(tmp_path / "run")
    _write(run, healthy_run())
    md, findings, plots = R.write_report(run)
    assert findings == []
    assert set(plots) == {p[0] for p in R.PLOTS}
    for p in plots:
        path = os.path.join(run, "report", p)
        with open(path, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
        import matplotlib.image as mpimg

        img = mpimg.imread(path)
        assert img.shape[0] >= 300 and img.shape[1] >= 600      # readable size
        assert img[..., :3].std() > 0.01                       # not blank
    text = open(md).read()
    assert "**Status: HEALTHY**" in text and "40 steps (1..40)" in text
    assert "| `reward/mean` (the trained groups) |" in text and "![ess.png](ess.png)" in text
    assert f"ESS < {R.ESS_MIN}" in text and f"veto fraction > {R.VETO_MAX}" in text


def test_unhealthy_run_flags_every_threshold(tmp_path):
    run = str(tmp_path / "bad")
    _write(run, unhealthy_run())
    _, findings, _ = R.write_report(run)
    got = {(f.severity, f.check) for f in findings}
    assert got == {("FAIL", "non-finite metrics"), ("FAIL", "ESS"), ("FAIL", "veto fraction"),
                   ("FAIL", "mean IS weight"), ("WARN", "RS masked fraction"), ("WARN", "IS ratio tail"),
                   ("WARN", "k3 KL rising"), ("WARN", "reward flat")}
    nonfinite = [f for f in findings if f.check == "non-finite metrics"][0]
    assert "actor/grad_norm at step 33" in nonfinite.message
    text = open(os.path.join(run, "report", "report.md")).read()
    assert "**Status: UNHEALTHY**" in text


def test_thresholds_are_on_the_documented_side():
    base = [{"step": s, "rollout_corr/rollout_is_eff_sample_size": 0.5,
             "rollout_corr/rollout_is_veto_fraction": 0.05, "rollout_corr/rollout_is_mean": 1.2}
            for s in range(4)]
    assert R.health_checks(base) == []       # exactly at the thresholds: not flagged
    below = [dict(r, **{"rollout_corr/rollout_is_eff_sample_size": 0.49}) for r in base]
    assert [f.check for f in R.health_checks(below)] == ["ESS"]
    # only the last quarter counts: an early dip does not fail the run
    early = [{"step": s, "rollout_corr/rollout_is_eff_sample_size": 0.1 if s < 4 else 0.9} for s in range(16)]
    assert R.health_checks(early) == []
    # trend checks need MIN_STEPS points
    short = [{"step": s, "reward/mean": 0.3, "rollout_corr/k3_kl": 10.0 ** s} for s in range(R.MIN_STEPS - 1)]
    assert R.health_checks(short) == []


def test_sparse_metrics_plot_only_what_exists(tmp_path):
    run = str(tmp_path / "sparse")
    _write(run, [{"step": s, "time": s, "reward/mean": s / 10, "perf/tokens_per_s": 100} for s in range(5)])
    _, findings, plots = R.write_report(run)
    assert plots == ["reward_length.png", "throughput.png"]
    assert findings == []


def test_repeated_steps_keep_last_and_sort(tmp_path):
    run = str(tmp_path / "resumed")
    _write(run, [{"step": 2, "reward/mean": 0.0}, {"step": 1, "reward/mean": 0.1}, {"step": 2, "reward/mean": 0.5}])
    recs = R.read_metrics(os.path.join(run, "metrics.jsonl"))
    assert [r["step"] for r in recs] == [1, 2] and recs[1]["reward/mean"] == 0.5


@pytest.mark.parametrize("lines,match", [
    (['{"step": 1}', "{not json"], r"metrics.jsonl:2: not valid JSON"),
    (['{"time": 3.0}'], r"metrics.jsonl:1: missing or non-integer 'step'"),
    (["[1, 2]"], r"metrics.jsonl:1: expected a JSON object"),
    ([""], r"no records"),
])
def test_malformed_metrics(tmp_path, lines, match):
    run = str(tmp_path / "m")
    _write(run, [], lines)
    with pytest.raises(R.MetricsError, match=match):
        R.write_report(run)


def _cli(*args):
    return run_cli("report", *args, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_cli(tmp_path):
    good, bad = str(tmp_path / "g"), str(tmp_path / "b")
    recs = healthy_run(12)
    _write(good, recs)
    _write(bad, unhealthy_run())
    r = _cli(good, "--out", str(tmp_path / "out"))
    assert r.returncode == 0 and "healthy" in r.stdout and os.path.isfile(tmp_path / "out" / "report.md")
    rewards = [x["reward/mean"] for x in recs]  # 12 steps: quarters are the first and last 3
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert f"reward/mean: first-quarter mean {first:.4g} -> last-quarter mean {last:.4g} (12 steps)" in r.stdout
    r = _cli(bad)
    assert r.returncode == 0 and "FAIL: ESS" in r.stdout
    assert _cli(bad, "--strict").returncode == 1
    r = _cli(str(tmp_path / "missing"))
    assert r.returncode == 2 and "does not exist" in r.stderr


def _figs(records):
    import matplotlib.pyplot as plt

    figs = dict(R.build_figures(records))
    yield figs
    for f in figs.values():
        plt.close(f)


def _recs(n, **series_fns):
    return [{"step": s, "time": float(s), **{k.replace("__", "/"): fn(s) for k, fn in series_fns.items()}}
            for s in range(1, n + 1)]


def test_panels_have_units_and_the_kl_note():
    recs = _recs(12, **{"perf__tokens_per_s": lambda s: 100.0 + s, "timing__rollout_s": lambda s: 1.0,
                        "rollout_corr__rollout_is_eff_sample_size": lambda s: 0.9,
                        "rollout_corr__rollout_rs_masked_fraction": lambda s: 0.01,
                        "rollout_corr__rollout_is_veto_fraction": lambda s: 0.0,
                        "rollout_corr__kl": lambda s: -1e-4 * s, "rollout_corr__k3_kl": lambda s: 1e-4})
    for figs in _figs(recs):
        labels = {name: [ax.get_ylabel() for ax in fig.axes] for name, fig in figs.items()}
        assert labels["throughput.png"] == ["tokens / s", "seconds per step"]
        assert labels["ess.png"] == ["ESS / N (fraction, 0..1)"]
        assert labels["masked_fractions.png"] == ["fraction rejected (0..1)"]
        note = " ".join(t.get_text() for t in figs["mismatch_kl.png"].texts)
        assert "can be negative" in note and "k3 is >= 0" in note


def _green_spans(ax):
    from matplotlib.colors import to_rgb

    return [p for p in ax.patches if tuple(p.get_facecolor()[:3]) == to_rgb("g")]


def test_is_ratio_band_does_not_fill_a_panel_whose_data_lies_inside_it():
    inside = _recs(12, rollout_corr__rollout_is_mean=lambda s: 0.997 + 0.0003 * s)   # 0.9973 .. 1.0006
    outside = _recs(12, rollout_corr__rollout_is_mean=lambda s: 1.0 + 0.05 * s)      # up to 1.6
    for figs in _figs(inside):
        ax = figs["is_ratio.png"].axes[0]
        assert _green_spans(ax) == []
        assert any("all inside the healthy band" in t.get_text() for t in ax.get_legend().get_texts())
    for figs in _figs(outside):
        ax = figs["is_ratio.png"].axes[0]
        (span,) = _green_spans(ax)
        y0, y1 = ax.get_ylim()
        assert y0 < 1.2 < y1   # the band's top edge is in view


def test_report_md_last_column_is_a_window_mean(tmp_path):
    """The quickstart's last step had pg_loss 0 and grad norm 0: the column shows the mean of the last 10."""
    recs = _recs(40, actor__pg_loss=lambda s: 0.0 if s == 40 else 0.5, actor__grad_norm=lambda s: float(s))
    run = str(tmp_path / "run")
    _write(run, recs)
    md, _, _ = R.write_report(run)
    row = [ln for ln in open(md).read().splitlines() if ln.startswith("| `actor/pg_loss`")][0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:] == ["0.5", f"{(0.5 * 9 + 0.0) / 10:.4g}", f"{(0.5 * 9 + 0.0) / 10:.4g}"]
    row = [ln for ln in open(md).read().splitlines() if ln.startswith("| `actor/grad_norm`")][0]
    assert [c.strip() for c in row.strip("|").split("|")][1:] == [f"{sum(range(1, 11)) / 10:.4g}",
                                                                   f"{sum(range(31, 41)) / 10:.4g}",
                                                                   f"{sum(range(31, 41)) / 10:.4g}"]
    assert "| metric | first 10 | last 10 | last-quarter mean |" in open(md).read()


def test_async_and_routing_panels(tmp_path):
    """async.png shows the staleness, the current-vs-lagged k3 KL and the overlap, with units and its note;
    routing.png the router agreement. A run without those metrics gets neither file."""
    recs = healthy_run(12)
    figs = dict(R.build_figures(recs))
    labels = [ax.get_ylabel() for ax in figs["async.png"].axes]
    assert labels == ["token lag (weight versions)", "k3 kl (nats): current vs lagged tokens",
                      "generation during training (fraction of step time)"]
    drawn = {line.get_label() for ax in figs["async.png"].axes for line in ax.get_lines()}
    assert {"rollout/staleness_mean", "rollout/staleness_max", "lag0_k3_kl", "lagged_k3_kl",
            "perf/rollout_overlap_frac"} <= drawn
    assert "max_staleness" in " ".join(t.get_text() for t in figs["async.png"].texts)
    assert [ax.get_ylabel() for ax in figs["routing.png"].axes] == ["agreement (fraction of token x layer x k)"]
    bare = [{k: v for k, v in r.items() if not k.startswith(("rollout/", "perf/rollout", "rollout_corr/lag",
                                                               "rollout_corr/router"))} for r in recs]
    names = {name for name, _ in R.build_figures(bare)}
    assert "async.png" not in names and "routing.png" not in names
