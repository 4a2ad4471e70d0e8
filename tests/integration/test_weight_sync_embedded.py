"""Bucketed in-memory weight sync into the embedded engine (``rollout.weight_sync: tensor``).

* TP2 and PP2 actors sync into an engine that was loaded from ANOTHER checkpoint (same shapes, other
  seed): afterwards every engine tensor equals the actor's checkpoint read by safetensors (independent
  reference; the actor loaded it losslessly), bit for bit in fp32 and == its bf16 cast in a bf16 engine, from
  an fp32 actor and from a bf16 one (``actor.bf16``);
  the buckets are many (bucket << model) and the sync reports them.
* A tensor perturbed in one bucket after its checksum was taken (a fault in transit) is caught by the
  verification, which names it, on every rank; the engine then refuses to generate.
* Peak host memory (the kernel's VmHWM, reset before the sync) on every trainer rank stays within one
  bucket + two of the largest tensor + slack for a model ~35 buckets large, while gathering the full state
  dict (the old path) exceeds that bound on rank 0 — so the measurement can fail.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_weight_sync_embedded.py -q``
"""
import ctypes
import json
import os
import re

import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.actor import MegatronActor
from megatron_rl.plan import actor_spec
from megatron_rl.plan import load_job_config
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.rollout.base import SamplingParams, WeightSyncError
from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.tasks.char_tokenizer import build_task_model
from megatron_rl.testing.distributed import RankError, run_ranks
from megatron_rl.testing.jobs import layout, named_job, setting
from megatron_rl.testing.tiny_hf import build_tiny_hf_model
from megatron_rl.weight_sync.verify import verify_disk_sync
from megatron_rl.trainer.sync_settings import weight_sync_settings

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ws_embedded")
    big = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
               num_key_value_heads=4)
    return {"actor": build_tiny_hf_model(root / "actor", arch="qwen2", seed=1, num_hidden_layers=4),
            "other": build_tiny_hf_model(root / "other", arch="qwen2", seed=2, num_hidden_layers=4),
            "big": build_tiny_hf_model(root / "big", arch="qwen2", seed=3, **big),
            "big_other": build_tiny_hf_model(root / "big_other", arch="qwen2", seed=4, **big)}


#: the actor's weights sent tensor by tensor to the embedded engine
TENSOR_SYNC = ("rollout.weight_sync=tensor",)
#: buckets of 0.02 MB: many buckets per sync of a tiny model
SMALL_BUCKETS = ("rollout.weight_sync_bucket_mb=0.02",)


def _reference(hf_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(hf_dir, "model.safetensors"))


def _sync_body(rank, world, job, engine_dir, dtype, corrupt_name=None):
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.weight_sync.publisher import build_weight_publisher

    initialize_model_parallel(job.parallel, seed=3, model=job.model)
    actor = MegatronActor(actor_spec(job))
    engine = EmbeddedEngine(engine_dir, dtype=dtype, seed=0, weight_version="step-0") if rank == 0 else None

    def corrupt(bucket):
        for name, t in bucket.tensors():
            if name == corrupt_name:
                t.add_(1e-2)

    try:
        metrics = build_weight_publisher(weight_sync_settings(job), actor, engine, corrupt=corrupt if corrupt_name else None).publish("step-1")
    except WeightSyncError as exc:
        refused = None
        if rank == 0:
            with pytest.raises(WeightSyncError, match="will not generate"):
                engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
            refused = True
        return {"error": str(exc), "refused": refused}
    if rank != 0:
        return {"metrics": metrics}
    return {"metrics": metrics, "version": engine.weight_version,
            "state": {k: v.clone() for k, v in engine.model.state_dict().items() if not k.endswith("inv_freq")}}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp,pp,dtype,bf16", [(2, 1, "float32", False), (1, 2, "float32", False),
                                             (2, 1, "bfloat16", False), (1, 2, "bfloat16", True)],
                         ids=["tp2-fp32", "pp2-fp32", "tp2-bf16-engine", "pp2-bf16-actor-bf16-engine"])
