"""The RL loop with a real SGLang server as the rollout engine (CPU, bf16): trains 2 steps at TP2, syncs weights
after each step through an HF export and ``/update_weights_from_disk`` (weight versions checked on every rollout).
The MoE loop starts its server itself (``rollout.sglang_launch``) and stops it; the dense and async loops run on the
copy model's server this pytest process shares (``copy_sglang_server``; each loop publishes its initial weights as
``step-0`` first, so what an earlier test left on the server does not carry over).

Seam check against an independent reference: step 1's mismatch metrics equal those recomputed from the
dumped rollouts with HF transformers' fp32 forward of the initial checkpoint.
"""
import json
import math
import os

import pytest
import torch

from megatron_rl.rollout.sglang_server import sglang_available
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import named_job

_OK, _REASON = sglang_available()
pytestmark = [pytest.mark.skipif(not _OK, reason=_REASON), pytest.mark.slow]


def _assert_step1_kl_matches_hf_fp32(model, metrics, recs):
    """Independent reference: step 1's logged kl equals the one recomputed from the dumped rollouts with HF
    transformers' fp32 forward of the initial checkpoint."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    d = []
    with torch.no_grad():
        for rec in (r for r in recs if r["step"] == 1):
            p, r = rec["prompt_ids"], rec["response_ids"]
            lsm = torch.log_softmax(hf(torch.tensor([p + r])).logits[0].double(), -1)
            d += [float(lsm[len(p) - 1 + j, r[j]]) - lp for j, lp in enumerate(rec["rollout_log_probs"])]
    assert metrics[0]["rollout_corr/valid_token_count"] == len(d)
    assert math.isclose(metrics[0]["rollout_corr/kl"], sum(-x for x in d) / len(d), rel_tol=1e-3, abs_tol=1e-6)


def _train_body(rank, world, cfg):
    from megatron_rl.trainer.loop import train

    return train(cfg)


@pytest.mark.timeout(900)
def test_loop_with_real_sglang_server(tmp_path, copy_sglang_server):
    model = copy_sglang_server.model_dir
    run_dir = str(tmp_path / "run")
    cfg = named_job("sglang_loop", *copy_sglang_server.job_overrides(), "parallel.tensor_model_parallel_size=2",
                    "rollout.max_new_tokens=4",
                    "data.prompts_per_step=4", "data.task_kwargs={min_digits: 1, max_digits: 2, heldout_frac: 0.1}",
                    "data.val_heldout=true", "trainer.test_freq=2", "trainer.val_before_train=false", hf=model,
                    run_dir=run_dir, world_size=2)
    run_ranks(_train_body, 2, cfg, timeout=840)
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        metrics = [json.loads(line) for line in fh]
    assert [m["step"] for m in metrics] == [1, 2]
    with open(os.path.join(run_dir, "rollouts.jsonl")) as fh:
        recs = [json.loads(line) for line in fh]
    assert {r["weight_version"] for r in recs if r["step"] == 2} == {"step-1"}  # synced after step 1
    _assert_step1_kl_matches_hf_fp32(model, metrics, recs)
    # validation through the server after the last step: every response carried the server's weight version
    # "step-2" (else the step fails with StaleRolloutError), one greedy response per held-out prompt
    from megatron_rl.tasks import DigitTask
    from megatron_rl.tokenizer import load_tokenizer

    heldout = DigitTask("copy", load_tokenizer(model), min_digits=1, max_digits=2, heldout_frac=0.1).heldout_prompts()
    assert "val/reward_mean" not in metrics[0] and metrics[1]["val/copy/prompts"] == len(heldout)
    assert 0 <= metrics[1]["val/copy/reward_mean"] <= 1 and 1 <= metrics[1]["val/response_length_mean"] <= 4


def _async_body(rank, world, cfg, delay_s):
    """Rank 0's SGLang calls are slowed (each /generate call waits ``delay_s`` first), so the trainer publishes
    new weights while a step is still being generated: an interrupted partial rollout on demand."""
    import time

    from megatron_rl.rollout.sglang_engine import SGLangEngine
    from megatron_rl.trainer.loop import train

    if rank == 0:
        real = SGLangEngine.generate

        def slow_generate(self, *args, **kwargs):
            time.sleep(delay_s)
            return real(self, *args, **kwargs)

        SGLangEngine.generate = slow_generate
    return train(cfg)


@pytest.mark.timeout(900)
def test_async_loop_with_real_sglang_server_and_interrupted_partial_rollouts(tmp_path, copy_sglang_server):
    """rollout.mode async, max_staleness 1, partial_rollout interrupt (segments of 2 tokens) at TP2 with a
    real server, weights in memory (``distributed``: the producer broadcasts rank 0's copy of each version in its
    own update group between segments, no disk export; every server tensor verified against the trainer's at
    each version, so a wrong or partial load ends the run): every token's version is within the staleness bound
    and non-decreasing along its response, at least one response continued on newer weights than it started
    with (the server really served the new version mid-rollout: its log-probs are the ones it sampled with), the
    lag metrics see the lagged tokens, and step 1's kl equals an HF fp32 recompute of the dumped rollouts."""
    model = copy_sglang_server.model_dir
    run_dir = str(tmp_path / "run")
    cfg = named_job("sglang_loop", *copy_sglang_server.job_overrides(), "parallel.tensor_model_parallel_size=2",
                    "rollout.max_new_tokens=8",
                    "data.prompts_per_step=4", "rollout.mode=async", "rollout.max_staleness=1",
                    "rollout.partial_rollout=interrupt", "rollout.segment_tokens=2", "trainer.steps=3", "actor.lr=1e-2",
                    "rollout.weight_sync=distributed", "rollout.weight_sync_verify_tensors=-1",
                    hf=model, run_dir=run_dir, world_size=2)
    run_ranks(_async_body, 2, cfg, 1.0, timeout=840)
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        metrics = [json.loads(line) for line in fh]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert not os.path.exists(os.path.join(run_dir, "weight_sync"))  # in memory: no disk export was written
    with open(os.path.join(run_dir, "rollouts.jsonl")) as fh:
        recs = [json.loads(line) for line in fh]
    mixed = 0
    for rec in recs:
        t = rec["step"] - 1                                   # 0-based step = trainer version
        versions = rec["token_versions"]
        assert len(versions) == len(rec["response_ids"])
        assert all(0 <= t - v <= 1 for v in versions), (rec["step"], versions)
        assert versions == sorted(versions)
        assert rec["weight_version"] == f"step-{versions[0]}" == f"step-{max(t - 1, 0)}"
        mixed += len(set(versions)) > 1
    assert mixed > 0, "no rollout was continued on new weights"
    for m in metrics[1:]:
        assert 0.0 < m["rollout_corr/lagged_token_fraction"] <= 1.0
    assert metrics[0]["rollout_corr/lagged_token_fraction"] == 0.0
    _assert_step1_kl_matches_hf_fp32(model, metrics, recs)


