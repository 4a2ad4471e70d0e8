"""``megatron-rl score`` (metrics-only mode): recorded rollouts -> megatron recompute at DP2 -> per-token
trainer log-probs equal to HF transformers' fp32 forward, global mismatch metrics from them."""
import json
import math

import pytest
import torch

from megatron_rl.config import load_job_config
from megatron_rl.score import read_rollouts
from megatron_rl.testing.distributed import run_ranks


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.tasks.char_tokenizer import build_task_model

    d = tmp_path_factory.mktemp("score")
    model = build_task_model(str(d / "model"), task="copy", seed=1, hidden_size=64, num_layers=2)
    engine = EmbeddedEngine(model, dtype="bfloat16", seed=3)
    prompts = [[5, 6, 7, 3], [8, 9, 3], [4, 4, 4, 4, 3], [6, 3]]
    rollouts = engine.generate(prompts, SamplingParams(temperature=0.8, max_new_tokens=5), n=2)
    path = d / "rollouts.jsonl"
    with open(path, "w") as fh:
        for r in rollouts:
            fh.write(json.dumps({"prompt_ids": list(r.prompt_ids), "response_ids": list(r.response_ids),
                                 "rollout_log_probs": list(r.rollout_log_probs)}) + "\n")
    return model, str(path), d


def _score_body(rank, world, cfg, records, out):
    from megatron_rl.score import score

    return score(cfg, records, out)


@pytest.mark.timeout(240)
def test_score_matches_hf_fp32_and_reports_global_metrics(recorded):
    from transformers import AutoModelForCausalLM

    model_dir, path, d = recorded
    cfg = load_job_config(None, [f"actor.load_hf={model_dir}", "rollout.temperature=0.8", "actor.micro_batch_size=3",
                                 "data.prompts_per_step=2",
                                 "algorithm.rollout_correction={rollout_is: sequence, rollout_is_threshold: 3.0}"],
                          world_size=2)
    records = read_rollouts(path)
    out = str(d / "scored.jsonl")
    metrics = run_ranks(_score_body, 2, cfg, records, out, timeout=200)
    assert metrics[0] == metrics[1]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    scored = [json.loads(line) for line in open(out)]
    diffs = []
    with torch.no_grad():
        for rec in scored:
            p, r = rec["prompt_ids"], rec["response_ids"]
            lsm = torch.log_softmax(hf(torch.tensor([p + r])).logits[0].double() / 0.8, -1)
            ref = [float(lsm[len(p) - 1 + j, r[j]]) for j in range(len(r))]
            assert len(rec["train_log_probs"]) == len(r)
            for a, b in zip(rec["train_log_probs"], ref):
                assert abs(a - b) <= 1e-4
            diffs += [t - x for t, x in zip(ref, rec["rollout_log_probs"])]
    kl = sum(-x for x in diffs) / len(diffs)
    assert math.isclose(metrics[0]["rollout_corr/kl"], kl, rel_tol=1e-3, abs_tol=1e-6)
    assert metrics[0]["rollout_corr/valid_token_count"] == len(diffs)
    assert "rollout_corr/rollout_is_seq_mean" in metrics[0]


def test_bad_rollout_files_name_line_and_field(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"prompt_ids": [1], "response_ids": [2, 3], "rollout_log_probs": [-0.1, -0.2]}\n'
                 '{"prompt_ids": [1], "response_ids": [2]}\n')
    with pytest.raises(ValueError, match=r"r\.jsonl:2: missing field 'rollout_log_probs'"):
        read_rollouts(str(p))
    p.write_text('{"prompt_ids": [1], "response_ids": [2, 3], "rollout_log_probs": [-0.1]}\n')
    with pytest.raises(ValueError, match=r":1: 2 response_ids but 1 rollout_log_probs"):
        read_rollouts(str(p))
    p.write_text("not json\n")
    with pytest.raises(ValueError, match=r":1: not valid JSON"):
        read_rollouts(str(p))
