"""Async rollouts' owned buckets (``rollout.mode: async``, ``rollout.weight_sync: tensor``) collected on rank 0 through
the senders' shared memory (``weight_sync/shm_owned.py``), applied later as the producer does (``payload.apply``).

* PP2 (dense) and EP2 (MoE), each with ``sender_transport`` "shm" and "gloo" in one run: the embedded engine's
  weights equal the actor's HF checkpoint (safetensors, or transformers' own load of it for the MoE) bit for bit both
  ways -- many small buckets pass one segment, so a bucket rank 0 did not copy out would be overwritten; with shm rank
  1's ``torch.distributed`` calls carry only the buckets' meta, with gloo its whole share.
* TP2 (one sender, its pieces through the job's TP gather): equal to the checkpoint.
* Rank 0 cannot map rank 1's shared memory (``/proc`` refused): the collection falls back to gloo, still exact.
* A sender failing mid-collection ends it on every rank with the cause, well within the bound; one killed mid-way
  leaves nothing in ``/dev/shm``.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_async_owned_shm.py -q``
"""
import dataclasses
import os
import signal
import time

import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.testing.distributed import RankError, run_ranks
from megatron_rl.testing.jobs import layout, named_job
from megatron_rl.testing.tiny_hf import build_tiny_hf_model
from megatron_rl.weight_sync import shm

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not shm.available(), reason="needs memfd_create and /proc")

JOB = ("rollout.mode=async", "rollout.weight_sync=tensor", "rollout.weight_sync_bucket_mb=0.02",
       "rollout.weight_sync_verify_tensors=-1")


