"""Path-valued config keys resolve once, where the config is loaded (megatron_rl/config/paths.py): a file's values
against its directory with ``~`` expanded, the command line's against the current directory, HF hub ids left
alone. The expected paths are written out from the test's own directories (and $HOME), not computed by the code."""
import os
import subprocess
import sys

import pytest

from megatron_rl.config import read_job_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(path, *overrides):
    cfg, _ = read_job_config(str(path), list(overrides))
    return cfg


def test_shipped_config_checks_from_another_directory(tmp_path):
    """The shipped Qwen3 config names the repository's sample data relative to itself: `check` passes from any cwd."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "check",
                        os.path.join(ROOT, "configs", "qwen3_30b_a3b_2x8.yaml")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "config OK" in r.stdout + r.stderr


def test_file_values_resolve_beside_the_file(tmp_path, monkeypatch):
    job = tmp_path / "jobs" / "job.yaml"
    job.parent.mkdir()
    job.write_text("data:\n  task: rewards/task.py:make\n  path: data/train.jsonl\n"
                   "  val_files: [data/a.jsonl, /abs/b.jsonl]\n  reward_fn: my_pkg.rewards:score\n"
                   "multi_turn:\n  env: ../envs/tools.py:ToolEnv\n"
                   "rollout:\n  weight_sync_dir: sync\n"
                   "trainer:\n  run_dir: out/run1\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = _load(job)
    j = str(tmp_path / "jobs")
    assert cfg.data.path == f"{j}/data/train.jsonl"
    assert cfg.data.val_files == [f"{j}/data/a.jsonl", "/abs/b.jsonl"]
    assert cfg.data.task == f"{j}/rewards/task.py:make"
    assert cfg.data.reward_fn == "my_pkg.rewards:score"           # a module, not a file: left alone
    assert cfg.multi_turn.env == f"{tmp_path}/envs/tools.py:ToolEnv"
    assert cfg.rollout.weight_sync_dir == f"{j}/sync"
    assert cfg.trainer.run_dir == f"{j}/out/run1"


def test_builtin_names_stay(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("data:\n  task: copy\n  reward_fn: math\n")
    cfg = _load(job)
    assert (cfg.data.task, cfg.data.reward_fn) == ("copy", "math")


def test_tilde_expands_in_every_path_key(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    job = tmp_path / "job.yaml"
    job.write_text("data:\n  path: ~/data/train.parquet\n  val_files: ~/data/val.parquet\n"
                   "actor:\n  load_hf: ~/ckpt/Qwen3-8B\ntrainer:\n  run_dir: ~/runs/x\n")
    cfg = _load(job, "rollout.weight_sync_dir=~/sync")
    assert cfg.data.path == f"{home}/data/train.parquet"
    assert cfg.data.val_files == f"{home}/data/val.parquet"
    assert cfg.actor.load_hf == f"{home}/ckpt/Qwen3-8B"
    assert cfg.trainer.run_dir == f"{home}/runs/x"
    assert cfg.rollout.weight_sync_dir == f"{home}/sync"


def test_hub_id_is_left_alone(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("actor:\n  load_hf: Qwen/Qwen3-8B\n")
    cfg, errors = read_job_config(str(job), [])
    assert cfg.actor.load_hf == "Qwen/Qwen3-8B"
    assert any("'Qwen/Qwen3-8B'" in e for e in errors), errors   # named as written


def test_load_hf_beside_the_file_resolves_without_prefix(tmp_path, monkeypatch):
    (tmp_path / "models" / "m").mkdir(parents=True)
    job = tmp_path / "job.yaml"
    job.write_text("actor:\n  load_hf: models/m\n")
    monkeypatch.chdir("/")
    assert _load(job).actor.load_hf == f"{tmp_path}/models/m"


def test_overrides_resolve_against_the_current_directory(tmp_path, monkeypatch):
    job = tmp_path / "conf" / "job.yaml"
    job.parent.mkdir()
    job.write_text("trainer:\n  run_dir: a\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    cfg = _load(job, "trainer.run_dir=runs/b", "data.val_files=[v1.jsonl, v2.jsonl]", "actor.load_hf=Qwen/Qwen3-8B")
    assert cfg.trainer.run_dir == f"{cwd}/runs/b"
    assert cfg.data.val_files == [f"{cwd}/v1.jsonl", f"{cwd}/v2.jsonl"]
    assert cfg.actor.load_hf == "Qwen/Qwen3-8B"


def test_a_config_written_for_the_old_rule_is_said_not_silently_moved(tmp_path, monkeypatch):
    """A config written before paths resolved beside the file (``run_dir: runs/my`` meaning the current directory's)
    must not silently train elsewhere: when a relative path in the file names nothing beside the file but something
    from the current directory, the problem names the key, both places and the fix. A path that exists beside the
    file, an override, or one that exists in neither place is not reported."""
    repo = tmp_path / "repo"
    (repo / "configs").mkdir(parents=True)
    (repo / "runs" / "my" / "checkpoints").mkdir(parents=True)          # the run the old rule continued
    (repo / "examples").mkdir()
    (repo / "examples" / "train.jsonl").write_text('{"prompt": "copy:1=", "answer": "1"}\n')
    job = repo / "configs" / "job.yaml"
    job.write_text("data:\n  task: file\n  path: examples/train.jsonl\ntrainer:\n  run_dir: runs/my\n")
    monkeypatch.chdir(repo)
    _, problems = read_job_config(str(job), [])
    said = [p for p in problems if "from the current directory" in p]
    assert len(said) == 2, problems
    run = next(p for p in said if p.startswith("trainer.run_dir"))
    assert str(repo / "configs" / "runs" / "my") in run and str(repo / "runs" / "my") in run
    assert "../runs/my" in run
    # an override of the key: the file's value is not used
    _, problems = read_job_config(str(job), ["trainer.run_dir=runs/my", "data.path=examples/train.jsonl"])
    assert not [p for p in problems if "from the current directory" in p]
    # an unrelated directory of the run_dir's name (no run in it) says nothing; the data file still does
    (repo / "runs" / "my" / "checkpoints").rmdir()
    _, problems = read_job_config(str(job), [])
    assert [p.split(":")[0] for p in problems if "from the current directory" in p] == ["data.path"]
    # from another directory nothing is ambiguous
    monkeypatch.chdir(tmp_path)
    _, problems = read_job_config(str(job), [])
    assert not [p for p in problems if "from the current directory" in p]
