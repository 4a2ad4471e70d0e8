"""MoE routing replay in the actor (``actor.routing_replay``), against an independent reference.

Reference = HF transformers fp32 forward of the same tiny Qwen3-MoE checkpoint with every router forced
to given expert ids (the test patches ``mlp.gate.forward``: softmax of HF's own router logits gathered at
the forced experts, renormalised — HF's norm_topk_prob), log_softmax(logits / T) picked at token t+1, the
policy loss of ``megatron_rl.losses`` and ``loss.backward()`` — no megatron, no replay code.

Checked (tiny Qwen3-MoE: 4 layers, 8 experts, top-2; routing forced to random distinct experts):
  * r3 log-probs (recompute pass) == HF forced <= 1e-5, and differ from HF's natural routing (replay matters);
  * r3 gradients of one train step (every parameter, routers included: gate weights are recomputed, so
    gradients reach the router) == HF forced gradients; at TP1, TP2 x EP2 (sequence parallel) and
    PP2 x EP2 on 4 gloo ranks, with and without full activation recompute — so replay is exact across
    layouts;
  * ``rollout_corr/router_agreement`` (and per layer) == the fraction of (token, layer, k) where HF's own
    top-k (under the forced history) contains the forced expert;
  * r2: the log-prob pass records the trainer's own routing (== HF's natural top-k at the initial
    weights) and every train forward of both mini-batches replays it exactly (agreement 1.0) while the
    weights change; the weights after the two steps equal HF + AdamW forced to that initial routing;
  * bad routing (expert id out of range / wrong layer count / wrong top-k in one DP shard only; rows
    missing) -> ``RoutingError`` / ``BatchError`` naming it on EVERY rank, before any model collective.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_routing_replay.py -q``
"""
import dataclasses

import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.actor import MegatronActor, RolloutBatch, row_blocks
from megatron_rl.plan import actor_spec
from megatron_rl.actor.batch import BatchError
from megatron_rl.actor.routing import RoutingError
from megatron_rl.losses import LossBatch, PolicyLoss, PolicyLossConfig, compute_policy_loss
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.testing.actor_reference import PPO_LOSS, actor_on_shard, hf_token_log_probs, load_hf_reference
from megatron_rl.testing.actor_reference import unfuse_experts
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import NO_LOAD_BALANCING, knobs, named_job

transformers = pytest.importorskip("transformers")

T = 0.8
E, K, NL = 8, 2, 4
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


@pytest.fixture(scope="module")
def moe_dir(tiny_hf_model):
    return tiny_hf_model("qwen3_moe", seed=31, num_hidden_layers=NL, num_experts=E, num_experts_per_tok=K)


#: this file's train step on the table's actor_ppo row: no gradient clipping, no load-balancing loss
REPLAY_STEP = ("actor.clip_grad=0.0", *NO_LOAD_BALANCING)


