"""MoE routing capture in the embedded engine and replay of it in the actor (R3 end to end).

  * ``EmbeddedEngine`` (fp32) captures, per rollout, ``[prompt + response - 1, moe_layers, topk]`` uint8
    expert ids equal to the top-k of HF's own routers in an independent full-sequence (no KV cache, no
    padding) fp32 forward of prompt + response;
  * bf16 engine -> ``StepBatch.routing`` (``rollout_phase.rollout_routing``) -> ``RolloutBatch`` ->
    actor at TP1: ``rollout_corr/router_agreement`` < 1 (the bf16 engine routes differently from the fp32
    trainer: there is something to fix), and the step's mismatch k3 KL between the engine's and the
    trainer's log-probs is lower with ``routing_replay: r3`` than with replay off, on the same rollouts.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_routing_capture.py -q``
"""
import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.testing.actor_reference import load_hf_reference
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.routing_reference import (hf_own_routing, random_prompts, rank_replay_mismatch,
                                                   replay_job, rollouts_batch)
from megatron_rl.trainer.rollout_phase import rollout_routing

transformers = pytest.importorskip("transformers")

E, K, NL = 8, 2, 4


@pytest.fixture(scope="module")
def moe_dir(tiny_hf_model):
    return tiny_hf_model("qwen3_moe", seed=41, num_hidden_layers=NL, num_experts=E, num_experts_per_tok=K)


def test_embedded_engine_captures_the_models_own_routing(moe_dir):
    from megatron_rl.rollout.embedded import EmbeddedEngine

    engine = EmbeddedEngine(moe_dir, dtype="float32", seed=3)
    assert engine.capture_routing
    rollouts = engine.generate(random_prompts(), SamplingParams(temperature=1.0, max_new_tokens=9), n=2)
    model = load_hf_reference(moe_dir).eval()
    agree, total, lengths = 0, 0, set()
    for r in rollouts:
        n = len(r.prompt_ids) + len(r.response_ids) - 1
        assert r.routed_experts.dtype == torch.uint8 and tuple(r.routed_experts.shape) == (n, NL, K)
        ref = hf_own_routing(model, (r.prompt_ids + r.response_ids)[:n])
        same = (r.routed_experts.long().sort(-1).values == ref.sort(-1).values).all(-1)
        agree += int(same.sum())
        total += same.numel()
        lengths.add(len(r.response_ids))
    assert len(lengths) > 1, "rows of different lengths (some stop early) must be covered"
    assert agree / total > 0.995, f"captured routing agrees with HF's own on {agree}/{total} (token, layer)"
    dense = EmbeddedEngine(moe_dir, dtype="float32", capture_routing=False)
    assert dense.generate([[5, 6]], SamplingParams(max_new_tokens=2))[0].routed_experts is None


@pytest.mark.timeout(180)
def test_bf16_engine_routing_replayed_lowers_mismatch(moe_dir):
    from megatron_rl.rollout.embedded import EmbeddedEngine

    T = 1.0
    engine = EmbeddedEngine(moe_dir, dtype="bfloat16", seed=7)
    rollouts = engine.generate(random_prompts(8, seed=1), SamplingParams(temperature=T, max_new_tokens=12), n=2)
    routing = rollout_routing(rollouts)
    assert routing is not None and len(routing) == len(rollouts)
    res = run_ranks(rank_replay_mismatch, 1, replay_job(moe_dir, "r3"), rollouts_batch(rollouts, routing), T,
                    timeout=150)[0]
    agreement = res["none"]["metrics"]["rollout_corr/router_agreement"]
    assert 0.5 < agreement < 1.0, f"bf16 engine vs fp32 trainer routing agreement {agreement}"
    assert res["r3"]["metrics"]["rollout_corr/router_agreement"] < 1.0
    assert all(f"rollout_corr/router_agreement_layer{j}" in res["none"]["metrics"] for j in range(NL))
    print("router_agreement", agreement, "k3 none", res["none"]["k3"], "k3 r3", res["r3"]["k3"])
    assert res["r3"]["k3"] < res["none"]["k3"], res
