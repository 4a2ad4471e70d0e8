"""The same-host shared-memory transports of the weight sync: senders -> an engine in rank 0's process, TP pieces -> their
sender.

* PP2 into the embedded engine with ``sender_transport`` "shm" and "gloo": every engine tensor equals the actor's
  checkpoint read by safetensors (independent reference) both ways; with shm rank 1's ``torch.distributed`` calls
  carry only the buckets' meta (a few KiB), with gloo its whole stage (so the traffic measure can fail).
* TP2 with each ``tp_gather`` (shm, flat, gloo): the engine equals the checkpoint; with shm rank 1's
  ``torch.distributed`` calls carry none of its pieces.
* A gather that fails on rank 0 (its own stream raises) fails the sync on every rank, named, and the engine refuses to
  generate.
* Nothing is left in ``/dev/shm`` after a sync, a failed one (a bucket perturbed in transit, named on every rank) or
  one whose sender is killed with its first bucket packed into a fresh segment (segments are anonymous memory files).

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_weight_sync_shm.py -q``
"""
import dataclasses
import os
import signal

import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.testing.distributed import RankError, run_ranks
from megatron_rl.testing.jobs import layout, named_job
from megatron_rl.testing.tiny_hf import build_tiny_hf_model
from megatron_rl.weight_sync import shm

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not shm.available(), reason="needs /dev/shm")

JOB = ("rollout.weight_sync=tensor", "rollout.weight_sync_bucket_mb=0.02", "rollout.weight_sync_verify_tensors=-1")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ws_shm")
    return {"actor": build_tiny_hf_model(root / "actor", arch="qwen2", seed=1, num_hidden_layers=4),
            "other": build_tiny_hf_model(root / "other", arch="qwen2", seed=2, num_hidden_layers=4)}


def _body(rank, world, job, engine_dir, transport, corrupt_name=None, kill_first=False, tp_gather="shm",
          fail_gather=False):
    from megatron_rl.actor import MegatronActor
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.plan import actor_spec
    from megatron_rl.rollout.base import WeightSyncError
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.testing.traffic import Traffic
    from megatron_rl.trainer.sync_settings import weight_sync_settings
    from megatron_rl.weight_sync.publisher import build_weight_publisher

    initialize_model_parallel(job.parallel, seed=3, model=job.model)
    actor = MegatronActor(actor_spec(job))
    engine = EmbeddedEngine(engine_dir, dtype="float32", seed=0, weight_version="step-0") if rank == 0 else None
    settings = weight_sync_settings(job)
    assert settings.sender_transport == "shm" and settings.tp_gather == "shm"  # the job's choice on a CPU host
    settings = dataclasses.replace(settings, sender_transport=transport, tp_gather=tp_gather)

    def corrupt(bucket):
        if kill_first and rank == 1:
            from megatron_rl.weight_sync import in_process

            assert in_process._WRITER[0] is not None  # the bucket is packed in a segment rank 0 has not mapped yet
            os.kill(os.getpid(), signal.SIGKILL)
        for name, t in bucket.tensors():
            if name == corrupt_name:
                t.add_(1e-2)

    if fail_gather and rank == 0:  # rank 0's own stream fails after its first bucket (a gather that raised)
        from megatron_rl.weight_sync import stream

        own = stream.own_buckets

        def failing(*args, **kwargs):
            it = own(*args, **kwargs)
            yield next(it)
            it.close()
            raise RuntimeError("a gather failed")

        stream.own_buckets = failing
    out = {"own": sum(p.numel() * 4 for p in actor.model[0].parameters())}
    hook = corrupt if corrupt_name or kill_first else None
    try:
        with Traffic() as t:
            out["metrics"] = build_weight_publisher(settings, actor, engine, corrupt=hook).publish("step-1")
        out["sent"] = t.sent
    except WeightSyncError as exc:
        out["error"] = str(exc)
    if rank == 0:
        out["invalid"] = engine._invalid
    if rank == 0 and "metrics" in out:
        out["state"] = {k: v.clone() for k, v in engine.model.state_dict().items() if not k.endswith("inv_freq")}
    return out


def _reference(hf_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(hf_dir, "model.safetensors"))


