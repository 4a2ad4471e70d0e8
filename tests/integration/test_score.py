"""``megatron-rl score`` (metrics-only mode): recorded rollouts -> megatron recompute at DP2 -> per-token
trainer log-probs equal to HF transformers' fp32 forward, global mismatch metrics from them."""
import json
import math

import pytest
import torch

from megatron_rl.plan import load_job_config
from megatron_rl.score import read_rollouts
from megatron_rl.testing.distributed import run_ranks


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, task_model):
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.embedded import EmbeddedEngine

    d = tmp_path_factory.mktemp("score")
    model = task_model(task="copy", seed=1, hidden_size=64, num_layers=2)
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
def test_score_matches_hf_fp32_and_reports_global_metrics(recorded, hf_reference):
    model_dir, path, d = recorded
    cfg = load_job_config(None, [f"actor.load_hf={model_dir}", "rollout.temperature=0.8", "actor.micro_batch_size=3",
                                 "data.prompts_per_step=2",
                                 "algorithm.rollout_correction={rollout_is: sequence, rollout_is_threshold: 3.0}"],
                          world_size=2)
    records = read_rollouts(path)
    out = str(d / "scored.jsonl")
    metrics = run_ranks(_score_body, 2, cfg, records, out, timeout=200)
    assert metrics[0] == metrics[1]
    hf = hf_reference(model_dir).model
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


# ------------------------------------------------------------------ weight versions
def _recs(*versions):
    return [{"prompt_ids": [1], "response_ids": [2], "rollout_log_probs": [-0.1],
             **({} if v is None else {"weight_version": v})} for v in versions]


def _ckpt(root, step):
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    (d / "COMPLETE").write_text("")


def test_several_versions_without_checkpoints_are_refused():
    from megatron_rl.score import plan_versions

    with pytest.raises(ValueError, match=r"3 weight versions \(step-0: 2, step-1: 1, step-2: 1\).*--checkpoints"):
        plan_versions(_recs("step-0", "step-1", "step-0", "step-2"))


def test_single_later_version_warns_and_one_initial_version_does_not():
    from megatron_rl.score import plan_versions

    groups, warnings = plan_versions(_recs("step-5", "step-5"))
    assert [g.indices for g in groups] == [[0, 1]] and groups[0].checkpoint is None
    assert len(warnings) == 1 and "weight version step-5" in warnings[0]
    assert plan_versions(_recs("step-0"))[1] == [] and plan_versions(_recs(None, None))[1] == []


def test_checkpoints_map_each_version_and_missing_ones_are_named(tmp_path):
    from megatron_rl.score import plan_versions

    _ckpt(tmp_path, 2)
    (tmp_path / "step_3").mkdir()  # incomplete: no COMPLETE marker
    groups, warnings = plan_versions(_recs("step-2", "step-0", "step-2"), str(tmp_path))
    assert [(g.version, g.indices, g.checkpoint) for g in groups] == [
        ("step-0", [1], None), ("step-2", [0, 2], str(tmp_path / "step_2"))]
    assert warnings == []
    with pytest.raises(ValueError, match=r"no complete checkpoint for weight version\(s\) step-3 \(1 record\(s\)\) "
                                         r"\(complete checkpoints: step_2\)"):
        plan_versions(_recs("step-2", "step-3"), str(tmp_path))


def test_weight_version_keeps_one_group_with_a_warning():
    from megatron_rl.score import plan_versions

    groups, warnings = plan_versions(_recs("step-0", "step-1", "step-1"), keep=["step-1"])
    assert [g.indices for g in groups] == [[1, 2]]
    assert any("skipping 1 record(s)" in w for w in warnings)
    with pytest.raises(ValueError, match="--weight-version step-9: no such records"):
        plan_versions(_recs("step-0"), keep=["step-9"])


def _score_versions_body(rank, world, cfg, records, out, ckpt_root):
    import os

    import torch
    import torch.distributed as dist

    from megatron_rl.score import plan_versions, score
    from megatron_rl.trainer.job import setup_distributed

    # a "step_1" checkpoint whose weights are the initial ones x 0.9 (linear in every HF tensor)
    actor = setup_distributed(cfg)
    with torch.no_grad():
        for p in actor.model[0].parameters():
            p.mul_(0.9)
    path = os.path.join(ckpt_root, "step_1")
    actor.save_checkpoint(path, 1)
    dist.barrier()
    if rank == 0:
        open(os.path.join(path, "COMPLETE"), "w").close()
    dist.barrier()
    groups, _ = plan_versions(records, ckpt_root)
    return score(cfg, records, out, groups)


@pytest.mark.timeout(300)
def test_each_version_is_scored_with_its_own_checkpoint(recorded, hf_reference):
    """Records of step-0 match HF fp32 of the initial model; records of step-1 match HF fp32 of the
    step_1 checkpoint's weights (the initial weights x 0.9, built independently in HF)."""
    model_dir, path, d = recorded
    cfg = load_job_config(None, [f"actor.load_hf={model_dir}", "rollout.temperature=0.8", "data.prompts_per_step=2"],
                          world_size=2)
    records = read_rollouts(path)
    for i, r in enumerate(records):
        r["weight_version"] = "step-1" if i % 2 else "step-0"
    out = str(d / "scored_versions.jsonl")
    ckpt_root = d / "checkpoints"
    ckpt_root.mkdir()
    metrics = run_ranks(_score_versions_body, 2, cfg, records, out, str(ckpt_root), timeout=280)
    assert metrics[0] == metrics[1]
    assert "step-0/rollout_corr/kl" in metrics[0] and "step-1/rollout_corr/kl" in metrics[0]
    hf0 = hf_reference(model_dir).model
    hf1 = hf_reference(model_dir).model
    with torch.no_grad():
        for p in hf1.parameters():
            p.mul_(0.9)
    scored = [json.loads(line) for line in open(out)]
    assert [r["weight_version"] for r in scored] == [r["weight_version"] for r in records]
    with torch.no_grad():
        for rec in scored:
            hf = hf1 if rec["weight_version"] == "step-1" else hf0
            p, r = rec["prompt_ids"], rec["response_ids"]
            lsm = torch.log_softmax(hf(torch.tensor([p + r])).logits[0].double() / 0.8, -1)
            ref = [float(lsm[len(p) - 1 + j, r[j]]) for j in range(len(r))]
            assert max(abs(a - b) for a, b in zip(rec["train_log_probs"], ref)) <= 1e-4
