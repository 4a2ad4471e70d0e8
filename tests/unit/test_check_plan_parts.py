"""``megatron-rl check`` sizes a job from the plan's own objects (``plan.job.plan_parts``) even when a key is
refused: the problem is named, and the plan is printed for what the job asks (a refused fp32 output layer on a
bf16 actor is still planned bf16; a refused recompute combination is still planned as that recomputation)."""
import pytest
import yaml

from megatron_rl.cli import main as cli_main

JOB = {
    "cluster": {"device": "cuda", "nodes": 1, "gpus_per_node": 4, "gpu_memory_gb": 80},
    "model": {"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
              "num_query_groups": 2, "kv_channels": 16, "vocab_size": 256, "max_position_embeddings": 1024},
    "parallel": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
    "rollout": {"engine": "embedded", "max_new_tokens": 32, "n_samples_per_prompt": 2},
    "data": {"task": "copy", "prompts_per_step": 4},
    "actor": {"micro_batch_size": 2, "ppo_mini_batches": 1, "bf16": True},
}


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(JOB))
    return str(path)


def _check(capsys, job, *args):
    rc = cli_main(["check", job, "--prompt-length", "16", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_refused_precision_is_named_and_the_plan_still_printed(job, capsys):
    rc, out, err = _check(capsys, job, "actor.fp32_output_layer=true")  # without the distributed optimizer
    assert rc == 2
    assert "actor.fp32_output_layer: needs actor.use_distributed_optimizer: true" in err
    assert "runs: device cuda; params 2 B (the actor builds bf16)" in out and "peak: stage" in out


def test_a_refused_recompute_is_planned_as_asked(job, capsys):
    rc, out, err = _check(capsys, job, "actor.recompute_granularity=full", "actor.recompute_method=block",
                          "actor.recompute_num_layers=9")  # more layers than a stage's 2
    assert rc == 2 and "actor.recompute_num_layers" in err, err
    assert "recompute full" in out and "(recompute=full" in out
