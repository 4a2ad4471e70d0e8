"""Config errors of ``train`` / ``score`` at launch: one report per launch under torchrun (root cause in the
summary, no other failures listed), how to launch when started without torchrun.

    pytest tests/integration/test_launch_errors.py
"""
import os
import subprocess
import sys

import pytest

from megatron_rl.cli.config_errors import reports_config_error

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join("configs", "tiny_cpu.yaml")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID",
                                                             "SLURM_NTASKS", "SLURM_LOCALID")}
    return dict(env, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra)


def test_reporting_rank():
    value_error = "invalid config:\n  - actor.lr: expected a number, got 'abc' (str)"
    path_error = "invalid config:\n  - actor.load_hf: '/x' is not a directory"
    assert reports_config_error(value_error, {"RANK": "0", "LOCAL_RANK": "0"})
    assert not reports_config_error(value_error, {"RANK": "3", "LOCAL_RANK": "0"})
    assert reports_config_error(path_error, {"RANK": "8", "LOCAL_RANK": "0"})       # first rank of node 2
    assert not reports_config_error(path_error, {"RANK": "1", "LOCAL_RANK": "1"})
    assert reports_config_error(value_error, {"SLURM_PROCID": "0", "SLURM_LOCALID": "0"})
    assert reports_config_error(value_error, {})                                     # not launched


def test_without_torchrun_says_how_to_launch():
    r = subprocess.run([sys.executable, "-m", "megatron_rl.train", "--config", TINY, "trainer.steps=3"],
                       capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=120)
    assert r.returncode == 2
    assert "not started by torchrun / srun, but this config runs on 4 ranks" in r.stderr
    assert f"torchrun --nproc-per-node 4 -m megatron_rl.train --config {TINY} trainer.steps=3" in r.stderr
    assert f"launch/torchrun.sh --nproc-per-node 4 --config {TINY} trainer.steps=3" in r.stderr
    assert "world_size=1" not in r.stderr and "world size: 1" not in r.stderr


@pytest.mark.timeout(240)
def test_under_torchrun_the_error_is_reported_once_and_the_summary_is_short():
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                        "-m", "megatron_rl.train", "--config", TINY, "actor.lr=abc", "actor.load_hf=null",
                        "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
                        "model.vocab_size=32"],
                       capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=220)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert out.count("actor.lr: expected a number, got 'abc' (str)") == 2, out  # rank 0's line + the summary's
    assert "<NO_OTHER_FAILURES>" in out and "rank      : 0" in out, out
    assert "traceback : megatron-rl train: invalid config:" in out  # the root cause is the config error
    assert len(out.splitlines()) < 45, out


def test_launcher_lists_every_problem_at_once_with_the_build_command(tmp_path):
    """A missing model directory AND a reward that cannot import AND a run directory holding another run: the
    launcher's check (launch/torchrun.sh runs ``megatron_rl.train --check-world-size N``) names all three in one
    attempt, with the model's build command, as ``megatron-rl check`` does -- not one problem per attempt."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    model = tmp_path / "not_built"
    r = subprocess.run(["bash", "launch/torchrun.sh", "--nproc-per-node", "4", "--config", TINY,
                        f"actor.load_hf={model}", "data.reward_fn=no_such_module_for_this_test:compute_score", f"trainer.run_dir={run}"],
                       capture_output=True, text=True, cwd=ROOT, env=_env(PYTHON=sys.executable), timeout=240)
    assert r.returncode == 2, r.stderr[-3000:]
    err = r.stderr
    assert "3 problem(s) at world size 4" in err, err[-3000:]
    assert f"actor.load_hf: '{model}' is not a directory" in err
    assert "no_such_module_for_this_test" in err and "data.reward_fn" in err
    assert f"trainer.run_dir: '{run}' holds another run's outputs" in err
    assert f"hint: build actor.load_hf first: python -m megatron_rl.tasks {model}" in err
    assert "Traceback" not in err
