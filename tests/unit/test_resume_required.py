"""``--resume=required`` (trainer.resume: required): a run directory without a COMPLETE checkpoint is refused before
anything starts; plain ``--resume`` there begins a new run at step 0 (a Slurm requeue's first start) and says so.

The checkpoint directories are built by hand here (a ``step_N`` folder, with or without its COMPLETE marker), the
reference for what "complete" means (docs/running.md)."""
import os
import shlex
import subprocess
import sys

import pytest

from megatron_rl.plan import collect_job_config
from megatron_rl.trainer.run_dir import run_dir_error

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _step(run_dir, n, complete):
    path = run_dir / "checkpoints" / f"step_{n}"
    path.mkdir(parents=True)
    if complete:
        (path / "COMPLETE").write_text("")


def test_required_refuses_a_directory_without_a_complete_checkpoint(tmp_path):
    empty = tmp_path / "typo"
    err = run_dir_error(str(empty), "required", False)
    assert "trainer.resume=required" in err and "mistyped" in err and str(empty / "checkpoints") in err
    assert run_dir_error(str(empty), True, False) is None          # plain --resume: a new run may begin
    half = tmp_path / "half"
    _step(half, 5, complete=False)                                  # a save that never finished
    (half / "metrics.jsonl").write_text("{}\n")
    err = run_dir_error(str(half), "required", False)
    assert "no complete checkpoint" in err and "metrics.jsonl" in err and "checkpoints/" in err
    _step(half, 3, complete=True)
    assert run_dir_error(str(half), "required", False) is None
    assert run_dir_error(str(half), False, False) is not None      # another run's outputs, no resume: refused


def test_the_key_takes_true_false_and_required_only():
    for value, want in (("true", True), ("false", False), ("required", "required")):
        cfg, errors = collect_job_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), [f"trainer.resume={value}"])
        assert cfg.trainer.resume == want and not [e for e in errors if e.startswith("trainer.resume")]
    _, errors = collect_job_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), ["trainer.resume=later"])
    assert "trainer.resume: expected true, false or 'required', got 'later'" in errors


def test_train_and_launcher_accept_resume_required(tmp_path):
    run = tmp_path / "nothing_here"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "megatron_rl.train", "--check-world-size", "4", "--config",
                        "configs/tiny_cpu.yaml", f"trainer.run_dir={run}", "--resume=required"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "trainer.resume=required" in r.stderr, r.stderr[-2000:]
    r = subprocess.run(["bash", "launch/torchrun.sh", "--config", "configs/tiny_cpu.yaml", "--resume=required"],
                       cwd=ROOT, env=dict(env, DRY_RUN="1", PYTHON=sys.executable), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    argv = shlex.split(r.stdout.strip())
    assert argv[-1] == "--resume=required" and "--nproc-per-node" in argv


def test_resume_leaves_the_next_override_alone_and_a_restart_keeps_required(tmp_path):
    """`--resume key=value` (the documented order; slurm.sbatch's srun mode appends overrides after it) parses the
    override as an override; a Slurm requeue / torchrun restart of a `--resume=required` job still refuses a
    directory without a checkpoint (the restart path used to turn it into plain --resume)."""
    import argparse
    from megatron_rl.train import add_arguments
    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args(["--config", "c.yaml", "--resume", "trainer.steps=3"])
    assert a.resume == "true" and a.overrides == ["trainer.steps=3"]
    a = p.parse_args(["--config", "c.yaml", "--resume=required", "trainer.steps=3"])
    assert a.resume == "required" and a.overrides == ["trainer.steps=3"]
    assert p.parse_args(["--config", "c.yaml", "trainer.steps=3"]).resume is None
    run = tmp_path / "typo"
    env = dict(os.environ, OMP_NUM_THREADS="1", SLURM_RESTART_COUNT="1")
    r = subprocess.run([sys.executable, "-m", "megatron_rl.train", "--check-world-size", "4", "--config",
                        "configs/tiny_cpu.yaml", "--resume=required", f"trainer.run_dir={run}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "trainer.resume=required" in r.stderr, r.stdout[-1000:] + r.stderr[-2000:]