def _data(vocab, B=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(1, 6, (B,), generator=g).tolist()
    rlens = torch.randint(2, 10, (B,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (p,), generator=g).tolist() for p in plens]
    responses = [torch.randint(0, vocab, (r,), generator=g).tolist() for r in rlens]
    rollout_lp = [(-torch.rand(r, generator=g) * 3 - 0.1).tolist() for r in rlens]
    L = max(p + r for p, r in zip(plens, rlens))
    # forced routing for every position (the engine's: prompt + response - 1 tokens per row are used)
    forced = torch.rand(B, L, NL, E, generator=g).argsort(-1)[..., :K]
    rows = [forced[b, : p + r - 1].to(torch.uint8) for b, (p, r) in enumerate(zip(plens, rlens))]
    batch = RolloutBatch.from_sequences(prompts, responses, rollout_lp, routing=rows)
    W = batch.max_length - 1
    old = (batch.rollout_log_probs + 0.3 * torch.randn(B, W, generator=g) * batch.response_mask).clamp(max=-1e-3)
    is_w = (torch.rand(B, W, generator=g) + 0.5) * batch.response_mask
    adv = torch.randn(B, generator=g)
    return batch, forced, old, adv, is_w


# ----------------------------------------------------------------------------- HF reference
def _ppo_loss():
    return PolicyLoss.of("ppo_clip", PolicyLossConfig(**PPO_LOSS))


def _moe_gates(model):
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def _force(model, forced, own_out=None):
    """Patch every HF router to route position (b, t) of layer j to ``forced[b, t, j]`` ([B, S, NL, k]);
    ``forced=None`` keeps HF's routing. ``own_out`` collects HF's own top-k per layer ([B*S, k])."""
    import torch.nn.functional as F

    for j, gate in enumerate(_moe_gates(model)):
        def fwd(hidden_states, gate=gate, j=j):
            h = hidden_states.reshape(-1, gate.hidden_dim)
            logits = F.linear(h, gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            own = torch.topk(probs, gate.top_k, dim=-1).indices
            if own_out is not None:
                own_out.append(own.detach())
            idx = own if forced is None else forced[:, : hidden_states.shape[0] // forced.shape[0], j].reshape(-1, gate.top_k)
            top = probs.gather(1, idx)
            if gate.norm_topk_prob:
                top = top / top.sum(-1, keepdim=True)
            return logits, top.to(logits.dtype), idx

        gate.forward = fwd


def _hf_logp(model, tokens):
    return hf_token_log_probs(model, tokens, T)


def _hf_reference(hf_dir, batch, forced, old, adv, is_w):
    model = load_hf_reference(hf_dir)
    model.eval()
    with torch.no_grad():
        natural = _hf_logp(model, batch.tokens)
    own = []
    _force(model, forced, own)
    with torch.no_grad():
        logp = _hf_logp(model, batch.tokens)
    B, S = batch.tokens.shape
    own = torch.stack([o.reshape(B, S, K) for o in own], dim=2)[:, : S - 1]      # [B, S-1, NL, k]
    model.train()
    W = S - 1
    out = compute_policy_loss(_ppo_loss(), LossBatch(_hf_logp(model, batch.tokens), old, adv[:, None].expand(-1, W),
                                                     batch.response_mask, is_weights=is_w))
    out.loss.backward()
    grads = unfuse_experts({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    valid = torch.arange(W)[None] < (batch.lengths[:, None] - 1)
    hit = (forced[:, :W].unsqueeze(-1) == own.unsqueeze(-2)).any(-1) & valid[:, :, None, None]
    agreement = {"all": float(hit.sum()) / (float(valid.sum()) * NL * K),
                 "layer": [float(hit[:, :, j].sum()) / (float(valid.sum()) * K) for j in range(NL)]}
    return {"logp": logp, "natural": natural, "grads": grads,
            "agreement": agreement, "valid": valid}


# ----------------------------------------------------------------------------- actor ranks
def _grads_hf(actor):
    """Collective: the full HF-named gradient dict on rank 0 (main_grad copied into the weights, then the
    actor's own HF gather)."""
    for chunk in actor.model:
        for p in chunk.module.parameters():
            p.data.copy_(p.main_grad)
    return actor.full_state_dict_hf()


def _rank_r3(rank, world, job, data):
    from megatron_rl.trainer.rollout_source import routing_layers

    batch, _, old, adv, is_w = data
    actor, shard, start, end = actor_on_shard(job, batch)
    layers = list(routing_layers(actor))
    if rank % 2 and len(layers) < NL:   # as a job's rank receives it: its pipeline stage's layers alone
        shard = dataclasses.replace(shard, routing=shard.routing[:, :, layers].contiguous())
    W = shard.max_length - 1
    lp, _ = actor.compute_log_probs(shard, T, compute_entropy=False)
    metrics = actor.train_step(shard, old[start:end, :W], adv[start:end], shard.response_mask, is_w[start:end, :W], T)
    recomputed = sum(r.recomputed for r in actor.routing.replays)
    return {"lp": lp, "rows": (start, end), "metrics": metrics, "grads": _grads_hf(actor), "recomputed": recomputed,
            "stage_local": shard.routing.shape[2] < NL}


#: token-budget micro-batches packed into THD sequences (issue 25): the replayed experts follow the packed positions
PACKED = dict(max_tokens_per_micro_batch=24, sequence_packing=True)
CASES = [(dict(), 1), (dict(**RECOMPUTE), 1), (dict(tp=2, ep=2, sp=True), 4), (dict(pp=2, ep=2), 4),
         (dict(pp=2, ep=2, **RECOMPUTE), 4), (dict(tp=2, pp=2, ep=2, etp=1, sp=True), 4),
         (dict(PACKED), 1), (dict(PACKED, **RECOMPUTE), 1), (dict(PACKED, tp=2, ep=2, sp=True), 4),
         (dict(PACKED, tp=2, pp=2, ep=2, etp=1, sp=True), 4)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout,world", CASES, ids=["tp1", "tp1-recompute", "tp2ep2sp", "pp2ep2",
                                                     "pp2ep2-recompute", "tp2sp-pp2-ep2", "tp1-packed",
                                                     "tp1-packed-recompute", "tp2ep2sp-packed",
                                                     "tp2sp-pp2-ep2-packed"])
def test_r3_matches_hf_forced_routing(moe_dir, layout, world):
    job = named_job("actor_ppo", *REPLAY_STEP, *knobs(routing_replay="r3", **layout), hf=moe_dir)
    data = _data(job.model.vocab_size)
    batch, forced = data[0], data[1]
    ref = _hf_reference(moe_dir, *data)
    mask = batch.response_mask.bool()
    assert (ref["natural"] - ref["logp"])[mask].abs().max() > 1e-3, "forced routing must change the log-probs"
    results = run_ranks(_rank_r3, world, job, data, timeout=200)
    W = batch.max_length - 1
    lp = torch.zeros(batch.num_rows, W)
    for r in results:
        s, e = r["rows"]
        lp[s:e, : r["lp"].shape[1]] = r["lp"]
    valid = torch.arange(W)[None] < (batch.lengths[:, None] - 1)
    torch.testing.assert_close(lp[valid], ref["logp"][valid], rtol=0, atol=1e-5)
    m = results[0]["metrics"]
    assert all(r["metrics"] == m for r in results)
    assert any(r["stage_local"] for r in results) == (layout.get("pp", 1) > 1)
    # with full recompute every router runs again inside backward and pops its forward's target
    assert all((r["recomputed"] > 0) == ("recompute_granularity" in layout) for r in results)
    assert m["rollout_corr/router_agreement"] == pytest.approx(ref["agreement"]["all"], abs=1e-12)
    assert m["rollout_corr/router_agreement"] < 1.0
    for j in range(NL):
        assert m[f"rollout_corr/router_agreement_layer{j}"] == pytest.approx(ref["agreement"]["layer"][j], abs=1e-12)
    grads = results[0]["grads"]
    assert grads is not None and sorted(grads) == sorted(k for k in ref["grads"] if k in grads)
    n = 0
    for k, g in ref["grads"].items():
        if k not in grads:
            assert k == "lm_head.weight"
            continue
        torch.testing.assert_close(grads[k], g, rtol=1e-4, atol=1e-6, msg=lambda s: f"grad {k}: {s}")
        n += 1
    assert n > 20 and any("mlp.gate.weight" in k and ref["grads"][k].abs().max() > 0 for k in ref["grads"])


# ----------------------------------------------------------------------------- r2
def _rank_r2(rank, world, job, data):
    batch, _, old, adv, is_w = data
    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    actor = MegatronActor(actor_spec(job))
    passes = []
    begin = actor.routing.begin

    def begin_keep(lengths, targets, record, keep_used=False):  # also keep what each train forward used
        rp = begin(lengths, targets, True, keep_used=True)
        close = rp.close

        def close_after_assemble():
            W = targets.shape[1]
            passes.append({"targets": targets.clone(), "lengths": lengths.clone(),
                           "used": rp.assemble(len(lengths), W, which="used"),
                           "own": rp.assemble(len(lengths), W, which="own")})
            close()

        rp.close = close_after_assemble
        return rp

    start, end = row_blocks(batch.num_rows, actor.dp_size)[actor.dp_rank]
    shard = dataclasses.replace(batch.select(start, end), routing=None)  # r2 needs no engine routing
    W = shard.max_length - 1
    actor.compute_log_probs(shard, T, compute_entropy=False)
    recorded = actor.routing.recorded[2].clone()
    actor.routing.begin = begin_keep
    metrics = actor.train_step(shard, old[start:end, :W], adv[start:end], shard.response_mask, is_w[start:end, :W], T)
    return {"rows": (start, end), "recorded": recorded, "passes": passes, "layers": actor.routing.local_layers,
            "metrics": metrics, "hf_sd": actor.full_state_dict_hf()}


def _hf_train(hf_dir, batch, forced, old, adv, is_w, lr, steps_rows):
    """HF + AdamW over mini-batches, routers forced to ``forced`` (None: HF's own routing). Also returns
    HF's own top-k at the weights each mini-batch starts from ([B_mb, S, NL, k])."""
    model = load_hf_reference(hf_dir)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    B, S = batch.tokens.shape
    W = S - 1
    own_per_step = []
    for rows in steps_rows:
        rows = torch.tensor(rows)
        own = []
        _force(model, None if forced is None else forced[rows], own)
        opt.zero_grad()
        out = compute_policy_loss(_ppo_loss(), LossBatch(_hf_logp(model, batch.tokens[rows]), old[rows],
                                                         adv[rows, None].expand(-1, W), batch.response_mask[rows],
                                                         is_weights=is_w[rows]))
        out.loss.backward()
        opt.step()
        own_per_step.append(torch.stack([o.reshape(len(rows), S, K) for o in own], dim=2))
    return unfuse_experts({n: p.detach().clone() for n, p in model.state_dict().items()}), own_per_step


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout,world", [(dict(), 1), (dict(pp=2, ep=2, **RECOMPUTE), 4),
                                          (dict(PACKED, pp=2, ep=2, **RECOMPUTE), 4)],
                         ids=["tp1", "pp2ep2-recompute", "pp2ep2-recompute-packed"])
def test_r2_replays_log_prob_pass_routing_in_every_train_forward(moe_dir, layout, world):
    lr = 2e-2
    job = named_job("actor_ppo", *REPLAY_STEP, *knobs(routing_replay="r2", ppo_mini_batches=2, lr=lr, mbs=2, **layout),
                    hf=moe_dir)
    batch, _, old, adv, is_w = _data(job.model.vocab_size, seed=1)
    B, S = batch.tokens.shape
    results = run_ranks(_rank_r2, world, job, (batch, None, old, adv, is_w), timeout=200)
    # HF's own routing at the initial weights: what the log-prob pass must have recorded
    model = load_hf_reference(moe_dir).eval()
    own0 = []
    _force(model, None, own0)
    with torch.no_grad():
        model(input_ids=batch.tokens)
    own0 = torch.stack([o.reshape(B, S, K) for o in own0], dim=2)
    valid = torch.arange(S - 1)[None] < (batch.lengths[:, None] - 1)
    for r in results:
        s, e = r["rows"]
        rec = r["recorded"].long()
        for j in r["layers"]:
            same = (rec[:, :, j].sort(-1).values == own0[s:e, : rec.shape[1], j].sort(-1).values).all(-1)
            assert bool(same[valid[s:e, : rec.shape[1]]].all()), f"layer {j}: recorded != HF's own top-k at step start"
        # every train forward (both mini-batches, recompute included) used exactly the recorded routing
        assert len(r["passes"]) == 2
        drift = 0
        for p in r["passes"]:
            v = torch.arange(p["targets"].shape[1])[None] < (p["lengths"][:, None] - 1)
            for j in r["layers"]:
                used, tgt, own = p["used"][:, :, j], p["targets"][:, :, j].long(), p["own"][:, :, j]
                assert torch.equal(used[v], tgt[v]), f"layer {j}: a train forward did not replay the record"
                drift += int((own.sort(-1).values != tgt.sort(-1).values).any(-1)[v].sum())
        r["drift"] = drift
    # the weights changed between the mini-batches enough to change the trainer's own routing somewhere
    assert sum(r["drift"] for r in results) > 0
    # optimizer step i trains block i of every DP shard
    shards = sorted({r["rows"] for r in results})
    blocks = [sum((list(range(s + bs, s + be)) for s, e in shards for bs, be in [row_blocks(e - s, 2)[i]]), [])
              for i in range(2)]
    ref, _ = _hf_train(moe_dir, batch, own0, old, adv, is_w, lr, blocks)
    free, own_steps = _hf_train(moe_dir, batch, None, old, adv, is_w, lr, blocks)
    hf_sd = results[0]["hf_sd"]
    n = 0
    for k, w in ref.items():
        if k in hf_sd:
            # Adam's second step amplifies fp32 noise of near-zero gradients (rare rows, experts with few tokens): 3 % of lr
            torch.testing.assert_close(hf_sd[k], w, rtol=0, atol=lr * 3e-2, msg=lambda m: f"weight {k}: {m}")
            n += 1
    assert n > 20
    gap = max(float((free[k] - ref[k]).abs().max()) for k in ref)
    assert gap > lr * 0.5, f"replay must change the result beyond the tolerance (max gap {gap})"


# ----------------------------------------------------------------------------- bad input
def _rank_bad(rank, world, job, data):
    batch = data[0]
    actor, shard, start, end = actor_on_shard(job, batch)
    out = {}

    def attempt(name, routing):
        try:
            actor.compute_log_probs(dataclasses.replace(shard, routing=routing), T, compute_entropy=False)
            out[name] = None
        except RoutingError as e:
            out[name] = str(e)

    r = shard.routing
    bad = r.clone()
    if actor.dp_rank == 1:  # only the second DP shard is broken: every rank must still raise
        bad[0, 0, 1, 0] = E + 3
    attempt("range", bad)
    attempt("layers", r[:, :, :-1].contiguous())
    attempt("topk", r[:, :, :, :1].contiguous())
    dup = r.clone()
    dup[-1, 1, 0, 1] = dup[-1, 1, 0, 0]
    attempt("duplicate", dup)
    attempt("missing", None)
    attempt("good", r)  # nobody was left inside a collective: the next pass works on every rank
    out["dp_rank"] = actor.dp_rank
    return out


@pytest.mark.timeout(120)
def test_bad_routing_raises_named_error_on_every_rank(moe_dir):
    job = named_job("actor_ppo", *REPLAY_STEP, *knobs(routing_replay="r3", pp=2), hf=moe_dir)  # DP2 x PP2, 4 ranks
    data = _data(job.model.vocab_size)
    results = run_ranks(_rank_bad, 4, job, data, timeout=100)
    for r in results:
        assert r["range"] is not None and r["range"].startswith("rank ") and "expert id outside [0, num_experts = 8)" in r["range"]
        named = int(r["range"].split(":")[0].split()[1])
        assert results[named]["dp_rank"] == 1 and "(and 1 more rank(s))" in r["range"]   # DP shard 1's 2 PP ranks
        assert "has 3 MoE layers" in r["layers"] and "the model has 4" in r["layers"]
        assert "top-1 expert ids" in r["topk"] and "moe_router_topk = 2" in r["topk"]
        assert "repeats in one token's top-k" in r["duplicate"]
        assert "RolloutBatch.routing is None but actor.routing_replay='r3'" in r["missing"]
        assert r["good"] is None


def test_routing_rows_missing_or_short_are_named():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, E, (n, NL, K), generator=g).to(torch.uint8) for n in (3, 5)]
    with pytest.raises(BatchError, match=r"routing: missing for rows \[1\]"):
        RolloutBatch.from_sequences([[1, 2], [3]], [[4, 5], [6, 7, 8, 9, 9]], routing=[rows[0], None])
    with pytest.raises(BatchError, match=r"routing\[1\] covers 3 tokens, the row needs 5"):
        RolloutBatch.from_sequences([[1, 2], [3]], [[4, 5], [6, 7, 8, 9, 9]], routing=[rows[0], rows[0]])
    b = RolloutBatch.from_sequences([[1, 2], [3]], [[4, 5], [6, 7, 8, 9, 9]], routing=rows)
    assert b.routing.dtype == torch.uint8 and tuple(b.routing.shape) == (2, 5, NL, K)
    assert torch.equal(b.routing[0, :3], rows[0][:3]) and torch.equal(b.routing[1], rows[1][:5])
    sub = b.select(1, 2, trim=True, multiple_of=4)
    assert tuple(sub.routing.shape) == (1, 7, NL, K) and torch.equal(sub.routing[0, :5], rows[1][:5])
