"""Your own task by import path (``data.task: "file.py:factory"``): built with ``factory(tokenizer,
**data.task_kwargs)``, trained by the real loop (1 gloo rank, embedded engine), its reward the one the job logs.

The task here is written as a user would, in a file outside the project: the copy task's prompts, rewarded by
whether the response (up to EOS) has an even number of tokens. Reference: that rule recomputed from the dumped
rollouts (``trainer.dump_rollouts``), independently of the task object; plus the errors that name ``data.task``
before anything starts (a module that does not import, a factory that returns something else).
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_rl.tasks import build_task, build_char_tokenizer
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import named_job

pytestmark = pytest.mark.mcore
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TASK_FILE = textwrap.dedent('''
    from megatron_rl.tasks import DigitTask, Task, split_at_eos


    class EvenLength(Task):
        name = "even_length"

        def __init__(self, tokenizer, max_digits=2):
            super().__init__(tokenizer)
            self.inner = DigitTask("copy", tokenizer, min_digits=1, max_digits=max_digits)

        def sample(self, n, rng):
            return self.inner.sample(n, rng)

        def reward(self, prompt, response_ids):
            ids, _ = split_at_eos(response_ids, [self.eos_token_id])
            return 1.0 if len(ids) % 2 == 0 else 0.0


    def make(tokenizer, max_digits=2):
        return EvenLength(tokenizer, max_digits=max_digits)


    def not_a_task(tokenizer, **kwargs):
        return 42
''')


@pytest.fixture
def task_file(tmp_path):
    path = tmp_path / "my_tasks.py"
    path.write_text(TASK_FILE)
    return str(path)


def test_build_task_and_the_errors_that_name_data_task(task_file):
    tok = build_char_tokenizer(task="copy")
    task = build_task(f"{task_file}:make", tok, task_kwargs={"max_digits": 3})
    assert type(task).__name__ == "EvenLength" and task.inner.max_digits == 3
    with pytest.raises(ValueError, match=r"data.task=.*not_a_task returned a int, not a megatron_rl.tasks.Task"):
        build_task(f"{task_file}:not_a_task", tok)
    with pytest.raises(ValueError, match=r"data.task=.*make\(tokenizer, \*\*data.task_kwargs\) failed: TypeError"):
        build_task(f"{task_file}:make", tok, task_kwargs={"no_such_option": 1})
    with pytest.raises(ValueError, match=r"data.task=.*no_such_module_xyz"):
        build_task("no_such_module_xyz:make", tok)
    with pytest.raises(ValueError, match=r"or 'module:factory'"):
        build_task("cpoy", tok)


def test_check_names_a_task_that_does_not_import(tmp_path):
    r = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "check", "configs/tiny_cpu.yaml",
                        "data.task=no_such_module_xyz:make", "data.task_kwargs={}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 2
    assert "data.task='no_such_module_xyz:make': module 'no_such_module_xyz' not found" in r.stderr, r.stderr[-2000:]


def _train(rank, world, cfg):
    from megatron_rl.trainer.loop import train

    return train(cfg)


@pytest.mark.timeout(300)
def test_the_loop_trains_your_task_and_logs_its_reward(task_model, task_file, tmp_path):
    model = task_model(task="copy", seed=0, hidden_size=64, num_layers=2)
    run_dir = tmp_path / "run"
    cfg = named_job("copy_loop", f"data.task={task_file}:make", "data.task_kwargs={max_digits: 2}", hf=model,
                    run_dir=run_dir, world_size=1)
    run_ranks(_train, 1, cfg, timeout=240)
    with open(run_dir / "rollouts.jsonl") as fh:
        recs = [json.loads(line) for line in fh if line.strip()]
    with open(os.path.join(model, "config.json")) as fh:
        eos = json.load(fh)["eos_token_id"]
    eos = set(eos if isinstance(eos, list) else [eos])
    assert recs and {r["step"] for r in recs} == {1, 2}
    for r in recs:
        n = next((i for i, t in enumerate(r["response_ids"]) if t in eos), len(r["response_ids"]))
        assert r["reward"] == (1.0 if n % 2 == 0 else 0.0), r
    with open(run_dir / "metrics.jsonl") as fh:
        metrics = [json.loads(line) for line in fh]
    for m in metrics:
        rows = [r["reward"] for r in recs if r["step"] == m["step"]]
        assert m["reward/mean"] == pytest.approx(sum(rows) / len(rows), abs=1e-6)


def test_the_launchers_check_refuses_task_kwargs_the_factory_does_not_take(task_file):
    """A config written for a digit task keeps its data.task_kwargs (min_digits, ...) when only data.task changes:
    the launcher's check names the mismatch before torchrun starts, not rank 0 after it."""
    r = subprocess.run([sys.executable, "-m", "megatron_rl.train", "--check-world-size", "4", "--config",
                        "configs/tiny_cpu.yaml", f"data.task={task_file}:make"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 2
    assert "data.task_kwargs:" in r.stderr and "do not fit make(tokenizer, **data.task_kwargs)" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "megatron_rl.train", "--check-world-size", "4", "--config",
                        "configs/tiny_cpu.yaml", f"data.task={task_file}:make", "data.task_kwargs={max_digits: 2}",
                        "actor.load_hf=" + os.path.join(ROOT, "runs", "no_model_needed_for_this_check")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert "data.task" not in r.stderr, r.stderr
