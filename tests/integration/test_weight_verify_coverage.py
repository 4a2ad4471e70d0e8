"""Weight-sync verification covers EVERY parameter class, in the embedded engine and a real SGLang server.

Model: a tiny Qwen3-MoE, untied lm_head: q/k/v (SGLang fuses them into ``qkv_proj``), embedding and lm_head
(SGLang pads their rows), experts (SGLang ``w13_weight`` / ``w2_weight``, transformers 5
``experts.gate_up_proj`` / ``down_proj``); for the embedded engine with a dense first layer
(``mlp_only_layers=[0]``: dense gate/up). SGLang 0.5.23's Qwen3-MoE ignores ``mlp_only_layers`` (it builds
every layer sparse and drops the dense weights), so its dense gate/up class is tested at TP=2 on a dense
model (``test_weight_sync_tp2.py``).

* One tensor of each class is perturbed in transit (after the trainer handed it over): the sync fails naming
  the engine tensor holding it and the HF tensor — the reference is the engine's own copy (SGLang's
  ``/weights_checker`` sha256, or the embedded model's parameters).
* A clean sync with every tensor sampled verifies ``weight_sync/verified_param_frac == 1``.
* Async (producer-applied) syncs are verified too: an engine whose load goes wrong after the update is named.
* Disk mode keeps only the exports an engine may still need (the count after N syncs).

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_weight_verify_coverage.py -q``
"""
import os

import pytest
import torch

from megatron_rl.rollout.sglang_server import find_free_port, sglang_available
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import layout, named_job, setting
from megatron_rl.testing.sglang_script import served
from megatron_rl.testing.tiny_hf import build_tiny_hf_model

transformers = pytest.importorskip("transformers")

#: one HF tensor per parameter class -> the engine tensor that holds it (SGLang, embedded)
CLASSES = {
    "q": ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.qkv_proj.weight",
          "model.layers.1.self_attn.q_proj.weight"),
    "v": ("model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.qkv_proj.weight",
          "model.layers.0.self_attn.v_proj.weight"),
    "up": ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
           "model.layers.0.mlp.up_proj.weight"),
    "embedding": ("model.embed_tokens.weight", "model.embed_tokens.weight", "model.embed_tokens.weight"),
    "lm_head": ("lm_head.weight", "lm_head.weight", "lm_head.weight"),
    "expert_up": ("model.layers.1.mlp.experts.2.up_proj.weight", "model.layers.1.mlp.experts.w13_weight",
                  "model.layers.1.mlp.experts.gate_up_proj"),
    "expert_down": ("model.layers.1.mlp.experts.3.down_proj.weight", "model.layers.1.mlp.experts.w2_weight",
                    "model.layers.1.mlp.experts.down_proj"),
}


def _moe(root, seed, **kw):
    return build_tiny_hf_model(root, arch="qwen3_moe", seed=seed, num_hidden_layers=2, num_experts=4,
                               num_experts_per_tok=2, tie_word_embeddings=False, **kw)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ws_cover")
    return {"actor": _moe(root / "actor", 1, mlp_only_layers=[0]), "other": _moe(root / "other", 2, mlp_only_layers=[0]),
            "moe_actor": _moe(root / "moe_actor", 1), "moe_other": _moe(root / "moe_other", 2)}


#: every tensor verified after a sync
VERIFY_ALL = ("rollout.weight_sync_verify_tensors=-1",)
#: the SGLang rows' server URL is the test's own; the job's is a placeholder
PLACEHOLDER_URL = ("rollout.sglang_urls=[http://x:1]",)


