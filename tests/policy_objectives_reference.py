"""Single-process transcriptions of the peers' policy objectives, for ``tests/*/test_losses_objectives*.py``.

Transcribed line by line (no megatron_rl code) from:
  * verl 0.9.1, ``verl/trainer/ppo/core_algos.py``: ``agg_loss`` and ``compute_policy_loss_vanilla``,
    ``_dppo_tv``, ``_dppo_kl``, ``_gspo``, ``_sapo``, ``_gpg``, ``_clip_cov``, ``_kl_cov``, ``_geo_mean``,
    ``_dro``, ``_cispo``, ``compute_policy_loss_reinforce``; ``verl/utils/torch_functional.py``:
    ``masked_mean`` / ``masked_sum``. Single process: ``dp_size=1``, no global batch info.
  * slime, ``slime/utils/ppo_utils.py``: ``compute_opsm_mask`` and ``compute_policy_loss`` (applied as in
    ``slime/backends/megatron_utils/loss.py``: ``pg_loss * opsm_mask``).
  * AReaL, ``areal/trainer/ppo/actor.py``: ``_apply_m2po_masking`` / ``_get_m2po_loss_mask``.
Each function returns (loss, metrics) like the original; metric keys without the ``actor/`` prefix.
``rollout_is_weights`` multiply the per-token loss as in verl. Clip-Cov's random choice is replaced by
"all candidates" (tests use a ratio that admits every candidate, where verl's choice is not random).
"""
import torch


class Cfg:
    """verl's ActorConfig / PolicyLossConfig fields the objectives read (verl 0.9.1 defaults)."""

    def __init__(self, **kw):
        self.clip_ratio = 0.2
        self.clip_ratio_low = 0.2
        self.clip_ratio_high = 0.2
        self.clip_ratio_c = 3.0
        self.tau_pos, self.tau_neg = 1.0, 1.05
        self.clip_cov_ratio, self.clip_cov_lb, self.clip_cov_ub = 0.0002, 1.0, 5.0
        self.kl_cov_ratio, self.ppo_kl_coef, self.dro_beta = 0.0002, 0.1, None
        self.opsm_delta, self.m2_threshold = 1e-4, None
        self.__dict__.update(kw)

    def get(self, k, default):
        return getattr(self, k, default)


def masked_sum(values, mask, axis=None):
    v = torch.where(mask.bool(), values, torch.zeros_like(values))
    return v.sum() if axis is None else v.sum(axis)


def masked_mean(values, mask, axis=None):
    return masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def agg_loss(loss_mat, loss_mask, loss_agg_mode, loss_scale_factor=None):
    if loss_agg_mode == "token-mean":
        return masked_sum(loss_mat, loss_mask) / loss_mask.sum()
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask)
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        loss = masked_sum(seq_losses, seq_mask) / seq_mask.sum()
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    if loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        return masked_sum(seq_losses, seq_mask) / seq_mask.sum()
    raise ValueError(loss_agg_mode)


def _w(pg, w):
    return pg if w is None else pg * w


def vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None,
            loss_scale_factor=None):
    nak = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(nak)
    ppo_kl = masked_mean(-nak, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * config.clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_losses = _w(pg_losses, rollout_is_weights)
    return agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor), dict(
        pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=pg_clipfrac_lower)


def _dppo(kind, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None,
          loss_scale_factor=None):
    lo, hi = config.clip_ratio_low, config.clip_ratio_high
    nak = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(nak)
    ppo_kl = masked_mean(-nak, response_mask)
    clip_ratio_c = config.get("clip_ratio_c", 20.0)
    truncated_ratio = torch.clamp(ratio, max=clip_ratio_c).detach()
    prob = torch.exp(log_prob)
    old_prob = torch.exp(old_log_prob)
    if kind == "tv":
        valid_positive_mask = (prob - old_prob) <= hi
        valid_negative_mask = (prob - old_prob) >= -lo
    else:
        binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        valid_positive_mask = (binary_kl <= hi) | (prob <= old_prob)
        valid_negative_mask = (binary_kl <= lo) | (prob >= old_prob)
    valid_mask = torch.where(advantages > 0, valid_positive_mask, valid_negative_mask).detach().float()
    pg_losses = -advantages * truncated_ratio * log_prob * valid_mask
    pg_losses = _w(pg_losses, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor)
    return loss, dict(pg_clipfrac=masked_mean((1.0 - valid_mask).float(), response_mask), ppo_kl=ppo_kl,
                      pg_clipfrac_lower=masked_mean((ratio > clip_ratio_c).float() * valid_mask, response_mask))


def dppo_tv(*a, **k):
    return _dppo("tv", *a, **k)


