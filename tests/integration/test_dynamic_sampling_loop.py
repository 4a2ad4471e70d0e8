"""Dynamic sampling (``algorithm.filter_groups``) in the real RL loop: megatron actor on gloo ranks, embedded
engine, the copy task with a reward the test controls through ``data.reward_fn`` (a file it writes).

* DP2, sync: prompts with an even last digit score alike on every sample (such groups carry no signal), the
  others vary with the response. Every group the ranks train on -- read back from the dumped rollouts -- has
  reward variance > 0, the batch is full, the rounds are bounded and reported, and the trained prompts are
  those the rounds' seeds draw (recomputed here with the task and ``random``: a resumed run draws the same).
* A reward that never varies: after max rounds the named warning, and ``on_exhausted`` decides -- "skip" (async
  rollouts, one step off): the actor's train step is never called, the step says so and the weight versions go
  on; "train" (sync): it trains and says the batch had no signal.
"""
import json
import os
import statistics

import pytest

from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import named_job

pytestmark = [pytest.mark.mcore, pytest.mark.timeout(300)]

REWARDS = '''
def half_alike(prompt_text, response_text, answer):
    if int(str(answer)[-1]) % 2 == 0:          # every sample of this prompt scores the same
        return 0.5
    return float(sum(map(ord, response_text)) % 2)


def alike(prompt_text, response_text, answer):
    return 0.5
'''


def _reward_fn(tmp_path, name):
    """The ``data.reward_fn`` override of function ``name`` of REWARDS (written to ``tmp_path``)."""
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return f"data.reward_fn={path}:{name}"


def _train(rank, world, cfg):
    """Run the loop; return how often the actor trained and the warnings raised on this rank."""
    import warnings

    from megatron_rl.actor import MegatronActor
    from megatron_rl.trainer.loop import train

    calls = []
    real = MegatronActor.train_step
    MegatronActor.train_step = lambda self, *a, **k: calls.append(1) or real(self, *a, **k)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        train(cfg)
    return len(calls), [(w.category.__name__, str(w.message)) for w in seen if "filter_groups" in str(w.message)]


def _read(run_dir, name):
    with open(os.path.join(run_dir, name)) as fh:
        return [json.loads(line) for line in fh]


def test_every_trained_group_has_signal_and_the_batch_is_full(copy_model, tmp_path):
    from megatron_rl.trainer.job import build_task
    from megatron_rl.trainer.rollout_phase import sample_prompts

    cfg = named_job("dynamic_sampling", _reward_fn(tmp_path, "half_alike"),
                    "algorithm.filter_groups.max_num_gen_batches=8", hf=copy_model, run_dir=tmp_path / "run",
                    world_size=2)
    results = run_ranks(_train, 2, cfg, timeout=240)
    assert results == [(2, []), (2, [])]
    metrics, rows = _read(cfg.trainer.run_dir, "metrics.jsonl"), _read(cfg.trainer.run_dir, "rollouts.jsonl")
    task, _ = build_task(cfg)
    n, prompts = 4, 4
    for m in metrics:
        step = m["step"] - 1
        mine = [r for r in rows if r["step"] == m["step"]]
        assert len(mine) == n * prompts                                   # the batch is full
        groups = [mine[g * n:(g + 1) * n] for g in range(prompts)]
        for g in groups:
            assert len({tuple(r["prompt_ids"]) for r in g}) == 1
            assert statistics.pvariance([r["reward"] for r in g]) > 0    # every trained group has signal
        rounds = int(m["filter_groups/rounds"])
        assert 1 <= rounds <= 8
        assert m["filter_groups/groups_drawn"] == prompts * rounds
        assert m["filter_groups/groups_kept"] >= prompts
        assert m["filter_groups/groups_kept"] + m["filter_groups/groups_dropped"] == m["filter_groups/groups_drawn"]
        assert m["filter_groups/groups_filled"] == m["filter_groups/exhausted"] == m["filter_groups/skipped"] == 0
        assert m["actor/grad_norm"] > 0
        # the trained prompts are drawn by the rounds' seeds, in draw order, odd last digit (the alike ones dropped)
        drawn = [p for rnd in range(rounds) for p in sample_prompts(task, cfg, step, rnd)]
        trained = [list(g[0]["prompt_ids"]) for g in groups]
        odd = [(i, list(p.prompt_ids)) for i, p in enumerate(drawn) if int(str(p.answer)[-1]) % 2]
        order, it = [], iter(odd)        # the trained prompts are a subsequence of the odd ones, in draw order
        for t in trained:
            order.append(next(i for i, p in it if p == t))
        if rounds > 1:   # the last round was needed: the batch has one of its prompts
            assert order[-1] >= prompts * (rounds - 1)
    assert max(m["filter_groups/rounds"] for m in metrics) > 1     # (seeded) a step needed more prompts


@pytest.mark.parametrize("mode, rollouts", [("skip", "async"), ("train", "sync")])
def test_groups_alike_for_max_rounds_warn_and_skip_or_train(copy_model, tmp_path, mode, rollouts):
    """Skipping in async mode (one step off) also proves that a skipped step still publishes its version: the
    producer waits for it before it generates the step after next."""
    steps = 3 if rollouts == "async" else 2
    cfg = named_job("dynamic_sampling", _reward_fn(tmp_path, "alike"), "algorithm.filter_groups.max_num_gen_batches=2",
                    f"algorithm.filter_groups.on_exhausted={mode}", f"rollout.mode={rollouts}",
                    f"trainer.steps={steps}", hf=copy_model, run_dir=tmp_path / "run", world_size=1)
    [(trained, warned)] = run_ranks(_train, 1, cfg, timeout=240)
    # one warning, at the first exhausted step; the later ones are counted (metrics, summary line)
    assert [w[0] for w in warned] == ["FilterGroupsExhaustedWarning"]
    assert warned[0][1].startswith("step 1:")
    assert "found 0 of the 4 prompt groups" in warned[0][1] and "max_num_gen_batches=2" in warned[0][1]
    metrics = _read(cfg.trainer.run_dir, "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    for m in metrics:
        assert m["filter_groups/rounds"] == 2 and m["filter_groups/groups_drawn"] == 8
        assert m["filter_groups/groups_kept"] == 0 and m["filter_groups/groups_filled"] == 4
        assert m["filter_groups/exhausted"] == 1
        assert m["filter_groups/skipped"] == (1 if mode == "skip" else 0)
        assert ("actor/grad_norm" in m) == (mode == "train")
    assert trained == (0 if mode == "skip" else steps)
    lag = 1 if rollouts == "async" else 0          # step t (1-based) generated from version max(t - 1 - lag, 0)
    versions = [r["weight_version"] for r in _read(cfg.trainer.run_dir, "rollouts.jsonl")]
    assert versions == [f"step-{max(t - 1 - lag, 0)}" for t in range(1, steps + 1) for _ in range(16)]
