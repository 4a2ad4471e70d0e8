"""The actor's learning-rate schedule (``megatron_rl.actor.lr_schedule``) against two independent references:
megatron-core's ``OptimizerParamScheduler`` built here with hand-resolved settings, and verl's cosine schedule
with a warm-up ratio (``verl.utils.torch_functional.get_cosine_schedule_with_warmup``, its formula written out
below). Bad keys are config errors naming the key. Through the actor (schedule per optimizer step, resume
mid-warm-up): ``tests/integration/test_actor_checkpoint.py``."""
import math

import pytest
import torch

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron_rl.actor.lr_schedule import LRSchedule, restore_scheduler
from megatron_rl.config import ConfigError
from megatron_rl.testing.jobs import named_job

def _schedule(job):
    """The job's schedule, as its plan builds it."""
    return LRSchedule.from_actor(job.actor, job.trainer.steps)


def _optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=123.0)


def _lrs(scheduler, n):
    out = []
    for _ in range(n):
        out.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.step(increment=1)
    return out


def _verl_cosine_with_warmup(step, num_warmup_steps, num_training_steps, min_lr_ratio, num_cycles=0.5):
    """verl's lr factor (get_cosine_schedule_with_warmup's lr_lambda; warm-up steps = int(ratio x total))."""
    if step < num_warmup_steps:
        return float(step) / float(max(1, num_warmup_steps))
    progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    x = math.cos(math.pi * float(num_cycles) * 2.0 * progress)
    return max(0.0, x * (1 - min_lr_ratio) * 0.5 + (1 + min_lr_ratio) * 0.5)


@pytest.mark.parametrize("overrides, megatron", [
    # cosine, warm-up as a fraction of the run's optimizer steps (10 steps x 2 epochs x 3 mini-batches = 60)
    (["actor.lr_decay_style=cosine", "actor.lr_warmup_fraction=0.13", "actor.min_lr=1e-5", "trainer.steps=10",
      "actor.ppo_epochs=2", "actor.ppo_mini_batches=3", "actor.micro_batch_size=1", "data.prompts_per_step=12"],
     dict(init_lr=0.0, max_lr=1e-4, min_lr=1e-5, lr_warmup_steps=7, lr_decay_steps=60, lr_decay_style="cosine")),
    (["actor.lr=3e-4", "actor.lr_decay_style=linear", "actor.lr_warmup_steps=4", "actor.lr_warmup_init=1e-5",
      "actor.lr_decay_steps=12", "actor.min_lr=2e-5", "trainer.steps=20"],
     dict(init_lr=1e-5, max_lr=3e-4, min_lr=2e-5, lr_warmup_steps=4, lr_decay_steps=12, lr_decay_style="linear")),
    (["actor.lr_decay_style=inverse-square-root", "actor.lr_warmup_steps=3", "trainer.steps=15"],
     dict(init_lr=0.0, max_lr=1e-4, min_lr=0.0, lr_warmup_steps=3, lr_decay_steps=15,
          lr_decay_style="inverse-square-root")),
    (["actor.lr_warmup_steps=5", "trainer.steps=8"],
     dict(init_lr=0.0, max_lr=1e-4, min_lr=0.0, lr_warmup_steps=5, lr_decay_steps=8, lr_decay_style="constant")),
    ([], dict(init_lr=0.0, max_lr=1e-4, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=20, lr_decay_style="constant")),
], ids=["cosine-fraction", "linear-init", "inverse-sqrt", "constant-warmup", "default"])
def test_lr_per_step_equals_megatron_scheduler(overrides, megatron):
    """Past the decay too (min_lr there; constant stays at lr)."""
    ours = _schedule(named_job("sized_model", *overrides, world_size=1)).build(_optimizer())
    ref = OptimizerParamScheduler(_optimizer(), start_wd=0.0, end_wd=0.0, wd_incr_steps=1, wd_incr_style="constant",
                                  **megatron)
    n = megatron["lr_decay_steps"] + 5
    got, want = _lrs(ours, n), _lrs(ref, n)
    assert got == want
    assert len(set(want)) > 1 or megatron["lr_warmup_steps"] == 0


def test_cosine_with_warmup_fraction_equals_verl():
    """verl: lr_warmup_steps_ratio 0.1, min_lr_ratio 0.1, total_training_steps 50, one optimizer step per
    training step (verl steps its scheduler once per update_actor)."""
    lr, ratio, total, min_ratio = 2e-6, 0.1, 50, 0.1
    sched = _schedule(named_job("sized_model", f"actor.lr={lr}", "actor.lr_decay_style=cosine",
                                          f"actor.lr_warmup_fraction={ratio}", f"actor.min_lr={min_ratio * lr}",
                                          f"trainer.steps={total}", world_size=1)).build(_optimizer())
    got = _lrs(sched, total)
    want = [lr * _verl_cosine_with_warmup(s, int(ratio * total), total, min_ratio) for s in range(total)]
    assert got[0] == 0.0 and max(got) == lr
    for s, (g, w) in enumerate(zip(got, want)):
        assert g == pytest.approx(w, rel=1e-12, abs=1e-20), f"step {s}: {g} != verl {w}"


