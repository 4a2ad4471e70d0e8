"""``megatron-rl check`` on the quickstart config: it plans what the file runs (4 CPU fp32 ranks, the copy
task's real prompt), reports every problem in one pass, and plans from a ``model:`` section even when
``actor.load_hf`` is missing.

    pytest tests/integration/test_check_cli.py
"""
import os
import subprocess
import sys

import pytest

from megatron_rl.testing.cli import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
Q7 = os.path.join(ROOT, "configs", "qwen2.5_7b_1x8.yaml")


def _cli_process(*args):
    """``python -m megatron_rl.cli check ARGS`` in a new interpreter (the console script as a user runs it)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "megatron_rl.cli", "check", *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)


def _cli(*args):
    """The same command in this process (no second import of torch / megatron: ~10 s of CPU a call)."""
    return run_cli("check", *args, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.fixture(scope="module")
def tiny_model(task_model):
    return task_model(task="copy", seed=0, hidden_size=128, num_layers=2)


def test_tiny_cpu_plans_four_cpu_fp32_ranks_and_the_real_prompt(tiny_model):
    r = _cli_process(TINY, f"actor.load_hf={tiny_model}")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "world size 4 (1 node(s) x 4 CPU rank(s))" in out
    assert "device cpu" in out and "params 4 B (the actor builds fp32)" in out and "on every DP rank" in out
    assert "host memory (CPU ranks) per rank" in out
    # the longest copy prompt with max_digits 3 is "copy:999=", encoded by the checkpoint's tokenizer (what
    # training uses); + rollout.max_new_tokens 4
    from megatron_rl.tasks.char_tokenizer import build_char_tokenizer

    n = len(build_char_tokenizer().encode("copy:999=", add_special_tokens=False))   # the saved tokenizer itself
    assert n == 6                                                                  # "copy" ":" "9" "9" "9" "="
    assert f"prompt {n} tokens (longest 'copy' prompt (max_digits 3), tokenizer of {tiny_model})" in out
    assert f"sequence {n + 4} tokens" in out
    assert "TP=2 PP=2" in out and "DP=1" in out


def test_tiny_cpu_before_the_model_exists_reports_every_problem(tmp_path):
    missing = str(tmp_path / "not_built")
    r = _cli(TINY, f"actor.load_hf={missing}", "parallel.tensor_model_parallel_size=3", "actor.lr=abc")
    assert r.returncode == 2
    err = r.stderr
    assert f"actor.load_hf: '{missing}' is not a directory" in err
    assert "world size: 4 ranks are not divisible by parallel.tensor_model_parallel_size x " \
           "parallel.pipeline_model_parallel_size x parallel.context_parallel_size = 3x2x1 = 6" in err
    assert "actor.lr: expected a number, got 'abc' (str)" in err
    assert "3 problem(s)" in err
    assert "expert" not in err
    assert "memory plan: skipped (no model shapes" in err


def test_missing_checkpoint_dir_does_not_stop_the_plan_when_the_model_section_gives_shapes():
    r = _cli(Q7, "actor.load_hf=/nonexistent/Qwen2.5-7B")
    assert r.returncode == 2
    assert "actor.load_hf: '/nonexistent/Qwen2.5-7B' is not a directory" in r.stderr
    assert "TP=4" in r.stdout and "peak: stage 0" in r.stdout


def test_flags_override_the_cluster_section():
    r = _cli(Q7, "--nodes", "2", "--gpu-memory-gb", "141")
    assert r.returncode == 0, r.stderr
    assert "world size 16 (2 node(s) x 8 GPU(s))" in r.stdout and "DP=4" in r.stdout  # TP=4
    assert "<= 141 GiB" in r.stdout or "> GPU memory 141 GiB" in r.stdout


@pytest.mark.parametrize("name,world", [("qwen2.5_7b_1x8.yaml", 8), ("qwen3_30b_a3b_2x8.yaml", 16),
                                        ("deepseek_v3_scale_64x8.yaml", 512)])
def test_gpu_configs_check_with_no_flags_at_the_size_in_their_name(name, world):
    r = _cli(os.path.join(ROOT, "configs", name))
    assert r.returncode == 0, r.stderr
    assert f"at world size {world} ({world // 8} node(s) x 8 GPU(s))" in r.stdout
    assert "peak: stage" in r.stdout


def test_every_shipped_config_names_its_cluster():
    import glob

    import yaml

    for path in glob.glob(os.path.join(ROOT, "configs", "*.yaml")):
        cluster = yaml.safe_load(open(path)).get("cluster")
        assert cluster and {"device", "nodes", "gpus_per_node"} <= set(cluster), path


def test_plan_includes_the_weight_sync():
    """The plan states what one trainer -> engine sync moves and holds. Reference: Qwen3-30B-A3B's published
    30.5 B parameters in bf16 (~61 GB, what the weight-sync issue quotes), the 512 MiB buckets of the config
    and the V x h output layer from its config (151936 x 2048 in bf16) gathered beside one bucket; PP2 x EP8:
    16 senders whose bytes add up to the whole model, the first of each stage carrying the dense tensors."""
    import re

    r = _cli("configs/qwen3_30b_a3b_2x8.yaml")
    assert r.returncode == 0, r.stderr
    m = re.search(r"weight sync \((\w+), buckets of 512 MiB\): ([\d.]+) GB per sync, rank 0 \+([\d.]+) GiB host, "
                  r"other senders \+([\d.]+) GiB; ~([\d.]+) s at an assumed 20 GB/s", r.stdout)
    assert m, r.stdout[-2000:]
    assert m.group(1) == "distributed"
    assert abs(float(m.group(2)) - 30.5e9 * 2 / 1e9) / 61.0 < 0.01
    out_layer = 151936 * 2048 * 2
    assert float(m.group(3)) == pytest.approx((512 * 2**20 + out_layer) / 2**30, abs=0.01)
    assert float(m.group(4)) == pytest.approx((512 * 2**20 + out_layer) / 2**30, abs=0.01)
    s = re.search(r"senders: (\d+), each over its own channel in parallel \((.*?)\); the largest sends ([\d.]+) GiB",
                  r.stdout)
    assert s, r.stdout[-2000:]
    assert int(s.group(1)) == 2 * 8
    shown = [float(x) for x in re.findall(r"stage \d EP rank \d ([\d.]+) GiB", s.group(2))]
    assert len(shown) == 8 and shown[0] > shown[1] == shown[2]  # EP rank 0 also sends the dense tensors
    # 16 senders: stage 0 and 1, 8 EP ranks each; the experts (48 x 128 x 3 x 2048 x 768) split evenly
    experts = 48 * 128 * 3 * 2048 * 768 * 2 / 16 / 2**30
    assert shown[1] == pytest.approx(experts, abs=0.01)
    assert float(m.group(5)) == pytest.approx(float(s.group(3)) * 2**30 / 20e9, abs=0.1)
    r = _cli("configs/qwen3_30b_a3b_2x8.yaml", "rollout.weight_sync=disk")
    assert r.returncode == 0, r.stderr
    assert re.search(r"weight sync \(disk\): ([\d.]+) GB per sync, rank 0 \+56\.\d\d GiB host", r.stdout), r.stdout[-800:]


def test_a_refused_correction_section_is_not_described_as_the_default_objective(tmp_path):
    # the section that failed to read stands at its defaults in the config check received: describing its
    # objective would name one the job does not ask for (gspo asked, ppo_clip described)
    r = _cli(TINY, f"actor.load_hf={tmp_path / 'not_built'}", "algorithm.rollout_correction.loss_type=gspo",
             "algorithm.rollout_correction.rollout_is_threshold=-1")
    assert r.returncode == 2
    assert "rollout_is_threshold: must be a finite positive number, got -1.0" in r.stderr
    assert "objective: ppo_clip" not in r.stdout + r.stderr
    r = _cli(TINY, f"actor.load_hf={tmp_path / 'not_built'}", "algorithm.rollout_correction.loss_type=gspo")
    assert "objective: gspo" in r.stdout    # a valid section is still described while the plan is not built
