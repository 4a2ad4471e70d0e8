"""Critic resume with changed settings is said, as the actor's is: a critic checkpoint records the critic's
optimizer / schedule / loss keys and rank 0 prints one line naming each ``critic.<key>`` that differs (nothing when
none does); a critic checkpoint saved at PP2 loads on one rank with the same values. The tiny checkpoint model.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_critic_resume_settings.py -q``
"""
import contextlib
import io
import multiprocessing

import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.actor.critic import MegatronCritic
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.plan.job import critic_spec
from megatron_rl.testing.actor_reference import checkpoint_batch
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import named_job, settings

CRITIC = ("algorithm.advantage_estimator=gae", "critic.enable=true")


def _rank(rank, world, job, save_dir, load_dir):
    try:
        initialize_model_parallel(job.parallel, seed=3, model=job.model)
        critic = MegatronCritic(critic_spec(job))
        out = io.StringIO()
        if load_dir:
            with contextlib.redirect_stdout(out):
                critic.load_checkpoint(load_dir)
        if save_dir:
            batch, _ = checkpoint_batch(1, rows=2)
            values = critic.compute_values(batch)
            critic.train_step(batch, values, values + batch.response_mask, batch.response_mask)
            critic.save_checkpoint(save_dir, 1)
        return out.getvalue()
    finally:
        for child in multiprocessing.active_children():
            child.terminate()
            child.join(5)


@pytest.mark.timeout(120)
def test_changed_critic_settings_are_said_on_resume(tmp_path):
    ck = str(tmp_path / "ck")
    run_ranks(_rank, 1, named_job("checkpoint_actor", *CRITIC, *settings("critic", lr=1e-3)), ck, None,
              timeout=100)
    same = run_ranks(_rank, 1, named_job("checkpoint_actor", *CRITIC, *settings("critic", lr=1e-3)), None, ck,
                     timeout=100)[0]
    assert "critic." not in same, same
    changed = run_ranks(_rank, 1, named_job("checkpoint_actor", *CRITIC,
                                            *settings("critic", lr=2e-3, ppo_epochs=2, cliprange_value=0.2)),
                        None, ck, timeout=100)[0]
    for key in ("critic.lr 0.001 -> 0.002", "critic.ppo_epochs 1 -> 2", "critic.cliprange_value 0.5 -> 0.2"):
        assert key in changed, changed
    assert "actor." not in changed, changed


def _values_rank(rank, world, job, save_dir, load_dir):
    import warnings

    try:
        initialize_model_parallel(job.parallel, seed=5 if save_dir else 9, model=job.model)
        critic = MegatronCritic(critic_spec(job))
        batch, _ = checkpoint_batch(2, rows=2)
        if load_dir:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "layout changed": said, and loaded
                critic.load_checkpoint(load_dir)
        if save_dir:
            values = critic.compute_values(batch)
            critic.train_step(batch, values, values + batch.response_mask, batch.response_mask)
            critic.save_checkpoint(save_dir, 1)
        return critic.compute_values(batch)
    finally:
        for child in multiprocessing.active_children():
            child.terminate()
            child.join(5)


@pytest.mark.timeout(150)
def test_critic_checkpoint_loads_at_another_layout(tmp_path):
    """Saved at PP2 (the value head on the last stage), loaded on one rank: the same values (the head's and the
    body's weights found by their global names), not the fresh init of another seed."""
    from megatron_rl.testing.jobs import layout

    ck = str(tmp_path / "ck")
    saved = run_ranks(_values_rank, 2, named_job("checkpoint_actor", *CRITIC, *layout(pp=2)), ck, None,
                      timeout=120)[0]
    loaded = run_ranks(_values_rank, 1, named_job("checkpoint_actor", *CRITIC), None, ck, timeout=100)[0]
    fresh = run_ranks(_values_rank, 1, named_job("checkpoint_actor", *CRITIC), None, None, timeout=100)[0]
    assert torch.equal(loaded, saved)
    assert not torch.equal(fresh, saved)
