"""The async rollout source applies versions with the job's ``DeferredPublisher``, built by ``build_job`` from the job
plan's ``WeightSyncSettings`` object itself (built once by ``JobPlan.build``), not a second build from the config:
``build_job`` on one gloo rank, embedded engine, copy task."""
import pytest

from megatron_rl.tasks.char_tokenizer import build_task_model
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import named_job

pytestmark = pytest.mark.timeout(200)


def _built(rank, world, cfg):
    from megatron_rl.trainer.job import build_job

    job = build_job(cfg)
    try:
        plan = job.plan.weight_sync
        return (type(job.source.publisher).__name__, job.source.publisher.settings is plan, plan.mode.name,
                type(job.source).__name__)
    finally:
        job.close(0)


def test_async_source_gets_the_plans_settings(tmp_path):
    hf = build_task_model(str(tmp_path / "m"), task="copy", seed=0, hidden_size=32, num_layers=1)
    cfg = named_job("async_copy", "rollout.mode=async", "rollout.max_staleness=1", "trainer.steps=1",
                    hf=hf, run_dir=str(tmp_path / "run"), world_size=1)
    assert run_ranks(_built, 1, cfg, timeout=180) == [("DeferredPublisher", True, "tensor", "AsyncRollouts")]
