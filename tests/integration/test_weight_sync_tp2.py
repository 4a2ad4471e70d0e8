"""Weight sync into a REAL SGLang server at TP=2 (CPU backend: two scheduler ranks, one core each through
``SGLANG_CPU_OMP_THREADS_BIND=0|1``; without it SGLang refuses more ranks than NUMA nodes).

The model has two KV heads, so q, k/v, gate/up, o/down and the padded vocabulary are all split over the two
ranks. KV-head replication (fewer KV heads than ranks) is NOT exercised against a real server: SGLang's CPU
backend pads the heads in that case (``adjust_config_with_unaligned_cpu_tp``) where its GPU path replicates
them; ``weight_layout.HeadSplit`` models the GPU rule.

* The trainer runs under torchrun's environment (``TORCHELASTIC_USE_AGENT_STORE=True``, ``MASTER_ADDR``,
  ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``): the weight-update group's store is the trainer's own.
* distributed sync: every server tensor afterwards equals the same server loading the checkpoint from disk
  (SGLang's own ``/weights_checker``, the independent reference), verification compares every TP shard of
  every tensor (``verified_param_frac == 1``).
* a k_proj perturbed in transit is named with the fused tensor and the TP ranks that hold it.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_weight_sync_tp2.py -q``
"""
import os

import pytest

from megatron_rl.rollout.sglang_server import find_free_port, launch_sglang_server, sglang_available
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import named_job
from megatron_rl.testing.sglang_script import load_from_disk, server_checksums
from megatron_rl.testing.tiny_hf import build_tiny_hf_model

_OK, _REASON = sglang_available()
pytestmark = [pytest.mark.skipif(not _OK, reason=_REASON), pytest.mark.slow]

# 2 KV heads: split over the 2 ranks. (With fewer KV heads than ranks, SGLang's CPU backend pads the heads
# (sglang.srt.configs.update_config.adjust_config_with_unaligned_cpu_tp, CPU only) instead of replicating
# them as its GPU path and weight_layout.HeadSplit do; that CPU-only layout is not modelled.)
ARCH = dict(arch="qwen2", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ws_tp2")
    return {"actor": build_tiny_hf_model(root / "actor", seed=1, **ARCH),
            "other": build_tiny_hf_model(root / "other", seed=2, **ARCH)}


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("ws_tp2_log") / "server.log")
    h = launch_sglang_server(models["other"], port=find_free_port(), device="cpu", max_total_tokens=2048,
                             extra_args=["--tp", "2"], env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"},
                             log_path=log, ready_timeout=600)
    yield h
    h.terminate()


def _checksums(url):
    ranks = server_checksums(url)
    assert len(ranks) == 2, ranks  # one entry per TP rank
    return ranks


#: the row's overrides: distributed sync in buckets of 0.02 MB, every tensor verified, bounded at 120 s (the
#: server's URL is the test's own; the job's is a placeholder)
DISTRIBUTED_SYNC = ("rollout.sglang_urls=[http://x:1]", "rollout.weight_sync_verify_tensors=-1",
                    "rollout.weight_sync_timeout_s=120", "rollout.weight_sync=distributed",
                    "rollout.weight_sync_bucket_mb=0.02")


def _body(rank, world, job, url, corrupt_name=None):
    from megatron_rl.actor import MegatronActor
    from megatron_rl.plan import actor_spec
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.rollout.base import WeightSyncError
    from megatron_rl.rollout.sglang_engine import SGLangEngine
    from megatron_rl.weight_sync.publisher import build_weight_publisher
    from megatron_rl.trainer.sync_settings import weight_sync_settings

    initialize_model_parallel(job.parallel, seed=3, model=job.model)
    actor = MegatronActor(actor_spec(job))
    # torchrun's rendezvous variables, its agent store at a port nobody serves
    os.environ.update({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port()), "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0", "GROUP_RANK": "0"})
    engine = SGLangEngine(url, weight_sync_timeout=job.rollout.weight_sync_timeout_s)

    def corrupt(bucket):
        for n, t in bucket.tensors():
            if n == corrupt_name:
                t.view(-1)[0] += 0.5

    try:
        publisher = build_weight_publisher(weight_sync_settings(job), actor, engine, corrupt=corrupt if corrupt_name else None)
        return {"metrics": publisher.publish("step-1")}
    except WeightSyncError as exc:
        return {"error": str(exc)}
    finally:
        engine.close()


@pytest.mark.timeout(900)
def test_distributed_sync_tp2_under_torchrun_env(models, server):
    url = server.url
    load_from_disk(url, models["actor"], "disk-ref")
    want = _checksums(url)
    load_from_disk(url, models["other"], "step-0")
    assert _checksums(url) != want
    job = named_job("sglang_actor", *DISTRIBUTED_SYNC, hf=models["actor"])
    out = run_ranks(_body, 1, job, url, timeout=800)[0]
    after = _checksums(url)
    diff = [(r, n) for r in range(2) for n in want[r] if after[r].get(n) != want[r][n]]
    assert not diff, (diff, out)  # every shard of every tensor == the server's own disk load
    assert "metrics" in out, out
    m = out["metrics"]
    assert m["weight_sync/verified"] == 1.0 and m["weight_sync/verified_param_frac"] == 1.0, m


@pytest.mark.timeout(900)
def test_corrupted_kv_named_with_tp_ranks(models, server):
    load_from_disk(server.url, models["other"], "step-0")
    job = named_job("sglang_actor", *DISTRIBUTED_SYNC, hf=models["actor"])
    name = "model.layers.1.self_attn.k_proj.weight"
    out = run_ranks(_body, 1, job, server.url, name, timeout=800)[0]
    err = out.get("error") or ""
    assert "verification failed" in err and "model.layers.1.self_attn.qkv_proj.weight" in err and name in err, out
    # two KV heads over two ranks: element 0 of k_proj is KV head 0's, held by TP rank 0 alone
    assert "TP rank 0" in err and "TP rank 1" not in err, err
    assert err.count("expected ") == 1, err
