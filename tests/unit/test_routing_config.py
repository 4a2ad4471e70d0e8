"""``actor.routing_replay`` config: the shipped tiny MoE config validates at 4 ranks with its model built by
``python -m megatron_rl.tasks OUT --moe``; bad values and replay on a dense model name the dotted key."""
import os

import pytest

from megatron_rl.plan import load_job_config
from megatron_rl.config.job import ConfigError

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


@pytest.fixture(scope="module")
def moe_task_model(task_model):
    return task_model(num_layers=4, num_experts=8, num_experts_per_tok=2)


def test_tiny_moe_cpu_validates_with_r3_at_four_ranks(moe_task_model):
    cfg = load_job_config(os.path.join(CONFIGS, "tiny_moe_cpu.yaml"), [f"actor.load_hf={moe_task_model}"],
                          world_size=4)
    assert cfg.actor.routing_replay == "r3"
    assert cfg.model.is_moe and cfg.model.num_moe_experts == 8 and cfg.model.moe_router_topk == 2
    assert cfg.model.num_layers == 4 and cfg.parallel.expert_model_parallel_size == 2


def test_bad_routing_replay_names_the_key(moe_task_model):
    path = os.path.join(CONFIGS, "tiny_moe_cpu.yaml")
    with pytest.raises(ConfigError, match=r"actor\.routing_replay: 'r4' is not one of none, r2, r3"):
        load_job_config(path, [f"actor.load_hf={moe_task_model}", "actor.routing_replay=r4"], world_size=4)


def test_replay_on_a_dense_model_names_the_key(task_model, tiny_job):
    dense = task_model(num_layers=2)
    with pytest.raises(ConfigError, match=r"actor\.routing_replay: 'r3' needs an MoE model"):
        tiny_job("actor.routing_replay=r3", model=dense, world_size=4)
