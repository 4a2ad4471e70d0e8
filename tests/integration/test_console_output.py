"""What a person reads on the console: warnings once per job (deprecation notices on rank 0 only, each
distinct message once), one line per step (a periodic summary adds window statistics instead of repeating
the per-step lines), and the layout printed once at start.

    pytest tests/integration/test_console_output.py
"""
import json
import os
import re
import subprocess
import sys

import pytest

WARN_CODE = r'''
import warnings
from megatron_rl.platform.warnings import install_known_message_filter
install_known_message_filter()
def load_state_dict_like():   # two call sites, as megatron's and torch's checkpoint loaders have
    warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning)
def other_site():
    warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning)
for _ in range(3):
    load_state_dict_like(); other_site()
    warnings.warn("some library: this API is going away", FutureWarning)
    warnings.warn("a rank-specific problem", UserWarning)
'''


def _stderr(rank):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "SLURM_PROCID", "MEGATRON_RL_SHOW_KNOWN_WARNINGS")}
    env.update(RANK=str(rank), PYTHONWARNINGS="always")
    return subprocess.run([sys.executable, "-c", WARN_CODE], capture_output=True, text=True, env=env,
                          timeout=60).stderr


def test_deprecation_warnings_once_on_rank0_none_elsewhere():
    err0 = _stderr(0).splitlines()
    assert sum("ShardedTensor" in ln for ln in err0) == 0, err0          # a known notice: hidden,
    assert sum("known, harmless library notices are hidden" in ln for ln in err0) == 1, err0   # said once
    assert sum("this API is going away" in ln for ln in err0) == 1, err0  # unknown FutureWarning: once
    assert sum("a rank-specific problem" in ln for ln in err0) == 1, err0
    assert not any(ln.strip().startswith("warnings.warn(") for ln in err0), err0  # no source-line echo
    err1 = _stderr(1)
    assert "ShardedTensor" not in err1 and "going away" not in err1, err1  # deprecations: rank 0 only
    assert err1.count("a rank-specific problem") == 1, err1                # other warnings: where raised


# ----------------------------------------------------------------------------- real runs through the launcher
LAUNCH_TIMEOUT = 900


def _launch(config, nproc, logs, *overrides):
    """``config`` on ``nproc`` ranks through the launcher, torchrun's per-rank logs under ``logs``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable, NPROC_PER_NODE=str(nproc), LOG_DIR=str(logs))
    env.pop("MEGATRON_RL_SHOW_KNOWN_WARNINGS", None)
    r = subprocess.run(["bash", "launch/torchrun.sh", "--config", config, *overrides], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return (r.stdout + r.stderr).splitlines()


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEP_LINE = re.compile(r"\] step (\d+)/(\d+) ")


def _rank_lines(lines, rank):
    tag = f"[default{rank}]:"
    return [ln[len(tag):] for ln in lines if ln.startswith(tag)]


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory, task_model):
    """A 2-rank (DP=2) tiny run of 2 steps with a checkpoint per step, then --resume to step 3."""
    tmp = tmp_path_factory.mktemp("console")
    model = task_model(task="copy", seed=0, hidden_size=64, num_layers=2)
    run = str(tmp / "run")
    common = [f"actor.load_hf={model}", f"trainer.run_dir={run}", "parallel.tensor_model_parallel_size=1",
              "parallel.pipeline_model_parallel_size=1", "data.prompts_per_step=4", "actor.ppo_mini_batches=1",
              "trainer.save_interval=1", "algorithm.filter_groups.enable=false",
              "trainer.console_table_interval=2"]
    first = _launch("configs/tiny_cpu.yaml", 2, tmp / "logs", *common, "trainer.steps=2")
    resumed = _launch("configs/tiny_cpu.yaml", 2, tmp / "logs", *common, "trainer.steps=3", "trainer.resume=true")
    return first, resumed, run


def test_one_line_per_step_a_summary_and_the_layout_once(tiny_runs):
    first, resumed, run = tiny_runs
    for lines, steps in ((first, [1, 2]), (resumed, [3])):
        r0 = _rank_lines(lines, 0)
        assert [int(STEP_LINE.search(ln).group(1)) for ln in r0 if STEP_LINE.search(ln)] == steps, r0
        # the old 10-step table repeated every progress line under a header: no such table now
        assert not any(ln.split()[:2] == ["step", "reward"] for ln in r0), r0
        summaries = [ln for ln in r0 if ln.startswith("[megatron-rl] step")]
        assert len(summaries) == 1 and "reward mean" in summaries[0], r0   # at step 2 (interval) / 3 (last)
        layout = [ln for ln in lines if "layout:" in ln]
        assert layout == ["[default0]:[megatron-rl] layout: world size 2, TP=1 PP=1 CP=1 DP=2; rollout engine "
                          "embedded, sync rollouts; weight sync tensor"], layout
    # the summary's window mean is the mean of the per-step rewards metrics.jsonl recorded
    with open(os.path.join(run, "metrics.jsonl")) as fh:
        recs = [json.loads(ln) for ln in fh]
    m = re.search(r"reward mean ([-\d.e]+)", [ln for ln in _rank_lines(first, 0) if "steps 1-2" in ln][0])
    want = sum(r["reward/mean"] for r in recs if r["step"] in (1, 2)) / 2
    assert abs(float(m.group(1)) - want) <= 1e-3 * max(1.0, abs(want)), (m.group(1), want)


def test_warnings_once_per_job_on_rank0(tiny_runs):
    first, resumed, _ = tiny_runs
    for lines in (first, resumed):
        assert not any("Warning" in ln for ln in _rank_lines(lines, 1)), _rank_lines(lines, 1)
        warn = [ln for ln in lines if "Warning" in ln or "deprecat" in ln.lower()]
        assert len(warn) == len(set(warn)), warn                       # each message once
        assert not any(ln.strip().endswith(("checkpoint.load_state_dict(", "return forward_call(*args, **kwargs)"))
                       for ln in lines), lines                         # no source-line echoes of warnings
    # the resume (checkpoint load) adds no deprecation notice on ranks other than 0
    assert not any("ShardedTensor" in ln or "load_state_dict" in ln for ln in _rank_lines(resumed, 1))


def test_report_of_a_sync_run_has_no_async_plot_and_fractions_on_0_1(tiny_runs, tmp_path):
    from megatron_rl.ops import report as R

    _, _, run = tiny_runs
    out = tmp_path / "report"
    r = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "report", run, "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert os.path.isfile(out / "report.md"), r.stdout + r.stderr
    assert not os.path.exists(out / "async.png") and os.path.isfile(out / "masked_fractions.png")
    figs = dict(R.build_figures(R.read_metrics(os.path.join(run, "metrics.jsonl"))))
    for name in ("masked_fractions.png", "ess.png"):
        if name in figs:
            assert all(ax.get_ylim() == (0.0, 1.0) for ax in figs[name].axes), name


def test_math_config_prints_one_line_per_step(tmp_path):
    from megatron_rl.tasks.chat_model import build_chat_model

    model = build_chat_model(str(tmp_path / "m"), seed=0)
    lines = _launch("configs/math_tiny_cpu.yaml", 1, tmp_path / "logs", f"actor.load_hf={model}",
                    f"trainer.run_dir={tmp_path / 'run'}", "trainer.steps=2")
    steps = [int(STEP_LINE.search(ln).group(1)) for ln in _rank_lines(lines, 0) if STEP_LINE.search(ln)]
    assert steps == [1, 2], lines[-40:]
