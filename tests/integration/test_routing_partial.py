"""A partial MoE routing capture (some rollouts without ``routed_experts``) in the real RL loop (issue 20, item 7):

* with ``actor.routing_replay: none`` the step goes on: the partial routing is dropped for the step and
  counted (``routing/missing_rows`` = the rows without routing), training completes;
* with ``actor.routing_replay: r3`` (which replays it) every rank ends the step with an error naming the
  config key, the rows and the prompts that miss it — before any log-prob pass.

The embedded engine (a real Qwen3-MoE task model, bf16) captures the routing of every rollout; the fault — rows
coming back without routing, as from one of several SGLang servers started without
``--enable-return-routed-experts`` — is injected by dropping the routing of prompt 0's rollouts on rank 0
(a real engine cannot be made to produce it on demand).
"""
import json
import os

import pytest

from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import named_job, train_or_error

N = 4            # samples per prompt


@pytest.fixture(scope="module")
def moe_dir(task_model):
    return task_model(task="copy", seed=0, hidden_size=64, num_layers=2, num_experts=4, num_experts_per_tok=2)


def _train(rank, world, cfg):
    from megatron_rl.rollout.embedded import EmbeddedEngine

    if rank == 0:
        real = EmbeddedEngine.generate

        def generate(self, prompt_ids, sampling, n=1, seed=None):
            out = real(self, prompt_ids, sampling, n=n, seed=seed)
            assert all(r.routed_experts is not None for r in out)       # the real engine captured every row
            for r in out:
                if r.prompt_index == 0:
                    r.routed_experts = None                             # the injected fault
            return out

        EmbeddedEngine.generate = generate
    return train_or_error(cfg)


def _run(moe_dir, run_dir, replay, world):
    """The loop with routing replay ``replay`` on ``world`` ranks (one node): every rank's error or None."""
    cfg = named_job("moe_routing_loop", f"actor.routing_replay={replay}", f"rollout.n_samples_per_prompt={N}",
                    f"cluster.gpus_per_node={world}", hf=moe_dir, run_dir=run_dir, world_size=world)
    return run_ranks(_train, world, cfg, timeout=540)


@pytest.mark.timeout(600)
def test_partial_routing_is_dropped_and_counted_without_replay(moe_dir, tmp_path):
    run_dir = str(tmp_path / "run")
    errors = _run(moe_dir, run_dir, "none", 1)
    assert errors == [None]
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        metrics = [json.loads(line) for line in fh]
    assert [m["step"] for m in metrics] == [1, 2]
    assert [m["routing/missing_rows"] for m in metrics] == [float(N), float(N)]


@pytest.mark.timeout(600)
def test_partial_routing_with_r3_is_a_named_error_on_every_rank(moe_dir, tmp_path):
    run_dir = str(tmp_path / "run")
    errors = _run(moe_dir, run_dir, "r3", 2)
    for err in errors:
        assert err is not None and "PartialRoutingError" in err, err
        assert "step 1: actor.routing_replay='r3'" in err
        assert f"returned none for {N} of {4 * N} rollouts (rows {list(range(N))}, prompts [0]" in err
    path = os.path.join(run_dir, "metrics.jsonl")
    assert not os.path.exists(path) or open(path).read().strip() == "", "a step was applied"
