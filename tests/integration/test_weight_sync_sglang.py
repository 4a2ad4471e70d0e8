"""In-memory weight sync into a REAL SGLang server (CPU, bf16; the pinned lean SGLang 0.5.23).

Reference (independent of the code under test): the same server loading the actor's checkpoint through
``/update_weights_from_disk`` (the disk path); SGLang's own ``/weights_checker`` checksums of EVERY server
tensor (fused qkv / gate_up included) must be equal after an in-memory sync, and differ from the server's
starting weights (another checkpoint).

* distributed (gloo groups, flattened buckets) from a PP2 actor -- each stage's rank sends over its own update
  group, and the bytes through any rank (counted at its ``torch.distributed`` calls) stay within its own shard
  + one bucket -- and tensor (shared memory) from a TP2 x PP2 actor (one sender per stage): every server tensor
  == the disk path; verified; the server reports the new version.
* a tensor perturbed in one bucket after its checksum was taken is caught by the verification (SGLang's
  checksums), named on every rank; the server is tagged ``sync-failed:<version>`` and the engine refuses to
  generate.
* delta syncs (``rollout.weight_sync_delta``) through our loader in the server: after deltas at lr 1e-6 every
  server tensor == the disk path; each delta <= 10 % of a full sync's bytes; a server that lost its version (its
  launch weights under another tag, as after a restart) gets the next version whole, not a delta.
* faults: the server killed in the middle of a sync -> a WeightSyncError naming the server on every rank;
  a group init the server rejects (NCCL on the CPU server) -> WeightSyncError naming the group and server.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_weight_sync_sglang.py -q``
"""
import os

import pytest
import requests

from megatron_rl.rollout.sglang_server import find_free_port, sglang_available
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import layout, named_job, setting
from megatron_rl.testing.sglang_script import SharedServer, load_from_disk, server_checksums
from megatron_rl.testing.tiny_hf import build_tiny_hf_model

_OK, _REASON = sglang_available()
pytestmark = [pytest.mark.skipif(not _OK, reason=_REASON), pytest.mark.slow]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ws_sglang")
    return {"actor": build_tiny_hf_model(root / "actor", arch="qwen2", seed=1, num_hidden_layers=4),
            "other": build_tiny_hf_model(root / "other", arch="qwen2", seed=2, num_hidden_layers=4)}


@pytest.fixture(scope="module")
def _shared_server(models, tmp_path_factory):
    with SharedServer(models["other"], tmp_path_factory.mktemp("ws_sglang_log"), max_total_tokens=2048,
                      ready_timeout=400, delta_loader=True) as shared:  # the delta test's loader
        yield shared


@pytest.fixture
def server(_shared_server):
    """The module's server, (re)started on demand: the kill test (last in the file) may run in any order."""
    return _shared_server.get()


def _checksums(url):
    return server_checksums(url)[0]


def _version(url):
    return requests.get(url + "/get_model_info", timeout=30).json()["weight_version"]


#: the server's URL is the test's own; the job's is a placeholder
PLACEHOLDER_URL = ("rollout.sglang_urls=[http://x:1]",)
#: buckets of 0.02 MB: many buckets per sync of a tiny model
SMALL_BUCKETS = ("rollout.weight_sync_bucket_mb=0.02",)


