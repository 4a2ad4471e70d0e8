"""``actor.recompute_*``: megatron-core's activation recomputation changes memory, never the training step.

Reference: the same train step with no recomputation (every activation kept). With full recomputation
(uniform groups, block) and selective recomputation (core attention) the loss, the gradient norm and every
parameter's main gradient are bit-identical on CPU (fp32: the recomputed forward runs the same kernels on the same
inputs), and megatron-core did recompute: the first decoder layer's forward runs again inside backward.
"""
import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.testing.actor_reference import actor_on_shard, policy_data, rank_main_grads
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import knobs, named_job

pytest.importorskip("transformers")

T = 0.8
NONE = {}
UNIFORM = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2}
BLOCK = {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}
SELECTIVE = {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_model):
    return tiny_hf_model("qwen2", seed=41, num_hidden_layers=4)


def _rank_train(rank, world, job, data):
    batch, old, adv, mask, is_w = data
    actor, shard, start, end = actor_on_shard(job, batch)
    layer = actor.model[0].module.decoder.layers[0]
    calls = {"forward": 0}
    layer.register_forward_hook(lambda *_: calls.__setitem__("forward", calls["forward"] + 1))
    W = shard.max_length - 1
    metrics = actor.train_step(shard, old[start:end, :W], adv[start:end], mask[start:end, :W], is_w[start:end, :W], T)
    return {"metrics": metrics, "grads": rank_main_grads(actor, job.parallel), "forwards": calls["forward"],
            "config": {k: getattr(layer.config, k) for k in ("recompute_granularity", "recompute_method",
                                                            "recompute_num_layers")}}


def _train(hf_dir, data, recompute):
    job = named_job("actor_ppo", *knobs(mbs=4, **recompute), hf=hf_dir)
    return run_ranks(_rank_train, 1, job, data, timeout=300)[0]


@pytest.mark.parametrize("recompute", [UNIFORM, BLOCK, SELECTIVE], ids=["full-uniform", "full-block", "selective"])
def test_recompute_trains_bit_identically(hf_dir, recompute):
    data = policy_data(_vocab(hf_dir), 8, 3, prompt_len=(1, 6), response_len=(2, 10),
                       reject_token=False)
    ref, got = _train(hf_dir, data, NONE), _train(hf_dir, data, recompute)
    assert got["config"] == {k: recompute.get(k) for k in got["config"]}, "TransformerConfig carries the keys"
    assert ref["config"]["recompute_granularity"] is None
    if recompute["recompute_granularity"] == "full":  # layer 0 is recomputed (uniform group 0-1, block layer 0)
        assert got["forwards"] == 2 * ref["forwards"], (got["forwards"], ref["forwards"])
    else:
        assert got["forwards"] == ref["forwards"]  # the layer itself is not rerun, its core attention is
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert got["metrics"][key] == ref["metrics"][key], key
    [(coords, g)], [(_, r)] = got["grads"], ref["grads"]
    assert sorted(g) == sorted(r)
    for k in r:
        assert torch.equal(g[k], r[k]), k


def _vocab(hf_dir):
    import json
    import os

    with open(os.path.join(hf_dir, "config.json")) as fh:
        return json.load(fh)["vocab_size"]
