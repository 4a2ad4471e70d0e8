"""SIGTERM (Slurm preemption) mid-run: the trainer finishes the step, writes a complete checkpoint and
exits 0; ``--resume`` continues from exactly that step. Real processes, real signal."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from megatron_rl.testing.processes import kill_job

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(300)
def test_sigterm_checkpoints_and_resume_continues(tmp_path):
    from megatron_rl.tasks.char_tokenizer import build_task_model

    model = build_task_model(str(tmp_path / "model"), task="copy", seed=0, hidden_size=32, num_layers=1)
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "megatron_rl.train", f"actor.load_hf={model}", f"trainer.run_dir={run_dir}",
            "rollout.max_new_tokens=4", "rollout.n_samples_per_prompt=2", "data.prompts_per_step=2",
            "trainer.progress=false", "actor.micro_batch_size=4"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    proc = subprocess.Popen(args + ["trainer.steps=100000"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 180
    try:
        while time.time() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_job(proc)  # the trainer and its worker processes, whatever happened
    assert proc.returncode == 0, out
    assert "received signal 15" in out
    done = len(metrics.read_text().splitlines())
    ckpt = run_dir / "checkpoints" / f"step_{done}"
    assert (ckpt / "COMPLETE").is_file(), (done, os.listdir(run_dir / "checkpoints"))
    # resume: exactly one more step, numbered after the preempted ones
    res = subprocess.run(args + [f"trainer.steps={done + 1}", "--resume"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"resumed from {ckpt}" in res.stdout
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, done + 2))