def _classes_body(rank, world, job, make_engine, classes):
    """Sync once per class with that class's tensor perturbed in transit, then once clean."""
    from megatron_rl.actor import MegatronActor
    from megatron_rl.plan import actor_spec
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.rollout.base import WeightSyncError
    from megatron_rl.weight_sync.publisher import build_weight_publisher
    from megatron_rl.trainer.sync_settings import weight_sync_settings

    initialize_model_parallel(job.parallel, seed=3, model=job.model)
    actor = MegatronActor(actor_spec(job))
    engine = make_engine()
    out = {}
    try:
        for i, (cls, row) in enumerate(classes.items()):
            def corrupt(bucket, name=row[0]):
                for n, t in bucket.tensors():
                    if n == name:
                        t.view(-1)[0] += 0.5

            try:
                build_weight_publisher(weight_sync_settings(job), actor, engine, corrupt=corrupt).publish(f"step-{i + 1}")
                out[cls] = "no error"
            except WeightSyncError as exc:
                out[cls] = str(exc)
        out["clean"] = build_weight_publisher(weight_sync_settings(job), actor, engine).publish("step-20")
    finally:
        engine.close()
    return out


def _check_classes(out, classes, col):
    wrong = {}
    for cls, row in classes.items():
        err = out[cls]
        others = [r[0] for c, r in classes.items() if c != cls and r[0] != row[0]]
        if not ("verification failed" in err and row[col] in err and row[0] in err):
            wrong[cls] = err  # the engine tensor and the HF tensor inside it must be named ...
        elif any(o in err for o in others):
            wrong[cls] = "names other tensors too: " + err  # ... and nothing else
    assert not wrong, wrong
    m = out["clean"]
    assert m["weight_sync/verified"] == 1.0 and m["weight_sync/verified_param_frac"] == 1.0, m


def _embedded(path):
    from megatron_rl.rollout.embedded import EmbeddedEngine

    return lambda: EmbeddedEngine(path, dtype="float32", seed=0, weight_version="step-0")


@pytest.mark.timeout(600)
def test_every_class_named_embedded(models):
    job = named_job("actor", *VERIFY_ALL, "rollout.weight_sync=tensor", "rollout.weight_sync_bucket_mb=0.02",
                    hf=models["actor"])
    out = run_ranks(_classes_body, 1, job, _embedded(models["other"]), CLASSES, timeout=540)[0]
    _check_classes(out, CLASSES, 2)


def _async_body(rank, world, job, engine_dir, broken):
    """Async apply (the producer's path, as the loop calls it): a disk export loaded, then the same with a load
    fault in the engine."""
    from megatron_rl.actor import MegatronActor
    from megatron_rl.plan import actor_spec
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.rollout.base import SamplingParams, WeightSyncError
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.weight_sync.publisher import payload_maker
    from megatron_rl.trainer.sync_settings import weight_sync_settings

    initialize_model_parallel(job.parallel, seed=3, model=job.model)
    actor = MegatronActor(actor_spec(job))
    engine = EmbeddedEngine(engine_dir, dtype="float32", seed=0, weight_version="step-0")
    load = engine.update_weights

    def faulty_load(hf_dir, version):  # an engine-side load fault (a real loader cannot fail on demand)
        load(hf_dir, version)
        with torch.no_grad():
            engine.model.state_dict()[broken].view(-1)[0] += 0.5

    payload = payload_maker(actor, weight_sync_settings(job))("step-1")
    good = payload.apply(engine, weight_sync_settings(job), "step-1")
    engine.update_weights = faulty_load
    try:
        payload.apply(engine, weight_sync_settings(job), "step-2")
        return {"good": good.metrics() if good else {}, "error": None}
    except WeightSyncError as exc:
        try:
            engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
            refused = False
        except WeightSyncError:
            refused = True
        return {"good": good.metrics() if good else {}, "error": str(exc), "refused": refused}


@pytest.mark.timeout(600)
def test_async_apply_is_verified_embedded(models, tmp_path):
    job = named_job("actor", *VERIFY_ALL, "rollout.weight_sync=disk", "rollout.mode=async", hf=models["actor"],
                    run_dir=tmp_path / "run")
    broken = "model.layers.1.mlp.experts.gate_up_proj"
    out = run_ranks(_async_body, 1, job, models["other"], broken, timeout=540)[0]
    assert out["error"] and "verification failed" in out["error"] and broken in out["error"], out
    assert out["refused"]
    assert out["good"]["weight_sync/verified_param_frac"] == 1.0


