"""``reward.model`` in the RL loop (issue 50): real single-rank ``python -m megatron_rl.train`` jobs on the copy
task whose reward comes only from a tiny sequence-classification RM (backend local).

* sync: every dumped row's reward equals HF transformers' own forward of the RM on that row (prompt decoded with
  the policy's tokenizer, rendered with the RM's template), and the step metrics carry ``reward/rm_*``;
* determinism: a second sync run with the same seed gives the identical reward curve;
* async (``rollout.mode: async``): the rewards are the RM's too (each dumped row checked the same way).

Run: OMP_NUM_THREADS=1 pytest tests/integration/test_reward_model_loop.py   (~1 min on 2 cores)
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from megatron_rl.testing.tiny_rm import build_tiny_rm
from megatron_rl.tokenizer import load_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID",
                                                             "SLURM_NTASKS")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return env


def _train(run, model, rm, *extra):
    args = [f"actor.load_hf={model}", f"trainer.run_dir={run}", "rollout.max_new_tokens=4",
            "rollout.n_samples_per_prompt=2", "data.prompts_per_step=2", "trainer.progress=false",
            "actor.micro_batch_size=4", "trainer.steps=2", "trainer.dump_rollouts=true",
            "reward.model.enable=true", f"reward.model.path={rm}", "reward.model.max_tokens_per_batch=40", *extra]
    r = subprocess.run([sys.executable, "-m", "megatron_rl.train", *args], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    return r.stdout + r.stderr, metrics, rows


@pytest.fixture(scope="module")
def rm(tmp_path_factory):
    return build_tiny_rm(tmp_path_factory.mktemp("rm") / "rm", seed=1)


def _hf_scores(rm, policy_dir, rows):
    """The RM's HF forward of each dumped row, one unpadded row at a time."""
    policy, rm_tok = load_tokenizer(policy_dir), load_tokenizer(rm)
    model = AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32).eval()
    out = []
    for row in rows:
        resp = list(row["response_ids"])
        if policy.eos_token_id in resp:
            resp = resp[:resp.index(policy.eos_token_id)]
        conv = [{"role": "user", "content": policy.decode(row["prompt_ids"])},
                {"role": "assistant", "content": policy.decode(resp, skip_special_tokens=True)}]
        ids = rm_tok.encode(rm_tok.apply_chat_template(conv, tokenize=False), add_special_tokens=False)
        with torch.no_grad():
            out.append(float(model(torch.tensor([ids])).logits[0, 0]))
    return out


def test_rm_rewards_in_sync_and_async_runs_equal_hf_and_repeat(copy_model, rm, tmp_path):
    out, metrics, rows = _train(tmp_path / "sync", copy_model, rm)
    assert "reward = 1 * (1 * rm + 0), rm: " in out                           # the formula, said at start
    assert [r["reward"] for r in rows] == pytest.approx(_hf_scores(rm, copy_model, rows), abs=1e-5)
    for m in metrics:
        assert m["reward/rm_failures"] == 0 and m["reward/rm_latency_s"] > 0
        assert m["reward/rm_score_min"] <= m["reward/rm_score_mean"] <= m["reward/rm_score_max"]
        assert m["reward_extra/rm_score/mean"] == pytest.approx(m["reward/rm_score_mean"])
    _, metrics2, rows2 = _train(tmp_path / "sync2", copy_model, rm)
    assert [m["reward/mean"] for m in metrics2] == [m["reward/mean"] for m in metrics]   # same seed, same curve
    assert [r["reward"] for r in rows2] == [r["reward"] for r in rows]
    _, ametrics, arows = _train(tmp_path / "async", copy_model, rm, "rollout.mode=async",
                                "rollout.max_staleness=1")
    assert len(ametrics) == 2 and all("reward/rm_latency_s" in m for m in ametrics)
    assert [r["reward"] for r in arows] == pytest.approx(_hf_scores(rm, copy_model, arows), abs=1e-5)


def test_check_reports_the_rm_and_its_template_on_a_row(copy_model, rm, capsys, monkeypatch):
    from megatron_rl.cli import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(ROOT)
    args = ["check", os.path.join(ROOT, "configs", "tiny_cpu.yaml"), f"actor.load_hf={copy_model}",
            "parallel.pipeline_model_parallel_size=1", "reward.model.enable=true", f"reward.model.path={rm}"]
    rc = main(args)
    out, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    assert "reward model: reward = 1 * (1 * rm + 0)" in out
    assert "reward model: the RM template renders" in out and "[assistant]" in out
    rc = main(args + ["reward.model.backend=sglang"])
    out, err = capsys.readouterr()
    assert rc == 2 and "reward.model.urls: backend 'sglang' needs at least one server URL" in err


def test_an_rm_server_that_is_down_ends_the_run_loudly(copy_model, rm, tmp_path):
    """Nothing listens at the RM's URL: every sample of step 1 fails, counted; past data.max_reward_failure_frac the
    run ends with RewardFailureError naming the server, before the step trains."""
    run = tmp_path / "down"
    args = [f"actor.load_hf={copy_model}", f"trainer.run_dir={run}", "rollout.max_new_tokens=4",
            "rollout.n_samples_per_prompt=2", "data.prompts_per_step=2", "trainer.progress=false",
            "actor.micro_batch_size=4", "trainer.steps=2", "reward.model.enable=true", f"reward.model.path={rm}",
            "reward.model.backend=sglang", 'reward.model.urls=["http://127.0.0.1:9"]', "reward.model.retries=1"]
    r = subprocess.run([sys.executable, "-m", "megatron_rl.train", *args], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert "RewardFailureError: step 1: 4 reward(s) failed and 0 timed out of 4 samples" in out, out[-3000:]
    assert "http://127.0.0.1:9" in out and "after 2 tries" in out
    assert not (run / "checkpoints").exists()
