"""MoE routing capture in the embedded engine and replay of it in the actor (R3 end to end).

  * ``EmbeddedEngine`` (fp32) captures, per rollout, ``[prompt + response - 1, moe_layers, topk]`` uint8
    expert ids equal to the top-k of HF's own routers in an independent full-sequence (no KV cache, no
    padding) fp32 forward of prompt + response;
  * bf16 engine -> ``StepRollouts.routing`` (``rollout_phase.rollout_routing``) -> ``RolloutBatch`` ->
    actor at TP1: ``rollout_corr/router_agreement`` < 1 (the bf16 engine routes differently from the fp32
    trainer: there is something to fix), and the step's mismatch k3 KL between the engine's and the
    trainer's log-probs is lower with ``routing_replay: r3`` than with replay off, on the same rollouts.

Run: ``OMP_NUM_THREADS=1 pytest tests/test_routing_capture.py -q``
"""
import dataclasses
import json
import os

import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.actor import MegatronActor, RolloutBatch
from megatron_rl.config import job_config_from_dict
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.trainer.rollout_phase import rollout_routing

transformers = pytest.importorskip("transformers")

E, K, NL = 8, 2, 4


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from megatron_rl.testing.tiny_hf import build_tiny_hf_model

    root = tmp_path_factory.mktemp("capture")
    return str(build_tiny_hf_model(root / "moe", arch="qwen3_moe", seed=41, num_hidden_layers=NL, num_experts=E,
                                   num_experts_per_tok=K))


def _prompts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _hf_own_routing(model, ids):
    """HF's own top-k per MoE layer for one unpadded sequence: [len(ids), NL, k]."""
    got = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, o: got.append(o[2]))
             for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return torch.stack(got, dim=1)


def test_embedded_engine_captures_the_models_own_routing(moe_dir):
    from megatron_rl.rollout.embedded import EmbeddedEngine

    engine = EmbeddedEngine(moe_dir, dtype="float32", seed=3)
    assert engine.capture_routing
    rollouts = engine.generate(_prompts(), SamplingParams(temperature=1.0, max_new_tokens=9), n=2)
    model = transformers.AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    agree, total, lengths = 0, 0, set()
    for r in rollouts:
        n = len(r.prompt_ids) + len(r.response_ids) - 1
        assert r.routed_experts.dtype == torch.uint8 and tuple(r.routed_experts.shape) == (n, NL, K)
        ref = _hf_own_routing(model, (r.prompt_ids + r.response_ids)[:n])
        same = (r.routed_experts.long().sort(-1).values == ref.sort(-1).values).all(-1)
        agree += int(same.sum())
        total += same.numel()
        lengths.add(len(r.response_ids))
    assert len(lengths) > 1, "rows of different lengths (some stop early) must be covered"
    assert agree / total > 0.995, f"captured routing agrees with HF's own on {agree}/{total} (token, layer)"
    dense = EmbeddedEngine(moe_dir, dtype="float32", capture_routing=False)
    assert dense.generate([[5, 6]], SamplingParams(max_new_tokens=2))[0].routed_experts is None


def _job(hf_dir, mode):
    from megatron_rl.convert.hf_config import model_config_from_hf

    with open(os.path.join(hf_dir, "config.json")) as fh:
        m = dataclasses.asdict(model_config_from_hf(json.load(fh)))
    m.update(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    return job_config_from_dict({"model": m, "actor": {"load_hf": hf_dir, "micro_batch_size": 4,
                                                       "routing_replay": mode}})


def _rank_kl(rank, world, job, batch, temperature):
    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    actor = MegatronActor(job)
    out = {}
    for mode in ("none", "r3"):
        actor.routing_mode = mode
        lp, _ = actor.compute_log_probs(batch, temperature, compute_entropy=False)
        mask = batch.response_mask.bool()
        d = (batch.rollout_log_probs - lp)[mask]
        out[mode] = {"k3": float((torch.exp(d) - 1 - d).mean()), "metrics": dict(actor.routing_metrics)}
    return out


@pytest.mark.timeout(180)
def test_bf16_engine_routing_replayed_lowers_mismatch(moe_dir):
    from megatron_rl.rollout.embedded import EmbeddedEngine

    T = 1.0
    engine = EmbeddedEngine(moe_dir, dtype="bfloat16", seed=7)
    rollouts = engine.generate(_prompts(8, seed=1), SamplingParams(temperature=T, max_new_tokens=12), n=2)
    routing = rollout_routing(rollouts)
    assert routing is not None and len(routing) == len(rollouts)
    batch = RolloutBatch.from_sequences([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts],
                                        [r.rollout_log_probs for r in rollouts], routing=routing)
    res = run_ranks(_rank_kl, 1, _job(moe_dir, "r3"), batch, T, timeout=150)[0]
    agreement = res["none"]["metrics"]["rollout_corr/router_agreement"]
    assert 0.5 < agreement < 1.0, f"bf16 engine vs fp32 trainer routing agreement {agreement}"
    assert res["r3"]["metrics"]["rollout_corr/router_agreement"] < 1.0
    assert all(f"rollout_corr/router_agreement_layer{j}" in res["none"]["metrics"] for j in range(NL))
    print("router_agreement", agreement, "k3 none", res["none"]["k3"], "k3 r3", res["r3"]["k3"])
    assert res["r3"]["k3"] < res["none"]["k3"], res
