"""``losses.compute_value_loss`` against verl 0.9.1's own ``compute_value_loss`` (the vendored core_algos, run through
``tests/verl_core_algos.py``) in every aggregation mode, with the clip active on some tokens; and the global
denominators: micro-batch losses summed equal the whole batch's, gradients included."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.losses import global_denominators
from megatron_rl.losses.config import LOSS_AGG_MODES
from megatron_rl.losses.value import compute_value_loss
from tests.verl_core_algos import verl_core_algos


@pytest.fixture(scope="module")
def verl():
    with verl_core_algos() as ca:
        yield ca


def _data(seed, B=6, T=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    mask[0, 1] = 0.0  # a masked token inside a row (an environment token)
    vpreds = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = vpreds + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    returns = torch.randn(B, T, generator=g, dtype=torch.float64)
    return vpreds, values, returns, mask.double()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
def test_matches_verl(verl, seed, agg):
    vpreds, values, returns, mask = _data(seed)
    scale = 7.0 if agg == "seq-mean-token-sum-norm" else None
    a = vpreds.clone().requires_grad_(True)
    want, want_cf = verl.compute_value_loss(a, returns, values, mask, 0.3, loss_agg_mode=agg,
                                            loss_scale_factor=scale)
    want.backward()
    b = vpreds.clone().requires_grad_(True)
    got = compute_value_loss(b, returns, values, mask, 0.3, agg, loss_scale_factor=scale)
    got.loss.backward()
    assert 0.0 < float(want_cf) < 1.0
    # verl's seq-mean-token-mean divides each row by (its tokens + 1e-8): equal to ~1e-8 relative
    torch.testing.assert_close(got.loss, want, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-7, atol=1e-10)
    # verl divides by (count + 1e-8)
    assert got.metrics["vf_clipfrac"].mean() == pytest.approx(float(want_cf), rel=1e-8)


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
def test_micro_batches_with_global_denominators_sum_to_the_batch(agg):
    vpreds, values, returns, mask = _data(7, B=8)
    whole = compute_value_loss(vpreds, returns, values, mask, 0.3, agg, loss_scale_factor=7.0).loss
    den = global_denominators(mask)
    parts = sum(compute_value_loss(vpreds[s:e], returns[s:e], values[s:e], mask[s:e], 0.3, agg, den,
                                   loss_scale_factor=7.0).loss for s, e in ((0, 3), (3, 4), (4, 8)))
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-12)


def test_refuses_bad_clip_and_shapes():
    vpreds, values, returns, mask = _data(1)
    with pytest.raises(ValueError, match="critic.cliprange_value"):
        compute_value_loss(vpreds, returns, values, mask, 0.0)
    with pytest.raises(ValueError, match="returns has shape"):
        compute_value_loss(vpreds, returns[:, :3], values, mask, 0.2)
