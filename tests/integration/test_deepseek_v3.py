"""DeepSeek-V3 family (MLA, shared experts, sigmoid group-limited routing, expert bias, YaRN): exact against
HF transformers' ``DeepseekV3ForCausalLM``.

The tiny model (``tiny_hf`` arch ``deepseek_v3``): 3 layers (layer 0 dense), MLA with q_lora 24 / kv_lora 16 /
nope 16 / rope 8 / v 12 and YaRN (factor 4), 8 routed experts in 2 groups (top-2 from the best group) + 1
shared expert, routed_scaling_factor 2.5 and a random e_score_correction_bias (it changes the selection:
checked). References are independent of the code under test: HF's forward for log-probs, and a
single-process HF + torch AdamW step (the ``test_actor_train`` recipe) for the train step.

* ``MegatronActor.compute_log_probs`` (fp32) == HF log-probs <= 1e-5 at TP1, TP2+SP x PP2 x EP2 (ETP1),
  TP2+SP x PP2, PP2 x EP2 and TP2+SP x EP2 (ETP1); with 3 layers every PP2 layout has uneven stages
  (``num_layers_in_first/last_pipeline_stage``: 2 + 1 or 1 + 2);
* one ``train_step`` at the same layouts: loss, pre-clip grad norm, every gradient (Megatron main_grad,
  unsharded) and every updated weight (HF export) == the reference; the expert bias is exported unchanged
  (not trained, not updated by megatron's aux-loss-free rule: ``moe_router_bias_update_rate`` 0).

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_deepseek_v3.py -q``
"""
import pytest
import torch

import megatron.core  # noqa: F401  (imported once in the parent: forked ranks start fast)
from megatron_rl.losses import LossBatch, PolicyLoss, PolicyLossConfig, compute_policy_loss
from megatron_rl.testing.actor_reference import CLIP_GRAD, LR, PPO_LOSS, actor_on_shard, hf_adamw, hf_token_log_probs
from megatron_rl.testing.actor_reference import load_hf_reference
from megatron_rl.testing.actor_reference import merge_rank_grads, policy_data, rank_main_grads, unfuse_experts
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import knobs, named_job

transformers = pytest.importorskip("transformers")

T = 0.9


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_model):
    return tiny_hf_model("deepseek_v3", seed=11)


def _data(vocab, B=6, seed=0):
    return policy_data(vocab, B, seed, prompt_len=(2, 6), response_len=(2, 9), reject_token=False)


def _rank(rank, world, job, data):
    batch, old, adv, mask, is_w = data
    actor, shard, start, end = actor_on_shard(job, batch)
    W = shard.max_length - 1
    lp, _ = actor.compute_log_probs(shard, T)
    metrics = actor.train_step(shard, old[start:end, :W], adv[start:end], mask[start:end, :W],
                               is_w[start:end, :W], T)
    return {"rows": (start, end), "lp": lp, "metrics": metrics, "grads": rank_main_grads(actor, job.parallel),
            "hf_sd": actor.full_state_dict_hf()}


def _hf_logprobs(model, tokens):
    return hf_token_log_probs(model, tokens, T, double=True)


