"""Token-budget micro-batches and sequence packing (issue 25) at their boundaries, on the real actor (gloo, CPU).

Independent reference: the actor's long-standing path — fixed ``micro_batch_size`` rows, right-padded, no
packing, one process (itself proved against HF + AdamW by test_actor_train.py) — on the SAME data. The loss's
denominators are global, so how rows are grouped (1 row, all rows, a padded budget, a packed budget, permuted by
the plan) must not change any metric of ``actor.train_step`` nor any log-prob of ``compute_log_probs``.

Covered: rows of length 1 (prompt only) and 2 (one response token), rows exactly at the budget, every
micro-batch a single row; token-mean / seq-mean-token-mean / seq-mean-token-sum / seq-mean-token-sum-norm (the
packed loss stays per ROW); uneven DP shards with a one-row shard (whose only row is prompt-only);
ppo_mini_batches=2; interleaved PP4 x VPP2 (equal shapes; a budget that fits everything, so the plan is split for
VPP; a plan of 5 micro-batches; a padded budget refused naming actor.sequence_packing); a row over the budget on
ONE DP rank (BatchError naming ``actor.max_tokens_per_micro_batch`` on every rank, no hang); CP2 and DP2 x CP2 packed vs CP1 unpacked on a
position-dependent model without attention (megatron's attention cannot run CP on CPU): log-probs, metrics,
gradients, weights; the RL loop (embedded engine, 2 sync steps) with budget + packing vs without, at DP1 and DP2
(token-balanced DP shards): step 1's rollouts identical, its metrics equal.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_packing_boundaries.py -q``
"""
import json
import os

import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.actor import RolloutBatch
from megatron_rl.actor.micro_batching import PackedCost, PaddedCost, plan_micro_batches
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import knobs, named_job
from megatron_rl.testing.positionwise_lm import cp_rank, positionwise_batch, positionwise_lm, rank_result

pytest.importorskip("transformers")

T = 0.8
KEY = "actor.max_tokens_per_micro_batch"
#: (prompt, response) lengths: prompt-only rows of length 1 and 3, a row of length 2 (one response token), two
#: rows of the batch's longest length 13 (the packed budget 13 holds them exactly; the padded budget 26 holds
#: exactly two of them)
SHAPES = [(1, 0), (1, 1), (3, 0), (4, 9), (2, 5), (5, 3), (1, 12), (6, 1)]


@pytest.fixture(scope="module")
def models(tiny_hf_model):
    return {"qwen2": tiny_hf_model("qwen2", seed=31, num_hidden_layers=2),
            "deep": tiny_hf_model("qwen2", seed=32, num_hidden_layers=8)}


def _data(vocab, shapes=SHAPES, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (p,), generator=g).tolist() for p, _ in shapes]
    responses = [torch.randint(0, vocab, (r,), generator=g).tolist() for _, r in shapes]
    lps = [(-torch.rand(r, generator=g) * 3 - 0.1).tolist() for _, r in shapes]
    batch = RolloutBatch.from_sequences(prompts, responses, lps)
    B, W = batch.num_rows, batch.max_length - 1
    mask = batch.response_mask
    old = (batch.rollout_log_probs + 0.3 * torch.randn(B, W, generator=g) * mask).clamp(max=-1e-3)
    is_w = (torch.rand(B, W, generator=g) + 0.5) * mask
    adv = torch.randn(B, generator=g)
    return batch, old, adv, mask, is_w


#: this file's train step on the table's actor_ppo row: weight decay 0.1, micro-batch 4 unless a case sets it
PACKING_STEP = ("actor.weight_decay=0.1", "actor.micro_batch_size=4")