def test_bucketed_sync_equals_checkpoint(models, tp, pp, dtype, bf16):
    """(the bf16 actor, ``actor.bf16``, holds the checkpoint rounded to bf16: its sync equals that exactly)"""
    job = named_job("actor", *TENSOR_SYNC, *layout(tp=tp, pp=pp), setting("actor.bf16", bf16), *SMALL_BUCKETS,
                    "rollout.weight_sync_verify_tensors=-1", hf=models["actor"])
    out = run_ranks(_sync_body, 2, job, models["other"], dtype, timeout=540)
    ref, got = _reference(models["actor"]), out[0]["state"]
    before = _reference(models["other"])
    assert set(got) == set(ref)
    want_dtype = getattr(torch, dtype)
    changed = [k for k in ref if not torch.equal(before[k].to(want_dtype), ref[k].to(want_dtype))]
    assert len(changed) > len(ref) // 2  # the engine started from other weights (biases / norms may agree)
    for k in ref:
        assert got[k].dtype == want_dtype and torch.equal(got[k], ref[k].to(want_dtype)), k
    m = out[0]["metrics"]
    item = torch.empty((), dtype=want_dtype).element_size()
    assert m["weight_sync/bytes"] == sum(t.numel() for t in ref.values()) * item
    assert m["weight_sync/buckets"] >= 10 and m["weight_sync/verified"] == 1.0
    assert out[0]["version"] == "step-1"
    assert out[1]["metrics"] == m  # every rank reports the sync


@pytest.mark.timeout(600)
def test_corrupted_bucket_is_caught_and_named(models):
    job = named_job("actor", *TENSOR_SYNC, *layout(pp=2), *SMALL_BUCKETS, "rollout.weight_sync_verify_tensors=-1",
                    hf=models["actor"])
    name = "model.layers.3.mlp.down_proj.weight"  # on the second pipeline stage
    out = run_ranks(_sync_body, 2, job, models["other"], "float32", name, timeout=540)
    for r in out:  # every rank raises, naming the tensor
        assert "verification failed" in r["error"] and name in r["error"]
        assert r["error"].count("model.layers") == 1  # only the perturbed one
    assert out[0]["refused"]


def _hwm_kb() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))


def _rss_kb() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1))


def _memory_body(rank, world, job, engine_dir):
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.weight_sync.publisher import build_weight_publisher

    # large blocks straight from / back to the kernel (glibc would otherwise keep freed buckets on its heap
    # after raising its mmap threshold, and RSS would count allocator retention instead of live tensors)
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD = 64 KiB
    initialize_model_parallel(job.parallel, seed=3, model=job.model)
    actor = MegatronActor(actor_spec(job))
    engine = EmbeddedEngine(engine_dir, dtype="float32", seed=0, weight_version="step-0") if rank == 0 else None
    build_weight_publisher(weight_sync_settings(job), actor, engine).publish("step-1")  # warm-up: first-call imports / buffers
    out = {}
    for label in ("bucketed", "full"):
        torch.distributed.barrier()
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset the peak-RSS high-water mark to the current RSS
        base = _rss_kb()
        if label == "bucketed":
            build_weight_publisher(weight_sync_settings(job), actor, engine).publish("step-2")
            sd = None
        else:
            sd = actor.full_state_dict_hf()
        out[label] = (_hwm_kb() - base) * 1024
        del sd
    model_bytes = sum(p.numel() * 4 for p in engine.model.parameters()) if rank == 0 else None
    return out, model_bytes


