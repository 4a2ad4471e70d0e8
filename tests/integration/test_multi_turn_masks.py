"""Multi-turn data model and masks: environment tokens are read by the model but never trained on or measured.

References, independent of ``RolloutBatch.loss_mask`` / ``response_mask``:
  * the layout: each model token's absolute position in prompt + response, found by walking the segments;
  * the log-probs: HF transformers (fp32) over the whole trajectory, picked at each model token's position;
  * the correction, the advantages and the policy loss: the float64 per-sequence reference of
    ``tests/correction_reference.py`` and a float64 PPO-clip loss written here, both run on the batch with the
    environment tokens DROPPED (every row compacted to its model tokens);
  * the train step (TP2 x DP2, 4 gloo ranks): HF + the loss with the reference's own mask, as
    ``tests/integration/test_actor_train.py``.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_multi_turn_masks.py -q``
"""
import dataclasses
import json
import math
import types

import pytest
import torch

import megatron.core  # noqa: F401  (imported once in the parent: forked ranks start fast)
from megatron_rl.actor import BatchError, MegatronActor, RolloutBatch
from megatron_rl.plan import actor_spec
from megatron_rl.algo.advantages import compute_advantages
from megatron_rl.correction import RolloutCorrectionConfig, compute_rollout_correction
from megatron_rl.losses import LossBatch, PolicyLoss, PolicyLossConfig, compute_policy_loss
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.rollout.trajectory import Segment, Trajectory
from megatron_rl.testing.actor_reference import CLIP_GRAD, LR, PPO_LOSS, hf_adamw, load_hf_reference, unfuse_experts
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import layout, named_job, setting
from megatron_rl.trainer.step_batch import StepBatch
from tests.correction_reference import check_against_reference

T = 0.8


# ---------------------------------------------------------------- data and the independent layout reference
def _trajectory(g, vocab, plen, kinds_lens, version=3):
    segs = []
    for i, (kind, n) in enumerate(kinds_lens):
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        if kind == "model":
            lp = (-torch.rand(n, generator=g, dtype=torch.float64) * 3 - 0.05).tolist()
            segs.append(Segment("model", ids, lp, [version + i] * n, "stop"))
        else:
            segs.append(Segment("env", ids))
    return Trajectory(prompt_ids=torch.randint(0, vocab, (plen,), generator=g).tolist(), segments=segs)


def _trajectories(vocab, seed=0):
    """Prompt + model + env + model (+ env + model) trajectories, one without env tokens, one ending on env."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, [("model", 4), ("env", 3), ("model", 5)]),
              (2, [("model", 2), ("env", 4), ("model", 3), ("env", 2), ("model", 2)]),
              (5, [("model", 6)]),
              (1, [("model", 3), ("env", 5), ("model", 1)]),
              (4, [("model", 1), ("env", 2), ("model", 4), ("env", 1)]),
              (2, [("model", 5), ("env", 3), ("model", 3)]),
              (3, [("model", 2), ("env", 2), ("model", 2), ("env", 2), ("model", 3)]),
              (6, [("model", 4), ("env", 6), ("model", 2)])]
    return [_trajectory(g, vocab, p, k) for p, k in shapes]


def _model_columns(traj):
    """Columns (t scores token t+1) of the model tokens, by walking the segments."""
    cols, pos = [], len(traj.prompt_ids)
    for seg in traj.segments:
        for _ in seg.ids:
            if seg.kind == "model":
                cols.append(pos - 1)
            pos += 1
    return cols


def _ref_mask(trajs, W):
    m = torch.zeros(len(trajs), W, dtype=torch.float32)
    for b, tr in enumerate(trajs):
        for c in _model_columns(tr):
            m[b, c] = 1
    return m


def _step_batch(trajs, rewards=None):
    return StepBatch(prompt_ids=[t.prompt_ids for t in trajs], response_ids=[t.response_ids for t in trajs],
                     rollout_log_probs=[t.rollout_log_probs for t in trajs],
                     rewards=rewards or [float(i % 3) for i in range(len(trajs))], weight_version="step-3",
                     token_versions=[t.token_versions for t in trajs], loss_masks=[t.loss_mask for t in trajs])


def _batch(trajs):
    return RolloutBatch.from_sequences([t.prompt_ids for t in trajs], [t.response_ids for t in trajs],
                                       [t.rollout_log_probs for t in trajs],
                                       loss_masks=[t.loss_mask for t in trajs])


def _compact(x, cols_per_row, Tm):
    """[B, W] -> [B, Tm]: each row's model-token columns, left-aligned (the env tokens dropped)."""
    out = torch.zeros(len(cols_per_row), Tm, dtype=x.dtype)
    for b, cols in enumerate(cols_per_row):
        if cols:
            out[b, : len(cols)] = x[b, cols]
    return out


