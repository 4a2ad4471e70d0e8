"""Sequence- and batch-level objectives through ``MegatronActor.train_step`` equal a single-process reference.

The actor (megatron-core, 1F1B schedule, DDP) trains one step with gspo / geo_mean at PP2 (the loss on the last
stage) and clip_cov at DP2 (its selection over the DP group) and PP2 (the selection on every stage); the reference is HF transformers on the whole batch in one process
with ``compute_policy_loss`` (and, for clip_cov, ``batch_selection`` over the whole batch). Checked: the
loss, the pre-clip grad norm and every parameter gradient. Context parallelism (megatron's attention needs
TE for it) runs ``train_mini_batch`` on the position-wise model of ``test_actor_cp_train``: CP2 and DP2 x CP2
with gspo / geo_mean / opsm (old log-probs perturbed so the per-sequence sums matter) equal CP1. Run:
``OMP_NUM_THREADS=1 pytest tests/integration/test_actor_objectives.py -q``
"""
import functools

import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.losses import LossBatch, PolicyLoss, PolicyLossConfig, batch_selection, compute_policy_loss
from megatron_rl.testing.actor_reference import CLIP_GRAD, LR, hf_adamw, hf_token_log_probs, load_hf_reference
from megatron_rl.testing.actor_reference import merge_rank_grads, unfuse_experts
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import knobs, named_job, setting
from tests.integration.test_actor_cp_train import _rank, assert_ranks_match
from tests.integration.test_actor_train import T, _data, _rank_train

transformers = pytest.importorskip("transformers")

LOSS = {"gspo": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "loss_agg_mode": "seq-mean-token-mean"},
        "geo_mean": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28},
        "opsm": {"opsm_delta": 0.0, "loss_agg_mode": "token-mean"},
        "clip_cov": {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.01, "clip_cov_ub": 50.0,
                     "loss_agg_mode": "seq-mean-token-mean"}}


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_model):
    return tiny_hf_model("qwen2", seed=31, num_hidden_layers=4)


@functools.lru_cache(maxsize=None)
def _reference(hf_dir, loss_type, vocab_size):
    """(pg_loss, grad norm, HF grads, selected tokens) of one step on ``_data``, shared by the layouts."""
    batch, old, adv, mask, is_w = _data(vocab_size)
    model = load_hf_reference(hf_dir)
    model.train()
    hf_adamw(model, LR, weight_decay=0.0)
    cfg = PolicyLossConfig(**LOSS[loss_type])
    W = batch.max_length - 1
    adv = adv[:, None].expand(-1, W).to(torch.float32)
    select, mask, _ = batch_selection(loss_type, cfg, old, None, adv, mask)
    logp = hf_token_log_probs(model, batch.tokens, T)
    out = compute_policy_loss(PolicyLoss.of(loss_type, cfg),
                              LossBatch(logp, old, adv, mask, is_weights=is_w, token_select=select))
    out.loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    grads = unfuse_experts({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    return float(out.pg_loss.detach()), norm, grads, (None if select is None else int(select.sum()))


# The DP2 train-step path is the same for every objective (global denominators, DP-reduced grads); clip_cov at DP2
# also runs its selection over the DP group. A gspo-dp2 case would add nothing the CP tests below and these miss.
CASES = [("gspo", dict(pp=2), 2), ("geo_mean", dict(pp=2), 2), ("clip_cov", dict(), 2), ("clip_cov", dict(pp=2), 2)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("loss_type,layout,world", CASES,
                         ids=["gspo-pp2", "geo_mean-pp2", "clip_cov-dp2", "clip_cov-pp2"])
def test_objective_train_step_matches_single_process(hf_dir, loss_type, layout, world):
    from megatron_rl.convert import hf_to_mcore, read_hf_checkpoint

    job = named_job("actor_ppo", setting("actor.policy_loss", LOSS[loss_type]),
                    f"algorithm.rollout_correction.loss_type={loss_type}", *knobs(**layout), hf=hf_dir)
    data = _data(job.model.vocab_size)
    pg_loss, norm, ref_grads, selected = _reference(hf_dir, loss_type, job.model.vocab_size)
    assert selected is None or selected > 0
    results = run_ranks(_rank_train, world, job, data, timeout=200)
    m = results[0]["metrics"]
    assert all(r["metrics"] == m for r in results)
    assert m["actor/pg_loss"] == pytest.approx(pg_loss, rel=1e-5, abs=1e-7)
    assert m["actor/grad_norm"] == pytest.approx(norm, rel=1e-5)
    grads = merge_rank_grads([r["grads"] for r in results], job)
    geom, _, _ = read_hf_checkpoint(hf_dir)
    ref = hf_to_mcore(ref_grads, geom)
    scale = min(1.0, CLIP_GRAD / norm)        # the actor's main_grad is read after clipping
    for k, g in ref.items():
        torch.testing.assert_close(grads[k], g * scale, rtol=1e-4, atol=1e-6, msg=lambda s: f"grad {k}: {s}")


def _cp_rank(rank, world, cp, loss_type):
    loss = dict(LOSS[loss_type])
    return _rank(rank, world, cp, loss.pop("loss_agg_mode", "token-mean"), loss_type, loss, old_noise=0.3)


@functools.lru_cache(maxsize=None)
def _cp1(loss_type):
    """The CP1 run both layouts compare with."""
    (ref,) = run_ranks(_cp_rank, 1, 1, loss_type, timeout=100)
    return ref


@pytest.mark.timeout(180)
@pytest.mark.parametrize("loss_type", ["gspo", "geo_mean", "opsm"])
@pytest.mark.parametrize("cp,world", [(2, 2), (2, 4)], ids=["cp2", "dp2xcp2"])
def test_sequence_objectives_under_context_parallel_match_cp1(cp, world, loss_type):
    ref = _cp1(loss_type)
    res = run_ranks(_cp_rank, world, cp, loss_type, timeout=150)
    if loss_type == "opsm":
        assert ref["metrics"]["opsm_clipfrac"] > 0
    assert_ranks_match(ref, res)
