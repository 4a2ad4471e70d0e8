"""LoRA sync into the embedded engine from a TP2 actor with ``actor.lora`` (random non-zero B): adapter-only sync
(``rollout.lora_sync: adapter``: A / B alone, applied in the engine's forward) and merged sync (``merged``: the
bucketed tensor path, checksums verified) both leave the engine giving the trainer's log-probs of a probe batch
(fp32) -- at version 1 and after the adapters change; adapter-only moves a small fraction of the model's bytes;
the log-prob verification catches an adapter applied with the wrong scale (the engine then refuses to serve)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import megatron.core  # noqa: F401  (import once in the parent: forked ranks start fast)
from megatron_rl.convert import storage
from megatron_rl.convert.geometry import HFGeometry
from megatron_rl.testing.distributed import run_ranks

pytest.importorskip("transformers")


def _rank(rank, world, hf_dir):
    from megatron_rl.actor import MegatronActor
    from megatron_rl.lora.apply import lora_modules
    from megatron_rl.lora.config import LoraConfig
    from megatron_rl.convert.lora_layout import set_full_adapters
    from megatron_rl.lora.names import find_targets
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.plan import actor_spec
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.testing.actor_reference import actor_job
    from megatron_rl.testing.lora_sync_reference import ALPHA, RANK, full_adapters
    from megatron_rl.weight_sync.adapter_sync import _trainer_probe, probe_sequences
    from megatron_rl.weight_sync.endpoint import WeightSyncError
    from megatron_rl.weight_sync.publisher import AdapterPublisher, StreamPublisher, build_weight_publisher
    from megatron_rl.weight_sync.settings import WeightSyncSettings

    lora = LoraConfig(rank=RANK, alpha=ALPHA, target_modules=["all-linear"])
    job = actor_job(hf_dir, {"bf16": False, "lora": lora.to_dict()}, parallel={"tensor_model_parallel_size": 2})
    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    actor = MegatronActor(actor_spec(job))  # applies actor.lora: the base frozen
    geom = HFGeometry.from_hf_config(storage.read_hf_config(hf_dir))
    set_full_adapters(find_targets([m.module for m in actor.model], lora), full_adapters(geom, seed=5))

    def settings(mode, alpha=ALPHA):
        r = dataclasses.replace(job.rollout, lora_sync=mode, weight_sync="tensor")
        return WeightSyncSettings.build(r, "/tmp/unused", EmbeddedEngine,
                                        dataclasses.replace(lora, alpha=alpha))

    engines = [EmbeddedEngine(hf_dir, dtype="float32") if rank == 0 else None for _ in range(3)]
    probe = probe_sequences(geom.vocab_size)
    out = {}
    adapter = build_weight_publisher(settings("adapter"), actor, engines[0])
    merged = build_weight_publisher(settings("merged"), actor, engines[1])
    out["classes"] = (type(adapter) is AdapterPublisher, type(merged) is StreamPublisher)
    base_logp = engines[0].token_log_probs(probe) if rank == 0 else None
    for step in (1, 2):
        if step == 2:  # the adapters change between versions
            with torch.no_grad():
                for m in lora_modules(actor.model):
                    m.lora_B.weight.mul_(-1.5)
        trainer = _trainer_probe(actor, probe)
        out[f"adapter{step}"] = adapter.publish(f"step-{step}")
        out[f"merged{step}"] = merged.publish(f"step-{step}")
        if rank == 0:
            for name, eng in (("adapter", engines[0]), ("merged", engines[1])):
                got = torch.tensor(eng.token_log_probs(probe))
                out[f"{name}{step}_diff"] = float((got - trainer).abs().max())
                out[f"{name}{step}_moved"] = float((got - torch.tensor(base_logp)).abs().max())
    wrong = build_weight_publisher(settings("adapter", alpha=ALPHA * 0.8), actor, engines[2])
    try:
        wrong.publish("step-3")
        out["wrong"] = None
    except WeightSyncError as exc:
        out["wrong"] = str(exc)
    if rank == 0:
        out["wrong_refuses"] = engines[2]._invalid is not None
        out["model_bytes"] = sum(t.numel() * t.element_size() for t in engines[1].model.state_dict().values())
    return out


def test_adapter_and_merged_sync_give_the_trainer_log_probs(tiny_hf_model):
    hf_dir = tiny_hf_model("qwen2", seed=31)
    res = run_ranks(_rank, 2, hf_dir, timeout=300)
    r0 = res[0]
    assert r0["classes"] == (True, True)
    for step in (1, 2):
        for mode in ("adapter", "merged"):
            assert r0[f"{mode}{step}_diff"] < 1e-4, (mode, step, r0[f"{mode}{step}_diff"])
            assert r0[f"{mode}{step}_moved"] > 1e-2  # the adapters changed the engine's outputs
        for r in res:  # every rank reports the verified sync
            assert r[f"adapter{step}"]["weight_sync/verified"] == 1.0
            assert r[f"merged{step}"]["weight_sync/verified"] == 1.0
        moved = r0[f"adapter{step}"]["weight_sync/bytes"]
        assert 0 < moved < 0.2 * r0[f"merged{step}"]["weight_sync/bytes"]
    assert r0["wrong"] is not None and "log-probs of the probe differ" in r0["wrong"]
    assert res[1]["wrong"] is not None  # raised on every rank
    assert r0["wrong_refuses"]
