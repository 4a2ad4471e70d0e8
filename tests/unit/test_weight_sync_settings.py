"""``WeightSyncSettings``: a job's weight-sync choices read once from its ``rollout`` section -- "auto" is the engine
class's declared default (sync or async rollouts), every other value as written."""
import os

import pytest

from megatron_rl.config import job_config_from_dict
from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.rollout.sglang_engine import SGLangEngine
from megatron_rl.trainer.sync_settings import weight_sync_settings


@pytest.mark.parametrize("engine,mode,cls", [("embedded", "sync", EmbeddedEngine), ("embedded", "async", EmbeddedEngine),
                                             ("sglang", "sync", SGLangEngine), ("sglang", "async", SGLangEngine)])
def test_auto_is_the_engine_class_default(engine, mode, cls):
    job = job_config_from_dict({"rollout": {"engine": engine, "mode": mode, "sglang_urls": ["http://h:1"]}})
    s = weight_sync_settings(job)
    assert s.mode.name == cls.sync_capabilities.default(async_rollouts=mode == "async")
    assert s.deferred_modes == cls.sync_capabilities.deferred and s.engine == engine


def test_every_other_value_as_written(tmp_path):
    job = job_config_from_dict({"trainer": {"run_dir": str(tmp_path)},
                                "rollout": {"engine": "sglang", "sglang_urls": ["http://h:1"], "weight_sync": "tensor",
                                            "weight_sync_bucket_mb": 3, "weight_sync_timeout_s": 17,
                                            "weight_sync_verify_interval": 4, "weight_sync_verify_tensors": -1,
                                            "weight_sync_delta": True}})
    s = weight_sync_settings(job)
    assert (s.mode.name, s.bucket_bytes, s.timeout_s, s.verify_interval, s.verify_tensors, s.delta) == \
        ("tensor", 3 * 2**20, 17.0, 4, -1, True)
    assert s.export_dir == os.path.join(str(tmp_path), "weight_sync")
    assert [v for v in range(9) if s.due(v)] == [0, 4, 8]
    master = job_config_from_dict({"rollout": {"engine": "sglang", "sglang_urls": ["http://h:1"],
                                               "weight_sync": "distributed",
                                               "weight_sync_master_address": "10.0.0.7"}})
    assert weight_sync_settings(master).mode.master_address == "10.0.0.7"
