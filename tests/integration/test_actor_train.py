"""Train step of ``MegatronActor``: exact against an independent single-process reference.

Reference = HF transformers (fp32) on the whole batch in one process: log_softmax(logits / T) picked at
token t+1 by a plain gather, ``compute_policy_loss`` over the full batch (IS weights, rejection mask),
``loss.backward()``, ``torch.nn.utils.clip_grad_norm_``, ``torch.optim.AdamW`` (no weight decay on 1-D
params, as megatron) — no megatron, no micro-batches, no parallelism.

The actor loads the same HF checkpoint at TP1, TP2xPP2 (4 ranks), DP2, TP2 + sequence parallel, EP2
(tiny Qwen3-MoE), PP2 with tied embeddings and interleaved PP4 x VPP2 (equal-length micro-batches), splits
its shard into micro-batches of different lengths and takes one optimizer step. Checked: gradients
(after clipping; unsharded from every rank's Megatron ``main_grad``) <= 1e-6 abs / 1e-4 rel, the
pre-clip grad norm, the loss, and the updated weights (HF export) <= 1e-5. Adam's first update is
nearly sign(grad) (scale invariant), so the gradient comparison is what pins the loss scaling through
megatron's schedule and DDP. A second test runs ppo_mini_batches=2 x ppo_epochs=2 (4 optimizer steps).

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_actor_train.py -q``
"""
import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.actor import MegatronActor, RolloutBatch, row_blocks
from megatron_rl.plan import actor_spec
from megatron_rl.losses import LossBatch, PolicyLoss, PolicyLossConfig, compute_policy_loss
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.testing.actor_reference import CLIP_GRAD, LR, PPO_LOSS, actor_on_shard, hf_adamw, hf_token_log_probs
from megatron_rl.testing.actor_reference import hf_token_log_probs_and_entropy, load_hf_reference
from megatron_rl.testing.actor_reference import merge_rank_grads, policy_data, rank_main_grads, unfuse_experts
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import knobs, named_job

transformers = pytest.importorskip("transformers")

T = 0.8


@pytest.fixture(scope="module")
def models(tiny_hf_model):
    return {"qwen2": tiny_hf_model("qwen2", seed=21, num_hidden_layers=4),
            "moe": tiny_hf_model("qwen3_moe", seed=22),
            "tied": tiny_hf_model("qwen2", seed=23, tie_word_embeddings=True),
            "deep": tiny_hf_model("qwen2", seed=24, num_hidden_layers=8)}


def _data(vocab, B=8, seed=0):
    return policy_data(vocab, B, seed, prompt_len=(1, 6), response_len=(1, 10), reject_token=True)


def _rank_train(rank, world, job, data):
    batch, old, adv, mask, is_w = data
    actor, shard, start, end = actor_on_shard(job, batch)
    W = shard.max_length - 1
    metrics = actor.train_step(shard, old[start:end, :W], adv[start:end], mask[start:end, :W],
                               is_w[start:end, :W], T)
    return {"metrics": metrics, "grads": rank_main_grads(actor, job.parallel), "hf_sd": actor.full_state_dict_hf()}