# ---------------------------------------------------------------- data model
def test_trajectory_fields_follow_the_segments():
    tr = Trajectory(prompt_ids=[1, 2], segments=[
        Segment("model", [5, 6], [-0.1, -0.2], [3, 3], "stop"), Segment("env", [9, 8, 7]),
        Segment("model", [4], [-0.3], [4], "stop"), Segment("env", [2])])
    assert tr.response_ids == [5, 6, 9, 8, 7, 4, 2]
    assert tr.loss_mask == [1, 1, 0, 0, 0, 1, 0]
    assert tr.rollout_log_probs == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3, 0.0]
    assert tr.token_versions == [3, 3, 3, 3, 3, 4, 4]
    assert (tr.num_model_tokens, tr.num_env_tokens) == (3, 4)
    assert Trajectory([1], [Segment("env", [3]), Segment("model", [4], [-1.0], [7])]).token_versions == [7, 7]


@pytest.mark.parametrize("make,words", [
    (lambda: Segment("model", [1, 2], [-0.1], [0, 0]), ["model segment", "2 ids", "1 log_probs"]),
    (lambda: Segment("model", [1, 2], [-0.1, -0.2], [0]), ["2 ids", "1 versions"]),
    (lambda: Segment("env", [1], [-0.1]), ["env segment", "log_probs"]),
    (lambda: Segment("tool", [1]), ["kind", "'tool'"]),
    (lambda: Trajectory([1], [Segment("model", [1], [-0.1], [0])], finish="done"), ["Trajectory.finish"]),
])
def test_malformed_segments_are_named(make, words):
    with pytest.raises(ValueError) as e:
        make()
    assert all(w in str(e.value) for w in words), str(e.value)


def test_segment_mutated_after_construction_is_named_by_trajectory():
    seg = Segment("model", [1, 2], [-0.1, -0.2], [0, 0])
    seg.log_probs.append(-0.5)
    with pytest.raises(ValueError, match=r"Trajectory.segments\[1\].*3 log_probs"):
        Trajectory([1], [Segment("env", [4]), seg])


# ---------------------------------------------------------------- RolloutBatch / StepBatch carry the mask
def test_response_mask_is_model_tokens_and_every_split_keeps_it():
    trajs = _trajectories(50)
    batch = _batch(trajs)
    W = batch.max_length - 1
    ref = _ref_mask(trajs, W)
    assert ref.sum() < RolloutBatch.from_sequences([t.prompt_ids for t in trajs],
                                                   [t.response_ids for t in trajs]).response_mask.sum()
    assert torch.equal(batch.response_mask, ref)
    # rollout log-probs sit at the same columns as the model tokens' engine values
    for b, tr in enumerate(trajs):
        model_lp = [x for s in tr.segments if s.kind == "model" for x in s.log_probs]
        assert batch.rollout_log_probs[b, _model_columns(tr)].tolist() == pytest.approx(model_lp, abs=1e-6)
    for rank in range(3):
        sh = batch.shard(rank, 3)
        start = sum(batch.shard(r, 3).num_rows for r in range(rank))
        assert torch.equal(sh.response_mask, ref[start:start + sh.num_rows])
    for (s, e), mb in batch.micro_batches(3, trim=True, multiple_of=4):
        w = mb.max_length - 1
        assert mb.max_length % 4 == 0
        assert torch.equal(mb.response_mask, torch.nn.functional.pad(ref[s:e], (0, max(0, w - W)))[:, :w])
    sub = batch.select(1, 4, trim=True)
    assert torch.equal(sub.response_mask, ref[1:4, : sub.max_length - 1])
    assert torch.equal(dataclasses.replace(batch, routing=None).response_mask, ref)  # the actor's r2/r3 rebuild