@pytest.mark.timeout(600)
def test_peak_memory_is_one_bucket_not_the_model(models):
    bucket_mb = 2.0
    job = named_job("actor", *TENSOR_SYNC, *layout(tp=2), setting("rollout.weight_sync_bucket_mb", bucket_mb),
                    hf=models["big"])
    out = run_ranks(_memory_body, 2, job, models["big_other"], timeout=540)
    model_bytes = out[0][1]
    largest = 512 * 1024 * 4  # an MLP matrix, fp32
    bound = bucket_mb * 2**20 + 2 * largest + 12 * 2**20
    print("peak extra host memory per rank (bytes):", [p for p, _ in out], "bound", bound, "model", model_bytes)
    assert model_bytes > 3.5 * bound and model_bytes > 30 * bucket_mb * 2**20  # the model is many buckets
    for rank, (peaks, _) in enumerate(out):
        assert peaks["bucketed"] <= bound, (rank, peaks, bound)
    assert out[0][0]["full"] > bound, out[0][0]  # the full-model path would not fit: the measurement can fail


@pytest.mark.timeout(120)
def test_disk_sync_is_verified_against_the_export(tmp_path):
    """Disk mode: after the engine loaded an HF export, sampled tensors of the export (read with safetensors,
    cast to the bf16 engine's dtype) must equal the engine's copies; one tensor changed in the engine after the
    load is named."""
    model = build_task_model(str(tmp_path / "m"), task="copy", seed=0, hidden_size=32, num_layers=2)
    cfg = load_job_config(None, [f"actor.load_hf={model}", "rollout.weight_sync=disk",
                                 "rollout.weight_sync_verify_tensors=-1", f"trainer.run_dir={tmp_path / 'run'}"],
                          world_size=1)
    engine = EmbeddedEngine(model, dtype="bfloat16", seed=0, weight_version="step-0")
    engine.update_weights(model, "step-1")
    checked = verify_disk_sync(engine, weight_sync_settings(cfg), model, "step-1")
    assert "model.layers.1.mlp.down_proj.weight" in checked and len(checked) >= 10
    with torch.no_grad():
        engine.model.model.layers[1].mlp.down_proj.weight[0, 0] += 0.5
    with pytest.raises(WeightSyncError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        verify_disk_sync(engine, weight_sync_settings(cfg), model, "step-1")


def _dying_sender_body(rank, world, job, engine_dir, result_path):
    """PP2: the second stage's sender stops for good after its first bucket; rank 0 reports, then kills it."""
    import signal
    import time

    import torch.distributed as dist

    from megatron_rl.weight_sync.publisher import build_weight_publisher

    initialize_model_parallel(job.parallel, seed=3, model=job.model)
    actor = MegatronActor(actor_spec(job))
    engine = EmbeddedEngine(engine_dir, dtype="float32", seed=0, weight_version="step-0") if rank == 0 else None
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    sent = []

    def stop(bucket):
        sent.append(bucket.nbytes)
        if rank == 1 and len(sent) == 2:
            os.kill(os.getpid(), signal.SIGSTOP)  # mid-sync, never to run again

    t0 = time.monotonic()
    try:
        build_weight_publisher(weight_sync_settings(job), actor, engine, corrupt=stop).publish("step-1")
        res = {"error": None}
    except WeightSyncError as exc:
        res = {"error": str(exc), "seconds": time.monotonic() - t0, "version": engine.weight_version}
        with pytest.raises(WeightSyncError, match="will not generate"):
            engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    with open(result_path, "w") as fh:
        json.dump(res, fh)
    os.kill(pids[1], signal.SIGKILL)
    return res


@pytest.mark.timeout(300)
def test_sender_dying_mid_sync_is_named_and_nothing_committed(models, tmp_path):
    timeout_s = 4
    job = named_job("actor", *TENSOR_SYNC, *layout(pp=2), *SMALL_BUCKETS,
                    setting("rollout.weight_sync_timeout_s", timeout_s), hf=models["actor"])
    with pytest.raises(RankError, match="rank 1"):
        run_ranks(_dying_sender_body, 2, job, models["other"], str(tmp_path / "rank0.json"), timeout=240)
    res = json.load(open(tmp_path / "rank0.json"))
    assert res["error"] and "sender rank 1" in res["error"], res
    assert res["version"] == "step-0"  # the engine kept no part of step-1 as a version
    assert res["seconds"] < 3 * timeout_s + 30  # bounded by rollout.weight_sync_timeout_s (pair recv + board)
