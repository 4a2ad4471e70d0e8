"""Jobs of the small runs tests start: job files for ``launch/torchrun.sh`` (a real job YAML on disk) and loop configs.

``sglang_loop_job`` is the JobConfig of a short loop on a launched real SGLang server (the loop tests); ``copy_job`` is the 2-rank job they share (TP2, the copy task with 1-2 digits, 4 prompts x 2 samples of 4 new
tokens, micro-batch 4); ``write_job`` writes a job dict as the YAML ``--config`` reads; ``train_or_error`` is the
body of a forked rank that runs the RL loop and reports how it ended; ``wait_for_steps`` waits until a
running job has logged some steps.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any


def copy_job(model: str | os.PathLike, run_dir: str | os.PathLike, steps: int, **trainer: Any) -> dict:
    """The small 2-rank copy-task job on ``model`` writing to ``run_dir``; ``trainer`` adds ``trainer.*`` keys."""
    return {"parallel": {"tensor_model_parallel_size": 2},
            "rollout": {"max_new_tokens": 4, "n_samples_per_prompt": 2},
            "data": {"task": "copy", "prompts_per_step": 4, "task_kwargs": {"min_digits": 1, "max_digits": 2}},
            "actor": {"lr": 1.0e-3, "micro_batch_size": 4, "load_hf": str(model)},
            "trainer": {"steps": steps, "run_dir": str(run_dir), **trainer}}


def write_job(path: str | os.PathLike, job: dict) -> Path:
    """Write ``job`` as YAML to ``path`` and return the path."""
    import yaml

    path = Path(path)
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def train_or_error(cfg) -> str | None:
    """Run ``trainer.loop.train(cfg)`` on this rank: None when it completes, else ``"ExcType: message"`` (the
    tests check every rank's error)."""
    from megatron_rl.trainer.loop import train

    try:
        train(cfg)
    except Exception as exc:  # noqa: BLE001 - the test checks every rank's error
        return f"{type(exc).__name__}: {exc}"
    return None


def wait_for_steps(proc: subprocess.Popen, metrics: Path, steps: int, timeout: float, poll: float) -> None:
    """Poll until ``metrics`` (a run's metrics.jsonl) holds ``steps`` records; ``AssertionError`` with the tail
    of the job's output if ``proc`` exits first, or when ``timeout`` s pass."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        time.sleep(poll)
    raise AssertionError(f"the job did not log {steps} steps in {timeout} s")


def sglang_loop_job(model: str | os.PathLike, run_dir: str | os.PathLike, world_size: int, *overrides: str):
    """The JobConfig of a short loop on a real SGLang server the job launches (``model``: a tiny task model; 2
    steps, 4 samples per prompt, rollouts dumped); ``overrides`` (dotted ``key=value``) come last and win."""
    from megatron_rl.config import load_job_config
    from megatron_rl.rollout.sglang_server import find_free_port

    return load_job_config(None, [
        f"actor.load_hf={model}", f"trainer.run_dir={run_dir}", "rollout.engine=sglang", "rollout.sglang_launch=true",
        f"rollout.sglang_port={find_free_port()}", "rollout.n_samples_per_prompt=4", "trainer.steps=2",
        "trainer.dump_rollouts=true", "trainer.progress=false", "actor.micro_batch_size=8", "actor.lr=1e-3",
        *overrides], world_size=world_size)