def _body(rank, world, job, url, fault=None):
    from megatron_rl.actor import MegatronActor
    from megatron_rl.plan import actor_spec
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.rollout.base import SamplingParams, WeightSyncError
    from megatron_rl.rollout.sglang_engine import SGLangEngine
    from megatron_rl.testing.traffic import Traffic
    from megatron_rl.weight_sync.publisher import build_weight_publisher
    from megatron_rl.trainer.sync_settings import weight_sync_settings

    initialize_model_parallel(job.parallel, seed=3, model=job.model)
    actor = MegatronActor(actor_spec(job))
    # the kill fault: HTTP waits on the dead server are bounded by this timeout (x retries)
    sync_timeout = 30 if fault and fault[0] == "kill" else 120
    engine = SGLangEngine(url, weight_sync_timeout=sync_timeout) if rank == 0 else None
    seen = []

    def corrupt(bucket):
        seen.append(bucket)
        if fault and fault[0] == "perturb":
            for name, t in bucket.tensors():
                if name == fault[1]:
                    t.add_(0.5)
        if fault and fault[0] == "kill" and len(seen) == 3:
            os.killpg(fault[1], 9)  # the whole server (its scheduler processes too), as when its node dies

    own = sum(p.numel() for p in actor.model[0].parameters()) * 4  # this rank's shard (fp32 >= the engine's dtype)
    try:
        with Traffic() as traffic:
            m = build_weight_publisher(weight_sync_settings(job), actor, engine, corrupt=corrupt if fault else None).publish("step-1")
        return {"metrics": m, "through": traffic.sent + traffic.received, "own": own}
    except WeightSyncError as exc:
        refused = None
        if rank == 0:
            try:
                engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
            except WeightSyncError as e2:
                refused = "will not generate" in str(e2)
        return {"error": str(exc), "refused": refused}
    finally:
        if engine is not None:
            engine.close()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode,tp,pp", [("distributed", 1, 2), ("tensor", 2, 2)])
def test_in_memory_sync_equals_disk_path(models, server, mode, tp, pp):
    url = server.url
    load_from_disk(url, models["actor"], "disk-ref")
    want = _checksums(url)
    load_from_disk(url, models["other"], "step-0")
    start = _checksums(url)
    assert sum(start[k] != want[k] for k in want) > len(want) // 2
    job = named_job("sglang_actor", *PLACEHOLDER_URL, *layout(tp=tp, pp=pp), setting("rollout.weight_sync", mode),
                    *SMALL_BUCKETS, "rollout.weight_sync_verify_tensors=-1", hf=models["actor"])
    out = run_ranks(_body, tp * pp, job, url, timeout=800)
    assert _checksums(url) == want  # every server tensor, fused ones included
    assert _version(url) == "step-1"
    m = out[0]["metrics"]
    assert m["weight_sync/verified"] == 1.0 and m["weight_sync/buckets"] >= 10
    assert m["weight_sync/senders"] == pp  # one per pipeline stage (TP rank 0)
    assert all(o["metrics"] == m for o in out)
    if mode == "distributed":  # each stage's bytes left from its own rank: none passed through rank 0
        for r, o in enumerate(out):
            assert 0 < o["through"] <= o["own"] + int(0.02 * (1 << 20)), (r, o["through"], o["own"])


def _delta_body(rank, world, job, url, export_dir, launch_dir):
    from megatron_rl.actor import MegatronActor
    from megatron_rl.plan import actor_spec
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.rollout.sglang_engine import SGLangEngine
    from megatron_rl.testing.actor_reference import policy_data
    from megatron_rl.weight_sync.publisher import DeltaPublisher, build_weight_publisher
    from megatron_rl.trainer.sync_settings import weight_sync_settings

    initialize_model_parallel(job.parallel, seed=3, model=job.model)
    actor = MegatronActor(actor_spec(job))
    engine = SGLangEngine(url, weight_sync_timeout=120)
    try:
        pub = build_weight_publisher(weight_sync_settings(job), actor, engine)
        assert isinstance(pub, DeltaPublisher)
        batch, old, adv, mask, _ = policy_data(job.model.vocab_size, 4, 7, (2, 5), (3, 7), False)
        metrics = [pub.publish("step-1")]  # the first version: full
        for v in (2, 3):
            actor.train_step(batch, old, adv, mask, None, 1.0)
            metrics.append(pub.publish(f"step-{v}"))
        # the server comes back as a restarted one does: its launch weights under another version tag (a real
        # restart costs a ~2 min CPU launch); the engine object still believes it serves step-3
        load_from_disk(url, launch_dir, "restarted")
        actor.train_step(batch, old, adv, mask, None, 1.0)
        metrics.append(pub.publish("step-4"))  # must be full: the server holds no step-3 to apply a delta to
        actor.export_hf(export_dir)
        return metrics
    finally:
        engine.close()


