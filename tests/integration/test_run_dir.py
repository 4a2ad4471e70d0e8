"""A run directory belongs to one run (issue 20 item 4): real single-rank ``python -m megatron_rl.train`` jobs.

* a re-run into a directory holding a run's outputs is refused before any process group exists, naming the
  directory and both ways out, and leaves the old run untouched;
* ``--resume`` continues the history from the checkpoint's step: metrics.jsonl reads 1..N once, and a
  checkpoint that was not COMPLETE (a crash while it was written, after its step was logged) is removed;
* ``trainer.overwrite=true`` removes the old outputs (and only them: a model directory inside the run
  directory is kept) and says so on one line.

A refused start is the training entry point run in this process (``megatron-rl train``, the same parser and
``run`` as ``python -m megatron_rl.train``): it returns before any process group exists, so no job is needed
to see it.

Edge cases, without a job: starting over must not delete the model the job loads, a torn last record (a writer
killed mid-line) must not corrupt the first resumed record, and an elastic restart / Slurm requeue continues its
own run instead of being refused or wiped.

Run: OMP_NUM_THREADS=1 pytest tests/integration/test_run_dir.py   (~1-2 min on 2 cores)
"""
import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from megatron_rl.tasks.char_tokenizer import build_task_model
from megatron_rl.testing.tiny_hf import build_tiny_hf_model
from megatron_rl.train import restart_count
from megatron_rl.trainer.run_dir import start_over, trim_to_step

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID",
                                                             "SLURM_NTASKS")}
    return dict(env, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def _args(run, model):
    return [f"actor.load_hf={model}", f"trainer.run_dir={run}", "rollout.max_new_tokens=4",
            "rollout.n_samples_per_prompt=2", "data.prompts_per_step=2", "trainer.progress=false",
            "actor.micro_batch_size=4", "algorithm.filter_groups.enable=false"]


def _train(run, model, *extra, timeout=240):
    return subprocess.run([sys.executable, "-m", "megatron_rl.train", *_args(run, model), *extra], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=timeout)


def _train_here(capsys, monkeypatch, *argv, **env):
    """``megatron-rl train *argv`` in this process, outside any launcher (plus ``env``): (exit code, stdout,
    stderr). Only for starts that must be refused or only checked: a start that goes on would train here."""
    from megatron_rl.cli import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "TORCHELASTIC_RESTART_COUNT",
              "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    rc = main(["train", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _train_ok(run, model, *extra):
    """``_train``, which must succeed: its stdout + stderr."""
    r = _train(run, model, *extra)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    return out


def _steps(run):
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _ckpts(run):
    return sorted(os.listdir(run / "checkpoints"))


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """A 3-step run with checkpoints at steps 2 and 3 whose step-3 checkpoint never got its COMPLETE marker
    (the process died while writing it, after step 3 was logged): the model lives inside the run directory,
    as the quickstart's does."""
    run = tmp_path_factory.mktemp("runs") / "run"
    model = build_task_model(str(run / "init_model"), task="copy", seed=0, hidden_size=32, num_layers=1)
    r = _train(run, model, "trainer.steps=3", "trainer.save_interval=2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert _steps(run) == [1, 2, 3] and _ckpts(run) == ["step_2", "step_3"]
    os.remove(run / "checkpoints" / "step_3" / "COMPLETE")   # the crash a real writer cannot stage on demand
    return run, model


@pytest.mark.slow  # a real job
@pytest.mark.timeout(600)
def test_rerun_into_a_used_run_dir_is_refused_before_anything_starts(first_run, capsys, monkeypatch):
    run, model = first_run
    before = (run / "metrics.jsonl").read_bytes()
    rc, out, msg = _train_here(capsys, monkeypatch, *_args(run, model), "trainer.steps=5")
    assert rc == 2, out[-3000:] + msg[-3000:]
    assert f"trainer.run_dir: '{run}' holds another run's outputs: metrics.jsonl, checkpoints/" in msg, msg
    assert "--resume (trainer.resume=true)" in msg and "trainer.overwrite=true" in msg, msg
    assert "complete checkpoints up to step_2" in msg, msg
    assert (run / "metrics.jsonl").read_bytes() == before and _ckpts(run) == ["step_2", "step_3"]
    assert not dist.is_initialized()                   # the refusal returned before any process group existed


@pytest.mark.slow  # a real job
@pytest.mark.timeout(600)
def test_resume_history_reads_1_to_n_and_stale_checkpoints_are_gone(first_run):
    run, model = first_run
    out = _train_ok(run, model, "trainer.steps=4", "--resume")
    assert _steps(run) == [1, 2, 3, 4]                 # the old step 3 is gone, the new one follows step 2
    assert _ckpts(run) == ["step_2", "step_4"]         # the incomplete step_3 can never be picked up
    assert f"resumed from {run / 'checkpoints' / 'step_2'} at step 2" in out, out[-3000:]
    assert "1 record(s) of metrics.jsonl after step 2" in out and "stale checkpoint(s) step_3" in out, out[-3000:]


@pytest.mark.slow  # a real job
@pytest.mark.timeout(600)
def test_overwrite_removes_the_old_run_and_keeps_other_files(first_run, capsys, monkeypatch):
    run, model = first_run
    out = _train_ok(run, model, "trainer.steps=1", "trainer.overwrite=true")
    lines = [line for line in out.splitlines() if "trainer.overwrite" in line]
    assert len(lines) == 1 and "removed the previous run's metrics.jsonl, checkpoints/" in lines[0], out[-3000:]
    assert _steps(run) == [1] and _ckpts(run) == ["step_1"]
    assert os.path.isfile(os.path.join(model, "config.json"))   # not an output: kept
    # resume and overwrite exclude each other
    rc, _, err = _train_here(capsys, monkeypatch, *_args(run, model), "trainer.overwrite=true", "--resume")
    assert rc == 2 and "trainer.overwrite: true together with trainer.resume" in err, err


# -------------------------------------------------------------------------------- edge cases, without a job
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


def test_a_restarted_job_resumes_instead_of_being_refused(tmp_path, capsys, monkeypatch):
    """The launcher's restart count turns a refused re-run into a resume (checked through train.run's own
    pre-start validation, --check-world-size, which needs no process group)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    model = tmp_path / "model"  # its own model: a clean clone has no runs/tiny_cpu/init_model yet
    build_tiny_hf_model(str(model))
    argv = ["--config", os.path.join(ROOT, "configs", "tiny_cpu.yaml"), "--check-world-size", "4",
            f"trainer.run_dir={run}", f"actor.load_hf={model}"]
    rc, _, err = _train_here(capsys, monkeypatch, *argv)
    assert rc == 2 and "holds another run's outputs" in err, err
    rc, out, err = _train_here(capsys, monkeypatch, *argv, TORCHELASTIC_RESTART_COUNT="1")
    assert rc == 0, err
    assert "restart 1 of this job" in out