def _disk_body(rank, world, job, engine_dir, n):
    from megatron_rl.actor import MegatronActor
    from megatron_rl.plan import actor_spec
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.weight_sync.publisher import build_weight_publisher
    from megatron_rl.trainer.sync_settings import weight_sync_settings

    initialize_model_parallel(job.parallel, seed=3, model=job.model)
    actor = MegatronActor(actor_spec(job))
    engine = EmbeddedEngine(engine_dir, dtype="bfloat16", seed=0, weight_version="step-0")
    out_dir = os.path.join(job.trainer.run_dir, "weight_sync")
    counts, metrics = [], []
    for v in range(1, n + 1):
        metrics.append(build_weight_publisher(weight_sync_settings(job), actor, engine).publish(f"step-{v}"))
        counts.append(sorted(os.listdir(out_dir)))
    return {"counts": counts, "metrics": metrics, "version": engine.weight_version}


@pytest.mark.timeout(600)
def test_disk_sync_keeps_one_export_and_verifies(models, tmp_path):
    job = named_job("actor", *VERIFY_ALL, "rollout.weight_sync=disk", hf=models["actor"], run_dir=tmp_path / "run")
    out = run_ranks(_disk_body, 1, job, models["other"], 4, timeout=540)[0]
    assert out["counts"] == [["step-1"], ["step-2"], ["step-3"], ["step-4"]]
    assert out["version"] == "step-4"
    for m in out["metrics"]:
        assert m["weight_sync/verified"] == 1.0 and m["weight_sync/verified_param_frac"] == 1.0, m


# ------------------------------------------------------------------------------------------ real SGLang

_OK, _REASON = sglang_available()


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    if not _OK:
        pytest.skip(_REASON)
    yield from served(models["moe_other"], tmp_path_factory.mktemp("ws_cover_log"), port=find_free_port(),
                      max_total_tokens=2048, ready_timeout=600)


def _sglang(url):
    from megatron_rl.rollout.sglang_engine import SGLangEngine

    return lambda: SGLangEngine(url, weight_sync_timeout=120)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_class_named_sglang(models, server):
    job = named_job("sglang_actor", *PLACEHOLDER_URL, *VERIFY_ALL, "rollout.weight_sync=distributed",
                    "rollout.weight_sync_bucket_mb=0.05", hf=models["moe_actor"])
    classes = {k: v for k, v in CLASSES.items() if k != "up"}
    out = run_ranks(_classes_body, 1, job, _sglang(server.url), classes, timeout=800)[0]
    _check_classes(out, classes, 1)


# ------------------------------------------------------------- several senders: expert-parallel ranks

def _senders_body(rank, world, job, make_engine, corrupt_name):
    """EP2: a clean sync (bytes through this rank counted), then one with an expert of EP rank 1 perturbed."""
    from megatron_rl.actor import MegatronActor
    from megatron_rl.plan import actor_spec
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.rollout.base import SamplingParams, WeightSyncError
    from megatron_rl.testing.traffic import Traffic
    from megatron_rl.weight_sync.publisher import build_weight_publisher
    from megatron_rl.trainer.sync_settings import weight_sync_settings

    initialize_model_parallel(job.parallel, seed=3, model=job.model)
    actor = MegatronActor(actor_spec(job))
    engine = make_engine() if rank == 0 else None
    # this rank's own shard: its experts, and on EP rank 0 the dense tensors (fp32: >= any engine dtype)
    own = sum(p.numel() for n, p in actor.model[0].named_parameters() if "experts" in n or rank == 0) * 4
    out = {"own_fp32": own}
    try:
        with Traffic() as t:
            out["metrics"] = build_weight_publisher(weight_sync_settings(job), actor, engine).publish("step-1")
        out["sent"], out["received"] = t.sent, t.received
        if rank == 0 and hasattr(engine, "model"):
            out["state"] = {k: v.clone() for k, v in engine.model.state_dict().items()}
        elif rank == 0:
            from megatron_rl.testing.sglang_script import server_checksums

            out["state"] = server_checksums(engine.urls[0])[0]

        def corrupt(bucket):
            for n, x in bucket.tensors():
                if n == corrupt_name:
                    x.view(-1)[0] += 0.5

        try:
            build_weight_publisher(weight_sync_settings(job), actor, engine, corrupt=corrupt).publish("step-2")
            out["error"] = "no error"
        except WeightSyncError as exc:
            out["error"] = str(exc)
            if rank == 0:
                try:
                    engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
                except WeightSyncError as e2:
                    out["refused"] = "will not generate" in str(e2)
    finally:
        if engine is not None:
            engine.close()
    return out


