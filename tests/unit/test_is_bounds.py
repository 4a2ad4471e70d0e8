"""``ISBounds.apply`` (the one IS bound of the correction) and ``CorrectionResult.loss_inputs`` (what the policy
loss uses per mode) against hand-written torch references."""
import pytest
import torch

from megatron_rl.correction import RolloutCorrectionConfig, compute_rollout_correction
from megatron_rl.correction.thresholds import parse_is_threshold

RAW = torch.tensor([[0.0, 0.2, 0.5, 1.0, 1.9999], [2.0, 2.0001, 3.0, 1e6, 0.4999]], dtype=torch.float64)


def _truncate(raw, c):
    return torch.minimum(raw, torch.full_like(raw, c))


def _mask(raw, lo, hi):
    keep = (raw >= lo) & (raw <= hi)
    return raw * keep.to(raw.dtype)


@pytest.mark.parametrize("spec,ref", [(2.0, lambda r: _truncate(r, 2.0)), ("0.5_2.0", lambda r: _mask(r, 0.5, 2.0)),
                                      (1.0, lambda r: _truncate(r, 1.0)), ("1_1", lambda r: _mask(r, 1.0, 1.0))],
                         ids=["truncate", "mask", "truncate-at-1", "mask-point"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_apply_truncates_or_masks_like_the_reference(spec, ref, dtype):
    b = parse_is_threshold(spec)
    for raw in (RAW.to(dtype), RAW[:, 1].to(dtype)):  # token level [B, T] and sequence level [B]
        got = b.apply(raw)
        assert got.dtype == dtype and got.shape == raw.shape
        assert torch.equal(got, ref(raw)), (got, ref(raw))
    assert b.apply(torch.zeros(0, dtype=dtype)).numel() == 0


def _lp(seed, B=4, T=6):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[1] = 0  # an empty row
    lr = -torch.rand(B, T, generator=g) * 2
    lt = lr + torch.randn(B, T, generator=g) * 0.8
    return lt.clamp(max=0.0), lr, mask


@pytest.mark.parametrize("spec", [2.0, "0.5_2.0"], ids=["truncate", "mask"])
def test_token_and_sequence_weights_follow_the_bound(spec):
    lt, lr, mask = _lp(0)
    lo, hi = (0.5, 2.0)
    ref = (lambda r: _truncate(r, hi)) if isinstance(spec, float) else (lambda r: _mask(r, lo, hi))
    d = (lt - lr).double()
    tok = compute_rollout_correction(lt, lr, mask, RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=spec))
    assert torch.allclose(tok.weights.double(), ref(torch.exp(d)) * mask, rtol=1e-6, atol=1e-7)
    seq = compute_rollout_correction(lt, lr, mask,
                                     RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=spec))
    per_seq = ref(torch.exp((d * mask).sum(1).clamp(-20, 20)))
    assert torch.allclose(seq.weights.double(), per_seq[:, None] * mask, rtol=1e-6, atol=1e-7)
    for res in (tok, seq):  # the empty row: 0 weights, no NaN anywhere
        assert not res.weights.isnan().any() and not res.weights[1].any()
        assert all(v == v for v in res.metrics.values())


# (bypass_mode, loss_type) -> (old policy is the rollout's, the loss applies the IS weights): verl's bypass table
MODES = {(False, "ppo_clip"): (False, True), (False, "reinforce"): (False, True), (False, "gspo"): (False, True),
         (True, "ppo_clip"): (True, False), (True, "vanilla"): (True, False), (True, "reinforce"): (True, True)}


@pytest.mark.parametrize("bypass,loss_type", list(MODES))
def test_loss_inputs_per_mode(bypass, loss_type):
    lt, lr, mask = _lp(1)
    res = compute_rollout_correction(lt, lr, mask, RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=2.0, bypass_mode=bypass, loss_type=loss_type))
    from_rollout, weighted = MODES[(bypass, loss_type)]
    assert (res.old_from_rollout, res.weights_in_loss) == (from_rollout, weighted)
    old, w = res.loss_inputs(lt, lr)
    assert old is (lr if from_rollout else lt)
    # bypass mode: the loss computes its weights from the current log-probs (correct_in_loss), none are given
    assert (w is res.weights) if weighted and not bypass else w is None
    with pytest.raises(ValueError, match="bypass_mode"):
        res.loss_inputs(None if not from_rollout else lt, None if from_rollout else lr)