def _reference(hf_dir, data):
    """HF forward log-probs, then one HF + torch AdamW step on the whole batch."""
    batch, old, adv, mask, is_w = data
    model = load_hf_reference(hf_dir)
    model.train()
    with torch.no_grad():
        lp = _hf_logprobs(model, batch.tokens) * batch.response_mask
    opt = hf_adamw(model, LR, weight_decay=0.1)
    W = batch.max_length - 1
    logp = hf_token_log_probs(model, batch.tokens, T)
    loss = compute_policy_loss(PolicyLoss.of("ppo_clip", PolicyLossConfig(**PPO_LOSS)),
                               LossBatch(logp, old, adv[:, None].expand(-1, W), mask, is_weights=is_w))
    loss.loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD))
    grads = unfuse_experts({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    opt.step()
    return {"lp": lp, "pg_loss": float(loss.pg_loss.detach()), "grad_norm": norm, "grads": grads,
            "weights": unfuse_experts({n: p.detach().clone() for n, p in model.state_dict().items()})}


def test_expert_bias_changes_hf_routing(hf_dir):
    """The tiny model's e_score_correction_bias changes which experts HF selects (else the bias path of the
    comparisons below would be untested)."""
    model = load_hf_reference(hf_dir).eval()
    tokens = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = _hf_logprobs(model, tokens)
        for layer in model.model.layers[1:]:
            assert layer.mlp.gate.e_score_correction_bias.abs().max() > 0.01
            layer.mlp.gate.e_score_correction_bias.zero_()
        unbiased = _hf_logprobs(model, tokens)
    assert (ref - unbiased).abs().max() > 1e-3


# 3 layers: every PP layout has uneven stages (2 + 1 or 1 + 2)
CASES = [("tp1", dict(), 1),
         ("tp2sp_pp2_ep2_etp1", dict(tp=2, sp=True, pp=2, ep=2, etp=1, last=1), 4),
         ("tp2sp_pp2", dict(tp=2, sp=True, pp=2, first=2), 4),
         ("pp2_ep2", dict(pp=2, ep=2, first=1), 4),
         ("tp2sp_ep2_etp1", dict(tp=2, sp=True, ep=2, etp=1), 2)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name,layout,world", CASES, ids=[c[0] for c in CASES])
def test_logprobs_and_train_step_match_hf(hf_dir, name, layout, world):
    from megatron_rl.convert import hf_to_mcore, read_hf_checkpoint

    job = named_job("actor_ppo", "actor.weight_decay=0.1", *knobs(mbs=2, **layout), hf=hf_dir)
    data = _data(384)
    ref = _reference(hf_dir, data)
    results = run_ranks(_rank, world, job, data, timeout=200)
    # forward: every rank's shard of log-probs equals HF's rows
    for r in results:
        s, e = r["rows"]
        W = r["lp"].shape[1]
        resp = data[0].response_mask[s:e, :W]
        err = ((r["lp"].double() - ref["lp"][s:e, :W]) * resp).abs().max().item()
        assert err <= 1e-5, f"{name}: max |log-prob - HF| = {err:.3e}"
    assert ref["lp"].abs().max() > 1.0
    # train step
    m = results[0]["metrics"]
    assert all(r["metrics"] == m for r in results), "metrics differ between ranks"
    assert m["actor/pg_loss"] == pytest.approx(ref["pg_loss"], rel=1e-5, abs=1e-7)
    grads = merge_rank_grads([r["grads"] for r in results], job)
    geom, _, hf_sd = read_hf_checkpoint(hf_dir)
    ref_grads = dict(ref["grads"])
    for k, v in hf_sd.items():  # the expert bias is a buffer (no grad): filled in, then left out
        if k.endswith("e_score_correction_bias"):
            ref_grads[k] = torch.zeros_like(v)
    ref_grads = {k: v for k, v in hf_to_mcore(ref_grads, geom).items() if not k.endswith("router.expert_bias")}
    assert sorted(grads) == sorted(ref_grads)
    for k, g in ref_grads.items():
        torch.testing.assert_close(grads[k], g, rtol=1e-4, atol=1e-6, msg=lambda s: f"{name} grad {k}: {s}")
    assert m["actor/grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert ref["grad_norm"] > CLIP_GRAD, "clipping must be active for the test to cover it"
    out = results[0]["hf_sd"]
    assert out is not None and all(r["hf_sd"] is None for r in results[1:])
    assert sorted(out) == sorted(ref["weights"])
    for k, w in ref["weights"].items():
        torch.testing.assert_close(out[k], w, rtol=0, atol=1e-5, msg=lambda s: f"{name} weight {k}: {s}")
        if k.endswith("e_score_correction_bias"):
            assert torch.equal(out[k], hf_sd[k]), f"{k} changed in the train step"
