"""A choice of a job is built at one site, the job plan, and handed down as an object: the actor and the critic
build their model with the spec's ``Recompute`` (not one rebuilt from ``actor.recompute_*``). Reference for what
the plan builds: the keys themselves, megatron-core's ``TransformerConfig`` names. Run:
``pytest tests/unit/test_plan_sites.py``.
"""
import dataclasses

import pytest

import megatron_rl.actor.actor as actor_mod
import megatron_rl.actor.critic as critic_mod
from megatron_rl.actor.actor import MegatronActor
from megatron_rl.actor.critic import MegatronCritic
from megatron_rl.models.recompute import Recompute
from megatron_rl.plan import PlanError, actor_spec
from megatron_rl.plan.job import JobPlan, critic_spec
from megatron_rl.testing.jobs import job_problems

GAE = ("algorithm.advantage_estimator=gae",)
FULL = ("actor.recompute_granularity=full", "actor.recompute_method=uniform", "actor.recompute_num_layers=1")


def test_specs_carry_the_plans_recompute():
    """``JobPlan.actor`` and the critic's spec hand down the plan's one ``Recompute`` object; the standalone
    ``actor_spec`` / ``critic_spec`` build the same settings (the keys as megatron-core names them)."""
    cfg, problems = job_problems("sized_model", *GAE, *FULL, world_size=1)
    assert not problems, problems
    plan = JobPlan.build(cfg, 1)
    assert plan.recompute.transformer_config_kwargs() == {
        "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    assert plan.actor.recompute is plan.recompute
    assert plan.critic.recompute is plan.recompute
    a = actor_spec(cfg, world_size=1)
    assert a.recompute == plan.recompute
    assert critic_spec(cfg, world_size=1).recompute is not None
    assert critic_spec(cfg, world_size=1).recompute == plan.recompute


def test_actor_spec_refuses_a_recompute_the_plan_refuses():
    """The standalone actor spec checks ``actor.recompute_*`` as the job plan does, naming the key."""
    cfg, _ = job_problems("sized_model", "actor.recompute_method=uniform", world_size=None)
    with pytest.raises(PlanError, match=r"actor\.recompute_method: 'uniform' has no effect"):
        actor_spec(cfg, world_size=1)


class _Built(Exception):
    """Raised by the stand-in model builder: the kwargs it got are recorded, nothing is built."""


def _capture(monkeypatch, module, spec):
    """``module``'s ``build_gpt_model`` records its kwargs and stops; megatron's groups say the spec's layout."""
    seen = {}

    def build(model, parallel, **kwargs):
        seen.update(kwargs)
        raise _Built()

    class _Groups:
        dims = spec.batcher.dims
        tp_size = 1

        @classmethod
        def from_parallel_state(cls, **_):
            return cls()

    monkeypatch.setattr(module, "build_gpt_model", build)
    monkeypatch.setattr(module, "ActorGroups", _Groups)
    return seen


# a recomputation the config does not ask for: only the spec's object can put it into the model's TransformerConfig
OTHER = Recompute("full", "block", 2)


def test_actor_builds_its_model_with_the_specs_recompute(monkeypatch):
    cfg, problems = job_problems("sized_model", world_size=1)
    assert not problems, problems
    spec = dataclasses.replace(actor_spec(cfg, world_size=1), recompute=OTHER)
    assert spec.actor.recompute_granularity is None  # the section asks for none
    seen = _capture(monkeypatch, actor_mod, spec)
    with pytest.raises(_Built):
        MegatronActor(spec)
    assert {k: v for k, v in seen.items() if k.startswith("recompute_")} == OTHER.transformer_config_kwargs()


def test_critic_builds_its_model_with_the_specs_recompute(monkeypatch):
    cfg, problems = job_problems("sized_model", *GAE, world_size=1)
    assert not problems, problems
    spec = dataclasses.replace(critic_spec(cfg, world_size=1), recompute=OTHER)
    assert spec.optim.recompute_granularity is None
    seen = _capture(monkeypatch, critic_mod, spec)
    with pytest.raises(_Built):
        MegatronCritic(spec)
    assert {k: v for k, v in seen.items() if k.startswith("recompute_")} == OTHER.transformer_config_kwargs()