def _rank_train_many(rank, world, jobs, data):
    """For each job: a fresh actor on this DP rank's block, its log-probs and one train_step."""
    from megatron_rl.actor import MegatronActor, row_blocks
    from megatron_rl.plan import actor_spec
    from megatron_rl.parallel import initialize_model_parallel

    batch, old, adv, mask, is_w = data
    out = []
    for job in jobs:
        initialize_model_parallel(job.parallel, seed=5, model=job.model)
        actor = MegatronActor(actor_spec(job))
        start, end = row_blocks(batch.num_rows, actor.dp_size)[actor.dp_rank]
        shard = batch.select(start, end)
        W = shard.max_length - 1
        lp, ent = actor.compute_log_probs(shard, T)
        metrics = actor.train_step(shard, old[start:end, :W], adv[start:end], mask[start:end, :W],
                                   is_w[start:end, :W], T)
        out.append({"metrics": metrics, "lp": lp, "ent": ent, "rows": (start, end)})
    return out


def _assert_same_metrics(got, ref, what):
    assert got.keys() == ref.keys(), what
    for k, v in ref.items():
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-7), f"{what}: {k} = {got[k]} vs {v}"


# -------------------------------------------------------------------------------- grouping independence (TP1)
BATCHINGS = {"mbs1": {"micro_batch_size": 1}, "mbs8": {"micro_batch_size": 8},
             "budget-padded": {"max_tokens_per_micro_batch": 26},
             "budget-packed": {"max_tokens_per_micro_batch": 13, "sequence_packing": True},
             "packed-mbs3": {"micro_batch_size": 3, "sequence_packing": True}}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_metrics_do_not_depend_on_grouping(models, agg):
    """actor.train_step's whole metrics dict (and compute_log_probs) is the same for 1 row / all rows per
    micro-batch, a padded budget (rows x longest <= 26), a packed budget of exactly the longest row (13), packed
    fixed-size micro-batches."""
    data = _data(300)
    lengths = data[0].lengths.tolist()
    assert min(lengths) == 1 and 2 in lengths and lengths.count(13) == 2
    # the plans really differ: permuted rows, several rows per micro-batch, rows exactly at the budget
    padded = plan_micro_batches(lengths, PaddedCost(), micro_batch_size=1, max_tokens=26)
    packed = plan_micro_batches(lengths, PackedCost(), micro_batch_size=1, max_tokens=13)
    assert list(padded.order) != list(range(8)) and list(packed.order) != list(range(8))
    assert 26 in padded.tokens and 13 in packed.tokens
    assert max(e - s for s, e in packed.bounds) >= 3
    names = list(BATCHINGS)
    jobs = [named_job("actor_ppo", *PACKING_STEP, f"actor.policy_loss.loss_agg_mode={agg}", *knobs(**BATCHINGS[n]),
                      hf=models["qwen2"]) for n in names]
    (res,) = run_ranks(_rank_train_many, 1, jobs, data, timeout=280)
    ref = res[0]
    valid = torch.arange(1, data[0].max_length).unsqueeze(0) < data[0].lengths.unsqueeze(1)
    assert ref["lp"][valid].abs().min() > 0
    for name, r in zip(names[1:], res[1:]):
        _assert_same_metrics(r["metrics"], ref["metrics"], f"{agg} {name} vs mbs1")
        torch.testing.assert_close(r["lp"], ref["lp"], rtol=0, atol=2e-6, msg=lambda m: f"{name} log-probs: {m}")
        torch.testing.assert_close(r["ent"], ref["ent"], rtol=0, atol=2e-6, msg=lambda m: f"{name} entropy: {m}")


@pytest.mark.timeout(200)
def test_every_micro_batch_a_single_row_packed(models):
    """A packed budget that holds one row only (all rows longer than half the budget): one micro-batch per row,
    rows in their own order — the same as micro_batch_size=1."""
    shapes = [(3, 5), (6, 4), (2, 7), (5, 5)]   # lengths 8, 10, 9, 10; budget 10 -> no two rows fit together
    data = _data(300, shapes, seed=1)
    plan = plan_micro_batches(data[0].lengths.tolist(), PackedCost(), micro_batch_size=1, max_tokens=10)
    assert plan.num_micro_batches == 4
    jobs = [named_job("actor_ppo", *PACKING_STEP, *knobs(micro_batch_size=1), hf=models["qwen2"]),
            named_job("actor_ppo", *PACKING_STEP, *knobs(max_tokens_per_micro_batch=10, sequence_packing=True),
                      hf=models["qwen2"])]
    (res,) = run_ranks(_rank_train_many, 1, jobs, data, timeout=180)
    _assert_same_metrics(res[1]["metrics"], res[0]["metrics"], "single-row packed")
    torch.testing.assert_close(res[1]["lp"], res[0]["lp"], rtol=0, atol=2e-6)