@pytest.mark.timeout(900)
def test_loop_with_real_sglang_server_replays_its_moe_routing(tmp_path):
    """routing_replay r3 through the whole loop with a real server: a tiny Qwen3-MoE, the loop launches the
    server (which captures routing because the model is MoE), 2 steps at EP2: the trainer replays the
    server's experts (r3 raises on every rank when routing is missing), router_agreement (trainer's own top-k
    vs the server's, measured on the recompute pass) is logged, and the weights synced after step 1 serve
    step 2."""
    from megatron_rl.tasks.char_tokenizer import build_task_model

    model = build_task_model(str(tmp_path / "model"), task="copy", seed=0, hidden_size=64, num_layers=2,
                             num_experts=8, num_experts_per_tok=2)
    run_dir = str(tmp_path / "run")
    cfg = named_job("sglang_loop", "parallel.tensor_model_parallel_size=1", "parallel.expert_model_parallel_size=2",
                    "actor.routing_replay=r3", "rollout.max_new_tokens=4", "data.prompts_per_step=4", hf=model,
                    run_dir=run_dir, world_size=2)
    run_ranks(_train_body, 2, cfg, timeout=840)
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        metrics = [json.loads(line) for line in fh]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:   # (agreement < 1 on more tokens: tests/integration/test_routing_sglang.py; here 2 small steps)
        assert 0.5 < m["rollout_corr/router_agreement"] <= 1.0
    with open(os.path.join(run_dir, "rollouts.jsonl")) as fh:
        recs = [json.loads(line) for line in fh]
    assert {r["weight_version"] for r in recs if r["step"] == 2} == {"step-1"}
