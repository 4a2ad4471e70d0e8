"""The RL loop end to end on real parts: megatron actor on gloo (TP2 x PP2), embedded bf16 engine,
the copy task, the correction and the losses — plus resume and the metrics-only scoring mode.

Seams checked against independent references: the step-1 mismatch metrics logged by the loop are
recomputed from the dumped rollouts with HF transformers' fp32 forward of the initial checkpoint.
"""
import json
import math
import os

import pytest
import torch

from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import named_job, layout

pytestmark = pytest.mark.mcore  # megatron runs inside the RL loop's ranks: runs on the 0.19 leg too


@pytest.fixture(scope="module")
def copy_model_h64(task_model):
    """The copy-task model these loops train: hidden 64, 2 layers, seed 0 (conftest's ``task_model`` factory)."""
    return task_model(task="copy", seed=0, hidden_size=64, num_layers=2)


def _train_body(rank, world, cfg):
    from megatron_rl.trainer.loop import train

    return train(cfg)


def _read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def _hf_log_probs(model_dir, records):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for rec in records:
            p, r = rec["prompt_ids"], rec["response_ids"]
            logits = model(torch.tensor([p + r])).logits[0].double()
            lsm = torch.log_softmax(logits, -1)
            out.append([float(lsm[len(p) - 1 + j, r[j]]) for j in range(len(r))])
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, tp_pp", [(4, (2, 2)), (2, (1, 1))], ids=["tp2xpp2", "dp2"])
def test_training_logs_correct_mismatch_metrics(copy_model_h64, tmp_path, world, tp_pp):
    """TP2 x PP2, and DP2 (each rank trains on its own prompt groups; the metrics are global)."""
    run_dir = str(tmp_path / "run")
    cfg = named_job("copy_loop", *layout(tp=tp_pp[0], pp=tp_pp[1]), hf=copy_model_h64, run_dir=run_dir,
                    world_size=world)
    run_ranks(_train_body, world, cfg, timeout=240)
    metrics = _read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "rollout_corr/kl", "rollout_corr/k3_kl",
                    "rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_token_k3_masked_fraction",
                    "perf/tokens_per_s", "timing/train_s"):
            assert key in m and math.isfinite(m[key]), key
        assert 0.0 <= m["reward/mean"] <= 1.0
    # independent reference: HF fp32 forward of the initial checkpoint on step 1's recorded rollouts
    with open(os.path.join(run_dir, "rollouts.jsonl")) as fh:
        recs = [json.loads(line) for line in fh if json.loads(line)["step"] == 1]
    train_lp = _hf_log_probs(copy_model_h64, recs)
    d = [t - r for tl, rec in zip(train_lp, recs) for t, r in zip(tl, rec["rollout_log_probs"])]
    kl = sum(-x for x in d) / len(d)
    k3 = sum(math.exp(x) - x - 1 for x in d) / len(d)
    assert metrics[0]["rollout_corr/valid_token_count"] == len(d)
    assert math.isclose(metrics[0]["rollout_corr/kl"], kl, rel_tol=1e-3, abs_tol=1e-6)
    assert math.isclose(metrics[0]["rollout_corr/k3_kl"], k3, rel_tol=1e-3, abs_tol=1e-7)
    assert metrics[0]["rollout_corr/k3_kl"] > 0  # bf16 engine vs fp32 trainer: a real mismatch
    assert os.path.isfile(os.path.join(run_dir, "checkpoints", "step_2", "COMPLETE"))


@pytest.mark.timeout(400)
def test_resume_reproduces_uninterrupted_run(copy_model_h64, tmp_path):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    tp2 = dict(hf=copy_model_h64, world_size=2)
    run_ranks(_train_body, 2, named_job("copy_loop", "parallel.tensor_model_parallel_size=2", run_dir=straight, **tp2),
              timeout=200)
    run_ranks(_train_body, 2, named_job("copy_loop", "parallel.tensor_model_parallel_size=2", "trainer.steps=1",
                                        run_dir=split, **tp2), timeout=200)
    run_ranks(_train_body, 2, named_job("copy_loop", "parallel.tensor_model_parallel_size=2", "trainer.resume=true",
                                        run_dir=split, **tp2), timeout=200)
    a, b = _read_metrics(straight), _read_metrics(split)
    assert [m["step"] for m in b] == [1, 2]
    for key, v in a[1].items():
        if key.startswith(("timing/", "perf/")) or key == "time":
            continue
        assert b[1][key] == v, f"step 2 {key}: resumed {b[1][key]!r} != uninterrupted {v!r}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ref_offload", [False, True], ids=["held", "parked"])
