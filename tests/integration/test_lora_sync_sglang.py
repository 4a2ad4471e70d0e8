"""Adapter-only LoRA sync (``rollout.lora_sync: adapter``) into a REAL CPU SGLang server (bf16, started with the
job's LoRA flags, ``rollout.sglang_lora_flags``; its LoRA layers allocate unpinned: ``platform/sglang_cpu``).

Reference (independent of the sync code): the trainer's own log-probs (the adapted megatron-core actor, proven
equal to PEFT's LoRA in ``test_lora_peft.py``) of the probe batch and of the server's sampled responses.

* versions step-0 .. step-3 (the adapters change between versions): after each publish the server's probe
  log-probs (the adapter named in the request) equal the trainer's within the bf16 tolerance and moved away from
  the base model's by more than it; the responses ``generate`` samples carry the trainer's log-probs and the
  version; the previous version's adapter is unloaded (the server refuses its name) and its directory deleted;
  only the adapters' bytes move.
* an adapter applied with a wrong scale is caught by the probe verification on every rank and the engine then
  refuses to generate.
* merged sync (``rollout.lora_sync: merged``, bucketed tensor mode, the same server): versions step-0 .. step-3,
  the adapters changed between versions, the server's log-probs of the probe (no adapter named: the merged base)
  equal the trainer's (adapters on) within the bf16 tolerance and moved away from the base model's by more than it
  (a sync that bypasses the merged view -- the base sent without B @ A -- fails there); verified by SGLang's
  checksums. The server gets its launch weights back afterwards.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_lora_sync_sglang.py -q``
"""
from __future__ import annotations

import os

import pytest

from megatron_rl.rollout.sglang_server import sglang_available
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.sglang_script import SharedServer

_OK, _REASON = sglang_available()
pytestmark = [pytest.mark.skipif(not _OK, reason=_REASON), pytest.mark.slow]


@pytest.fixture(scope="module")
def model_dir(tiny_hf_model):
    return tiny_hf_model("qwen2", seed=31)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    from megatron_rl.lora.config import LoraConfig
    from megatron_rl.rollout.sglang_lora_flags import sglang_lora_args
    from megatron_rl.testing.lora_sync_reference import RANK

    args = sglang_lora_args(LoraConfig(rank=RANK, target_modules=["all-linear"]), "cpu")
    with SharedServer(model_dir, tmp_path_factory.mktemp("lora_sglang_log"), max_total_tokens=2048,
                      ready_timeout=400, extra_args=args) as shared:
        yield shared.get()


