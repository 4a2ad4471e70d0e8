"""``migrate verl`` of a reward model beside a custom reward function. verl 0.9.1's reward loop
(verl/experimental/reward_loop/reward_loop.py, ``RewardLoopWorker.compute_score``) scores with the custom function
alone when ``custom_reward_function.path`` is set, reward model or not (a GenRM / hybrid reward calls the RM from the
function); only without one does the RM's score become the reward. The migrated job must not silently score with
the RM alone: the pair is refused (exit 3), naming both keys."""
from __future__ import annotations

import pytest

from megatron_rl.config.migrate_verl import migrate_verl, with_verl_defaults
from megatron_rl.config.verl_keys import MAPPED, UNSUPPORTED
from megatron_rl.config.verl_versions import VERL_VERSIONS


def _migrate(tree, version):
    merged, said = with_verl_defaults(tree, version)
    return migrate_verl(merged, version, said)


def _legacy(fn):
    tree = {"reward_model": {"enable": True, "model": {"path": "/rm"}}}
    if fn:
        tree["custom_reward_function"] = {"path": "reward.py", "name": "compute_score"}
    return tree, "reward_model.enable"


def _reward_loop(fn):
    tree = {"reward": {"reward_model": {"enable": True, "model_path": "/rm"}}}
    if fn:
        tree["reward"]["custom_reward_function"] = {"path": "reward.py", "name": "compute_score"}
    return tree, "reward.reward_model.enable"


@pytest.mark.parametrize("version", VERL_VERSIONS)
@pytest.mark.parametrize("spelling", [_legacy, _reward_loop])
def test_reward_model_beside_a_custom_function_is_refused(version, spelling):
    tree, key = spelling(True)
    m = _migrate(tree, version)
    [e] = [e for e in m.entries if e.key == key]
    assert e.kind == UNSUPPORTED and "custom_reward_function" in e.detail
    assert e in m.differences()
    assert not (m.tree.get("reward", {}).get("model", {}) or {}).get("enable")


@pytest.mark.parametrize("version", VERL_VERSIONS)
@pytest.mark.parametrize("spelling", [_legacy, _reward_loop])
def test_reward_model_alone_still_maps(version, spelling):
    tree, key = spelling(False)
    m = _migrate(tree, version)
    [e] = [e for e in m.entries if e.key == key]
    assert e.kind == MAPPED and m.tree["reward"]["model"]["enable"] is True
