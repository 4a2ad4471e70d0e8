"""The plan's reward checks (plan/reward_checks.py): a reward from a model beside ``data.val_files`` is refused
naming the key. Validation files are scored by a FileTask with the rule reward (tasks/val_set.py), never by the
judge or the RM, so ``val/reward_mean`` would measure another reward than training's -- silently."""
from __future__ import annotations

import pytest

from megatron_rl.config.load import build_job_config
from megatron_rl.plan.reward_checks import reward_errors_of_job


def _cfg(tmp_path, reward, **data):
    cfg, _ = build_job_config({"reward": reward, "data": data})
    return cfg


@pytest.mark.parametrize("reward, key", [
    ({"judge": {"enable": True, "urls": ["http://judge:30100"]}}, "reward.judge.enable"),
    ({"model": {"enable": True, "path": "/rm", "backend": "sglang", "urls": ["http://rm:30010"]}},
     "reward.model.enable"),
])
def test_val_files_beside_a_model_reward_are_refused(tmp_path, reward, key):
    val = tmp_path / "val.jsonl"
    val.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    errs = reward_errors_of_job(_cfg(tmp_path, reward, val_files=str(val)))
    hits = [e for e in errs if e.startswith("data.val_files")]
    assert len(hits) == 1 and key.split(".")[1] in hits[0], errs
    assert not [e for e in reward_errors_of_job(_cfg(tmp_path, reward)) if e.startswith("data.val_files")]
