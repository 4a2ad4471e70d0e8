"""The actor-vs-HF-reference set-up shared by the actor tests and the ranks they fork.

A test of ``MegatronActor`` builds a job from a tiny HF directory (``tiny_hf.build_tiny_hf_model``), forks
ranks that run the actor (``distributed.run_ranks``; fixtures do not reach a forked rank, so the pieces here
are plain functions), and compares with an independent single-process reference: HF transformers in fp32
plus torch's AdamW. This module holds the pieces every such test wrote again:

* ``hf_model_config`` / ``hf_model_section``: the model section read from the directory's ``config.json`` by the
  project's one HF config reading (the tests build their jobs from ``testing.jobs``, whose actor rows use it);
  ``actor_job``: such a job from plain sections, for tools outside the tests;
* ``policy_data``: a random rollout batch with old log-probs, advantages, a response mask and IS weights;
* ``load_hf_reference``, ``hf_token_log_probs``, ``hf_adamw``, ``unfuse_experts``: the HF side;
* ``actor_on_shard``: on a rank, the actor and its DP block of the batch;
* ``rank_main_grads`` / ``merge_rank_grads``: each rank's Megatron ``main_grad`` by ``RankCoords``, and
  their merge into one unsharded state dict on the parent;
* ``assert_state_dicts_close``: two state dicts with the same keys, every tensor within ``atol`` (0: equal).

In tests, conftest.py's ``tiny_hf_model`` fixture builds the directories and its ``hf_reference`` fixture loads
the HF side; a forked rank calls the functions here directly.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional

import torch

#: The reference train step's learning rate (AdamW on both sides).
LR = 1e-3
#: The reference train step's gradient clipping (small: clipping is active in every test step).
CLIP_GRAD = 0.02
#: The PPO-clip policy loss the actor reference tests train with (``actor.policy_loss``).
PPO_LOSS = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "loss_agg_mode": "seq-mean-token-mean"}
#: The correction every actor reference test trains with: token-level IS, threshold 2, PPO-clip loss.
TOKEN_IS = {"rollout_is": "token", "rollout_is_threshold": 2.0, "bypass_mode": False, "loss_type": "ppo_clip"}


def hf_model_config(hf_dir: str, **kwargs: Any):
    """The ``ModelConfig`` of the HF directory's ``config.json`` (``convert.hf_config.model_config_from_hf``,
    the project's one HF config reading; ``kwargs`` go to it, e.g. ``padded_vocab_size``)."""
    from megatron_rl.convert.hf_config import model_config_from_hf
    from megatron_rl.convert.storage import read_hf_config

    return model_config_from_hf(read_hf_config(hf_dir), **kwargs)


def hf_model_section(hf_dir: str, **overrides: Any) -> dict:
    """The ``model:`` section (a dict) of ``hf_model_config(hf_dir)``, with ``overrides`` applied."""
    section = dataclasses.asdict(hf_model_config(hf_dir))
    section.update(overrides)
    return section


def actor_job(hf_dir: str, actor: dict, parallel: Optional[dict] = None, model: Optional[dict] = None,
              correction: Optional[dict] = None):
    """``JobConfig`` of an actor that loads ``hf_dir``: ``actor`` (``load_hf`` added), ``parallel`` (the
    ``parallel:`` section), ``model`` overrides of the directory's own section and the rollout ``correction``
    (``algorithm.rollout_correction``; left at its default when None)."""
    from megatron_rl.config import job_config_from_dict

    d = {"model": hf_model_section(hf_dir, **(model or {})), "actor": {"load_hf": hf_dir, **actor},
         "parallel": parallel or {}}
    if correction is not None:
        d["algorithm"] = {"rollout_correction": dict(correction)}
    return job_config_from_dict(d)


