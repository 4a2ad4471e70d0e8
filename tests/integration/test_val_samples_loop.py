"""trainer.val_log_samples in a real single-rank ``python -m megatron_rl.train`` job (the copy task's held-out
split): every validation -- before training (step 0), after each step -- appends N samples to
run_dir/val_generations.jsonl, the same held-out prompts each time (verl's fixed choice), and ``--resume`` drops the
records after the checkpoint's step so the file reads each validation once.

Run: OMP_NUM_THREADS=1 pytest tests/integration/test_val_samples_loop.py   (~1 min on 2 cores)
"""
import json
import os
import subprocess
import sys

from megatron_rl.tasks.char_tokenizer import build_task_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train(tmp_path, steps, *extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID",
                                                             "SLURM_NTASKS", "SLURM_RESTART_COUNT")}
    args = ["--config", os.path.join(ROOT, "configs", "tiny_cpu.yaml"), *extra, "parallel.tensor_model_parallel_size=1",
            "parallel.pipeline_model_parallel_size=1", "actor.load_hf=model", "trainer.run_dir=run",
            f"trainer.steps={steps}", "trainer.test_freq=1", "data.val_heldout=true", "data.task_kwargs.heldout_frac=0.1",
            "data.val_max_samples=8", "trainer.val_log_samples=3", "trainer.progress=false", "data.prompts_per_step=2",
            "rollout.n_samples_per_prompt=2"]
    r = subprocess.run([sys.executable, "-m", "megatron_rl.train", *args], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600, env=dict(env, OMP_NUM_THREADS="1", PYTHONPATH=ROOT))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return [json.loads(line) for line in (tmp_path / "run" / "val_generations.jsonl").read_text().splitlines()]


def test_validation_samples_are_logged_each_validation_and_resume_keeps_them_once(tmp_path):
    build_task_model(str(tmp_path / "model"), task="copy", seed=0, hidden_size=32, num_layers=1)
    rows = _train(tmp_path, 2)
    assert [r["step"] for r in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    inputs = [r["input"] for r in rows[:3]]
    assert len(set(inputs)) == 3 and all(s.startswith("copy:") for s in inputs)
    assert [r["input"] for r in rows] == inputs * 3            # the same prompts at every validation
    assert {r["data_source"] for r in rows} == {"copy"} and all(isinstance(r["score"], float) for r in rows)
    with open(tmp_path / "run" / "val_generations.jsonl", "a") as fh:   # logged after the checkpoint, then killed
        fh.write(json.dumps({"step": 3, "input": "stale"}) + "\n")
    rows = _train(tmp_path, 3, "--resume")
    assert [r["step"] for r in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert [r["input"] for r in rows[-3:]] == inputs
