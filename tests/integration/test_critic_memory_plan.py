"""``check``'s memory plan counts the critic: its per-stage bytes (weights + gradients + Adam state) equal those of
the parameters megatron-core really builds for ``MegatronCritic`` on each pipeline stage (the value head on the
last one, the output layer gone), untied and tied embeddings, PP2.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_critic_memory_plan.py -q``
"""
import pytest

from megatron.core import parallel_state

from megatron_rl.actor.critic import MegatronCritic
from megatron_rl.ops.memory import MemoryOptions, memory_plan
from megatron_rl.plan.sizing import memory_job
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.plan.job import critic_spec
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import layout, named_job

CRITIC = ("algorithm.advantage_estimator=gae", "critic.enable=true")


def _rank(rank, world, job):
    initialize_model_parallel(job.parallel, seed=3, model=job.model)
    critic = MegatronCritic(critic_spec(job))
    n = sum(p.numel() for c in critic.model for p in c.module.parameters())
    return parallel_state.get_pipeline_model_parallel_rank(), n


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_plan_counts_the_critics_parameters(tied):
    job = named_job("checkpoint_actor", *CRITIC, *layout(pp=2),
                    f"model.untie_embeddings_and_output_weights={str(not tied).lower()}")
    built = dict(run_ranks(_rank, 2, job, timeout=150))
    opts = MemoryOptions(prompt_length=8, params_bytes=4, grad_bytes=4, distributed_optimizer=False)
    plan = memory_plan(memory_job(job, 2), opts)
    assert plan.critic_model
    for st in plan.stages:  # fp32: 4 B weight + 4 B gradient + 8 B Adam moments per parameter
        assert st.critic == 16 * built[st.stage], (st.stage, st.critic / 16, built[st.stage])
    without = memory_plan(memory_job(named_job("checkpoint_actor", *layout(pp=2)), 2), opts)
    assert not without.critic_model and all(st.critic == 0 for st in without.stages)