def test_kl_to_reference_policy(copy_model_h64, tmp_path, ref_offload):
    """With kl_loss_coef > 0 the loop scores a frozen reference: step 1's KL loss is 0 (actor == reference)
    and step 2's is positive (the actor moved); the same with its weights parked between passes
    (actor.ref_param_offload)."""
    run_dir = str(tmp_path / "kl")
    cfg = named_job("copy_loop", "actor.policy_loss.kl_loss_coef=0.1", "actor.policy_loss.kl_loss_type=k3",
                    f"actor.ref_param_offload={str(ref_offload).lower()}",
                    "actor.lr=5e-3", "trainer.steps=4", "data.prompts_per_step=8", hf=copy_model_h64, run_dir=run_dir,
                    world_size=1)
    run_ranks(_train_body, 1, cfg, timeout=240)
    m = _read_metrics(run_dir)
    assert abs(m[0]["actor/kl_loss"]) < 1e-6
    moved = [i for i in range(len(m) - 1) if m[i]["actor/grad_norm"] > 0]
    assert moved, "no step had a nonzero gradient (all advantages zero?)"
    assert all(m[i + 1]["actor/kl_loss"] > 1e-7 for i in moved[:1])


def test_dp_rows_match_batch_shards():
    """Each DP rank's rewards, group indices and lag are those of exactly the rows its RolloutBatch shard holds
    (StepBatch.shard carries a step's rows as one unit)."""
    import torch

    from megatron_rl.trainer.step_batch import StepBatch

    for rows, dp, n in ((8, 1, 2), (8, 2, 2), (16, 4, 4), (24, 3, 8)):
        batch = StepBatch(prompt_ids=[[i + 1] for i in range(rows)], response_ids=[[5, 6]] * rows,
                          rollout_log_probs=[[-0.5, -0.5]] * rows, rewards=[float(i + 1) for i in range(rows)],
                          weight_version="step-3", token_versions=[[3 - i % 2, 3] for i in range(rows)])
        for r in range(dp):
            shard = batch.shard(3, n, 0, r, dp, torch.device("cpu"))
            first = shard.batch.tokens[:, 0].tolist()
            assert shard.rewards.tolist() == [float(t) for t in first], (rows, dp, r)
            assert shard.group_index.tolist() == [(t - 1) // n for t in first], (rows, dp, r)
            assert shard.token_lag[:, 0].tolist() == [(t - 1) % 2 for t in first], (rows, dp, r)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset", ["bypass_ppo_clip", "bypass_pg_is", "decoupled_geo_rs_seq_tis", "decoupled_token_kpop"])
def test_presets_run_in_the_loop(copy_model_h64, tmp_path, preset):
    """Bypass (rollout log-probs as the old policy; REINFORCE with weights) and decoupled RS presets train
    for 2 steps with finite metrics; geo RS with a +-1e-6 band rejects sequences and the loop carries on."""
    run_dir = str(tmp_path / preset)
    extra = ", rs_threshold: 0.999999_1.000001" if preset == "decoupled_geo_rs_seq_tis" else ""
    cfg = named_job("copy_loop", f"algorithm.rollout_correction={{preset: {preset}{extra}}}", hf=copy_model_h64,
                    run_dir=run_dir, world_size=1)
    run_ranks(_train_body, 1, cfg, timeout=240)
    metrics = _read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["rollout_corr/kl"])
    if preset == "decoupled_token_kpop":  # AReaL's default phi 2.0: the binary KL metrics are reported
        assert all(math.isfinite(m["rollout_corr/rollout_rs_binary_kl_max"]) for m in metrics)
    if preset == "decoupled_geo_rs_seq_tis":
        m = metrics[0]
        assert m["rollout_corr/rollout_rs_seq_masked_fraction"] > 0
        assert m["rollout_corr/kept_token_count"] < m["rollout_corr/valid_token_count"]