def test_restore_continues_the_schedule():
    """A scheduler restored from a saved state (or, for a checkpoint without one, from a step count) gives the
    same lr sequence as the uninterrupted one; this job's settings win over the saved ones."""
    cfg = named_job("sized_model", "actor.lr_decay_style=cosine", "actor.lr_warmup_steps=6", "trainer.steps=20",
                    world_size=1)
    straight = _lrs(_schedule(cfg).build(_optimizer()), 12)
    first = _schedule(cfg).build(_optimizer())
    _lrs(first, 4)  # stopped mid-warm-up
    for state in (first.state_dict(), None):
        resumed = _schedule(cfg).build(_optimizer())
        _lrs(resumed, 2)  # whatever it did before the restore is forgotten
        restore_scheduler(resumed, state, num_steps=4)
        assert _lrs(resumed, 8) == straight[4:]
    longer = _schedule(named_job("sized_model", "actor.lr_decay_style=cosine", "actor.lr_warmup_steps=6",
                                           "trainer.steps=40", world_size=1)).build(_optimizer())
    restore_scheduler(longer, first.state_dict(), num_steps=0)
    assert longer.lr_decay_steps == 40 and longer.num_steps == 4


def test_restore_uses_this_jobs_lr_over_the_loaded_optimizer_groups():
    """Resuming with a changed actor.lr / min_lr: loading the optimizer's state puts the saved run's ``max_lr`` /
    ``min_lr`` back into its param groups (torch restores every group key; megatron's scheduler reads them first);
    the resumed lr must follow megatron-core's scheduler with this job's settings from the saved step on."""
    sched = ["actor.lr_decay_style=cosine", "actor.lr_warmup_steps=3", "actor.lr_decay_steps=8", "trainer.steps=8"]
    old_job = named_job("sized_model", "actor.lr=1e-3", *sched, world_size=1)
    new_job = named_job("sized_model", "actor.lr=2e-3", "actor.min_lr=1e-4", *sched, world_size=1)

    def megatron_groups(job):  # megatron's get_megatron_optimizer: each group carries max_lr / min_lr
        return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))], "max_lr": job.actor.lr,
                                 "min_lr": job.actor.min_lr}], lr=123.0)

    first = _schedule(old_job).build(megatron_groups(old_job))
    _lrs(first, 4)
    resumed = _schedule(new_job).build(megatron_groups(new_job))
    resumed.optimizer.load_state_dict(first.optimizer.state_dict())
    restore_scheduler(resumed, first.state_dict(), num_steps=0)
    ref = OptimizerParamScheduler(_optimizer(), init_lr=0.0, max_lr=2e-3, min_lr=1e-4, lr_warmup_steps=3,
                                  lr_decay_steps=8, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
                                  wd_incr_steps=1, wd_incr_style="constant")
    want = _lrs(ref, 10)[4:]
    assert want[0] > 1e-3 and want[-1] == 1e-4  # above the saved run's lr; this job's min_lr after the decay
    assert _lrs(resumed, 6) == want


@pytest.mark.parametrize("overrides, match", [
    (["actor.lr_warmup_steps=2", "actor.lr_warmup_fraction=0.1"],
     r"actor\.lr_warmup_fraction: set together with actor\.lr_warmup_steps"),
    (["actor.lr_decay_style=cosine_with_min_lr"], r"actor\.lr_decay_style: 'cosine_with_min_lr' is not one of"),
    (["actor.lr_warmup_fraction=1.5"], r"actor\.lr_warmup_fraction: must be in \[0, 1\)"),
    (["actor.lr_warmup_steps=-1"], r"actor\.lr_warmup_steps: must be an integer >= 0"),
    (["actor.lr_warmup_steps=20", "trainer.steps=20"],
     r"actor\.lr_warmup_steps: the warm-up \(20 optimizer steps\) must be shorter than the decay"),
    (["actor.lr_decay_steps=0"], r"actor\.lr_decay_steps: must be an integer >= 1"),
    (["actor.min_lr=1e-3"], r"actor\.min_lr: must be in \[0, actor\.lr"),
    (["actor.lr_warmup_init=-1e-5"], r"actor\.lr_warmup_init: must be in \[0, actor\.lr"),
])
def test_bad_schedule_keys_are_named(overrides, match):
    with pytest.raises(ConfigError, match=match):
        named_job("sized_model", *overrides, world_size=1)


def test_an_old_checkpoints_schedule_is_named_where_it_differs():
    """A checkpoint written before the optimizer settings were recorded holds megatron's scheduler state (its
    ``state_dict``, built here by megatron-core itself): what differs from this run's schedule is named."""
    from megatron_rl.actor.lr_schedule import scheduler_changes

    saved = OptimizerParamScheduler(_optimizer(), init_lr=0.0, max_lr=1e-3, min_lr=0.0, lr_warmup_steps=1,
                                    lr_decay_steps=20, lr_decay_style="constant", start_wd=0.01, end_wd=0.01,
                                    wd_incr_steps=20, wd_incr_style="constant").state_dict()
    now = LRSchedule(max_lr=2e-3, min_lr=1e-4, init_lr=2e-4, warmup_steps=3, decay_steps=10, decay_style="cosine",
                     weight_decay=0.05).build(_optimizer())
    assert scheduler_changes(saved, now) == {
        "actor.lr": (1e-3, 2e-3), "actor.min_lr": (0.0, 1e-4), "actor.weight_decay": (0.01, 0.05),
        "actor.lr_decay_style": ("constant", "cosine"),
        "lr warm-up optimizer steps (actor.lr_warmup_steps / lr_warmup_fraction)": (1, 3),
        "lr decay optimizer steps (actor.lr_decay_steps)": (20, 10)}
    same = LRSchedule(max_lr=1e-3, min_lr=0.0, init_lr=0.0, warmup_steps=1, decay_steps=20, decay_style="constant",
                      weight_decay=0.01).build(_optimizer())
    assert scheduler_changes(saved, same) == {} and scheduler_changes(None, now) == {}