def dppo_kl(*a, **k):
    return _dppo("kl", *a, **k)


def gspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None,
         loss_scale_factor=None):
    nak = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    nak_seq = torch.sum(nak * response_mask, dim=-1) / seq_lengths
    log_sir = log_prob - log_prob.detach() + nak_seq.detach().unsqueeze(-1)
    log_sir = torch.clamp(log_sir, max=10.0)
    sir = torch.exp(log_sir)
    pg_losses1 = -advantages * sir
    pg_losses2 = -advantages * torch.clamp(sir, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    pg_losses = _w(torch.maximum(pg_losses1, pg_losses2), rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor)
    return loss, dict(pg_clipfrac=masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask),
                      ppo_kl=masked_mean(-nak, response_mask), pg_clipfrac_lower=torch.tensor(0.0))


def sapo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None,
         loss_scale_factor=None):
    tau_pos = torch.as_tensor(config.tau_pos, dtype=advantages.dtype)
    tau_neg = torch.as_tensor(config.tau_neg, dtype=advantages.dtype)
    nak = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(nak)
    taus = torch.where(advantages > 0, tau_pos, tau_neg)
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    pg_losses = _w(-gates * advantages, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean")
    return loss, dict(pg_clipfrac=torch.tensor(0.0), ppo_kl=masked_mean(-nak, response_mask),
                      pg_clipfrac_lower=torch.tensor(0.0))


def gpg(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None,
        loss_scale_factor=None):
    pg_losses = _w(-log_prob * advantages, rollout_is_weights)
    return agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor), {}


def clip_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None,
             loss_scale_factor=None):
    """verl's clip_cov with the random permutation dropped: every candidate up to clip_num is taken in
    index order (tests choose clip_cov_ratio so that clip_num >= the number of candidates)."""
    nak = log_prob - old_log_prob
    ratio = torch.exp(nak)
    ppo_kl = masked_mean(-nak, response_mask)
    pg_losses1 = -advantages * ratio
    corr = torch.ones_like(advantages)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)
    cov_all = (advantages - masked_mean(advantages, response_mask)) * (
        log_prob - masked_mean(log_prob.detach(), response_mask))
    cov_all = cov_all.detach().clone()
    cov_all[response_mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(config.clip_cov_ratio * response_mask.sum().item()), 1)
    top_k_idx = torch.nonzero((cov_all < config.clip_cov_ub) & (cov_all > config.clip_cov_lb) & (response_mask > 0))
    top_k_idx = top_k_idx[: min(clip_num, len(top_k_idx))]
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    pg_clipfrac = masked_mean((corr == 0).float(), response_mask)
    pg_losses = _w(torch.maximum(pg_losses1, pg_losses2) * corr, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor)
    return loss, dict(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, n_candidates=len(top_k_idx), clip_num=clip_num)


def kl_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None,
           loss_scale_factor=None):
    nak = log_prob - old_log_prob
    abs_kl = nak.abs()
    ratio = torch.exp(nak)
    ppo_kl_abs = masked_mean(nak.abs(), response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = -advantages * ratio + config.ppo_kl_coef * abs_kl
    pg_losses = pg_losses1.clone()
    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = log_prob[all_valid].detach().reshape(-1).cpu()
    k = min(config.kl_cov_ratio, len(all_valid_adv))
    if k != 0:
        cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
        k_percent_nums = max(1, int(len(cov_lst_all) * config.kl_cov_ratio))
        large_cov_idxs = torch.topk(cov_lst_all, k_percent_nums, largest=True).indices
        if len(large_cov_idxs) != 0:
            large_cov_idxs = all_valid_idx[large_cov_idxs]
            r, c = large_cov_idxs // advantages.shape[1], large_cov_idxs % advantages.shape[1]
            pg_losses[r, c] = pg_losses_kl[r, c]
    pg_losses = _w(pg_losses, rollout_is_weights)
    return agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor), dict(ppo_kl=ppo_kl_abs)


