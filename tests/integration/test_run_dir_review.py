"""Run-directory edge cases found in review: starting over must not delete the model the job loads, a torn
last record (a writer killed mid-line) must not corrupt the first resumed record, and an elastic restart /
Slurm requeue continues its own run instead of being refused or wiped."""
import json
import os

import pytest

from megatron_rl.testing.tiny_hf import build_tiny_hf_model
from megatron_rl.train import restart_count
from megatron_rl.trainer.run_dir import start_over, trim_to_step


def test_overwrite_refuses_to_delete_the_model_it_loads(tmp_path):
    run = tmp_path / "run"
    model = run / "weight_sync" / "step-40"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match="actor.load_hf.*weight_sync"):
        start_over(str(run), keep=str(model))
    assert (model / "config.json").is_file() and (run / "metrics.jsonl").is_file()  # nothing removed
    other = tmp_path / "model"
    other.mkdir()
    start_over(str(run), keep=str(other))
    assert not (run / "weight_sync").exists() and not (run / "metrics.jsonl").exists()


def test_a_torn_last_record_is_dropped_on_resume(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n{"step": 3, "x"')
    trim_to_step(str(run), 2)
    with open(run / "metrics.jsonl", "a") as fh:  # what the resumed run appends
        fh.write(json.dumps({"step": 3, "x": 3}) + "\n")
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["x"] == 3


@pytest.mark.parametrize("var", ["TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"])
def test_restart_count(monkeypatch, var):
    for k in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)
    assert restart_count() == 0
    monkeypatch.setenv(var, "2")
    assert restart_count() == 2


def test_a_restarted_job_resumes_instead_of_being_refused(tmp_path, monkeypatch):
    """The launcher's restart count turns a refused re-run into a resume (checked through train.run's own
    pre-start validation, --check-world-size, which needs no process group)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    model = tmp_path / "model"  # its own model: a clean clone has no runs/tiny_cpu/init_model yet
    build_tiny_hf_model(str(model))
    cmd = [sys.executable, "-m", "megatron_rl.train", "--config", os.path.join(root, "configs", "tiny_cpu.yaml"),
           "--check-world-size", "4", f"trainer.run_dir={run}", f"actor.load_hf={model}"]
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")}
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert first.returncode == 2 and "holds another run's outputs" in first.stderr
    again = subprocess.run(cmd, capture_output=True, text=True, env={**env, "TORCHELASTIC_RESTART_COUNT": "1"},
                           cwd=root, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "restart 1 of this job" in again.stdout
