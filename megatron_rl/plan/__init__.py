"""The job plan: every choice of a job built once from its config (``JobPlan``), validation being what failed."""
from megatron_rl.plan.job import JobPlan, PlanError, actor_spec, job_engine, replay_of, world_errors

__all__ = ["JobPlan", "PlanError", "actor_spec", "job_engine", "replay_of", "world_errors"]