def geo_mean(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None,
             loss_scale_factor=None):
    nak = log_prob - old_log_prob
    ppo_kl = masked_mean(-nak, response_mask)
    sgn_advantage = torch.sign(advantages)
    nak_clamp = torch.clamp(nak, -config.clip_ratio_low, config.clip_ratio_high)
    nak_min = sgn_advantage * torch.min(sgn_advantage * nak, sgn_advantage * nak_clamp)
    response_mask_sum = response_mask.sum(dim=-1)
    ratio = torch.exp((nak_min * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8))
    advantage = (advantages * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    pg_losses = -advantage * ratio
    if rollout_is_weights is not None:
        seq_is_weights = torch.exp(
            (torch.log(rollout_is_weights + 1e-10) * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8))
        pg_losses = pg_losses * seq_is_weights
    pg_loss = torch.mean(pg_losses)
    clipped = torch.ne(nak, nak_clamp)
    return pg_loss, dict(pg_clipfrac=masked_mean((clipped * (advantages > 0)).float(), response_mask),
                         ppo_kl=ppo_kl,
                         pg_clipfrac_lower=masked_mean((clipped * (advantages < 0)).float(), response_mask))


def dro(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None,
        loss_scale_factor=None):
    beta = config.dro_beta
    log_ratio = log_prob - old_log_prob
    pg_losses = _w(-(log_prob * advantages - 0.5 * beta * log_ratio.square()), rollout_is_weights)
    return agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor), dict(
        ppo_kl=masked_mean(-log_ratio, response_mask))


def cispo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None,
          loss_scale_factor=None):
    nak = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(nak)
    ppo_kl = masked_mean(-nak, response_mask)
    clipped_ratio = torch.clamp(ratio, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
    pg_clipfrac = masked_mean((ratio != clipped_ratio).float(), response_mask)
    pg_losses = _w(pg_losses, rollout_is_weights)
    return agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor), dict(
        pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=torch.tensor(0.0))


def reinforce(rollout_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None,
              loss_scale_factor=None):
    pg_losses = -advantages * log_prob * (1.0 if rollout_is_weights is None else rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor)
    return loss, dict(ppo_kl=masked_mean(-(log_prob - rollout_log_prob), response_mask))


def opsm(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None,
         loss_scale_factor=None):
    """slime: per sample, seq_kl = sum((old - logp) * mask) / max(mask.sum(), 1); mask = (A < 0) &
    (seq_kl > opsm_delta); pg_loss (PPO-clip with eps_clip_c) * (1 - mask), then the IS weights."""
    opsm_rows = []
    for lp, olp, a, m in zip(log_prob, old_log_prob, advantages, response_mask):
        seq_kl = ((olp - lp) * m).sum() / torch.clamp_min(m.sum(), 1)
        opsm_rows.append(1 - ((a < 0) & (seq_kl > config.opsm_delta)).float())
    opsm_mask = torch.stack(opsm_rows)
    ppo_kl = old_log_prob - log_prob
    ratio = (-ppo_kl).exp()
    pg_losses1 = -ratio * advantages
    pg_losses2 = -ratio.clamp(1 - config.clip_ratio_low, 1 + config.clip_ratio_high) * advantages
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    clipfrac = torch.gt(pg_losses2, pg_losses1).float()
    pg_losses3 = -config.clip_ratio_c * advantages
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_losses = _w(pg_losses * opsm_mask, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor)
    return loss, dict(pg_clipfrac=masked_mean(clipfrac, response_mask), ppo_kl=masked_mean(ppo_kl, response_mask),
                      opsm_clipfrac=masked_mean(1 - opsm_mask, response_mask))


def m2po_loss_mask(old_logp, prox_logp, loss_mask, m2_threshold):
    """AReaL ``_apply_m2po_masking`` (old_logp = behaviour/rollout, prox_logp = recomputed old)."""
    delta = old_logp - prox_logp
    m2 = delta * delta
    mask_flat = loss_mask.view(-1)
    m2_selected = m2.view(-1)[mask_flat]
    if m2_selected.numel() == 0:
        return loss_mask
    sorted_m2, indices = torch.sort(m2_selected, descending=True)
    restored_indices = torch.argsort(indices)
    n = sorted_m2.numel()
    suffix_sums = sorted_m2.flip(0).cumsum(0).flip(0)
    counts = torch.arange(n, 0, -1, dtype=sorted_m2.dtype)
    avg_m2_suffix = suffix_sums / counts
    below = torch.where(avg_m2_suffix < m2_threshold)[0]
    num_to_mask = below[0].item() if len(below) > 0 else n - 1
    keep = torch.ones_like(sorted_m2, dtype=torch.bool)
    if num_to_mask > 0:
        keep[:num_to_mask] = False
    full = torch.zeros_like(mask_flat, dtype=torch.bool)
    full[mask_flat] = keep[restored_indices]
    return full.view_as(loss_mask)


VERL = {"vanilla": vanilla, "ppo_clip": vanilla, "dppo_tv": dppo_tv, "dppo_kl": dppo_kl, "gspo": gspo,
        "sapo": sapo, "gpg": gpg, "clip_cov": clip_cov, "kl_cov": kl_cov, "geo_mean": geo_mean, "dro": dro,
        "cispo": cispo, "reinforce": reinforce, "opsm": opsm}
"""loss type -> reference function (opsm: slime's)."""
