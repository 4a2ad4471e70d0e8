"""The job plan: every choice of a job built once from its config (``JobPlan``), validation being what failed."""
from megatron_rl.plan.job import (JobPlan, PlanError, actor_spec, budget_of, dynamic_sampling_of, job_engine, replay_of,
                                  world_errors)
from megatron_rl.plan.load import collect_job_config, job_errors, load_job_config, validate_job

__all__ = ["JobPlan", "PlanError", "actor_spec", "budget_of", "dynamic_sampling_of", "job_engine", "replay_of", "world_errors",
           "collect_job_config", "job_errors", "load_job_config", "validate_job"]
