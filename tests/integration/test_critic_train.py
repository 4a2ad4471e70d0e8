"""``MegatronCritic`` against a single-process reference (``tests/critic_reference.py``): HF transformers' body in
fp32 with the critic's head, verl 0.9.1's own ``compute_value_loss`` on the whole batch.

At TP1, TP2, PP2, DP2, TP2 + SP and with packed token-budget micro-batches the critic loads the same HF checkpoint, computes the values of a batch (micro-batches of
different lengths) and takes one optimizer step of the clipped value loss (clipping active on some tokens).
Checked: the values (<= 1e-5), vf_loss, vf_clipfrac, vpred_mean, the grad norm and every gradient (the body's,
unsharded from each rank's ``main_grad``, and the value head's) <= 1e-6 abs / 1e-4 rel.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_critic_train.py -q``
"""
import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.actor import row_blocks
from megatron_rl.actor.critic import MegatronCritic
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.plan.job import critic_spec
from megatron_rl.testing.actor_reference import load_hf_reference, merge_rank_grads, policy_data, rank_main_grads
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import knobs, named_job
from tests.critic_reference import reference_step, reference_values
from tests.verl_core_algos import verl_core_algos

transformers = pytest.importorskip("transformers")

CLIP_V = 0.2
CRITIC = ("algorithm.advantage_estimator=gae", "critic.enable=true", "critic.clip_grad=1000000.0", "critic.lr=0.001",
          "critic.weight_decay=0.0", f"critic.cliprange_value={CLIP_V}")


@pytest.fixture(scope="module")
def model(tiny_hf_model):
    return tiny_hf_model("qwen2", seed=31, num_hidden_layers=4)


def _head(critic):
    chunk = critic.model[-1].module
    if not chunk.post_process:
        return None
    return chunk.output_layer.weight.detach().clone(), chunk.output_layer.bias.detach().clone()


def _rank(rank, world, job, data):
    """The trainer's order: the critic's values, the old values = them + ``noise`` (so the clip is active on some
    tokens), one train step."""
    batch, noise, returns, mask = data
    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    critic = MegatronCritic(critic_spec(job))
    start, end = row_blocks(batch.num_rows, critic.dp_size)[critic.dp_rank]
    shard = batch.select(start, end)
    W = shard.max_length - 1
    v = critic.compute_values(shard)
    head = _head(critic)
    old = (v + noise[start:end, :W]) * mask[start:end, :W]
    metrics = critic.train_step(shard, old, returns[start:end, :W], mask[start:end, :W])
    grads = rank_main_grads(critic, job.parallel)
    head_grads = None
    for coords, g in grads:
        if "output_layer.weight" in g:
            head_grads = (g.pop("output_layer.weight"), g.pop("output_layer.bias"))
    return {"values": (start, v), "old": (start, old), "head": head, "metrics": metrics, "grads": grads,
            "head_grads": head_grads}


def _data(vocab, seed=0, B=8):
    batch, _, _, mask, _ = policy_data(vocab, B, seed, prompt_len=(1, 6), response_len=(1, 10), reject_token=False)
    g = torch.Generator().manual_seed(seed + 100)
    W = batch.max_length - 1
    returns = torch.randn(B, W, generator=g) * mask
    return batch, mask, returns, g


#: token-budget micro-batches packed into THD sequences (rows of 2..15 tokens: 1-5 rows per micro-batch)
PACKED = dict(max_tokens_per_micro_batch=24, sequence_packing=True)
TM, SM = "token-mean", "seq-mean-token-mean"
CASES = [(dict(), 1, TM), (dict(tp=2), 2, TM), (dict(pp=2), 2, TM), (dict(), 2, TM), (dict(), 2, SM),
         (dict(tp=2, sp=True), 2, TM), (PACKED, 1, SM), (dict(pp=2, **PACKED), 2, TM)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout,world,agg", CASES, ids=["tp1", "tp2", "pp2", "dp2", "dp2-seq-mean", "tp2sp",
                                                          "packed-seq-mean", "pp2-packed"])
