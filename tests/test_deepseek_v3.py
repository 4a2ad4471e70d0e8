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

Run: ``OMP_NUM_THREADS=1 pytest tests/test_deepseek_v3.py -q``
"""
import dataclasses
import json
import os

import pytest
import torch

import megatron.core  # noqa: F401  (imported once in the parent: forked ranks start fast)
from megatron_rl.actor import MegatronActor, RolloutBatch
from megatron_rl.config import job_config_from_dict
from megatron_rl.convert.hf_config import model_config_from_hf
from megatron_rl.losses import PolicyLossConfig, compute_policy_loss
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.testing.distributed import run_ranks

transformers = pytest.importorskip("transformers")

T = 0.9
LR = 1e-3
CLIP = 0.02
LOSS = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "loss_agg_mode": "seq-mean-token-mean"}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from megatron_rl.testing.tiny_hf import build_tiny_hf_model

    return build_tiny_hf_model(tmp_path_factory.mktemp("dsv3") / "m", arch="deepseek_v3", seed=11)


def _data(vocab, B=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(2, 6, (B,), generator=g).tolist()
    rlens = torch.randint(2, 9, (B,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (p,), generator=g).tolist() for p in plens]
    responses = [torch.randint(0, vocab, (r,), generator=g).tolist() for r in rlens]
    rollout_lp = [(-torch.rand(r, generator=g) * 3 - 0.1).tolist() for r in rlens]
    batch = RolloutBatch.from_sequences(prompts, responses, rollout_lp)
    W = batch.max_length - 1
    mask = batch.response_mask.clone()
    old = (batch.rollout_log_probs + 0.3 * torch.randn(B, W, generator=g) * mask).clamp(max=-1e-3)
    is_w = (torch.rand(B, W, generator=g) + 0.5) * mask
    adv = torch.randn(B, generator=g)
    return batch, old, adv, mask, is_w


def _job(hf_dir, tp=1, pp=1, ep=1, etp=None, sp=False, first=None, last=None, mbs=2):
    with open(os.path.join(hf_dir, "config.json")) as fh:
        model = dataclasses.asdict(model_config_from_hf(json.load(fh)))
    return job_config_from_dict({
        "model": model,
        "actor": {"load_hf": hf_dir, "micro_batch_size": mbs, "lr": LR, "clip_grad": CLIP, "weight_decay": 0.1,
                  "policy_loss": LOSS},
        "parallel": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                     "expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp, "sequence_parallel": sp,
                     "num_layers_in_first_pipeline_stage": first, "num_layers_in_last_pipeline_stage": last},
        "algorithm": {"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 2.0,
                                             "bypass_mode": False, "loss_type": "ppo_clip"}},
    })


def _rank(rank, world, job, data):
    from megatron_rl.actor import row_blocks
    from megatron_rl.convert import canonical_state_dict
    from megatron_rl.convert.partition import RankCoords

    batch, old, adv, mask, is_w = data
    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    actor = MegatronActor(job)
    start, end = row_blocks(batch.num_rows, actor.dp_size)[actor.dp_rank]
    shard = batch.select(start, end)
    W = shard.max_length - 1
    lp, _ = actor.compute_log_probs(shard, T)
    metrics = actor.train_step(shard, old[start:end, :W], adv[start:end], mask[start:end, :W],
                               is_w[start:end, :W], T)
    grads = []
    p = job.parallel
    for i, chunk in enumerate(actor.model):
        named = {n: q.main_grad.detach().clone() for n, q in chunk.module.named_parameters()}
        coords = RankCoords.from_groups(actor.groups, vp_stage=i, first_stage_layers=p.num_layers_in_first_pipeline_stage,
                                        last_stage_layers=p.num_layers_in_last_pipeline_stage)
        grads.append((coords, canonical_state_dict(named)))
    return {"rows": (start, end), "lp": lp, "metrics": metrics, "grads": grads, "hf_sd": actor.full_state_dict_hf()}


def _unfuse(sd):
    """transformers keeps routed experts fused in memory; map to the per-expert names it saves."""
    out = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            pre, f = k[: -len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"], out[f"{pre}{e}.up_proj.weight"] = v[e, :f], v[e, f:]
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                out[f"{k[: -len('down_proj')]}{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    return out


def _hf_logprobs(model, tokens):
    logits = model(input_ids=tokens).logits[:, :-1] / T
    return torch.log_softmax(logits.double(), dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def _reference(hf_dir, data):
    """HF forward log-probs, then one HF + torch AdamW step on the whole batch."""
    batch, old, adv, mask, is_w = data
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.train()
    with torch.no_grad():
        lp = _hf_logprobs(model, batch.tokens) * batch.response_mask
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.999), eps=1e-8)
    W = batch.max_length - 1
    logits = model(input_ids=batch.tokens).logits[:, :-1] / T
    logp = torch.log_softmax(logits, dim=-1).gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    loss = compute_policy_loss(logp, old, adv[:, None].expand(-1, W), mask, PolicyLossConfig(**LOSS),
                               loss_type="ppo_clip", is_weights=is_w)
    loss.loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    grads = _unfuse({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    opt.step()
    return {"lp": lp, "pg_loss": float(loss.pg_loss.detach()), "grad_norm": norm, "grads": grads,
            "weights": _unfuse({n: p.detach().clone() for n, p in model.state_dict().items()})}


def test_expert_bias_changes_hf_routing(hf_dir):
    """The tiny model's e_score_correction_bias changes which experts HF selects (else the bias path of the
    comparisons below would be untested)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
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
    from megatron_rl.convert.partition import merge_state_dicts

    job = _job(hf_dir, **layout)
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
    shards = {}
    for r in results:
        for coords, g in r["grads"]:
            shards.setdefault(coords, {}).update(g)
    grads = merge_state_dicts(shards, job.model.num_layers, False, job.parallel.tensor_model_parallel_size,
                              job.parallel.etp, job.model.num_moe_experts)
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
    assert ref["grad_norm"] > CLIP, "clipping must be active for the test to cover it"
    out = results[0]["hf_sd"]
    assert out is not None and all(r["hf_sd"] is None for r in results[1:])
    assert sorted(out) == sorted(ref["weights"])
    for k, w in ref["weights"].items():
        torch.testing.assert_close(out[k], w, rtol=0, atol=1e-5, msg=lambda s: f"{name} weight {k}: {s}")
        if k.endswith("e_score_correction_bias"):
            assert torch.equal(out[k], hf_sd[k]), f"{k} changed in the train step"
