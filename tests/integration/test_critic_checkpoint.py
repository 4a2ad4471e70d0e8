"""Critic checkpoints: resume is exact. 2 critic steps in one go == 1 step, save, a fresh set of processes (another
init seed) loads, 1 step -- bitwise: every rank's weights, Adam state, metrics and the learning rate of a critic
warm-up that the resume interrupts (its lr per step from megatron-core's own ``OptimizerParamScheduler``).

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_critic_checkpoint.py -q``
"""
import multiprocessing

import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.actor.critic import MegatronCritic
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.plan.job import critic_spec
from megatron_rl.testing.actor_reference import checkpoint_batch
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import layout, named_job, settings

#: a critic warm-up of 3 optimizer steps from 2e-4 to 1e-3, then cosine decay: the resume happens mid-warm-up
SCHEDULE = settings("critic", lr=1e-3, lr_warmup_steps=3, lr_warmup_init=2e-4, lr_decay_style="cosine",
                    lr_decay_steps=8)
CRITIC = ("algorithm.advantage_estimator=gae", "critic.enable=true", "critic.cliprange_value=0.2")


def _megatron_lrs(n):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    sched = OptimizerParamScheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), init_lr=2e-4,
                                    max_lr=1e-3, min_lr=0.0, lr_warmup_steps=3, lr_decay_steps=8,
                                    lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=8,
                                    wd_incr_style="constant")
    out = []
    for _ in range(n):
        out.append(sched.optimizer.param_groups[0]["lr"])
        sched.step(increment=1)
    return out


def _step(critic, seed):
    batch, _ = checkpoint_batch(seed, rows=4)
    g = torch.Generator().manual_seed(seed)
    values = critic.compute_values(batch)
    mask = batch.response_mask
    returns = torch.randn(values.shape, generator=g) * mask
    return critic.train_step(batch, values, returns, mask)


def _snapshot(critic):
    return {"weights": {f"{i}.{n}": p.detach().clone() for i, c in enumerate(critic.model)
                        for n, p in c.module.named_parameters()},
            "opt": critic.optimizer.state_dict()}


def _rank(rank, world, job, steps, save_dir, load_dir, init_seed):
    try:
        initialize_model_parallel(job.parallel, seed=init_seed, model=job.model)
        critic = MegatronCritic(critic_spec(job))
        start = 0
        if load_dir:
            start, _ = critic.load_checkpoint(load_dir)
        metrics = [_step(critic, 100 + s) for s in range(start, start + steps)]
        if save_dir:
            critic.save_checkpoint(save_dir, start + steps)
        out = _snapshot(critic)
        out["next_lr"] = float(critic.optimizer.param_groups[0]["lr"])
        return {"metrics": metrics, "final": out, "start": start}
    finally:
        for child in multiprocessing.active_children():
            child.terminate()
            child.join(5)


def _adam(opt_sd):
    sds = opt_sd if isinstance(opt_sd, list) else [opt_sd]
    return [((o, i), n, st[n]) for o, sd in enumerate(sds) for i, st in sorted((sd.get("state") or {}).items())
            for n in sorted(st)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp,pp,world", [(2, 1, 2), (1, 2, 2)], ids=["tp2", "pp2"])
def test_critic_resume_is_exact(tmp_path, tp, pp, world):
    job = named_job("checkpoint_actor", *CRITIC, *SCHEDULE, *layout(tp=tp, pp=pp))
    full = run_ranks(_rank, world, job, 2, None, None, 7, timeout=150)
    run_ranks(_rank, world, job, 1, str(tmp_path / "ck"), None, 7, timeout=150)
    resumed = run_ranks(_rank, world, job, 1, None, str(tmp_path / "ck"), 99, timeout=150)
    assert resumed[0]["start"] == 1
    assert [m["critic/lr"] for m in full[0]["metrics"]] == _megatron_lrs(2)
    for r_full, r_res in zip(full, resumed):
        assert r_res["metrics"][0] == r_full["metrics"][1]
        assert r_res["final"]["next_lr"] == r_full["final"]["next_lr"] == _megatron_lrs(3)[2]
        wa, wb = r_full["final"]["weights"], r_res["final"]["weights"]
        assert sorted(wa) == sorted(wb)
        for k in wa:
            assert torch.equal(wa[k], wb[k]), k
        flat_a, flat_b = _adam(r_full["final"]["opt"]), _adam(r_res["final"]["opt"])
        assert len(flat_a) == len(flat_b) > 0
        for (i, n, x), (j, m, y) in zip(flat_a, flat_b):
            assert (i, n) == (j, m) and torch.equal(torch.as_tensor(x), torch.as_tensor(y)), f"Adam state {i}.{n}"
    # non-vacuous: the fresh init (seed 99) differs from the checkpointed weights
    fresh = run_ranks(_rank, world, job, 0, None, None, 99, timeout=150)
    assert any(not torch.equal(fresh[0]["final"]["weights"][k], full[0]["final"]["weights"][k])
               for k in full[0]["final"]["weights"])