@pytest.mark.gpu
def test_to_device_moves_the_loss_mask():
    trajs = _trajectories(50)
    batch = _batch(trajs)
    moved = batch.to("cuda")
    assert moved.loss_mask.device.type == "cuda"
    assert torch.equal(moved.response_mask.cpu(), _ref_mask(trajs, batch.max_length - 1))


def test_from_sequences_names_bad_loss_masks():
    with pytest.raises(BatchError, match=r"row 1 has 3 response tokens but 2 loss_masks"):
        RolloutBatch.from_sequences([[1], [2]], [[3], [4, 5, 6]], loss_masks=[[1], [1, 0]])
    with pytest.raises(BatchError, match=r"row 0 loss_masks must hold only 0/1"):
        RolloutBatch.from_sequences([[1]], [[3, 4]], loss_masks=[[1, 2]])
    with pytest.raises(BatchError, match=r"2 responses but 1 loss_masks rows"):
        RolloutBatch.from_sequences([[1], [2]], [[3], [4]], loss_masks=[[1]])
    b = RolloutBatch.from_sequences([[1]], [[3, 4]])
    with pytest.raises(BatchError, match=r"loss_mask\[0, 1\] = 0.5"):
        RolloutBatch(tokens=b.tokens, prompt_lengths=b.prompt_lengths, lengths=b.lengths,
                     loss_mask=torch.tensor([[1.0, 0.5]]))
    with pytest.raises(BatchError, match=r"loss_mask must be a float32 \[B, L-1\]"):
        RolloutBatch(tokens=b.tokens, prompt_lengths=b.prompt_lengths, lengths=b.lengths,
                     loss_mask=torch.ones(1, 3))


def test_step_batch_shard_keeps_each_rows_mask_and_records_write_it():
    trajs = _trajectories(50)
    sb = _step_batch(trajs)
    ref = _ref_mask(trajs, max(len(t.prompt_ids) + len(t.response_ids) for t in trajs) - 1)
    for rank in range(2):  # DP = 2, whole prompt groups of n = 2
        sh = sb.shard(step=3, n_samples=2, pad_id=0, dp_rank=rank, dp_size=2, device=torch.device("cpu"))
        rows = sh.rows
        w = sh.batch.max_length - 1
        assert torch.equal(sh.batch.response_mask, ref[list(rows), :w])
    plain = StepBatch(prompt_ids=sb.prompt_ids, response_ids=sb.response_ids,
                      rollout_log_probs=sb.rollout_log_probs, rewards=sb.rewards, weight_version="step-3")
    assert plain.shard(3, 2, 0, 0, 1, torch.device("cpu")).batch.loss_mask is None
    recs = [json.loads(r) for r in sb.records(3)]
    assert [r["loss_mask"] for r in recs] == [t.loss_mask for t in trajs]
    assert all("loss_mask" not in json.loads(r) for r in plain.records(3))


# ---------------------------------------------------------------- log-probs of a trajectory vs HF
@pytest.fixture(scope="module")
def hf_dir(tiny_hf_model):
    return tiny_hf_model("qwen2", seed=31, num_hidden_layers=2)


def _rank_logprobs(rank, world, job, batch):
    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    actor = MegatronActor(actor_spec(job))
    shard = batch.shard(actor.dp_rank, actor.dp_size)
    lp, _ = actor.compute_log_probs(shard, T)
    return {"dp_rank": actor.dp_rank, "dp_size": actor.dp_size, "lp": lp, "mask": shard.response_mask}