@pytest.mark.timeout(200)
def test_ppo_mini_batches_with_packing(models):
    jobs = [named_job("actor_ppo", *PACKING_STEP, *knobs(micro_batch_size=1, ppo_mini_batches=2), hf=models["qwen2"]),
            named_job("actor_ppo", *PACKING_STEP,
                      *knobs(max_tokens_per_micro_batch=13, sequence_packing=True, ppo_mini_batches=2),
                      hf=models["qwen2"])]
    (res,) = run_ranks(_rank_train_many, 1, jobs, _data(300), timeout=180)
    assert res[1]["metrics"]["actor/num_optimizer_steps"] == 2
    _assert_same_metrics(res[1]["metrics"], res[0]["metrics"], "ppo_mini_batches=2 packed")


# -------------------------------------------------------------------------------- DP: uneven, one-row shard
@pytest.mark.timeout(300)
@pytest.mark.parametrize("shapes,batching", [
    ([(4, 9), (1, 1), (1, 0)], {"max_tokens_per_micro_batch": 13, "sequence_packing": True}),
    ([(4, 9), (1, 1), (1, 0)], {"max_tokens_per_micro_batch": 13}),
    (SHAPES[:7], {"max_tokens_per_micro_batch": 14, "sequence_packing": True})],
    ids=["one-row-prompt-only-shard-packed", "one-row-prompt-only-shard-padded", "7-rows-dp2-packed"])
def test_uneven_dp_shards_match_one_rank(models, shapes, batching):
    """DP2 with shards of 2 and 1 rows (the single row prompt-only: no token to train on that rank) and of 4
    and 3 rows: metrics and log-probs equal to one rank with micro_batch_size=1."""
    data = _data(300, shapes, seed=2)
    one = named_job("actor_ppo", *PACKING_STEP, *knobs(micro_batch_size=1), hf=models["qwen2"])
    (ref,) = run_ranks(_rank_train_many, 1, [one], data, timeout=150)
    dp2 = named_job("actor_ppo", *PACKING_STEP, *knobs(**batching), hf=models["qwen2"])
    res = run_ranks(_rank_train_many, 2, [dp2], data, timeout=200)
    for rank, r in enumerate(res):
        _assert_same_metrics(r[0]["metrics"], ref[0]["metrics"], f"DP2 rank {rank}")
    W = data[0].max_length - 1
    lp = torch.cat([torch.nn.functional.pad(r[0]["lp"], (0, W - r[0]["lp"].shape[1])) for r in res])
    torch.testing.assert_close(lp, ref[0]["lp"], rtol=0, atol=2e-6)


# -------------------------------------------------------------------------------- interleaved VPP + packing
@pytest.mark.timeout(300)
def test_interleaved_vpp_with_packed_budget_matches_one_rank(models):
    """PP4 x VPP2: a packed budget that fits every row in one micro-batch is split to >= PP micro-batches; the
    interleaved schedule gets equal shapes. Same metrics / log-probs as one rank, micro_batch_size=1."""
    data = _data(300)
    one = named_job("actor_ppo", *PACKING_STEP, *knobs(micro_batch_size=1), hf=models["deep"])
    (ref,) = run_ranks(_rank_train_many, 1, [one], data, timeout=150)
    vpp = named_job("actor_ppo", *PACKING_STEP,
                    *knobs(pp=4, vpp=2, max_tokens_per_micro_batch=64, sequence_packing=True), hf=models["deep"])
    res = run_ranks(_rank_train_many, 4, [vpp], data, timeout=250)
    for r in res:
        _assert_same_metrics(r[0]["metrics"], ref[0]["metrics"], "pp4-vpp2")
        torch.testing.assert_close(r[0]["lp"], ref[0]["lp"], rtol=0, atol=2e-6)