@pytest.mark.timeout(900)
def test_delta_sync_equals_disk_path(models, server, tmp_path):
    """Delta syncs (``rollout.weight_sync_delta``, our loader inside the server) at lr 1e-6: after a full first
    version, two deltas, the server losing its version (as on a restart) and one more version, every server
    tensor equals the same weights loaded from disk (SGLang's checksums); each delta sent <= 10 % of the first
    (full) version's bytes, and the version after the loss was sent whole."""
    url = server.url
    load_from_disk(url, models["other"], "step-0")
    job = named_job("sglang_actor", *PLACEHOLDER_URL, "rollout.weight_sync=tensor", "rollout.weight_sync_delta=true",
                    *SMALL_BUCKETS, hf=models["actor"])
    job.actor.lr = 1e-6
    out = run_ranks(_delta_body, 1, job, url, str(tmp_path / "export"), models["other"], timeout=600)[0]
    got, version = _checksums(url), _version(url)
    load_from_disk(url, str(tmp_path / "export"), "disk-ref")
    assert version == "step-4" and got == _checksums(url)
    full = out[0]["weight_sync/bytes_sent"]
    assert all(m["weight_sync/verified"] == 1.0 for m in out)
    assert [m["weight_sync/changed_frac"] == 1.0 for m in out] == [True, False, False, True], out
    assert out[3]["weight_sync/bytes_sent"] == full  # the fallback: a full sync
    fracs = [m["weight_sync/bytes_sent"] / full for m in out[1:3]]
    assert all(0 < f <= 0.10 for f in fracs), fracs
    print("SGLang delta bytes / full bytes per step at lr 1e-6:", [round(f, 4) for f in fracs])


@pytest.mark.timeout(900)
def test_corrupted_bucket_is_named_and_server_tagged_failed(models, server):
    url = server.url
    load_from_disk(url, models["other"], "step-0")
    name = "model.layers.2.self_attn.o_proj.weight"
    job = named_job("sglang_actor", *PLACEHOLDER_URL, *layout(tp=2), "rollout.weight_sync=distributed", *SMALL_BUCKETS,
                    "rollout.weight_sync_verify_tensors=-1", hf=models["actor"])
    out = run_ranks(_body, 2, job, url, ("perturb", name), timeout=800)
    for r in out:
        assert "verification failed" in r["error"] and name in r["error"], r
        assert r["error"].count("model.layers") == 1
    assert out[0]["refused"]
    assert _version(url) == "sync-failed:step-1"


@pytest.mark.timeout(900)
def test_group_init_rejected(models, server):
    from megatron_rl.rollout.base import WeightSyncError
    from megatron_rl.rollout.sglang_engine import SGLangEngine
    from megatron_rl.weight_sync.transport import UpdateGroup

    engine = SGLangEngine(server.url)
    with pytest.raises(WeightSyncError, match=r"weight-update group .* \(nccl.*could not be set up.*" + server.url):
        UpdateGroup(engine.server_set(), "127.0.0.1", 30, "nccl")
    engine.close()


@pytest.mark.timeout(900)
def test_server_killed_mid_sync(models, server):
    """Runs last: kills the module's server (it is started again if a test needs it afterwards)."""
    url = server.url
    load_from_disk(url, models["other"], "step-0")
    # a short sync timeout: whatever the trainer waits on after the kill must end within it
    job = named_job("sglang_actor", *PLACEHOLDER_URL, *layout(tp=2), "rollout.weight_sync=distributed", *SMALL_BUCKETS,
                    "rollout.weight_sync_timeout_s=60", hf=models["actor"])
    out = run_ranks(_body, 2, job, url, ("kill", server.pid), timeout=300)
    for r in out:
        assert "error" in r and url in r["error"], r
    assert out[0]["refused"]
    assert not server.alive()
