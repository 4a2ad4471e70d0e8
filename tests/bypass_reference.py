"""Single-process reference of verl 0.9.1's bypass-mode loss over several optimizer steps, for
``tests/integration/test_bypass_steps.py``.

Transcribed (no megatron_rl code) from verl 0.9.1:
  * ``core_algos.compute_policy_loss_bypass_mode``: in EVERY micro-batch the IS weights and the rejection mask are
    computed from the CURRENT log-probs (``old_log_prob=log_prob``) against the rollout's, under ``torch.no_grad``;
    the rejection mask replaces the response mask of the policy term; reinforce applies the weights, ppo_clip
    does not (its ratio pi_theta / pi_rollout already is the correction);
  * ``rollout_corr_helper.compute_rollout_correction_weights`` (sequence level: exp of the clamped masked sum of the
    log-ratio, times the mask, truncated at the threshold) and ``compute_rollout_rejection_mask`` (seq_sum_k1 /
    seq_mean_k1 with "lo_hi" or U bounds: keep iff log lo <= k1 statistic <= log hi, k1 = -clamp(log-ratio));
  * ``core_algos.compute_policy_loss_vanilla`` / ``compute_policy_loss_reinforce`` (the per-token losses, see
    ``tests/policy_objectives_reference.py``) and ``agg_loss`` with the global batch info of verl's engine:
    ``batch_num_tokens`` / ``global_batch_size`` are counted on the mini-batch's loss mask BEFORE the bypass
    rejection (the trainer runs no correction in bypass mode), the numerators on the rejected mask.

Not transcribed: verl's ``masked_mean`` adds 1e-8 to the denominator of seq_mean statistics (the tests check that no
decision lies within 1e-4 of a bound, so the two agree); batch normalisation (not used by these tests).
The training loop is HF transformers (fp32) + ``torch.optim.AdamW`` as megatron builds it (no weight decay on 1-D
parameters), ``clip_grad_norm_`` before each step.
"""
import math

import torch

B20 = 20.0


def parse_k1_bounds(spec):
    """verl's k1 spec: "lo_hi" or a number U meaning [1/U, U]; returns (log lo, log hi)."""
    if isinstance(spec, str) and "_" in spec:
        lo, hi = (float(x) for x in spec.split("_"))
    else:
        hi = float(spec)
        lo = 1.0 / hi
    return math.log(lo), math.log(hi)


def bypass_correction(log_prob, rollout_log_prob, mask, rollout_is, is_threshold, rollout_rs, rs_threshold):
    """(IS weights or None, rejection mask, per-sequence k1 statistic of the RS option or None) of one micro-batch,
    from the current log-probs (no gradient). ``rollout_is``: None or "sequence"; ``rollout_rs``: None,
    "seq_sum_k1" or "seq_mean_k1"."""
    with torch.no_grad():
        m = mask.to(torch.float64)
        log_ratio = log_prob.detach().to(torch.float64) - rollout_log_prob.to(torch.float64)
        weights = None
        if rollout_is == "sequence":
            s = (log_ratio * m).sum(-1, keepdim=True).clamp(-B20, B20)
            weights = (torch.exp(s).expand_as(log_ratio) * m).clamp(max=float(is_threshold))
        elif rollout_is is not None:
            raise ValueError(rollout_is)
        keep, stat = m.clone(), None
        if rollout_rs is not None:
            k1 = -log_ratio.clamp(-B20, B20)
            if rollout_rs == "seq_sum_k1":
                stat = (k1 * m).sum(-1)
            elif rollout_rs == "seq_mean_k1":
                stat = (k1 * m).sum(-1) / m.sum(-1).clamp(min=1)
            else:
                raise ValueError(rollout_rs)
            lo, hi = parse_k1_bounds(rs_threshold)
            keep = keep * ((stat >= lo) & (stat <= hi)).to(torch.float64)[:, None]
        return weights, keep, (None if stat is None else (stat, lo, hi))


def per_token_loss(loss_type, log_prob, rollout_log_prob, advantages, weights, clip_low, clip_high, clip_c):
    """verl's vanilla (bypass: old = rollout, no weights) or reinforce (-A * w * logp) per-token loss."""
    if loss_type == "reinforce":
        return -advantages * log_prob * (1.0 if weights is None else weights.to(log_prob.dtype))
    ratio = torch.exp(torch.clamp(log_prob - rollout_log_prob, min=-B20, max=B20))
    l1 = -advantages * ratio
    l2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(l1, l2)
    return torch.where(advantages < 0, torch.min(-advantages * clip_c, clipped), clipped)


def agg(loss_mat, keep, base_mask, mode):
    """verl's ``agg_loss`` with the global batch info of the mini-batch's (pre-rejection) ``base_mask``."""
    keep = keep.to(loss_mat.dtype)
    if mode == "token-mean":
        return (loss_mat * keep).sum() / base_mask.sum()
    if mode == "seq-mean-token-mean":
        n = keep.sum(-1)
        seq = (loss_mat * keep).sum(-1) / (n + 1e-8)
        return (seq * (n > 0).to(seq.dtype)).sum() / (base_mask.sum(-1) > 0).sum()
    raise ValueError(mode)


def train_bypass(model, tokens, rollout_log_prob, advantages, mask, steps_rows, epochs, lr, weight_decay, clip_grad,
                 temperature, corr, loss_type, loss):
    """Train ``model`` (HF, fp32) as verl's bypass mode would: ``epochs`` x one optimizer step per entry of
    ``steps_rows`` (the rows of each mini-batch, one micro-batch each). ``corr``: rollout_is / rollout_is_threshold /
    rollout_rs / rollout_rs_threshold; ``loss``: clip_ratio_low / clip_ratio_high / clip_ratio_c / loss_agg_mode.
    Returns per optimizer step: pg_loss, grad_norm (before clipping), the kept rows, the weights of the rows, and the
    smallest distance of an RS statistic to a bound; plus the final weights (state dict)."""
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.999), eps=1e-8)
    model.train()
    out = {"pg_loss": [], "grad_norm": [], "kept": [], "seq_weights": [], "margin": []}
    for _ in range(epochs):
        for rows in steps_rows:
            rows = torch.as_tensor(rows)
            opt.zero_grad()
            logits = model(input_ids=tokens[rows]).logits[:, :-1] / temperature
            logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[rows][:, 1:, None]).squeeze(-1)
            m = mask[rows]
            w, keep, rs = bypass_correction(logp, rollout_log_prob[rows], m, corr.get("rollout_is"),
                                            corr.get("rollout_is_threshold", 2.0), corr.get("rollout_rs"),
                                            corr.get("rollout_rs_threshold"))
            adv = advantages[rows][:, None].expand_as(logp)
            lt = per_token_loss(loss_type, logp, rollout_log_prob[rows], adv, w, loss["clip_ratio_low"],
                                loss["clip_ratio_high"], loss.get("clip_ratio_c", 3.0))
            pg = agg(lt, keep, m, loss["loss_agg_mode"])
            pg.backward()
            out["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)))
            out["pg_loss"].append(float(pg.detach()))
            out["kept"].append([int(r) for r, k in zip(rows.tolist(), keep.sum(-1).tolist()) if k > 0])
            out["seq_weights"].append(None if w is None else w.max(-1).values.tolist())
            if rs is not None:
                stat, lo, hi = rs
                out["margin"].append(float(torch.minimum((stat - lo).abs(), (stat - hi).abs()).min()))
            opt.step()
    out["weights"] = {n: p.detach().clone() for n, p in model.state_dict().items()}
    return out
