"""What a GPU-cluster user meets: install extras that exist, the shared filesystem of disk syncs said by ``check``,
one visible GPU per Slurm task, config hints for verl's rollout keys, and weight verification being off when SGLang
is not importable in the trainer's environment said loudly (docs/cluster.md)."""
import ast
import glob
import os
import re

import pytest

from megatron_rl.config import ConfigError, job_config_from_dict
from megatron_rl.plan import load_job_config
from megatron_rl.plan.sizing import job_sync_plan
from megatron_rl.parallel.launch import LaunchEnv, cuda_device_index

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _extras():
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return set(ast.literal_eval(node.value))
    raise AssertionError("setup.py has no extras_require")


def test_every_documented_pip_extra_exists():
    extras, seen = _extras(), 0
    for path in [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]:
        for names in re.findall(r"pip install[^\n`]*?\.\[([a-z0-9_,\- ]+)\]", open(path).read()):
            seen += 1
            missing = {n.strip() for n in names.split(",")} - extras
            assert not missing, f"{os.path.relpath(path, ROOT)}: extra(s) {sorted(missing)} not in setup.py {sorted(extras)}"
    assert seen >= 2
    install = open(os.path.join(ROOT, "docs", "cluster.md")).read()
    assert '".[math,parquet]"' in install


@pytest.mark.parametrize("engine, shared", [("sglang", True), ("embedded", False)])
def test_check_says_disk_syncs_need_a_shared_filesystem(engine, shared):
    over = [f"rollout.engine={engine}", "trainer.run_dir=/scratch/run"]
    if engine == "sglang":   # async with SGLang servers: the disk sync, the only one async accepts
        over += ["rollout.mode=async", 'rollout.sglang_urls=["http://srv:30000"]']
    else:                    # the embedded engine loads the export in the trainer's own process
        over.append("rollout.weight_sync=disk")
    cfg = load_job_config(os.path.join(ROOT, "configs", "qwen2.5_7b_1x8.yaml"), over, world_size=8)
    line = job_sync_plan(cfg, 7_000_000_000).line()
    assert line.startswith("weight sync (disk)")
    assert ("filesystem shared by the trainer's rank 0 and every server node" in line) == shared
    assert ("/scratch/run/weight_sync" in line) == shared


@pytest.mark.parametrize("staleness", [1, 2])
def test_check_counts_the_versions_async_in_memory_sync_holds_on_rank_0(staleness):
    """Async rollouts with a streamed sync: rank 0 keeps every published, not yet loaded version whole, in the
    trainer's dtype (fp32 here), and builds the next one: (max_staleness + 2) copies of 7e9 x 4 bytes."""
    over = ["rollout.engine=sglang", 'rollout.sglang_urls=["http://srv:30000"]', "rollout.weight_sync=distributed"]
    cfg = load_job_config(os.path.join(ROOT, "configs", "qwen2.5_7b_1x8.yaml"), over, world_size=8)
    sync = job_sync_plan(cfg, 7_000_000_000).rank0_host_bytes
    cfg = load_job_config(os.path.join(ROOT, "configs", "qwen2.5_7b_1x8.yaml"),
                          over + ["rollout.mode=async", f"rollout.max_staleness={staleness}"], world_size=8)
    held = job_sync_plan(cfg, 7_000_000_000).rank0_host_bytes - sync
    assert held == (staleness + 2) * 7e9 * (2 if cfg.actor.bf16 else 4), held


def _launch(launcher, local):
    return LaunchEnv(rank=local, local_rank=local, world_size=8, master_addr="n0", master_port=1, launcher=launcher)


def test_a_slurm_task_that_sees_one_gpu_uses_it():
    assert cuda_device_index(_launch("slurm", 3), visible=1) == 0          # srun --gpus-per-task=1
    assert cuda_device_index(_launch("slurm", 3), visible=8) == 3          # all of the node's GPUs visible
    assert cuda_device_index(_launch("torchrun", 5), visible=8) == 5
    with pytest.raises(RuntimeError, match="local rank 5 but only 2 GPU"):
        cuda_device_index(_launch("slurm", 5), visible=2)
    with pytest.raises(RuntimeError, match="torchrun launch: local rank 1 but only 1 GPU"):
        cuda_device_index(_launch("torchrun", 1), visible=1)


def _error(tree):
    with pytest.raises(ConfigError) as err:
        job_config_from_dict(tree)
    return str(err.value)


def test_hints_for_verl_rollout_keys():
    msg = _error({"rollout": {"tensor_model_parallel_size": 4}})
    assert "launch/sglang_server.sh --tp" in msg and "SGLANG_TP" in msg
    assert "this project's key is parallel.tensor_model_parallel_size" not in msg
    assert "this project's key is parallel.tensor_model_parallel_size" in _error({"actor": {"tensor_model_parallel_size": 2}})
    msg = _error({"rollout": {"max_prompt_length": 512}})
    assert "this project's key is data.max_prompt_length" in msg and "not supported" not in msg
    try:   # verl's loss_mode: a key of this project or a hint to it, never "did you mean loss_agg_mode"
        job_config_from_dict({"actor": {"policy_loss": {"loss_mode": "vanilla"}}})
    except ConfigError as exc:
        assert "loss_agg_mode" not in str(exc)


def test_unverified_gpu_syncs_are_said_in_the_docs():
    text = re.sub(r"\s+", " ", open(os.path.join(ROOT, "docs", "cluster.md")).read())
    assert "Then weight syncs to GPU servers are not verified" in text
    assert "verification skipped -- OFF for this whole run" in text