@pytest.mark.timeout(240)
def test_model_token_log_probs_match_hf_over_the_whole_trajectory(hf_dir):
    """TP2 (2 gloo ranks): the actor's log-prob at each model token of prompt + model + env + model segments
    equals HF's fp32 forward over the whole trajectory at that token's position."""
    job = named_job("actor", "actor.micro_batch_size=3", *layout(tp=2), hf=hf_dir)
    trajs = _trajectories(job.model.vocab_size, seed=1)
    batch = _batch(trajs)
    res = run_ranks(_rank_logprobs, 2, job, batch, timeout=200)
    assert res[0]["dp_size"] == 1
    torch.testing.assert_close(res[0]["lp"], res[1]["lp"], rtol=0, atol=0)
    model = load_hf_reference(hf_dir).eval()
    checked = 0
    for b, tr in enumerate(trajs):
        seq = tr.prompt_ids + tr.response_ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq])).logits[0].double() / T
        pos, ref = len(tr.prompt_ids), []
        for seg in tr.segments:
            for tok in seg.ids:
                if seg.kind == "model":
                    ref.append(float(torch.log_softmax(logits[pos - 1], -1)[tok]))
                pos += 1
        got = res[0]["lp"][b][res[0]["mask"][b] == 1].tolist()
        assert got == pytest.approx(ref, abs=1e-4), f"row {b}"
        checked += len(ref)
    assert checked == int(_ref_mask(trajs, batch.max_length - 1).sum())


# ---------------------------------------------------------------- correction / advantages / loss drop env tokens
CORRECTIONS = [
    dict(rollout_is="token", rollout_is_threshold=2.0),                                   # token IS, truncate
    dict(rollout_is="token", rollout_is_threshold="0.5_2.0", rollout_is_batch_normalize=True),  # token IS, mask
    dict(rollout_is="sequence", rollout_is_threshold=3.0, rollout_is_batch_normalize=True),     # seq IS, truncate
    dict(rollout_is="sequence", rollout_is_threshold="0.2_5.0"),                                # seq IS, mask
    dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold="0.5_1.6"),
    dict(rollout_is="geometric", rollout_is_threshold=1.5, rollout_rs="seq_max_k3,seq_sum_k3",
         rollout_rs_threshold="0.3,1.0", rollout_token_veto_threshold=1e-3),
]


