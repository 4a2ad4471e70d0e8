"""A LoRA job (``actor.lora``) through the real RL loop on the copy task (one rank, embedded bf16 engine): merged
sync with delta sync (sync rollouts: checksums verified every step) and adapter-only sync under async rollouts
(staleness 1: the producer applies and probe-verifies each version later) both train, and the rollouts' log-probs
are the trainer's at the version that made them (the correction's k3 KL between them stays at bf16 rounding);
adapter-only moves a fraction of merged sync's bytes."""
import json
import os

import pytest

from megatron_rl.tasks.char_tokenizer import build_task_model
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import named_job, train_or_error

pytestmark = pytest.mark.timeout(400)
LORA = "actor.lora={rank: 4, alpha: 8}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_task_model(str(tmp_path_factory.mktemp("m") / "m"), task="copy", seed=0, hidden_size=64,
                            num_layers=2)


def _train(rank, world, cfg):
    return train_or_error(cfg)


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def test_lora_job_syncs_merged_and_adapter_only(model_dir, tmp_path):
    merged, adapter = str(tmp_path / "merged"), str(tmp_path / "adapter")
    cfg = named_job("async_copy", LORA, "rollout.lora_sync=merged", "rollout.weight_sync_delta=true",
                    "trainer.steps=2", hf=model_dir, run_dir=merged, world_size=1)
    assert run_ranks(_train, 1, cfg, timeout=300) == [None]
    cfg = named_job("async_copy", LORA, "rollout.lora_sync=adapter", "rollout.mode=async", "rollout.max_staleness=1",
                    "trainer.steps=2", hf=model_dir, run_dir=adapter, world_size=1)
    assert run_ranks(_train, 1, cfg, timeout=300) == [None]
    m, a = _metrics(merged), _metrics(adapter)
    assert len(m) == len(a) == 2
    assert all(s["weight_sync/verified"] == 1.0 for s in m)
    assert all(0 < s["weight_sync/bytes"] < 0.5 * m[0]["weight_sync/bytes"] for s in a)
    for s in m + a:  # rollout vs trainer log-probs of the tokens each version generated
        lag = [k for k in s if k.startswith("rollout_corr/lag") and k.endswith("_k3_kl") and "lagged" not in k]
        assert lag and all(abs(s[k]) < 1e-3 for k in lag), {k: s[k] for k in lag}
