"""``migrate verl`` of verl's reward-model keys (issue 50): the legacy ``reward_model.*`` block (verl <= 0.8 run
scripts, still in 0.9.1's generated config as nulls) and 0.9.1 / main's ``reward.reward_model.*``. The verl names
and their meaning are read off verl's generated defaults bundled in ``megatron_rl/config/verl_defaults/``."""
from __future__ import annotations

import pytest

from megatron_rl.config.load import build_job_config
from megatron_rl.config.migrate_verl import UNCHANGED, migrate_verl, with_verl_defaults
from megatron_rl.config.verl_keys import MAPPED, NO_MEANING, SERVER, UNSUPPORTED
from megatron_rl.config.verl_versions import VERL_VERSIONS, verl_defaults


def _migrate(tree, version="0.9.1"):
    merged, said = with_verl_defaults(tree, version)
    return migrate_verl(merged, version, said)


def _entry(m, key):
    [e] = [e for e in m.entries if e.key == key]
    return e


@pytest.mark.parametrize("version", VERL_VERSIONS)
def test_the_bundled_defaults_name_the_keys_mapped_here(version):
    """The keys this mapping reads exist in verl's generated config (so the rules match real files)."""
    d = verl_defaults(version, "fsdp")
    assert "enable" in d["reward"]["reward_model"] and "model_path" in d["reward"]["reward_model"]
    assert "name" in d["reward"]["reward_model"]["rollout"]
    assert "enable" in d["reward_model"] and "path" in d["reward_model"]["model"]


@pytest.mark.parametrize("version", VERL_VERSIONS)
def test_rm_off_by_default_writes_no_reward_section(version):
    m = _migrate({}, version)
    assert "reward" not in m.tree
    for key in ("reward.reward_model.enable", "reward.reward_model.model_path", "reward.reward_model.rollout.name"):
        assert _entry(m, key).kind == UNCHANGED, key


def test_legacy_reward_model_block_maps_its_counterparts():
    m = _migrate({"reward_model": {"enable": True, "model": {"path": "/models/skywork-rm", "input_tokenizer": "x",
                                                              "trust_remote_code": True},
                                   "micro_batch_size_per_gpu": 8, "use_dynamic_bsz": True,
                                   "forward_max_token_len_per_gpu": 6000, "strategy": "fsdp",
                                   "reward_manager": "naive", "max_length": 4096}})
    rm = m.tree["reward"]["model"]
    assert rm == {"enable": True, "backend": "sglang", "path": "/models/skywork-rm", "max_rows_per_batch": 8,
                  "max_tokens_per_batch": 6000}
    assert "reward.model.urls" in _entry(m, "reward_model.enable").detail
    assert _entry(m, "reward_model.model.trust_remote_code").kind == UNSUPPORTED
    assert _entry(m, "reward_model.model.input_tokenizer").kind == NO_MEANING
    assert _entry(m, "reward_model.strategy").kind == NO_MEANING
    assert _entry(m, "reward_model.max_length").kind == UNSUPPORTED       # no truncation of RM inputs here
    # the migrated job refuses to start until the RM server is named: a clear decision, the key named
    cfg, _ = build_job_config(m.tree)
    assert any(p.startswith("reward.model.urls") for p in cfg.reward.errors())


def test_token_budget_only_with_dynamic_batches():
    m = _migrate({"reward_model": {"enable": True, "model": {"path": "/rm"}, "use_dynamic_bsz": False,
                                   "forward_max_token_len_per_gpu": 6000}})
    assert "max_tokens_per_batch" not in m.tree["reward"]["model"]
    assert "use_dynamic_bsz is off" in _entry(m, "reward_model.forward_max_token_len_per_gpu").detail


@pytest.mark.parametrize("server, kind", [("sglang", UNCHANGED), ("vllm", UNSUPPORTED)])
def test_reward_loop_reward_model_block(server, kind):
    m = _migrate({"reward": {"reward_model": {"enable": True, "model_path": "/rm",
                                              "rollout": {"name": server, "tensor_model_parallel_size": 2}}}})
    assert m.tree["reward"]["model"] == {"enable": True, "backend": "sglang", "path": "/rm"}
    assert _entry(m, "reward.reward_model.rollout.name").kind == kind
    assert _entry(m, "reward.reward_model.rollout.tensor_model_parallel_size").kind == SERVER
    assert _entry(m, "reward.reward_model.enable").kind == MAPPED