#: megatron-core's interleaved schedule needs num_microbatches % microbatch_group_size_per_vp_stage == 0 (PP by
#: default); a token-budget plan only guarantees >= PP micro-batches (run_schedule makes them one group).
@pytest.mark.timeout(300)
def test_interleaved_vpp_with_a_budget_plan_of_five_micro_batches(models):
    """PP4 x VPP2 with the packed budget 13 on the 8 rows: the plan has 5 micro-batches (a token-budget plan's
    count depends on the data). megatron-core's interleaved schedule (microbatch_group_size_per_vp_stage = PP by
    default) refuses a count that is not a multiple of PP; the step must still match one rank."""
    data = _data(300)
    plan = plan_micro_batches(data[0].lengths.tolist(), PackedCost(), micro_batch_size=1, max_tokens=13,
                              min_micro_batches=4)
    assert plan.num_micro_batches == 5
    one = named_job("actor_ppo", *PACKING_STEP, *knobs(micro_batch_size=1), hf=models["deep"])
    (ref,) = run_ranks(_rank_train_many, 1, [one], data, timeout=150)
    vpp = named_job("actor_ppo", *PACKING_STEP,
                    *knobs(pp=4, vpp=2, max_tokens_per_micro_batch=13, sequence_packing=True), hf=models["deep"])
    res = run_ranks(_rank_vpp_padded, 4, vpp, data, timeout=250)
    assert all("out" in r for r in res), [r.get("error") for r in res]
    for r in res:
        _assert_same_metrics(r["out"]["metrics"], ref[0]["metrics"], "pp4-vpp2, 5 packed micro-batches")
        torch.testing.assert_close(r["out"]["lp"], ref[0]["lp"], rtol=0, atol=2e-6)


def _rank_vpp_padded(rank, world, job, data):
    try:
        return {"out": _rank_train_many(rank, world, [job], data)[0]}
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return {"error": f"{type(e).__name__}: {e}"}


#: A padded budget plan has micro-batches of different row counts; the interleaved schedule has fixed shapes: the
#: actor (and the config's validation) refuse it naming actor.sequence_packing.
@pytest.mark.timeout(300)
def test_interleaved_vpp_with_padded_budget_is_refused_on_every_rank(models):
    """PP4 x VPP2 with a PADDED budget: the plan's micro-batches hold different numbers of rows (3, 2, 3 here),
    but megatron-core's interleaved schedule has fixed shapes [seq_length, micro_batch_size, h]: every rank's
    actor refuses it naming actor.sequence_packing before any model collective — never a shape error deep inside
    (the config's validation refuses it too: tests/unit/test_micro_batching.py)."""
    data = _data(300)
    plan = plan_micro_batches(data[0].lengths.tolist(), PaddedCost(), micro_batch_size=1, max_tokens=26,
                              min_micro_batches=4)
    assert len({e - s for s, e in plan.bounds}) > 1, "micro-batches of different row counts"
    job = named_job("actor_ppo", *PACKING_STEP, *knobs(pp=4, vpp=2, max_tokens_per_micro_batch=26), hf=models["deep"])
    res = run_ranks(_rank_vpp_padded, 4, job, data, timeout=250)
    errors = [r.get("error") for r in res]
    assert all(e and "actor.sequence_packing" in e for e in errors), errors


@pytest.mark.timeout(300)
def test_interleaved_shard_too_small_on_one_dp_rank_is_refused_on_every_rank(models):
    """PP4 x VPP2 x DP2 with 7 rows: one DP rank's shard has 4 rows, the other's 3 — fewer micro-batches than PP
    for the interleaved schedule on that rank only. Every rank raises a BatchError naming the layout (no rank is
    left waiting in the other DP group's collectives)."""
    data = _data(300, shapes=[(2, 3), (3, 2), (1, 4), (2, 2), (1, 1), (3, 3), (2, 1)])
    job = named_job("actor_ppo", *PACKING_STEP, "actor.policy_loss.loss_agg_mode=token-mean",
                    *knobs(pp=4, vpp=2, micro_batch_size=1), hf=models["deep"])
    res = run_ranks(_rank_vpp_padded, 8, job, data, timeout=250)
    errors = [r.get("error") for r in res]
    assert all(e and "BatchError" in e and "pipeline_model_parallel_size=4" in e for e in errors), errors


