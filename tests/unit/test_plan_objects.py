"""The plan's checks and lines take their facts from the objects it built, not from the keys again: the objective's
line from its row (looked up when ``algorithm.rollout_correction`` was read), the optimizer-offload refusals from
the actor's ``Precision``. Run: ``pytest tests/unit/test_plan_objects.py``.
"""
import itertools

import pytest
import torch

from megatron_rl.actor.optimizer import offload_errors
from megatron_rl.actor.precision import Precision
from megatron_rl.config.sections import ActorConfig
from megatron_rl.losses.registry import objective_summary
from megatron_rl.plan.job import JobPlan
from megatron_rl.testing.jobs import job_problems


@pytest.mark.parametrize("bf16,fp32_out,dist", list(itertools.product([False, True], repeat=3)))
def test_requested_precision_is_what_the_section_asks(bf16, fp32_out, dist):
    """``actor.bf16``: bf16 parameters, else fp32; ``actor.fp32_output_layer`` only on a bf16 actor (docs of the
    keys); ``from_actor_config``, where it accepts the pair, builds the same object."""
    ac = ActorConfig(bf16=bf16, fp32_output_layer=fp32_out, use_distributed_optimizer=dist)
    want = Precision(params_dtype=torch.bfloat16 if bf16 else torch.float32, fp32_output_layer=fp32_out and bf16)
    assert Precision.requested(ac) == want
    if not fp32_out or (bf16 and dist):
        assert Precision.from_actor_config(ac) == want
    else:
        with pytest.raises(ValueError, match=r"actor\.fp32_output_layer"):
            Precision.from_actor_config(ac)


def test_offload_refusals_ask_the_actors_precision():
    """The precision handed in decides, whatever the section's ``bf16`` says (the key is read in precision.py)."""
    ac = ActorConfig(bf16=False, use_distributed_optimizer=True, optimizer_cpu_offload=True)
    assert any("needs actor.bf16" in e for e in offload_errors(ac))
    assert offload_errors(ac, precision=Precision(params_dtype=torch.bfloat16)) == []
    both = offload_errors(ac, precision=Precision(params_dtype=torch.bfloat16, fp32_output_layer=True))
    assert len(both) == 1 and "not with actor.fp32_output_layer" in both[0]


def test_plan_keeps_the_offload_refusal_of_a_refused_output_layer():
    """A precision the plan refuses (fp32 output layer without the distributed optimizer) still meets the offload
    check as it was asked: every refusal is listed, each naming its key."""
    _, problems = job_problems("sized_model", "actor.bf16=true", "actor.fp32_output_layer=true",
                               "actor.optimizer_cpu_offload=true", world_size=1)
    heads = sorted(p.split(" (")[0] for p in problems)
    assert heads == ["actor.fp32_output_layer: needs actor.use_distributed_optimizer: true",
                     "actor.optimizer_cpu_offload: needs actor.use_distributed_optimizer: true",
                     "actor.optimizer_cpu_offload: not with actor.fp32_output_layer"], problems


@pytest.mark.parametrize("overrides,loss_type,bypass", [
    ((), "ppo_clip", False),
    (("algorithm.rollout_correction.loss_type=clip_cov",), "clip_cov", False),
    (("algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.loss_type=reinforce"),
     "reinforce", True)])
def test_objective_line_is_the_rows_summary(overrides, loss_type, bypass):
    """The plan's objective (its ``PolicyLoss``) is the configured loss type's row in its mode, and its line is
    what the loss-type table says for that name, mode and ``actor.policy_loss``."""
    cfg, problems = job_problems("sized_model", *overrides, world_size=1)
    assert problems == []
    plan = JobPlan.build(cfg, 1)
    loss = plan.objective.loss
    assert (loss.objective.name, loss.bypass_mode) == (loss_type, bypass)
    assert plan.objective_line() == objective_summary(loss_type, bypass, cfg.actor.policy_loss)


@pytest.mark.parametrize("overrides,want", [
    ((), "actor: fp32 params;"),
    (("actor.bf16=true",), "actor: bf16 params;"),
    (("actor.bf16=true", "actor.fp32_output_layer=true", "actor.use_distributed_optimizer=true"),
     "actor: bf16 params, fp32 output layer;")])
def test_actor_line_says_the_precision_asked_for(overrides, want):
    """``check`` / the trainer's start print the actor's precision as the keys ask for it (``Precision.describe``)."""
    cfg, problems = job_problems("sized_model", *overrides, world_size=1)
    assert problems == []
    [line] = [ln for ln in JobPlan.build(cfg, 1).describe() if ln.startswith("actor: ")]
    assert line.startswith(want), line