@pytest.mark.timeout(600)
def test_pp2_sync_through_shared_memory_equals_checkpoint(models):
    job = named_job("actor", *JOB, *layout(pp=2), hf=models["actor"])
    before = shm.leftovers()
    ref = _reference(models["actor"])
    sent = {}
    for transport in ("shm", "gloo"):
        out = run_ranks(_body, 2, job, models["other"], transport, timeout=300)
        got = out[0]["state"]
        assert set(got) == set(ref)
        for k in ref:
            assert torch.equal(got[k], ref[k]), (transport, k)
        assert out[0]["metrics"]["weight_sync/senders"] == 2.0 and out[0]["metrics"]["weight_sync/verified"] == 1.0
        sent[transport] = out[1]["sent"]
        assert shm.leftovers() == before, transport
    stage2 = out[1]["own"] // 2  # rank 1's stage, in bytes of a 2-byte dtype at the least
    assert sent["gloo"] >= stage2, sent  # the bytes crossed the pair group ...
    buckets = out[0]["metrics"]["weight_sync/buckets"]
    assert sent["shm"] <= 4096 * buckets and sent["shm"] * 20 < sent["gloo"], sent  # ... and here only their meta


@pytest.mark.timeout(600)
def test_no_shared_memory_is_left_after_failed_syncs(models):
    job = named_job("actor", *JOB, *layout(pp=2), "rollout.weight_sync_timeout_s=20", hf=models["actor"])
    before = shm.leftovers()
    name = "model.layers.3.mlp.down_proj.weight"  # on the second pipeline stage
    out = run_ranks(_body, 2, job, models["other"], "shm", name, timeout=300)
    for r in out:
        assert "verification failed" in r["error"] and name in r["error"], r.get("error")
    assert shm.leftovers() == before
    with pytest.raises(RankError, match="rank 1"):  # killed with a fresh segment rank 0 has not mapped
        run_ranks(_body, 2, job, models["other"], "shm", None, True, timeout=300)
    assert shm.leftovers() == before


@pytest.mark.timeout(600)
def test_tp2_gathers_equal_checkpoint_and_shm_moves_no_bytes_through_gloo(models):
    """TP2 into the embedded engine with each ``tp_gather`` (shm: pieces through shared memory; flat: one
    all_gather_into_tensor per parameter; gloo: the per-rank all_gather): every engine tensor equals the checkpoint;
    with shm rank 1 passes (almost) nothing through ``torch.distributed``, with gloo its half of the model."""
    job = named_job("actor", *JOB, *layout(tp=2), hf=models["actor"])
    ref = _reference(models["actor"])
    sent = {}
    for how in ("shm", "flat", "gloo"):
        out = run_ranks(_body, 2, job, models["other"], "shm", tp_gather=how, timeout=300)
        got = out[0]["state"]
        assert set(got) == set(ref)
        for k in ref:
            assert torch.equal(got[k], ref[k]), (how, k)
        sent[how] = out[1]["sent"]
    half = out[1]["own"] // 2 // 2  # rank 1's pieces in a 2-byte dtype, at the least (fp32 here)
    assert sent["gloo"] >= half, sent  # (testing.traffic does not count all_gather_single: flat is not compared)
    assert sent["shm"] < 64 * 1024, sent  # only the plan's and the board's small messages


@pytest.mark.timeout(600)
def test_moe_tp2_etp2_shm_gather_equals_checkpoint(tmp_path):
    """The expert kinds (``expert_glu_column``, ``expert_row``) through the shared-memory gather: a Qwen3-MoE at TP2 /
    ETP2 syncs into the embedded engine; every tensor equals that engine's own load of the checkpoint."""
    from megatron_rl.rollout.embedded import EmbeddedEngine

    def moe(path, seed):
        return build_tiny_hf_model(path, arch="qwen3_moe", seed=seed, num_hidden_layers=2, num_experts=4,
                                   num_experts_per_tok=2, tie_word_embeddings=False)

    actor, other = moe(tmp_path / "actor", 1), moe(tmp_path / "other", 2)
    job = named_job("actor", *JOB, *layout(tp=2, etp=2, sp=True), hf=actor)
    out = run_ranks(_body, 2, job, other, "shm", timeout=300)
    ref = EmbeddedEngine(actor, dtype="float32", seed=0).model.state_dict()
    got = out[0]["state"]
    assert set(got) == {k for k in ref if not k.endswith("inv_freq")}
    assert [k for k in got if not torch.equal(got[k], ref[k])] == []
    assert out[1]["sent"] < 64 * 1024, out[1]["sent"]


@pytest.mark.timeout(600)
def test_a_failed_gather_on_rank0_aborts_the_update_on_every_rank(models):
    """Rank 0's own stream raises after its first bucket (its gather failed): the sync fails on every rank with the
    cause named, at once (not after rank 1's wait for a decision), and the engine refuses to generate."""
    job = named_job("actor", *JOB, *layout(pp=2), "rollout.weight_sync_timeout_s=60", hf=models["actor"])
    out = run_ranks(_body, 2, job, models["other"], "shm", fail_gather=True, timeout=120)
    for r in out:
        assert "sender rank 0: gathering its tensors failed" in r["error"] and "a gather failed" in r["error"], r
    assert "a gather failed" in (out[0]["invalid"] or "")