def _reference(hf_dir, data, steps_rows, epochs=1, loss=None):
    """HF + torch AdamW; ``steps_rows``: the rows of each optimizer step (one list per mini-batch); ``loss``: the
    job's PolicyLossConfig (default PPO_LOSS); with an entropy bonus the entropy is -sum p log p of HF's logits."""
    batch, old, adv, mask, is_w = data
    model = load_hf_reference(hf_dir)
    model.train()
    opt = hf_adamw(model, LR, weight_decay=0.1)
    cfg = loss or PolicyLossConfig(**PPO_LOSS)
    W = batch.max_length - 1
    out = {"grad_norm": [], "pg_loss": [], "entropy_loss": [], "grads": None}
    for _ in range(epochs):
        for rows in steps_rows:
            rows = torch.tensor(rows)
            opt.zero_grad()
            logp, ent = hf_token_log_probs_and_entropy(model, batch.tokens[rows], T)
            loss = compute_policy_loss(PolicyLoss.of("ppo_clip", cfg),
                                       LossBatch(logp, old[rows], adv[rows, None].expand(-1, W), mask[rows],
                                                 is_weights=is_w[rows], entropy=ent))
            loss.loss.backward()
            out["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD)))
            out["pg_loss"].append(float(loss.pg_loss.detach()))
            if loss.entropy_loss is not None:
                out["entropy_loss"].append(float(loss.entropy_loss.detach()))
            if out["grads"] is None:
                out["grads"] = unfuse_experts({n: p.grad.detach().clone() for n, p in model.named_parameters()})
            opt.step()
    out["weights"] = unfuse_experts({n: p.detach().clone() for n, p in model.state_dict().items()})
    return out


def _check(results, ref, job, hf_dir, check_grads=True):
    from megatron_rl.convert import hf_to_mcore, read_hf_checkpoint

    m = results[0]["metrics"]
    for r in results:
        assert r["metrics"] == m, "metrics differ between ranks"
    assert m["actor/pg_loss"] == pytest.approx(sum(ref["pg_loss"]) / len(ref["pg_loss"]), rel=1e-5, abs=1e-7)
    assert m["actor/grad_norm"] == pytest.approx(sum(ref["grad_norm"]) / len(ref["grad_norm"]), rel=1e-5)
    assert max(ref["grad_norm"]) > CLIP_GRAD, "clipping must be active (in some step) for the test to cover it"
    if ref["entropy_loss"]:
        assert m["actor/entropy_loss"] == pytest.approx(sum(ref["entropy_loss"]) / len(ref["entropy_loss"]), rel=1e-5)
    else:
        assert "actor/entropy_loss" not in m
    if check_grads:
        grads = merge_rank_grads([r["grads"] for r in results], job)
        geom, _, _ = read_hf_checkpoint(hf_dir)
        ref_grads = hf_to_mcore(ref["grads"], geom)
        assert sorted(grads) == sorted(ref_grads)
        for k, g in ref_grads.items():
            torch.testing.assert_close(grads[k], g, rtol=1e-4, atol=1e-6, msg=lambda s: f"grad {k}: {s}")
    hf_sd = results[0]["hf_sd"]
    assert hf_sd is not None and all(r["hf_sd"] is None for r in results[1:])
    moved = 0
    for k, w in ref["weights"].items():
        if k == "lm_head.weight" and k not in hf_sd:
            continue
        torch.testing.assert_close(hf_sd[k], w, rtol=0, atol=1e-5, msg=lambda s: f"weight {k}: {s}")
        moved += 1
    assert moved > 10


#: verl's entropy bonus (actor.policy_loss.entropy_coeff), large enough to move the gradients visibly
ENTROPY = {"policy_loss": {**PPO_LOSS, "entropy_coeff": 0.1}}
CASES = [("qwen2", dict(), 1), ("qwen2", dict(tp=2, pp=2, **ENTROPY), 4), ("qwen2", dict(), 2),
         ("qwen2", dict(tp=2, sp=True), 2), ("moe", dict(ep=2), 2), ("tied", dict(pp=2), 2),
         ("deep", dict(pp=4, vpp=2, mbs=2), 4)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("key,layout,world", CASES,
                         ids=["tp1", "tp2pp2-entropy", "dp2", "tp2sp", "moe-ep2", "tied-pp2", "pp4-vpp2"])
def test_one_step_matches_reference(models, key, layout, world):
    job = named_job("actor_ppo", "actor.weight_decay=0.1", *knobs(**layout), hf=models[key])
    data = _data(job.model.vocab_size)
    ref = _reference(models[key], data, [list(range(data[0].num_rows))], loss=job.actor.policy_loss)
    results = run_ranks(_rank_train, world, job, data, timeout=150)
    _check(results, ref, job, models[key])


#: token-budget micro-batches (issue 25): padded (rows x longest row <= budget) and packed (THD sequences);
#: the rows of the 8-row batch are 2..15 tokens long, so a budget of 24 groups 1-5 rows per micro-batch
PACKING = {"budget": {"max_tokens_per_micro_batch": 24}, "packed": {"sequence_packing": True, "mbs": 3},
           "budget-packed": {"max_tokens_per_micro_batch": 24, "sequence_packing": True}}
PACKING_CASES = [("qwen2", dict(), 1, "budget"), ("qwen2", dict(), 1, "packed"), ("qwen2", dict(), 1, "budget-packed"),
                 ("qwen2", dict(), 2, "budget-packed"), ("qwen2", dict(tp=2, pp=2, sp=True), 4, "budget-packed"),
                 ("moe", dict(ep=2), 2, "budget-packed"), ("deep", dict(pp=4, vpp=2, mbs=2), 4, "budget-packed")]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("key,layout,world,batching", PACKING_CASES,
                         ids=["tp1-budget", "tp1-packed", "tp1-budget-packed", "dp2-budget-packed",
                              "tp2sp-pp2-budget-packed", "moe-ep2-budget-packed", "pp4-vpp2-budget-packed"])
def test_one_step_with_token_budget_and_packing_matches_reference(models, key, layout, world, batching):
    """The same single-process reference as above (no micro-batches at all): grouping rows by tokens and packing
    them into THD sequences leaves the gradients, the loss, the grad norm and the updated weights unchanged."""
    job = named_job("actor_ppo", "actor.weight_decay=0.1", *knobs(**layout, **PACKING[batching]), hf=models[key])
    data = _data(job.model.vocab_size)
    ref = _reference(models[key], data, [list(range(data[0].num_rows))])
    results = run_ranks(_rank_train, world, job, data, timeout=150)
    _check(results, ref, job, models[key])


@pytest.mark.timeout(180)
def test_mini_batches_and_epochs_match_reference(models):
    job = named_job("actor_ppo", "actor.weight_decay=0.1", *knobs(tp=2, pp=2, ppo_mini_batches=2, ppo_epochs=2, mbs=2),
                    hf=models["qwen2"])
    data = _data(job.model.vocab_size)
    B = data[0].num_rows
    ref = _reference(models["qwen2"], data, [list(range(s, e)) for s, e in row_blocks(B, 2)], epochs=2)
    results = run_ranks(_rank_train, 4, job, data, timeout=150)
    assert results[0]["metrics"]["actor/num_optimizer_steps"] == 4
    _check(results, ref, job, models["qwen2"], check_grads=False)


def _rank_recipe(rank, world, job, batch, adv):
    """The loop's recipe: recompute old log-probs, correction over the DP group, train step."""
    from megatron_rl.correction import compute_rollout_correction

    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    actor = MegatronActor(actor_spec(job))
    shard = batch.shard(actor.dp_rank, actor.dp_size)
    start = sum(batch.shard(r, actor.dp_size).num_rows for r in range(actor.dp_rank))
    old, _ = actor.compute_log_probs(shard, T)
    res = compute_rollout_correction(old, shard.rollout_log_probs, shard.response_mask,
                                     job.algorithm.rollout_correction, group=actor.dp_group)
    metrics = actor.train_step(shard, old, adv[start:start + shard.num_rows], res.response_mask, res.weights, T)
    return {"metrics": metrics, "grads": [], "hf_sd": actor.full_state_dict_hf(), "corr": res.metrics}


@pytest.mark.timeout(180)
def test_loop_recipe_with_correction_matches_reference(models):
    """compute_log_probs -> compute_rollout_correction(group=actor.dp_group) -> train_step at TP2 x DP2
    equals the single-process chain (HF log-probs, correction without groups, HF + AdamW step)."""
    from megatron_rl.correction import compute_rollout_correction

    job = named_job("actor_ppo", "actor.weight_decay=0.1", *knobs(tp=2), hf=models["qwen2"])
    job.algorithm.rollout_correction = type(job.algorithm.rollout_correction).from_dict(
        {"rollout_is": "token", "rollout_is_threshold": 1.5, "rollout_rs": "token_k1",
         "rollout_rs_threshold": "0.3_3.0"})
    batch, _, adv, _, _ = _data(job.model.vocab_size, seed=3)
    model = load_hf_reference(models["qwen2"]).eval()
    with torch.no_grad():
        old = hf_token_log_probs(model, batch.tokens, T)
    # rollout log-probs = the policy's plus bf16-like noise (some tokens beyond the RS bounds)
    noise = 0.6 * torch.randn(old.shape, generator=torch.Generator().manual_seed(4))
    rollout = ((old + noise).clamp(max=-1e-4) * batch.response_mask).to(torch.float32)
    batch = RolloutBatch(tokens=batch.tokens, prompt_lengths=batch.prompt_lengths, lengths=batch.lengths,
                         rollout_log_probs=rollout)
    ref_corr = compute_rollout_correction(old, batch.rollout_log_probs, batch.response_mask,
                                          job.algorithm.rollout_correction)
    assert 0 < ref_corr.response_mask.sum() < batch.response_mask.sum(), "rejection must drop some tokens"
    data = (batch, old, adv, ref_corr.response_mask, ref_corr.weights)
    ref = _reference(models["qwen2"], data, [list(range(batch.num_rows))])
    results = run_ranks(_rank_recipe, 4, job, batch, adv, timeout=150)
    for k, v in ref_corr.metrics.items():
        assert results[0]["corr"][k] == pytest.approx(v, rel=1e-4, abs=1e-5), k
    _check(results, ref, job, models["qwen2"], check_grads=False)