# -------------------------------------------------------------------------------- a row over the budget
def _rank_over_budget(rank, world, job, data, phase):
    from megatron_rl.actor import BatchError, MegatronActor, row_blocks
    from megatron_rl.plan import actor_spec
    from megatron_rl.parallel import initialize_model_parallel

    batch, old, adv, mask, is_w = data
    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    actor = MegatronActor(actor_spec(job))
    start, end = row_blocks(batch.num_rows, actor.dp_size)[actor.dp_rank]
    shard = batch.select(start, end)
    W = shard.max_length - 1
    try:
        if phase == "logprob":
            actor.compute_log_probs(shard, T)
        else:
            actor.train_step(shard, old[start:end, :W], adv[start:end], mask[start:end, :W], is_w[start:end, :W], T)
    except BatchError as e:
        # a later collective must still work: no rank was left inside a schedule
        import torch.distributed as dist

        t = torch.ones(1)
        dist.all_reduce(t)
        return {"error": str(e), "after": float(t)}
    return {"error": None}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("phase", ["logprob", "train"])
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_row_over_budget_on_one_dp_rank_raises_on_every_rank(models, phase, packing):
    shapes = [(2, 1), (4, 9), (1, 1), (2, 2), (2, 1), (1, 2), (3, 1), (2, 0)]   # only rank 0 has a long row (13)
    data = _data(300, shapes, seed=3)
    job = named_job("actor_ppo", *PACKING_STEP, "actor.policy_loss.loss_agg_mode=token-mean",
                    *knobs(max_tokens_per_micro_batch=8, sequence_packing=packing), hf=models["qwen2"])
    res = run_ranks(_rank_over_budget, 2, job, data, phase, timeout=150)
    for r in res:
        assert r["error"] is not None, "every rank must raise"
        assert KEY in r["error"] and "13" in r["error"], r["error"]
        assert r["after"] == 2.0


# -------------------------------------------------------------------------------- the RL loop
def _train_body(rank, world, cfg):
    from megatron_rl.trainer.loop import train

    return train(cfg)


def _read(run_dir, name):
    with open(os.path.join(run_dir, name)) as fh:
        return [json.loads(line) for line in fh]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2], ids=["dp1", "dp2-balanced"])
def test_loop_step_with_budget_and_packing_matches_without(copy_model, tmp_path, world):
    plain, packed = str(tmp_path / "plain"), str(tmp_path / "packed")
    run_ranks(_train_body, world, named_job("packing_loop", hf=copy_model, run_dir=plain, world_size=world),
              timeout=280)
    run_ranks(_train_body, world, named_job("packing_loop", "actor.max_tokens_per_micro_batch=24",
                                            "actor.sequence_packing=true", hf=copy_model, run_dir=packed,
                                            world_size=world), timeout=280)
    r_plain = [r for r in _read(plain, "rollouts.jsonl") if r["step"] == 1]
    r_packed = [r for r in _read(packed, "rollouts.jsonl") if r["step"] == 1]
    assert r_plain == r_packed and len(r_plain) == 16
    if world == 2:  # the token-balanced DP split really differs from contiguous blocks of prompt groups
        from megatron_rl.trainer.step_batch import balanced_rows

        toks = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in r_plain]
        assert balanced_rows(toks, 4, 0, 2) != list(range(8)), toks
    m_plain, m_packed = _read(plain, "metrics.jsonl")[0], _read(packed, "metrics.jsonl")[0]
    assert m_plain["step"] == m_packed["step"] == 1
    keys = [k for k in m_plain if k.startswith(("actor/", "rollout_corr/", "reward/"))]
    assert any(k == "actor/pg_loss" for k in keys) and any(k.startswith("rollout_corr/") for k in keys)
    # chi2 = E[w^2] - 1 near 0: its absolute error is fp32 rounding of E[w^2] ~ 1 (log-probs differ by ~1e-7)
    bad = {k: (m_packed[k], m_plain[k]) for k in keys
           if m_packed[k] != pytest.approx(m_plain[k], rel=1e-5, abs=1e-6 if "chi2" in k else 1e-7)}
    assert not bad, bad