def _rank(rank, world, hf_dir, url, adapter_dir):
    import dataclasses

    import requests
    import torch

    from megatron_rl.actor import MegatronActor, RolloutBatch
    from megatron_rl.convert import storage
    from megatron_rl.convert.geometry import HFGeometry
    from megatron_rl.lora.apply import lora_modules
    from megatron_rl.lora.config import LoraConfig
    from megatron_rl.convert.lora_layout import set_full_adapters
    from megatron_rl.lora.names import find_targets
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.plan import actor_spec
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.sglang_engine import SGLangEngine
    from megatron_rl.testing.actor_reference import actor_job
    from megatron_rl.testing.lora_sync_reference import ALPHA, RANK, full_adapters
    from megatron_rl.weight_sync.adapter_sync import _trainer_probe, probe_sequences
    from megatron_rl.weight_sync.endpoint import WeightSyncError
    from megatron_rl.weight_sync.publisher import AdapterPublisher, build_weight_publisher
    from megatron_rl.weight_sync.settings import WeightSyncSettings

    lora = LoraConfig(rank=RANK, alpha=ALPHA, target_modules=["all-linear"])
    job = actor_job(hf_dir, {"bf16": False, "lora": lora.to_dict()})
    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    actor = MegatronActor(actor_spec(job))
    geom = HFGeometry.from_hf_config(storage.read_hf_config(hf_dir))
    set_full_adapters(find_targets([m.module for m in actor.model], lora), full_adapters(geom, seed=5))

    def settings(alpha=ALPHA):
        r = dataclasses.replace(job.rollout, engine="sglang", sglang_urls=[url], lora_sync="adapter",
                                weight_sync_verify_interval=1)
        return WeightSyncSettings.build(r, "/tmp/unused", SGLangEngine, dataclasses.replace(lora, alpha=alpha))

    engine = SGLangEngine([url], lora_adapter_dir=adapter_dir, weight_version="start") if rank == 0 else None
    probe = probe_sequences(geom.vocab_size)
    out = {"steps": {}}
    base = torch.tensor(engine.token_log_probs(probe)) if rank == 0 else None
    pub = build_weight_publisher(settings(), actor, engine)
    out["class"] = type(pub) is AdapterPublisher
    for step in range(4):
        if step:  # the adapters change between versions
            with torch.no_grad():
                for m in lora_modules(actor.model):
                    m.lora_B.weight.mul_(-1.3).add_(0.05 * torch.randn_like(m.lora_B.weight))
        trainer = _trainer_probe(actor, probe)
        res = {"metrics": pub.publish(f"step-{step}")}
        if rank == 0:
            got = torch.tensor(engine.token_log_probs(probe))
            res["diff"] = float((got - trainer).abs().max())
            res["moved"] = float((got - base).abs().max())
            [ro] = engine.generate([probe[0][:6]], SamplingParams(temperature=1.0, max_new_tokens=6))
            res["version"] = (ro.weight_version, requests.get(url + "/get_model_info", timeout=30).json()
                              ["weight_version"])
            res["dirs"] = sorted(os.listdir(adapter_dir))
            if step:  # the previous version's adapter is gone from the server
                old = requests.post(url + "/generate", json={"input_ids": probe[0][:4], "lora_path": f"step-{step - 1}",
                                                            "sampling_params": {"max_new_tokens": 1}}, timeout=60)
                res["old_refused"] = old.status_code >= 400 or "error" in old.text.lower()
            res["rollout"] = (ro.prompt_ids, ro.response_ids, ro.rollout_log_probs)
        out["steps"][step] = res
    # the trainer's log-probs of the response the server sampled at the last version (one rank: no collective
    # mismatch; the adapters are unchanged since that publish)
    p, r, lp = out["steps"][3]["rollout"]
    logp, _ = actor.compute_log_probs(RolloutBatch.from_sequences([p], [r]), temperature=1.0, compute_entropy=False)
    out["sampled_vs_trainer"] = float((logp[0, -len(r):].float() - torch.tensor(lp)).abs().max())
    wrong = build_weight_publisher(settings(alpha=ALPHA * 0.3), actor, engine)
    try:
        wrong.publish("step-4")
        out["wrong"] = None
    except WeightSyncError as exc:
        out["wrong"] = str(exc)
    if rank == 0:
        try:
            engine.generate([probe[0][:6]], SamplingParams(max_new_tokens=2))
            out["wrong_refuses"] = False
        except WeightSyncError:
            out["wrong_refuses"] = True
        out["model_bytes"] = sum(os.path.getsize(os.path.join(hf_dir, f)) for f in os.listdir(hf_dir)
                                 if f.endswith(".safetensors"))
    return out


def test_adapter_sync_to_a_real_sglang_server_gives_the_trainers_log_probs(model_dir, server, tmp_path):
    adapter_dir = str(tmp_path / "lora_adapters")
    [r0] = run_ranks(_rank, 1, model_dir, server.url, adapter_dir, timeout=400)
    assert r0["class"]
    for step, res in r0["steps"].items():
        assert res["diff"] < 0.1, (step, res["diff"])  # bf16 server vs fp32 trainer
        assert res["moved"] > 0.3, (step, res["moved"])  # the adapter is served (far beyond the tolerance)
        assert res["metrics"]["weight_sync/verified"] == 1.0
        assert 0 < res["metrics"]["weight_sync/bytes"] < 0.2 * r0["model_bytes"]
        assert res["version"] == (f"step-{step}", f"step-{step}")
        assert res["dirs"] == [f"step-{step}"]
        if step:
            assert res["old_refused"], step
    assert r0["sampled_vs_trainer"] < 0.1, r0["sampled_vs_trainer"]
    assert r0["wrong"] is not None and "log-probs of the probe differ" in r0["wrong"], r0["wrong"]
    assert r0["wrong_refuses"]


