"""The MoE routing references shared by the routing-capture tests (embedded engine, SGLang) and their ranks.

* ``random_prompts``: the seeded token-id prompts the capture tests generate from;
* ``hf_own_routing``: HF transformers' own router top-k of one unpadded sequence (a full fp32 forward, no KV
  cache) — the independent reference a captured ``routed_experts`` is compared with;
* ``replay_job`` / ``rollouts_batch`` / ``rank_replay_mismatch``: an actor job of a MoE directory, the batch of
  engine rollouts, and the forked rank that measures the engine-vs-trainer mismatch (k3 KL and
  ``rollout_corr/router_agreement``) with routing replay off and with ``r3``, on the same batch.

"""
from __future__ import annotations

import torch

from megatron_rl.testing.jobs import NO_LOAD_BALANCING, named_job


def random_prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of 2-6 token ids in ``[3, 300)``, seeded."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def hf_own_routing(model, ids: list[int]) -> torch.Tensor:
    """HF's own top-k per MoE layer for one unpadded sequence: ``[len(ids), moe_layers, k]``."""
    got = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, o: got.append(o[2])) for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return torch.stack(got, dim=1)


def replay_job(hf_dir: str, mode: str):
    """The job of an actor on ``hf_dir`` (micro-batch 4, no load balancing loss) with ``routing_replay: mode``."""
    return named_job("actor", "actor.micro_batch_size=4", f"actor.routing_replay={mode}", *NO_LOAD_BALANCING, hf=hf_dir)


def rollouts_batch(rollouts, routing) -> "RolloutBatch":
    """The ``RolloutBatch`` of engine rollouts (prompt, response, rollout log-probs) with ``routing``."""
    from megatron_rl.actor import RolloutBatch

    return RolloutBatch.from_sequences([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts],
                                       [r.rollout_log_probs for r in rollouts], routing=routing)


def rank_replay_mismatch(rank, world, job, batch, temperature):
    """On one rank: for routing mode ``none`` then ``r3``, the k3 KL of the batch's rollout log-probs to the
    actor's and the actor's routing metrics."""
    from megatron_rl.actor import MegatronActor
    from megatron_rl.plan import actor_spec
    from megatron_rl.actor.replay_modes import replay_mode
    from megatron_rl.parallel import initialize_model_parallel

    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    actor = MegatronActor(actor_spec(job))
    out = {}
    for mode in ("none", "r3"):
        actor.replay = replay_mode(mode)
        lp, _ = actor.compute_log_probs(batch, temperature, compute_entropy=False)
        mask = batch.response_mask.bool()
        d = (batch.rollout_log_probs - lp)[mask]
        out[mode] = {"k3": float((torch.exp(d) - 1 - d).mean()), "metrics": dict(actor.routing_metrics)}
    return out