def _correction_data(seed=0):
    """Trajectory batch, train log-probs (every column: the actor computes env columns too), rollout log-probs."""
    trajs = _trajectories(50, seed=seed)
    batch = _batch(trajs)
    g = torch.Generator().manual_seed(100 + seed)
    lr = batch.rollout_log_probs.double()
    lt = (lr + 0.4 * torch.randn(lr.shape, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    # env columns: the train log-probs are real values far from the rollout's 0.0 (a leak would show)
    lt = torch.where(batch.response_mask.bool(), lt, -4.0 - torch.rand(lr.shape, generator=g, dtype=torch.float64))
    return trajs, batch, lt.float(), batch.rollout_log_probs


def _check_dropping_env(res, trajs, lt, lr, cfg):
    cols = [_model_columns(t) for t in trajs]
    Tm = max(len(c) for c in cols)
    mask_c = torch.zeros(len(trajs), Tm)
    for b, c in enumerate(cols):
        mask_c[b, : len(c)] = 1
    W = lt.shape[1]
    off = 1 - _ref_mask(trajs, W)
    assert float((res.response_mask * off).abs().sum()) == 0.0
    if res.weights is not None:
        assert float((res.weights * off).abs().sum()) == 0.0
    compact = types.SimpleNamespace(
        response_mask=_compact(res.response_mask, cols, Tm),
        weights=None if res.weights is None else _compact(res.weights, cols, Tm), metrics=res.metrics)
    check_against_reference(compact, _compact(lt, cols, Tm), _compact(lr, cols, Tm), mask_c, cfg, atol=1e-6)


@pytest.mark.parametrize("i", range(len(CORRECTIONS)))
def test_correction_with_env_tokens_equals_reference_without_them(i):
    cfg = RolloutCorrectionConfig.from_dict(CORRECTIONS[i])
    trajs, batch, lt, lr = _correction_data(seed=i)
    res = compute_rollout_correction(lt, lr, batch.response_mask, cfg)
    _check_dropping_env(res, trajs, lt, lr, cfg)


def _rank_correction(rank, world, batch, lt, lr, cfg):
    import torch.distributed as dist

    sh = batch.shard(rank, world)
    start = sum(batch.shard(r, world).num_rows for r in range(rank))
    W = sh.max_length - 1
    rows = slice(start, start + sh.num_rows)
    res = compute_rollout_correction(lt[rows, :W], lr[rows, :W], sh.response_mask, cfg, group=dist.group.WORLD)
    return {"mask": res.response_mask, "weights": res.weights, "metrics": res.metrics}


@pytest.mark.timeout(120)
def test_correction_with_env_tokens_over_dp2_equals_reference_without_them():
    cfg = RolloutCorrectionConfig.from_dict(CORRECTIONS[4])
    trajs, batch, lt, lr = _correction_data(seed=7)
    out = run_ranks(_rank_correction, 2, batch, lt, lr, cfg, timeout=100)
    assert out[0]["metrics"] == out[1]["metrics"]
    W = lt.shape[1]
    pad = lambda x: torch.nn.functional.pad(x, (0, W - x.shape[1]))  # noqa: E731
    res = types.SimpleNamespace(response_mask=torch.cat([pad(o["mask"]) for o in out]),
                                weights=torch.cat([pad(o["weights"]) for o in out]), metrics=out[0]["metrics"])
    _check_dropping_env(res, trajs, lt, lr, cfg)


def _ppo_reference(logp, old, adv, w, mask, cfg, mode):
    """float64 PPO-clip (dual clip) with IS weights after clipping, over each row's listed tokens."""
    rows, clipped, kl, n = [], 0, 0.0, 0
    for b in range(len(mask)):
        vals = []
        for t in range(len(mask[b])):
            if not mask[b][t]:
                continue
            lr_ = max(-20.0, min(20.0, logp[b][t] - old[b][t]))
            r, a = math.exp(lr_), adv[b][t]
            u, c = -a * r, -a * min(max(r, 1 - cfg.clip_ratio_low), 1 + cfg.clip_ratio_high)
            lo = max(u, c)
            clipped += c > u
            if a < 0 and cfg.clip_ratio_c is not None:
                lo = min(lo, -a * cfg.clip_ratio_c)
            vals.append(lo * w[b][t])
            kl += -lr_
            n += 1
        rows.append(vals)
    seqs = [v for v in rows if v]
    if mode == "token-mean":
        loss = sum(map(sum, seqs)) / n
    elif mode == "seq-mean-token-mean":
        loss = sum(sum(v) / len(v) for v in seqs) / len(seqs)
    else:  # seq-mean-token-sum
        loss = sum(map(sum, seqs)) / len(seqs)
    return loss, clipped / n, kl / n


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_advantages_and_policy_loss_equal_reference_without_env_tokens(mode):
    trajs, batch, lt, lr = _correction_data(seed=11)
    cfg_c = RolloutCorrectionConfig.from_dict(CORRECTIONS[4])
    res = compute_rollout_correction(lt, lr, batch.response_mask, cfg_c)
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.5, 1.5, 1.5, 0.0, 3.0])
    group = torch.arange(8) // 4
    adv = compute_advantages(rewards, group, res.response_mask.float(), estimator="grpo")
    # reference advantages: GRPO scalar (unbiased std) at kept model tokens, 0 at env tokens and padding
    final = res.response_mask
    for b in range(8):
        grp = rewards[group == group[b]].double()
        a = (float(rewards[b]) - float(grp.mean())) / (float(grp.std()) + 1e-6)
        for t in range(adv.shape[1]):
            assert float(adv[b, t]) == pytest.approx(a if final[b, t] else 0.0, abs=1e-6)
    g = torch.Generator().manual_seed(5)
    logp = (lt.double() + 0.3 * torch.randn(lt.shape, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode)
    out = compute_policy_loss(PolicyLoss.of("ppo_clip", cfg),
                              LossBatch(logp, lt.double(), adv.double(), final, is_weights=res.weights.double()))
    cols = [_model_columns(t) for t in trajs]
    Tm = max(len(c) for c in cols)
    c = lambda x: _compact(x.double(), cols, Tm).tolist()  # noqa: E731
    ref_loss, ref_clip, ref_kl = _ppo_reference(c(logp), c(lt), c(adv), c(res.weights), c(final), cfg, mode)
    assert float(out.pg_loss) == pytest.approx(ref_loss, rel=1e-9, abs=1e-12)
    assert out.metrics["pg_clipfrac"].mean() == pytest.approx(ref_clip, abs=1e-12)
    assert out.metrics["ppo_kl"].mean() == pytest.approx(ref_kl, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("i", [0, 3, 5])
def test_rollout_log_probs_at_env_tokens_change_nothing(i):
    cfg = RolloutCorrectionConfig.from_dict(CORRECTIONS[i])
    trajs, batch, lt, lr = _correction_data(seed=20 + i)
    env = _ref_mask(trajs, lt.shape[1]) == 0
    g = torch.Generator().manual_seed(9)
    lr2 = torch.where(env, -30.0 * torch.rand(lr.shape, generator=g) + 2.0, lr)  # wild, even positive, values
    assert not torch.equal(lr, lr2)
    a = compute_rollout_correction(lt, lr, batch.response_mask, cfg)
    b = compute_rollout_correction(lt, lr2, batch.response_mask, cfg)
    assert torch.equal(a.response_mask, b.response_mask)
    assert (a.weights is None and b.weights is None) or torch.equal(a.weights, b.weights)
    assert a.metrics == b.metrics
    # bypass mode: the rollout log-probs ARE the old policy of the loss
    logp = (lt + 0.2).clamp(max=-1e-4)
    adv = torch.randn(lt.shape, generator=g) * a.response_mask
    cfg_l = PolicyLossConfig(**PPO_LOSS)
    la = compute_policy_loss(PolicyLoss.of("ppo_clip", cfg_l), LossBatch(logp, lr, adv, a.response_mask))
    lb = compute_policy_loss(PolicyLoss.of("ppo_clip", cfg_l), LossBatch(logp, lr2, adv, b.response_mask))
    assert float(la.pg_loss) == float(lb.pg_loss)
    assert {k: v.mean() for k, v in la.metrics.items()} == {k: v.mean() for k, v in lb.metrics.items()}


# ---------------------------------------------------------------- one train step, TP2 x DP2, env tokens
def _rank_train(rank, world, job, sb, n):
    """The loop's recipe on this rank's StepBatch shard: log-probs, correction over DP, advantages, train."""
    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    actor = MegatronActor(actor_spec(job))
    shard = sb.shard(3, n, 0, actor.dp_rank, actor.dp_size, torch.device("cpu"))
    rows = shard.batch
    old, _ = actor.compute_log_probs(rows, T, compute_entropy=False)
    corr = compute_rollout_correction(old, rows.rollout_log_probs, rows.response_mask,
                                      job.algorithm.rollout_correction, group=actor.dp_group)
    adv = compute_advantages(shard.rewards, shard.group_index, corr.response_mask.float())
    metrics = actor.train_step(rows, old, adv, corr.response_mask, corr.weights, T)
    return {"metrics": metrics, "hf_sd": actor.full_state_dict_hf(), "rows": shard.rows,
            "mask": rows.response_mask, "corr": corr.metrics}


@pytest.mark.timeout(300)
def test_train_step_tp2_dp2_with_env_tokens_matches_reference(hf_dir):
    job = named_job("actor_ppo", "actor.micro_batch_size=2", "actor.weight_decay=0.1", *layout(tp=2),
                    setting("algorithm.rollout_correction", {"rollout_is": "token", "rollout_is_threshold": 1.5,
                                                             "rollout_rs": "token_k1",
                                                             "rollout_rs_threshold": "0.3_3.0"}), hf=hf_dir)
    trajs = _trajectories(job.model.vocab_size, seed=4)
    model = load_hf_reference(hf_dir)
    batch = _batch(trajs)
    W = batch.max_length - 1
    mask = _ref_mask(trajs, W)  # the reference's own mask: model tokens, built from the segments
    with torch.no_grad():
        old = torch.log_softmax(model(input_ids=batch.tokens).logits[:, :-1] / T, -1).gather(
            -1, batch.tokens[:, 1:, None]).squeeze(-1)
    # rollout log-probs at model tokens: the policy's plus noise (the segments carry them; env tokens none)
    noise = 0.5 * torch.randn(old.shape, generator=torch.Generator().manual_seed(8))
    roll = (old + noise).clamp(max=-1e-4)
    for tr, b in zip(trajs, range(len(trajs))):
        cols = iter(_model_columns(tr))
        for seg in tr.segments:
            if seg.kind == "model":
                seg.log_probs = [float(roll[b, next(cols)]) for _ in seg.ids]
    n = 2
    sb = _step_batch(trajs, rewards=[1.0, 0.0, 2.0, 2.0, 0.5, 1.5, 0.0, 3.0])
    ref_rollout = torch.zeros_like(old)
    ref_rollout[mask.bool()] = roll[mask.bool()]
    ref_corr = compute_rollout_correction(old, ref_rollout, mask, job.algorithm.rollout_correction)
    assert 0 < ref_corr.response_mask.sum() < mask.sum(), "rejection must drop some tokens"
    rewards = torch.tensor(sb.rewards)
    adv = compute_advantages(rewards, torch.arange(8) // n, ref_corr.response_mask.float())
    # reference: HF + torch AdamW, the loss over the reference mask (env tokens never in it)
    model.train()
    opt = hf_adamw(model, LR, weight_decay=0.1)
    logp = torch.log_softmax(model(input_ids=batch.tokens).logits[:, :-1] / T, -1).gather(
        -1, batch.tokens[:, 1:, None]).squeeze(-1)
    loss = compute_policy_loss(PolicyLoss.of("ppo_clip", PolicyLossConfig(**PPO_LOSS)),
                               LossBatch(logp, old, adv, ref_corr.response_mask, is_weights=ref_corr.weights))
    loss.loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD))
    opt.step()
    weights = unfuse_experts({k: v.detach().clone() for k, v in model.state_dict().items()})
    # the loss with env tokens left in differs: the test can see a leak
    plain = RolloutBatch.from_sequences(sb.prompt_ids, sb.response_ids).response_mask  # env tokens included
    leak = compute_policy_loss(PolicyLoss.of("ppo_clip", PolicyLossConfig(**PPO_LOSS)),
                               LossBatch(logp.detach(), old, compute_advantages(rewards, torch.arange(8) // n, plain),
                                         plain))
    assert abs(float(leak.pg_loss) - float(loss.pg_loss.detach())) > 1e-3

    results = run_ranks(_rank_train, 4, job, sb, n, timeout=260)
    for r in results:  # the DP shard kept each row's mask
        rows = r["rows"]
        assert torch.equal(r["mask"], mask[list(rows), : r["mask"].shape[1]])
    m = results[0]["metrics"]
    assert all(r["metrics"] == m for r in results)
    for k, v in ref_corr.metrics.items():
        assert results[0]["corr"][k] == pytest.approx(v, rel=1e-4, abs=1e-5), k
    assert m["actor/pg_loss"] == pytest.approx(float(loss.pg_loss.detach()), rel=1e-5, abs=1e-7)
    assert m["actor/grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    assert m["actor/num_tokens"] == float(ref_corr.response_mask.sum())
    hf_sd = results[0]["hf_sd"]
    moved = 0
    for k, w in weights.items():
        if k in hf_sd:
            torch.testing.assert_close(hf_sd[k], w, rtol=0, atol=1e-5, msg=lambda s: f"weight {k}: {s}")
            moved += 1
    assert moved > 5