def _check_senders(out, corrupt_name, engine_tensor, bucket_bytes):
    m = out[0]["metrics"]
    assert m["weight_sync/senders"] == 2.0 and m["weight_sync/verified_param_frac"] == 1.0, m
    assert all(o["metrics"] == m for o in out)
    for r, o in enumerate(out):  # no rank carries another's tensors: its own shard (fp32 bound) + one bucket
        assert 0 < o["sent"] + o["received"] <= o["own_fp32"] + bucket_bytes, (r, o["sent"], o["received"])
    # the expert tensors of EP rank 1 went out from rank 1, not through rank 0
    assert out[1]["sent"] > 0
    for o in out:  # every rank raises, naming the fused engine tensor and the perturbed expert of rank 1
        assert "verification failed" in o["error"] and corrupt_name in o["error"] and engine_tensor in o["error"]
    assert out[0]["refused"]


@pytest.mark.timeout(600)
def test_expert_parallel_senders_embedded(models):
    """EP2 into the embedded engine: every tensor == the engine loaded from the checkpoint itself."""
    from megatron_rl.rollout.embedded import EmbeddedEngine

    bucket = 0.02
    job = named_job("actor", *VERIFY_ALL, *layout(ep=2), "rollout.weight_sync=tensor",
                    setting("rollout.weight_sync_bucket_mb", bucket), hf=models["actor"])
    name = "model.layers.1.mlp.experts.3.up_proj.weight"  # expert 3: EP rank 1's
    out = run_ranks(_senders_body, 2, job, _embedded(models["other"]), name, timeout=540)
    ref = EmbeddedEngine(models["actor"], dtype="float32", seed=0).model.state_dict()
    got = out[0]["state"]
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    _check_senders(out, name, "model.layers.1.mlp.experts.gate_up_proj", int(bucket * (1 << 20)))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_expert_parallel_senders_sglang(models, server):
    """EP2 into a real SGLang server, each EP rank over its own update group: every server tensor == the same
    server after ``/update_weights_from_disk`` of the actor's checkpoint."""
    from megatron_rl.testing.sglang_script import load_from_disk, server_checksums

    url = server.url
    load_from_disk(url, models["moe_actor"], "disk-ref")
    want = server_checksums(url)[0]
    load_from_disk(url, models["moe_other"], "step-0")
    bucket = 0.05
    job = named_job("sglang_actor", *PLACEHOLDER_URL, *VERIFY_ALL, *layout(ep=2), "rollout.weight_sync=distributed",
                    setting("rollout.weight_sync_bucket_mb", bucket), hf=models["moe_actor"])
    name = "model.layers.1.mlp.experts.2.up_proj.weight"  # expert 2: EP rank 1's
    out = run_ranks(_senders_body, 2, job, _sglang(url), name, timeout=800)
    assert out[0]["state"] == want  # every server tensor, fused qkv / gate_up / experts included
    _check_senders(out, name, "model.layers.1.mlp.experts.w13_weight", int(bucket * (1 << 20)))
