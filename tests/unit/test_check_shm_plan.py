"""Which shared-memory segments ``megatron-rl check`` plans where (``ops.weight_sync_plan.sync_segments``): the TP
gather slots only on CPU jobs (a CUDA job gathers with NCCL), the senders' segments only with an engine in rank 0's
process, and only the ranks of rank 0's host counted there (``cluster.gpus_per_node`` ranks per host, megatron's
order: stage s of a TP2 x PP2 job is ranks 2s, 2s + 1). The sizes themselves are checked against a real sync in
``tests/integration/test_check_shm_segments.py``."""
from megatron_rl.config import job_config_from_dict
from megatron_rl.plan.sizing import job_sync_plan

MODEL = {"vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_attention_heads": 4, "ffn_hidden_size": 128}


def _plan(device="cpu", engine="embedded", gpus_per_node=4, nodes=1):
    rollout = {"engine": engine, "weight_sync": "tensor", "weight_sync_bucket_mb": 0.02}
    if engine == "sglang":
        rollout["sglang_urls"] = ["http://127.0.0.1:9"]
    cfg = job_config_from_dict({"model": MODEL, "rollout": rollout,
                                "parallel": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
                                "cluster": {"device": device, "nodes": nodes, "gpus_per_node": gpus_per_node}})
    return job_sync_plan(cfg, world_size=4)


def test_cpu_embedded_job_plans_both_kinds_on_one_host():
    plan = _plan()
    assert {g.holder: g.rank0_host for g in plan.segments} == {"stage 0 TP rank 1": True, "stage 1 TP rank 1": True,
                                                               "sender stage 1": True}


def test_cuda_jobs_gather_with_nccl_and_sglang_receives_no_sender_segment():
    assert [g.holder for g in _plan(device="cuda").segments] == ["sender stage 1"]
    assert [g.holder for g in _plan(engine="sglang").segments] == ["stage 0 TP rank 1", "stage 1 TP rank 1"]


def test_only_rank_0s_host_is_counted_there():
    plan = _plan(gpus_per_node=2, nodes=2)   # ranks 2, 3 (stage 1) on the second host
    # stage 1's sender is on the other host: its buckets go over gloo, no segment (``shm_reach``)
    assert {g.holder: g.rank0_host for g in plan.segments} == {"stage 0 TP rank 1": True, "stage 1 TP rank 1": False}
    assert "gather slots of 1 rank(s)" in plan.line() and "sender segment" not in plan.line()
