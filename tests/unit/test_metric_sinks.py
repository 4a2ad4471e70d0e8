"""Metric sinks: metrics.jsonl (one JSON object per step, non-finite values dropped), TensorBoard events
read back with TensorBoard's own reader, a missing optional extra warns instead of failing, rank != 0
writes nothing."""
import builtins
import json
import math

import pytest

from megatron_rl.trainer.sinks import MetricSinks


def test_jsonl_and_console(tmp_path, capsys):
    s = MetricSinks(str(tmp_path), total_steps=2)
    s.log(1, {"reward/mean": 0.25, "actor/pg_loss": float("nan"), "rollout_corr/kl": 1e-3})
    s.log(2, {"reward/mean": 0.5})
    s.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["reward/mean"] == 0.25 and "actor/pg_loss" not in rows[0] and rows[0]["rollout_corr/kl"] == 1e-3
    out = capsys.readouterr().out
    assert "step 1/2" in out and "reward=0.25" in out and "kl=0.001" in out


def test_resume_appends(tmp_path):
    MetricSinks(str(tmp_path), 3, progress=False).log(1, {"a": 1.0})
    s = MetricSinks(str(tmp_path), 3, progress=False, resume=True)
    s.log(2, {"a": 2.0})
    s.close()
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [1, 2]


def test_tensorboard_events_written(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    s = MetricSinks(str(tmp_path), 2, progress=False, tensorboard=True)
    s.log(1, {"reward/mean": 0.25})
    s.log(2, {"reward/mean": 0.75})
    s.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    vals = [(e.step, e.value) for e in acc.Scalars("reward/mean")]
    assert [v[0] for v in vals] == [1, 2] and math.isclose(vals[1][1], 0.75)


def test_missing_extra_warns_and_continues(tmp_path, monkeypatch, capsys):
    real_import = builtins.__import__

    def no_wandb(name, *a, **k):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    s = MetricSinks(str(tmp_path), 1, progress=False, wandb=True)
    s.log(1, {"x": 1.0})
    s.close()
    assert "trainer.wandb: disabled" in capsys.readouterr().err
    assert (tmp_path / "metrics.jsonl").exists()


def test_other_ranks_write_nothing(tmp_path):
    s = MetricSinks(str(tmp_path / "r1"), 1, enabled=False)
    s.log(1, {"x": 1.0})
    s.close()
    assert not (tmp_path / "r1").exists()


def test_console_summary_every_n_steps(tmp_path, capsys):
    """A progress line per step and, every table_interval steps and at the last one, ONE summary line of
    the window (mean / min / max reward, change from the previous window) -- not a repeat of the lines."""
    s = MetricSinks(str(tmp_path), total_steps=5, config={"trainer": {"console_table_interval": 2}})
    for step in range(1, 6):
        s.log(step, {"reward/mean": step / 10, "actor/grad_norm": 2.0 * step, "timing/step_s": 1.0 + step})
    s.close()
    out = capsys.readouterr().out.splitlines()
    bars = [ln for ln in out if ln.startswith("[#") or ln.startswith("[.")]
    assert len(bars) == 5 and "step 5/5" in bars[-1] and "eta" in bars[0]
    summaries = [ln for ln in out if ln.startswith("[megatron-rl] step")]
    assert len(summaries) == 3 and len(out) == 8, out  # after steps 2, 4 and the last step 5
    assert summaries[0].startswith("[megatron-rl] steps 1-2 (2 step(s)): reward mean 0.15 (min 0.1, max 0.2)")
    assert "step 2.5 s" in summaries[0]
    assert "reward mean 0.35 (min 0.3, max 0.4), +0.2 vs previous" in summaries[1]
    assert summaries[2].startswith("[megatron-rl] step 5 (1 step(s)): reward mean 0.5 (min 0.5, max 0.5), +0.15")


def test_console_table_interval_zero_prints_bar_only(tmp_path, capsys):
    s = MetricSinks(str(tmp_path), total_steps=2, table_interval=0)
    s.log(1, {"reward/mean": 1.0})
    s.log(2, {"reward/mean": 1.0})
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all(ln.startswith("[") for ln in out)


def test_both_reward_figures_are_named_under_dynamic_sampling():
    """reward/mean (the trained groups) and reward/raw_mean (every generated sample) differ under dynamic sampling
    (0.87 vs 0.949 on the quickstart): the summary line names both; without dynamic sampling only the one."""
    from megatron_rl.trainer.sinks import format_summary
    line = format_summary([(1, {"reward/mean": 0.8, "reward/raw_mean": 0.9}), (2, {"reward/mean": 0.9,
                                                                                    "reward/raw_mean": 1.0})])
    assert "reward mean 0.85 (min 0.8, max 0.9)" in line
    assert "sampled reward mean 0.95 (every generated sample; reward: the trained groups)" in line
    assert "sampled" not in format_summary([(1, {"reward/mean": 0.8})])
