"""Every policy objective side by side with verl 0.9.1's own function, on the same random tensors.

For each of verl's loss modes (``verl.trainer.ppo.core_algos.get_policy_loss_fn``; REINFORCE through
``compute_policy_loss_reinforce``), every ``loss_agg_mode`` and with / without IS weights, the loss, its
gradient w.r.t. the log-probs and verl's metrics are computed by verl and by ``megatron_rl.losses`` on
identical float32 inputs (masks with rejected tokens, per-token advantages), and the largest differences
are printed. Clip-Cov runs with ``clip_cov_ratio=1`` (every candidate is cut, so verl's random choice is
not random); GMPO on rows that all keep a valid token (verl's ``torch.mean`` counts emptied rows).

verl is never a dependency of this project. Install it into a scratch directory first (as
``tools/bench_correction.py`` does)::

    python tools/compare_policy_losses.py --install-verl      # pip --no-deps into /tmp/megatron_rl_bench_verl
    python tools/compare_policy_losses.py                     # or --verl-path DIR

Exit status 1 when a difference exceeds the float32 tolerance (loss / gradient rtol 1e-5 + atol 1e-6, the
loss's atol times the number of valid tokens for the unnormalised token-sum; metrics atol 1e-5), 2 when verl
cannot be imported.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rl.losses import (LOSS_AGG_MODES, LossBatch, PolicyLoss, PolicyLossConfig,  # noqa: E402
                                compute_policy_loss)
from tools.bench_correction import DEFAULT_VERL_PATH, add_verl_path, install_verl  # noqa: E402

MODES = ("vanilla", "gspo", "geo_mean", "cispo", "sapo", "dppo_tv", "dppo_kl", "gpg", "clip_cov", "kl_cov", "dro",
         "reinforce")
PARAMS = {"dro": dict(dro_beta=0.3), "kl_cov": dict(kl_cov_ratio=0.2),
          "clip_cov": dict(clip_cov_ratio=1.0, clip_cov_lb=0.05, clip_cov_ub=5.0),
          "dppo_tv": dict(clip_ratio_low=0.1, clip_ratio_high=0.05),
          "dppo_kl": dict(clip_ratio_low=0.05, clip_ratio_high=0.02)}
POLICY_LOSS_KEYS = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta")


def load_verl(path):
    """((core_algos module, ActorConfig, PolicyLossConfig), version) or (None, why)."""
    add_verl_path(path)
    try:
        import verl
        from verl.trainer.ppo import core_algos
        from verl.workers.config import ActorConfig
        from verl.workers.config import PolicyLossConfig as VerlPolicyLossConfig
    except Exception as exc:  # noqa: BLE001 - any import failure means "no verl to compare with"
        return None, f"{type(exc).__name__}: {exc}"
    return (core_algos, ActorConfig, VerlPolicyLossConfig), getattr(verl, "__version__", "?")


def make_batch(seed, B=16, T=24):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]) & (torch.rand(B, T, generator=g) > 0.15)
    mask[:, 0] = True
    logp = -3.0 * torch.rand(B, T, generator=g) - 1e-3
    old = torch.clamp(logp + 0.3 * torch.randn(B, T, generator=g), max=-1e-4)
    adv = torch.randn(B, T, generator=g)
    weights = 2.0 * torch.rand(B, T, generator=g)
    return logp, old, adv, mask.float(), weights


def verl_side(verl, mode, agg, params, logp, old, adv, mask, w):
    core_algos, ActorConfig, VerlPLC = verl
    actor_keys = {k: v for k, v in params.items() if k not in POLICY_LOSS_KEYS}
    pl = VerlPLC(loss_mode=mode, **{k: v for k, v in params.items() if k in POLICY_LOSS_KEYS})
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=pl, loss_agg_mode=agg,
                      loss_scale_factor=8 if agg == "seq-mean-token-sum-norm" else None, **actor_keys)
    if agg == "seq-mean-token-sum-norm":
        cfg.global_batch_info["loss_scale_factor"] = 8
    lp = logp.clone().requires_grad_(True)
    fn = core_algos.compute_policy_loss_reinforce if mode == "reinforce" else core_algos.get_policy_loss_fn(mode)
    loss, metrics = fn(old, lp, adv, mask.bool(), loss_agg_mode=agg, config=cfg, rollout_is_weights=w)
    grad, = torch.autograd.grad(loss, lp)
    return float(loss.detach()), grad, {k.split("/")[-1]: float(torch.as_tensor(v).detach()) for k, v in metrics.items()}


def our_side(mode, agg, params, logp, old, adv, mask, w, device="cpu"):
    cfg = PolicyLossConfig(loss_agg_mode=agg, loss_scale_factor=8.0 if agg == "seq-mean-token-sum-norm" else None,
                           **params)
    lp = logp.to(device).requires_grad_(True)
    old, adv, mask = old.to(device), adv.to(device), mask.to(device)
    out = compute_policy_loss(PolicyLoss.of(mode, cfg),
                              LossBatch(lp, old, adv, mask, is_weights=None if w is None else w.to(device)))
    grad, = torch.autograd.grad(out.loss, lp)
    return float(out.loss.detach()), grad.cpu(), {k: v.mean() for k, v in out.metrics.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--verl-path", default=os.environ.get("MEGATRON_RL_BENCH_VERL", DEFAULT_VERL_PATH))
    ap.add_argument("--install-verl", action="store_true", help="pip --no-deps verl 0.9.1 into --verl-path first")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="where megatron_rl's side runs (e.g. cuda; verl's runs on CPU)")
    args = ap.parse_args()
    if args.install_verl:
        install_verl(args.verl_path)
    verl, version = load_verl(args.verl_path)
    if verl is None:
        print(f"verl not importable from {args.verl_path}: {version} (run with --install-verl)")
        return 2
    print(f"verl {version} (cpu) vs megatron_rl.losses ({args.device}), float32, {args.seeds} seeds x {len(LOSS_AGG_MODES)} aggregation "
          f"modes x IS weights on/off")
    print(f"{'loss_mode':10s} {'max |dloss|':>12s} {'max rel':>9s} {'max |dgrad|':>12s} {'max |dmetric|':>14s}")
    bad = False
    for mode in MODES:
        params = PARAMS.get(mode, {})
        worst = [0.0, 0.0, 0.0, 0.0]
        for seed in range(args.seeds):
            logp, old, adv, mask, weights = make_batch(seed)
            for agg in LOSS_AGG_MODES:
                for w in (None, weights):
                    lv, gv, mv = verl_side(verl, mode, agg, params, logp, old, adv, mask, w)
                    lo, go, mo = our_side(mode, agg, params, logp, old, adv, mask, w, args.device)
                    dl = abs(lv - lo)
                    dg = float((gv - go).abs().max())
                    dm = max([abs(mv[k] - mo[k]) for k in mv if k in mo] or [0.0])
                    worst = [max(worst[0], dl), max(worst[1], dl / max(abs(lv), 1e-12)), max(worst[2], dg),
                             max(worst[3], dm)]
                    # token-sum is an unnormalised float32 sum of N terms: its rounding grows with N
                    tol_l = 1e-5 * abs(lv) + 1e-6 * (float(mask.sum()) if agg == "token-sum" else 1.0)
                    if dl > tol_l or not torch.allclose(go, gv, rtol=1e-5, atol=1e-6) or dm > 1e-5:
                        bad = True
                        print(f"  MISMATCH {mode} {agg} weights={w is not None} seed={seed}: loss {lv} vs {lo}, "
                              f"|dgrad| {dg:.2e}, metrics {mv} vs {mo}")
        print(f"{mode:10s} {worst[0]:12.2e} {worst[1]:9.2e} {worst[2]:12.2e} {worst[3]:14.2e}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