def test_value_step_matches_reference(model, layout, world, agg):
    from megatron_rl.convert import hf_to_mcore, read_hf_checkpoint

    job = named_job("actor_ppo", *CRITIC, f"critic.loss_agg_mode={agg}", *knobs(**layout), hf=model)
    batch, mask, returns, g = _data(job.model.vocab_size)
    ref_model = load_hf_reference(model)
    noise = 0.4 * torch.randn(returns.shape, generator=g)
    results = run_ranks(_rank, world, job, (batch, noise, returns, mask), timeout=200)
    head_w, head_b = next(r["head"] for r in results if r["head"] is not None)
    with torch.no_grad():
        v0 = reference_values(ref_model, batch.tokens, head_w, head_b)
    old = torch.zeros_like(returns)
    for r in results:  # the critic's values before any step equal the reference's
        start, v = r["values"]
        W = v.shape[1]
        torch.testing.assert_close(v * mask[start:start + v.shape[0], :W],
                                   v0[start:start + v.shape[0], :W] * mask[start:start + v.shape[0], :W],
                                   rtol=1e-4, atol=1e-5)
        start, o = r["old"]
        old[start:start + o.shape[0], : o.shape[1]] = o
    with verl_core_algos() as verl:
        loss, clipfrac, ref_grads, (gw, gb), norm, vmean = reference_step(
            verl, ref_model, batch.tokens, head_w, head_b, old, returns, mask, CLIP_V, agg)
    m = results[0]["metrics"]
    assert all(r["metrics"] == m for r in results), "metrics differ between ranks"
    assert 0.05 < clipfrac < 0.95, "the value clip must be active on some tokens and not all"
    assert m["critic/vf_loss"] == pytest.approx(loss, rel=1e-5)
    assert m["critic/vf_clipfrac"] == pytest.approx(clipfrac, rel=1e-6)
    assert m["critic/vpred_mean"] == pytest.approx(vmean, rel=1e-5, abs=1e-6)
    assert m["critic/grad_norm"] == pytest.approx(norm, rel=1e-5)
    hg = next(r["head_grads"] for r in results if r["head_grads"] is not None)
    torch.testing.assert_close(hg[0], gw, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(hg[1], gb, rtol=1e-4, atol=1e-6)
    grads = merge_rank_grads([r["grads"] for r in results], job)
    geom, _, _ = read_hf_checkpoint(model)
    want = hf_to_mcore(ref_grads, geom)
    want.pop("output_layer.weight", None)
    assert sorted(grads) == sorted(want)
    for k, gr in want.items():
        torch.testing.assert_close(grads[k], gr, rtol=1e-4, atol=1e-6, msg=lambda s: f"grad {k}: {s}")


def _rank_epochs(rank, world, job, data):
    from megatron_rl.convert import canonical_state_dict
    from megatron_rl.convert.partition import RankCoords

    batch, noise, returns, mask = data
    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    critic = MegatronCritic(critic_spec(job))
    head = _head(critic)
    old = (critic.compute_values(batch) + noise) * mask
    metrics = critic.train_step(batch, old, returns, mask)
    weights = []
    for i, chunk in enumerate(critic.model):
        named = {n: p.detach().clone() for n, p in chunk.module.named_parameters()}
        head_after = (named.pop("output_layer.weight", None), named.pop("output_layer.bias", None))
        coords = RankCoords.from_groups(critic.groups, vp_stage=i)
        weights.append((coords, canonical_state_dict(named)))
    return {"head": head, "head_after": head_after if head is not None else None, "weights": weights,
            "metrics": metrics, "old": old}


@pytest.mark.timeout(240)
def test_mini_batches_and_epochs_match_reference(model):
    """critic.ppo_mini_batches=2 x critic.ppo_epochs=2 (4 Adam steps, the clip against the values before the step)
    at TP2 equal the single-process chain: verl's loss per mini-batch, torch's Adam."""
    from megatron_rl.convert import hf_to_mcore, read_hf_checkpoint
    from megatron_rl.testing.actor_reference import merge_rank_grads

    job = named_job("actor_ppo", *CRITIC, "critic.ppo_mini_batches=2", "critic.ppo_epochs=2",
                    "critic.loss_agg_mode=token-mean", *knobs(tp=2, mbs=2), hf=model)  # the actor's is seq-mean-token-mean
    batch, mask, returns, g = _data(job.model.vocab_size)
    noise = 0.4 * torch.randn(returns.shape, generator=g)
    results = run_ranks(_rank_epochs, 2, job, (batch, noise, returns, mask), timeout=200)
    head_w, head_b = next(r["head"] for r in results if r["head"] is not None)
    old = results[0]["old"]
    ref_model = load_hf_reference(model)
    w = head_w.clone().requires_grad_(True)
    b = head_b.clone().requires_grad_(True)
    params = [p for n, p in ref_model.named_parameters() if n != "lm_head.weight"] + [w, b]
    opt = torch.optim.Adam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    losses = []
    with verl_core_algos() as verl:
        for _ in range(2):
            for s, e in row_blocks(batch.num_rows, 2):
                opt.zero_grad()
                vp = reference_values(ref_model, batch.tokens[s:e], w, b)
                W = vp.shape[1]
                loss, _ = verl.compute_value_loss(vp, returns[s:e, :W], old[s:e, :W], mask[s:e, :W], CLIP_V,
                                                  loss_agg_mode="token-mean")
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
    m = results[0]["metrics"]
    assert m["critic/num_optimizer_steps"] == 4
    assert m["critic/vf_loss"] == pytest.approx(sum(losses) / 4, rel=1e-5)
    merged = merge_rank_grads([r["weights"] for r in results], job)
    geom, _, _ = read_hf_checkpoint(model)
    want = hf_to_mcore({n: p.detach() for n, p in ref_model.state_dict().items()}, geom)
    want.pop("output_layer.weight", None)
    assert sorted(merged) == sorted(want)
    # Adam's normalised steps turn fp32 summation-order noise of near-zero gradients into ~1e-5 differences; each
    # step moves a weight by up to lr = 1e-3 (4e-3 in all), checked below
    init = hf_to_mcore(read_hf_checkpoint(model)[2], geom)
    assert max(float((want[k] - init[k]).abs().max()) for k in want) > 1e-3
    for k, x in want.items():
        torch.testing.assert_close(merged[k], x, rtol=0, atol=3e-5, msg=lambda s: f"weight {k}: {s}")
    hw, hb = next(r["head_after"] for r in results if r["head_after"] is not None)
    torch.testing.assert_close(hw, w.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(hb, b.detach(), rtol=0, atol=1e-5)


@pytest.mark.timeout(240)
def test_bf16_critic_values_and_step(model):
    """actor.bf16 (the critic takes the actor's precision): bf16 weights from the HF fp32 values, values within bf16
    rounding of the fp32 reference, and one step of the value loss moves the values toward the returns."""
    job = named_job("actor_ppo", *CRITIC, "actor.bf16=true", hf=model)
    batch, mask, returns, g = _data(job.model.vocab_size)
    res = run_ranks(_rank_bf16, 1, job, (batch, returns, mask), timeout=200)[0]
    head_w, head_b = (t.float() for t in res["head"])
    with torch.no_grad():
        v0 = reference_values(load_hf_reference(model), batch.tokens, head_w, head_b)
    W = res["before"].shape[1]
    torch.testing.assert_close(res["before"] * mask[:, :W], v0[:, :W] * mask[:, :W], rtol=0.05, atol=0.05)
    err = lambda v: float((((v - returns[:, :W]) * mask[:, :W]) ** 2).sum())  # noqa: E731
    assert err(res["after"]) < err(res["before"])


def _rank_bf16(rank, world, job, data):
    batch, returns, mask = data
    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    critic = MegatronCritic(critic_spec(job))
    assert next(critic.model[0].module.parameters()).dtype == torch.bfloat16
    W = batch.max_length - 1
    before = critic.compute_values(batch)
    head = _head(critic)
    for _ in range(3):
        critic.train_step(batch, before, returns[:, :W], mask[:, :W])
    return {"before": before, "after": critic.compute_values(batch), "head": head}