def checkpoint_batch(seed: int, rows: int):
    """``(batch, advantages)``: ``rows`` random sequences (prompts of 1-4, responses of 1-7 tokens below id 256, their
    rollout log-probs in (-4, 0]) -- the batch the checkpoint and resume tests train a step on."""
    from megatron_rl.actor import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
               for _ in range(rows)]
    responses = [torch.randint(0, 256, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(rows)]
    lps = [(-torch.rand(len(r), generator=g) * 4).tolist() for r in responses]
    return RolloutBatch.from_sequences(prompts, responses, lps), torch.randn(rows, generator=g)


def checkpoint_step(actor, seed: int):
    """One train step on this DP rank's share of ``checkpoint_batch(seed, rows=8)`` (the same global batch at every
    DP size); returns the step's metrics."""
    batch, adv = checkpoint_batch(seed, rows=8)
    rows = 8 // actor.dp_size
    lo = actor.dp_rank * rows
    shard, adv = batch.select(lo, lo + rows), adv[lo:lo + rows]
    old, _ = actor.compute_log_probs(shard, 1.0)
    return actor.train_step(shard, old, adv, shard.response_mask, None, 1.0)


def policy_data(vocab: int, rows: int, seed: int, prompt_len: tuple[int, int], response_len: tuple[int, int],
                reject_token: bool):
    """A random ``RolloutBatch`` of ``rows`` sequences (prompt/response lengths drawn in ``[lo, hi)``) and
    its train-step inputs ``(batch, old_log_probs, advantages, response_mask, is_weights)``; with
    ``reject_token`` the last prompt position of row 1 is masked (a rejected token)."""
    from megatron_rl.actor import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(*prompt_len, (rows,), generator=g).tolist()
    rlens = torch.randint(*response_len, (rows,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (p,), generator=g).tolist() for p in plens]
    responses = [torch.randint(0, vocab, (r,), generator=g).tolist() for r in rlens]
    rollout_lp = [(-torch.rand(r, generator=g) * 3 - 0.1).tolist() for r in rlens]
    batch = RolloutBatch.from_sequences(prompts, responses, rollout_lp)
    W = batch.max_length - 1
    mask = batch.response_mask.clone()
    if reject_token:
        mask[1, int(batch.prompt_lengths[1]) - 1] = 0
    old = batch.rollout_log_probs + 0.3 * torch.randn(rows, W, generator=g) * batch.response_mask
    old = old.clamp(max=-1e-3)
    is_w = (torch.rand(rows, W, generator=g) + 0.5) * mask
    adv = torch.randn(rows, generator=g)
    return batch, old, adv, mask, is_w


def load_hf_reference(hf_dir: str):
    """The HF model of ``hf_dir`` in fp32, as ``from_pretrained`` returns it (eval mode)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)


def hf_token_log_probs(model, tokens: torch.Tensor, temperature: float, double: bool = False) -> torch.Tensor:
    """``log_softmax(logits / T)`` of ``model`` picked at token t+1: ``[B, S-1]`` (float64 with ``double``)."""
    return hf_token_log_probs_and_entropy(model, tokens, temperature, double)[0]


def hf_token_log_probs_and_entropy(model, tokens: torch.Tensor, temperature: float,
                                   double: bool = False) -> tuple:
    """(``hf_token_log_probs``, the entropy ``-sum p log p`` of softmax(logits / T) at each position): ``[B, S-1]``
    each, differentiable, plain torch over the full vocabulary."""
    logits = model(input_ids=tokens).logits[:, :-1] / temperature
    if double:
        logits = logits.double()
    lsm = torch.log_softmax(logits, dim=-1)
    return lsm.gather(-1, tokens[:, 1:, None]).squeeze(-1), -(lsm.exp() * lsm).sum(-1)


def hf_adamw(model, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """torch AdamW over ``model`` as megatron builds it: no weight decay on 1-D parameters."""
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.999), eps=1e-8)


def unfuse_experts(sd: dict, drop_suffixes: Iterable[str] = ()) -> dict:
    """transformers keeps MoE experts fused in memory (``[E, 2F, H]`` gate_up_proj, ``[E, H, F]`` down_proj) and
    writes per-expert tensors to safetensors: map the in-memory names to the saved ones; keys ending in one of
    ``drop_suffixes`` are left out."""
    drop = tuple(drop_suffixes)
    out = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            pre, f = k[: -len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"], out[f"{pre}{e}.up_proj.weight"] = v[e, :f], v[e, f:]
        elif k.endswith("mlp.experts.down_proj"):
            pre = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = v[e]
        elif not (drop and k.endswith(drop)):
            out[k] = v
    return out


def actor_on_shard(job, batch):
    """On one rank: initialise model parallelism (seed 5), build ``MegatronActor(job)`` and select this DP rank's
    block of ``batch`` (``row_blocks``); returns ``(actor, shard, start, end)``."""
    from megatron_rl.actor import MegatronActor, row_blocks
    from megatron_rl.plan import actor_spec
    from megatron_rl.parallel import initialize_model_parallel

    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    actor = MegatronActor(actor_spec(job))
    start, end = row_blocks(batch.num_rows, actor.dp_size)[actor.dp_rank]
    return actor, batch.select(start, end), start, end


def rank_main_grads(actor, parallel) -> list:
    """On one rank: ``[(RankCoords, canonical main_grad state dict)]``, one entry per model chunk (uneven
    first/last stages read from ``parallel``)."""
    from megatron_rl.convert import canonical_state_dict
    from megatron_rl.convert.partition import RankCoords

    grads = []
    for i, chunk in enumerate(actor.model):
        named = {n: p.main_grad.detach().clone() for n, p in chunk.module.named_parameters()}
        coords = RankCoords.from_groups(actor.groups, vp_stage=i,
                                        first_stage_layers=parallel.num_layers_in_first_pipeline_stage,
                                        last_stage_layers=parallel.num_layers_in_last_pipeline_stage)
        grads.append((coords, canonical_state_dict(named)))
    return grads


def merge_rank_grads(per_rank: list, job) -> dict:
    """On the parent: every rank's ``rank_main_grads`` merged into one unsharded megatron state dict."""
    from megatron_rl.convert.partition import merge_state_dicts

    shards: dict = {}
    for grads in per_rank:
        for coords, g in grads:
            shards.setdefault(coords, {}).update(g)
    return merge_state_dicts(shards, job.model.num_layers, not job.model.untie_embeddings_and_output_weights,
                             job.parallel.tensor_model_parallel_size, job.parallel.etp,
                             job.model.num_moe_experts or 0)


def assert_state_dicts_close(a: dict, b: dict, atol: float = 0.0) -> None:
    """The same keys, and every tensor of ``a`` within ``atol`` of ``b``'s (``atol=0``: bit-equal values); the
    failure names the key."""
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=lambda m: f"{k}: {m}")
