"""GRPO / RLOO advantages vs a plain-Python reference (statistics module, explicit loops), including the
post-rejection mask, baseline_over="all" vs "kept", size-1 groups and bad input.

Run: ``OMP_NUM_THREADS=1 pytest tests/unit/test_advantages.py -q``
"""
from __future__ import annotations

import math
import random
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algo import compute_advantages, group_advantage_scalars


def reference_scalars(rewards, groups, estimator, norm, eps=1e-6, include=None):
    """Plain Python: per group of included samples, GRPO (statistics.stdev = unbiased) or RLOO."""
    include = include or [True] * len(rewards)
    out = []
    for i, (r, g) in enumerate(zip(rewards, groups)):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == g and include[j]]
        if not include[i] or len(members) < 2:
            out.append(0.0)
            continue
        mean = sum(members) / len(members)
        if estimator == "grpo":
            a = r - mean
            if norm:
                a = a / (statistics.stdev(members) + eps)
        else:
            others = list(members)
            others.remove(r)
            a = r - sum(others) / len(others)
        out.append(a)
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.floats(-3, 3, allow_nan=False)), min_size=1, max_size=24),
       st.sampled_from(["grpo", "rloo"]), st.booleans())
def test_scalars_match_plain_python(pairs, estimator, norm):
    groups = [g for g, _ in pairs]
    rewards = [r for _, r in pairs]
    got = group_advantage_scalars(torch.tensor(rewards), groups, estimator, norm_adv_by_std=norm)
    want = reference_scalars(rewards, groups, estimator, norm)
    for a, b in zip(got.tolist(), want):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-4), (a, b)


def test_verl_semantics_examples():
    # group {0: [1, 0, 0, 1]}: mean 0.5, unbiased std = sqrt(1/3)
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    g = torch.tensor([7, 7, 7, 7, 3, 3])
    adv = group_advantage_scalars(r, g, "grpo")
    s = math.sqrt(1 / 3)
    a = 0.5 / (s + 1e-6)
    assert torch.allclose(adv, torch.tensor([a, -a, -a, a, 0.0, 0.0]), atol=1e-6)
    # RLOO = n/(n-1) (r - mean)
    rl = group_advantage_scalars(r, g, "rloo")
    b = 4 / 3 * 0.5
    assert torch.allclose(rl[:4], torch.tensor([b, -b, -b, b]), atol=1e-6)


def test_size_one_groups_get_zero():
    r = torch.tensor([5.0, 1.0, 2.0])
    for est in ("grpo", "rloo"):
        adv = group_advantage_scalars(r, ["a", "b", "b"], est)
        assert adv[0] == 0.0 and adv[1] != 0.0


def test_string_uids_and_noncontiguous_groups():
    r = [0.1, 0.9, 0.5, 0.3, 0.7]
    g = ["p1", "p2", "p1", "p2", "p1"]
    got = group_advantage_scalars(torch.tensor(r), g, "grpo")
    want = reference_scalars(r, g, "grpo", True)
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float32), atol=1e-5)


def test_broadcast_with_post_rejection_mask_all_samples_baseline():
    """Rejected tokens (mask 0) get zero advantage; group statistics use every sample (default)."""
    rng = random.Random(0)
    B, T = 8, 6
    rewards = [float(rng.randint(0, 1)) + rng.random() for _ in range(B)]
    groups = [i // 4 for i in range(B)]
    mask = torch.ones(B, T)
    mask[0, 3:] = 0  # response end
    mask[1, 1] = 0  # a rejected token
    mask[2] = 0  # a fully rejected sequence
    adv = compute_advantages(torch.tensor(rewards), groups, mask, "grpo")
    want = reference_scalars(rewards, groups, "grpo", True)
    for i in range(B):
        for t in range(T):
            assert math.isclose(float(adv[i, t]), want[i] * float(mask[i, t]), abs_tol=1e-5)
    assert adv[2].abs().sum() == 0 and adv[1, 1] == 0


def test_kept_only_baseline():
    """baseline_over="kept": fully rejected sequences leave the group statistics."""
    rewards = [1.0, 0.0, 0.5, 0.2, 0.9, 0.4]
    groups = [0, 0, 0, 1, 1, 1]
    mask = torch.ones(6, 4)
    mask[1] = 0
    mask[3] = 0
    mask[4] = 0  # group 1 has a single kept sample -> all zero
    include = [bool(m.sum() > 0) for m in mask]
    for est in ("grpo", "rloo"):
        got = compute_advantages(torch.tensor(rewards), groups, mask, est, baseline_over="kept")
        want = reference_scalars(rewards, groups, est, True, include=include)
        assert torch.allclose(got, torch.tensor(want).unsqueeze(-1) * mask, atol=1e-5)
        assert got[3:].abs().sum() == 0
        all_ = compute_advantages(torch.tensor(rewards), groups, mask, est, baseline_over="all")
        assert not torch.allclose(all_[0], got[0])  # the excluded reward changed the baseline


def test_equal_rewards_give_zero_and_no_std_option():
    r = torch.tensor([0.3, 0.3, 0.3, 1.0, 0.0])
    g = [0, 0, 0, 1, 1]
    adv = group_advantage_scalars(r, g, "grpo")
    assert adv[:3].abs().max() == 0
    adv = group_advantage_scalars(r, g, "grpo", norm_adv_by_std=False)
    assert torch.allclose(adv[3:], torch.tensor([0.5, -0.5]))


@pytest.mark.parametrize("kwargs,needle", [
    (dict(rewards=torch.tensor([[1.0]])), r"rewards must be \[B=2\]"),
    (dict(rewards=torch.tensor([1.0, float("nan")])), "non-finite values at indices \\[1\\]"),
    (dict(estimator="ppo"), "advantage_estimator='ppo'"),
    (dict(group_index=[0]), "sequence of 2 group ids"),
    (dict(group_index=torch.tensor([0.0, 1.0])), "integer tensor"),
    (dict(response_mask=torch.ones(3, 2)), "match response_mask"),
    (dict(response_mask=torch.full((2, 2), 0.5)), "only 0 and 1"),
    (dict(baseline_over="some"), "baseline_over"),
])
def test_bad_input(kwargs, needle):
    args = dict(rewards=torch.tensor([1.0, 0.0]), group_index=[0, 0], response_mask=torch.ones(2, 2),
                estimator="grpo", baseline_over="all")
    args.update(kwargs)
    with pytest.raises(ValueError, match=needle):
        compute_advantages(**args)