# -------------------------------------------------------------------------------- CP x packing, a model that runs
VOCAB_CP, HIDDEN_CP = 64, 16


def _build_positionwise(cp):
    """No attention (megatron's cannot run CP on CPU), and the position id enters the logits: a packed sequence
    gives each row's log-probs only when every segment's positions restart at 0 and each CP rank gets megatron's
    per-segment chunks (``testing.positionwise_lm``)."""
    return positionwise_lm(cp, vocab=VOCAB_CP, hidden=HIDDEN_CP, use_positions=True)


def _cp_data():
    return positionwise_batch([2, 5, 1, 3, 1, 2, 6, 1], [7, 3, 9, 2, 0, 8, 1, 1], vocab=VOCAB_CP)


def _rank_cp(rank, world, cp, agg, packed, budget):
    from megatron_rl.actor.batcher import MicroBatcher
    from megatron_rl.actor.forward import compute_log_probs
    from megatron_rl.actor.train_step import train_mini_batch
    from megatron_rl.losses import PolicyLoss, PolicyLossConfig

    groups, model, opt, _, adv, is_w, shard, rows = cp_rank(cp, _build_positionwise, _cp_data())
    batcher = MicroBatcher(groups.dims, packed=packed, max_tokens=budget)
    plan = batcher.plan(shard.lengths.tolist())
    order = torch.tensor(plan.order)
    inv = torch.argsort(order)
    ordered = shard.take(plan.order)
    lp, ent = compute_log_probs(model, ordered, bounds=plan.bounds, temperature=0.9, groups=groups, batcher=batcher)
    per_token = {"old_log_probs": lp, "advantages": adv[rows][order], "response_mask": ordered.response_mask,
                 "is_weights": is_w[rows][order], "ref_log_probs": None}
    loss = PolicyLoss.of("ppo_clip", PolicyLossConfig(loss_agg_mode=agg))
    metrics = train_mini_batch(model, opt, ordered, per_token, loss, temperature=0.9, bounds=plan.bounds,
                               groups=groups, batcher=batcher)
    return rank_result(groups, model, lp[inv], ent[inv], metrics)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("cp,world,budget", [(1, 1, 16), (2, 2, 24), (2, 4, 16)], ids=["cp1", "cp2", "dp2xcp2"])
def test_packed_context_parallel_matches_unpacked_cp1(cp, world, budget, agg):
    """Packed micro-batches (per-segment CP chunks, loss in row layout with each CP rank's held positions) at CP2
    and DP2 x CP2: log-probs, metrics, gradients and updated weights equal to CP1 with one row per micro-batch."""
    (ref,) = run_ranks(_rank_cp, 1, 1, agg, False, None, timeout=100)
    res = run_ranks(_rank_cp, world, cp, agg, True, budget, timeout=150)
    lp = torch.cat([next(r["lp"] for r in res if r["dp_rank"] == d) for d in range(world // cp)])
    torch.testing.assert_close(lp, ref["lp"], rtol=0, atol=1e-6)
    batch = _cp_data()[0]
    assert ref["lp"][batch.response_mask.bool()].std() > 0.1
    for r in res:
        _assert_same_metrics(r["metrics"], ref["metrics"], f"packed cp{cp} world{world}")
        for n, g in ref["grads"].items():
            assert g.abs().max() > 0
            torch.testing.assert_close(r["grads"][n], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"grad {n}: {m}")
            torch.testing.assert_close(r["weights"][n], ref["weights"][n], rtol=0, atol=1e-6)
