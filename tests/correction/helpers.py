"""Batch generators and comparison helpers shared by the correction tests."""
import math

import torch

from tests.correction.reference import reference

PREFIX = "rollout_corr/"


def make_batch(seed, B=12, T=16, spread=0.3, empty_rows=(3,), extreme=True, pad_garbage=True):
    """Random rollout / train log-probs with right padding, empty rows and out-of-clamp ratios."""
    g = torch.Generator().manual_seed(seed)
    lr = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4.0
    lt = (lr + spread * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0.0)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float32)
    for r in empty_rows:
        if r < B:
            mask[r] = 0
    if extreme and B > 1 and T > 1:
        lr[1, 0], lt[1, 0] = -45.0, -0.01   # log-ratio ~ +45: beyond the +-20 clamp
        lr[0, 1], lt[0, 1] = -0.02, -30.0   # log-ratio ~ -30
        mask[0, :2] = 1
        mask[1, 0] = 1
    if pad_garbage:  # padding may hold anything (NaN, inf, positive): it must be ignored
        lt = torch.where(mask.bool(), lt, torch.full_like(lt, float("nan")))
        lr = torch.where(mask.bool(), lr, torch.full_like(lr, 7.0))
    return lt.float(), lr.float(), mask


def check_against_reference(res, lt, lr, mask, cfg, rtol=1e-6, atol=1e-9):
    """Compare a CorrectionResult with the independent reference (weights, mask, every metric)."""
    ref_w, ref_mask, ref_m = reference(lt.double(), lr.double(), mask, **cfg.to_dict())
    assert res.response_mask.tolist() == [[float(x) for x in row] for row in ref_mask] or \
        res.response_mask.bool().tolist() == [[bool(x) for x in row] for row in ref_mask]
    if ref_w is None:
        assert res.weights is None
    else:
        assert res.weights.dtype == torch.float32 and not res.weights.requires_grad
        torch.testing.assert_close(res.weights.double(), torch.tensor(ref_w, dtype=torch.float64),
                                   rtol=2e-6, atol=1e-7)
    ratios = ref_m.pop("_ratios_sorted", None)
    got = dict(res.metrics)
    for k, v in ref_m.items():
        key = PREFIX + k
        assert key in got, f"missing metric {key}"
        assert math.isfinite(got[key]), f"{key} = {got[key]}"
        # std = sqrt(E[x^2] - E[x]^2): the cancellation leaves ~sqrt(eps)*|x| absolute noise near 0
        tol = max(atol, 1e-6) if key.endswith("_std") else atol
        assert math.isclose(got[key], v, rel_tol=rtol, abs_tol=tol), f"{key}: got {got[key]!r}, reference {v!r}"
    extra = set(got) - {PREFIX + k for k in ref_m} - {PREFIX + f"rollout_is_p{q}" for q in (50, 90, 99)}
    assert not extra, f"metrics without reference: {sorted(extra)}"
    if ratios is not None:
        check_quantiles(got, ratios)
    return ref_m


def check_quantiles(metrics, ratios_sorted):
    """Histogram quantiles lie within the documented half-bin bound of the inverted-CDF quantile."""
    n = len(ratios_sorted)
    for q in (0.5, 0.9, 0.99):
        est = metrics[PREFIX + f"rollout_is_p{int(q * 100)}"]
        if n == 0:
            assert est == 0.0
            continue
        true = ratios_sorted[max(1, math.ceil(q * n - 1e-9)) - 1]
        lt = math.log(true)
        tol = 1e-3 * math.cosh(math.asinh(abs(lt) / 1e-3) + 5e-3) * 5e-3 / 2 + 1e-12
        assert abs(math.log(est) - lt) <= tol, f"p{int(q*100)}: {est} vs {true}"