def _moe(path, seed):
    return build_tiny_hf_model(path, arch="qwen3_moe", seed=seed, num_hidden_layers=2, num_experts=4,
                               num_experts_per_tok=2, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("async_owned")
    return {"actor": build_tiny_hf_model(root / "actor", arch="qwen2", seed=1, num_hidden_layers=4),
            "other": build_tiny_hf_model(root / "other", arch="qwen2", seed=2, num_hidden_layers=4)}


def _body(rank, world, job, engine_dir, transports, refuse=None, fail=None):
    from megatron_rl.actor import MegatronActor
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.plan import actor_spec
    from megatron_rl.rollout.base import WeightSyncError
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.testing.traffic import Traffic
    from megatron_rl.trainer.sync_settings import weight_sync_settings
    from megatron_rl.weight_sync import stream
    from megatron_rl.weight_sync.publisher import deferred_publisher

    if refuse and rank == 0:  # rank 0 may not open another process's /proc/<pid>/fd (containers, ptrace policy)
        def refused(cls, path, key, nbytes):
            raise PermissionError(1, "Operation not permitted", path)
        shm.Segment.attach = classmethod(refused)
    if fail and rank == 1:  # the sender's stream breaks after its first bucket: raised, or the process killed
        own = stream.own_buckets

        def failing(*args, **kwargs):
            it = own(*args, **kwargs)
            yield next(it)
            if fail == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            it.close()
            raise RuntimeError("a gather failed")

        stream.own_buckets = failing
    initialize_model_parallel(job.parallel, seed=3, model=job.model)
    actor = MegatronActor(actor_spec(job))
    settings = weight_sync_settings(job)
    assert settings.sender_transport == "shm"  # the job's choice on a CPU host
    out = {"own": sum(p.numel() * p.element_size() for p in actor.model[0].parameters())}
    for transport in transports:
        s = dataclasses.replace(settings, sender_transport=transport)
        engine = EmbeddedEngine(engine_dir, dtype="float32", seed=0, weight_version="step-0") if rank == 0 else None
        start = time.monotonic()
        try:
            with Traffic() as t:
                payload = deferred_publisher(s, actor).make("step-1")  # the trainer's side, every rank
            if rank == 0:  # the producer's side, later, rank 0 alone
                out[transport + "_verified"] = payload.apply(engine, s, "step-1", actor).verified_frac
                out[transport] = {k: v.clone() for k, v in engine.model.state_dict().items()
                                  if not k.endswith("inv_freq")}
                out[transport + "_buckets"] = payload.report().buckets
        except WeightSyncError as exc:
            out["error"], out["seconds"] = str(exc), time.monotonic() - start
            return out
        out[transport + "_sent"] = t.sent
    return out


def _check(out, ref, transports):
    for transport in transports:
        got = out[0][transport]
        assert set(got) == set(ref), transport
        assert [k for k in ref if not torch.equal(got[k], ref[k])] == [], transport


@pytest.mark.timeout(600)
def test_async_pp2_owned_buckets_through_shm_and_gloo_equal_checkpoint(models):
    from safetensors.torch import load_file

    job = named_job("actor", *JOB, *layout(pp=2), hf=models["actor"])
    before = shm.leftovers()
    out = run_ranks(_body, 2, job, models["other"], ("shm", "gloo"), timeout=300)
    _check(out, load_file(os.path.join(models["actor"], "model.safetensors")), ("shm", "gloo"))
    assert out[0]["shm_buckets"] > 8  # many buckets passed rank 1's one segment
    assert out[0]["shm_verified"] == out[0]["gloo_verified"] == 1.0  # the producer's verification passed too
    stage = out[1]["own"] // 2  # rank 1's stage in bytes of a 2-byte dtype at the least (fp32 here)
    assert out[1]["gloo_sent"] >= stage, out[1]  # the bytes crossed the pair group ...
    assert out[1]["shm_sent"] * 20 < out[1]["gloo_sent"], out[1]  # ... and with shm only their meta
    assert shm.leftovers() == before


@pytest.mark.timeout(600)
def test_async_ep2_owned_buckets_through_shm_and_gloo_equal_transformers_load(tmp_path):
    from megatron_rl.rollout.embedded import EmbeddedEngine

    actor, other = _moe(tmp_path / "actor", 1), _moe(tmp_path / "other", 2)
    job = named_job("actor", *JOB, *layout(ep=2), hf=actor)
    out = run_ranks(_body, 2, job, other, ("shm", "gloo"), timeout=300)
    ref = {k: v for k, v in EmbeddedEngine(actor, dtype="float32", seed=0).model.state_dict().items()
           if not k.endswith("inv_freq")}
    _check(out, ref, ("shm", "gloo"))
    assert out[1]["gloo_sent"] > 20 * out[1]["shm_sent"], out[1]  # rank 1's experts crossed by gloo only there


@pytest.mark.timeout(600)
def test_async_tp2_owned_buckets_gathered_through_shm_equal_checkpoint(models):
    """TP2: one sender; its pieces come through the TP gather of the job (``tp_gather``), as in a streamed sync."""
    from safetensors.torch import load_file

    job = named_job("actor", *JOB, *layout(tp=2), hf=models["actor"])
    out = run_ranks(_body, 2, job, models["other"], ("shm",), timeout=300)
    _check(out, load_file(os.path.join(models["actor"], "model.safetensors")), ("shm",))
    assert out[0]["shm_verified"] == 1.0


@pytest.mark.timeout(600)
def test_async_owned_buckets_fall_back_to_gloo_when_rank0_cannot_map(models):
    from safetensors.torch import load_file

    job = named_job("actor", *JOB, *layout(pp=2), hf=models["actor"])
    out = run_ranks(_body, 2, job, models["other"], ("shm",), "proc", timeout=300)
    _check(out, load_file(os.path.join(models["actor"], "model.safetensors")), ("shm",))
    assert out[1]["shm_sent"] >= out[1]["own"] // 2, out[1]  # the bytes went over gloo


@pytest.mark.timeout(600)
def test_a_failing_sender_ends_the_collection_on_every_rank(models):
    job = named_job("actor", *JOB, *layout(pp=2), "rollout.weight_sync_timeout_s=60", hf=models["actor"])
    before = shm.leftovers()
    out = run_ranks(_body, 2, job, models["other"], ("shm",), None, "raise", timeout=200)
    for r in out:
        assert "sender rank 1: gathering its tensors failed" in r["error"] and "a gather failed" in r["error"], r
        assert r["seconds"] < 30, r["seconds"]  # at once, not after the 60 s bound
    with pytest.raises(RankError, match="rank 1"):
        run_ranks(_body, 2, job, models["other"], ("shm",), None, "kill", timeout=200)
    assert shm.leftovers() == before


def _choice_body(rank, world):
    from megatron_rl.testing import fake_accelerator as fa
    from megatron_rl.weight_sync import shm_owned

    on_host = shm_owned.owned_collector()
    fa.install()
    fa.make_default_group()  # the default group becomes "NCCL": device tensors only
    return on_host.__name__, shm_owned.owned_collector().__name__


def test_an_nccl_default_group_keeps_the_device_path():
    """The choice is the default group's device: the senders' channels (shm / gloo) on the host, the stages over the
    default group (staged on its device) with an NCCL-like one (``testing.fake_accelerator``)."""
    assert run_ranks(_choice_body, 2, timeout=60)[0] == ("collect_from_senders", "collect_from_stages")
