"""Context-parallel data path of the log-prob pass and the train step, exercised on CPU.

Megatron's GPT attention cannot run with CP on CPU (TE only), so these tests use a *position-wise*
language model (embedding -> linear -> vocab logits, no attention): its output at a position depends
only on that position's token, so splitting sequences over CP ranks in megatron's zigzag order is
exact. Everything else is the real actor code and megatron machinery — ``MicroBatcher.cut``
(zigzag split of tokens / targets / per-token tensors), megatron's schedule, Megatron DDP (grads
scaled by 1/(DP x CP)), ``finalize_model_grads``, the Megatron optimizer, ``cp_gather`` of log-probs,
metric reduction over DP x CP. CP2 (2 ranks) and DP2 x CP2 (4 ranks) must equal CP1: log-probs,
metrics, gradients and updated weights (with the entropy bonus).

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_actor_cp_train.py -q``
"""
import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.positionwise_lm import cp_rank, positionwise_batch, positionwise_lm, rank_result

VOCAB, HIDDEN = 64, 16
ENTROPY = {"entropy_coeff": 0.1}  # policy_loss keys: verl's entropy bonus


def _build(cp):
    return positionwise_lm(cp, vocab=VOCAB, hidden=HIDDEN)


def _data():
    return positionwise_batch([2, 5, 1, 3, 4, 2, 6, 1], [7, 3, 9, 2, 5, 8, 1, 4], vocab=VOCAB)


def _rank(rank, world, cp, agg, loss_type="ppo_clip", loss=None, old_noise=0.0):
    """One rank's log-prob pass and train step; ``loss_type`` / ``loss`` (PolicyLossConfig keys) pick the
    objective, ``old_noise`` > 0 perturbs the old log-probs (a fixed draw) so that ratios differ from 1."""
    from megatron_rl.actor.batcher import MicroBatcher
    from megatron_rl.actor.forward import compute_log_probs
    from megatron_rl.actor.train_step import train_mini_batch
    from megatron_rl.losses import PolicyLoss, PolicyLossConfig

    groups, model, opt, batch, adv, is_w, shard, rows = cp_rank(cp, _build, _data())
    bounds = [(s, min(s + 3, shard.num_rows)) for s in range(0, shard.num_rows, 3)]   # micro-batches of 3 rows
    lp, ent = compute_log_probs(model, shard, bounds=bounds, temperature=0.9, groups=groups,
                                batcher=MicroBatcher(groups.dims))
    old = lp
    if old_noise:
        g = torch.Generator().manual_seed(3)
        noise = old_noise * torch.randn(batch.num_rows, batch.max_length - 1, generator=g)[rows, : lp.shape[1]]
        old = torch.clamp(lp + noise, max=-1e-4)
    per_token = {"old_log_probs": old, "advantages": adv[rows], "response_mask": shard.response_mask,
                 "is_weights": is_w[rows], "ref_log_probs": None}
    cfg = PolicyLossConfig(**{"loss_agg_mode": agg, **(loss or {})})
    metrics = train_mini_batch(model, opt, shard, per_token, PolicyLoss.of(loss_type, cfg), temperature=0.9,
                               bounds=bounds, groups=groups, batcher=MicroBatcher(groups.dims))
    return rank_result(groups, model, lp, ent, metrics)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("cp,world", [(2, 2), (2, 4)], ids=["cp2", "dp2xcp2"])
def test_cp_matches_cp1(cp, world, agg):
    """With verl's entropy bonus (its aggregated entropy is a metric: actor/entropy_loss)."""
    (ref,) = run_ranks(_rank, 1, 1, agg, "ppo_clip", ENTROPY, timeout=100)
    res = run_ranks(_rank, world, cp, agg, "ppo_clip", ENTROPY, timeout=100)
    assert ref["metrics"]["entropy_loss"] > 0
    batch = _data()[0]
    lp = torch.cat([next(r["lp"] for r in res if r["dp_rank"] == d) for d in range(world // cp)])
    torch.testing.assert_close(lp, ref["lp"], rtol=0, atol=1e-6)
    assert ref["lp"][batch.response_mask.bool()].std() > 0.1
    assert_ranks_match(ref, res)
    for r in res:
        for n, w in ref["weights"].items():
            torch.testing.assert_close(r["weights"][n], w, rtol=0, atol=1e-6)


def assert_ranks_match(ref, res):
    """Every rank's metrics and (non-zero) gradients equal the CP1 reference's."""
    for r in res:
        assert r["metrics"].keys() == ref["metrics"].keys()
        for k, v in ref["metrics"].items():
            assert r["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
        for n, g in ref["grads"].items():
            assert g.abs().max() > 0
            torch.testing.assert_close(r["grads"][n], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"grad {n}: {m}")
