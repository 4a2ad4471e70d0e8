"""The RL loop with a critic (``gae``): the critic's metrics every step, ``critic_warmup`` (verl's comparison: the
actor does not update at global step 1 of ``critic_warmup: 2``), the critic in every checkpoint, and resume through
the loop reproduces the uninterrupted run exactly (step 2's metrics, actor and critic, TP2).

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_critic_loop.py -q``
"""
import json
import os

import pytest

from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import named_job

GAE = ("algorithm.advantage_estimator=gae", "critic.lr=1e-3", "critic.critic_warmup=2",
       "parallel.tensor_model_parallel_size=2")
CRITIC_KEYS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/vf_explained_var",
               "critic/grad_norm")


@pytest.fixture(scope="module")
def copy_model_h64(task_model):
    return task_model(task="copy", seed=0, hidden_size=64, num_layers=2)


def _train_body(rank, world, cfg):
    from megatron_rl.trainer.loop import train

    return train(cfg)


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


@pytest.mark.timeout(400)
def test_loop_with_critic_warmup_and_exact_resume(copy_model_h64, tmp_path):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    kw = dict(hf=copy_model_h64, world_size=2)
    run_ranks(_train_body, 2, named_job("copy_loop", *GAE, run_dir=straight, **kw), timeout=200)
    a = _metrics(straight)
    assert [m["step"] for m in a] == [1, 2]
    assert all(k in m for m in a for k in CRITIC_KEYS)
    assert not any(k.startswith("actor/") for k in a[0])       # warm-up: global step 1 < critic_warmup 2
    assert "actor/pg_loss" in a[1]
    assert os.path.isfile(os.path.join(straight, "checkpoints", "step_2", "critic", "latest"))
    run_ranks(_train_body, 2, named_job("copy_loop", *GAE, "trainer.steps=1", run_dir=split, **kw), timeout=200)
    run_ranks(_train_body, 2, named_job("copy_loop", *GAE, "trainer.resume=true", run_dir=split, **kw), timeout=200)
    b = _metrics(split)
    assert [m["step"] for m in b] == [1, 2]
    for key, v in a[1].items():
        if key.startswith(("timing/", "perf/")) or key == "time":
            continue
        assert b[1][key] == v, f"step 2 {key}: resumed {b[1][key]!r} != uninterrupted {v!r}"


@pytest.mark.timeout(200)
def test_resume_without_the_critic_is_refused(copy_model_h64, tmp_path):
    """A checkpoint of a run without a critic cannot resume a run with one (named: critic.enable)."""
    from megatron_rl.testing.jobs import train_or_error

    run = str(tmp_path / "run")
    kw = dict(hf=copy_model_h64, world_size=1)
    run_ranks(_train_body, 1, named_job("copy_loop", "trainer.steps=1", run_dir=run, **kw), timeout=150)
    errs = run_ranks(lambda r, w, c: train_or_error(c), 1,
                     named_job("copy_loop", "algorithm.advantage_estimator=gae", "trainer.resume=true", run_dir=run,
                               **kw), timeout=150)
    assert errs[0] is not None and "critic.enable" in errs[0] and "holds no critic" in errs[0], errs