def _merged_rank(rank, world, hf_dir, url):
    import dataclasses

    import torch

    from megatron_rl.actor import MegatronActor
    from megatron_rl.convert import storage
    from megatron_rl.convert.geometry import HFGeometry
    from megatron_rl.lora.apply import lora_modules
    from megatron_rl.lora.config import LoraConfig
    from megatron_rl.convert.lora_layout import set_full_adapters
    from megatron_rl.lora.names import find_targets
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.plan import actor_spec
    from megatron_rl.rollout.sglang_engine import SGLangEngine
    from megatron_rl.testing.actor_reference import actor_job
    from megatron_rl.testing.lora_sync_reference import ALPHA, RANK, full_adapters
    from megatron_rl.weight_sync.adapter_sync import _trainer_probe, probe_sequences
    from megatron_rl.weight_sync.publisher import StreamPublisher, build_weight_publisher
    from megatron_rl.weight_sync.settings import WeightSyncSettings

    lora = LoraConfig(rank=RANK, alpha=ALPHA, target_modules=["all-linear"])
    job = actor_job(hf_dir, {"bf16": False, "lora": lora.to_dict()})
    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    actor = MegatronActor(actor_spec(job))
    geom = HFGeometry.from_hf_config(storage.read_hf_config(hf_dir))
    set_full_adapters(find_targets([m.module for m in actor.model], lora), full_adapters(geom, seed=6))
    r = dataclasses.replace(job.rollout, engine="sglang", sglang_urls=[url], lora_sync="merged",
                            weight_sync="tensor", weight_sync_verify_interval=1, weight_sync_verify_tensors=-1)
    engine = SGLangEngine([url], weight_version="start", weight_sync_timeout=120) if rank == 0 else None
    probe = probe_sequences(geom.vocab_size)
    base = torch.tensor(engine.token_log_probs(probe)) if rank == 0 else None
    pub = build_weight_publisher(WeightSyncSettings.build(r, "/tmp/unused", SGLangEngine, lora), actor, engine)
    out = {"class": type(pub) is StreamPublisher, "steps": {}}
    try:
        for step in range(4):
            if step:  # the adapters change between versions
                with torch.no_grad():
                    for m in lora_modules(actor.model):
                        m.lora_B.weight.mul_(-1.3).add_(0.05 * torch.randn_like(m.lora_B.weight))
            trainer = _trainer_probe(actor, probe)
            res = {"metrics": pub.publish(f"step-{step}")}
            if rank == 0:
                got = torch.tensor(engine.token_log_probs(probe))
                res["diff"] = float((got - trainer).abs().max())
                res["moved"] = float((got - base).abs().max())
            out["steps"][step] = res
    finally:
        if engine is not None:
            engine.close()
    return out


def test_merged_sync_to_a_real_sglang_server_gives_the_trainers_log_probs(model_dir, server):
    from megatron_rl.testing.sglang_script import load_from_disk

    try:
        [r0] = run_ranks(_merged_rank, 1, model_dir, server.url, timeout=400)
    finally:  # the server's launch weights back (the adapter-only test above serves adapters over them)
        load_from_disk(server.url, model_dir, "start")
    assert r0["class"]
    for step, res in r0["steps"].items():
        assert res["diff"] < 0.1, (step, res["diff"])  # bf16 server vs fp32 trainer
        assert res["moved"] > 0.3, (step, res["moved"])  # B @ A is in the served weights (far beyond the tolerance)
        assert res["metrics"]["weight_sync/verified"] == 1.0
