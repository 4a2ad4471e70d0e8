"""The memory plan's parameter, gradient and optimizer columns (``ops.memory.memory_plan``) against the bytes
megatron-core really allocates for a built actor after one optimizer step, counted tensor by tensor: the bf16
weights, DDP's gradient buffers, the distributed optimizer's fp32 main shards and Adam moments -- and with
``actor.optimizer_cpu_offload`` the ``HybridDeviceOptimizer``'s fp32 copies, moments and gradient copies on the
host (its CPU sub-optimizers) and on the device (its device sub-optimizer). Layouts: DP2, PP2 and a MoE at EP2
(megatron's separate expert optimizer). Tolerance: DDP pads its buckets and splits the shard unevenly over the
ranks (< 0.5%). ``optimizer_offload_fraction`` < 1: megatron offloads whole parameters until the fraction is
reached, the plan f of the elements, so only their sum (the rank's optimizer elements) is compared there.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_memory_plan_measured.py -q``
"""
import multiprocessing

import pytest
import torch

from megatron.core import parallel_state

from megatron_rl.actor import MegatronActor
from megatron_rl.ops.memory import MemoryOptions, memory_plan
from megatron_rl.plan.sizing import memory_job
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.plan import actor_spec
from megatron_rl.testing.actor_reference import checkpoint_batch
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import CHECKPOINT_MODEL, knobs, layout, named_job, setting

MOE = setting("model", dict(CHECKPOINT_MODEL, num_layers=2, num_moe_experts=4, moe_ffn_hidden_size=32,
                            moe_router_topk=2, moe_router_load_balancing_type="none", qk_layernorm=True,
                            kv_channels=16))


def _bytes(tensors) -> int:
    seen, n = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            n += t.numel() * t.element_size()
    return n


def _moments(opt):
    return [v for st in opt.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]


def _measure(rank, world, job):
    try:
        initialize_model_parallel(job.parallel, seed=7, model=job.model)
        actor = MegatronActor(actor_spec(job))
        batch, adv = checkpoint_batch(100, rows=8)
        rows = 8 // actor.dp_size
        lo = actor.dp_rank * rows
        shard, adv = batch.select(lo, lo + rows), adv[lo:lo + rows]
        old, _ = actor.compute_log_probs(shard, 1.0)
        actor.train_step(shard, old, adv, shard.response_mask, None, 1.0)
        grads = [b.grad_data for c in actor.model
                 for b in list(c.buffers) + list(getattr(c, "expert_parallel_buffers", []))]
        device, host = [], []
        for o in getattr(actor.optimizer, "chained_optimizers", None) or [actor.optimizer]:
            device += [p for g in o.shard_fp32_from_float16_groups + o.shard_fp32_groups for p in g]
            inner = o.optimizer
            if type(inner).__name__ != "HybridDeviceOptimizer":
                device += _moments(inner)
                continue
            for sub in inner.cpu_optimizers:
                host += [p for g in sub.param_groups for p in g["params"]] + _moments(sub)
            host += list(inner.cpu_copy_map_grad.values())
            if inner.gpu_optimizer is not None:
                device += [p for g in inner.gpu_optimizer.param_groups for p in g["params"]]
                device += _moments(inner.gpu_optimizer)
        return {"stage": parallel_state.get_pipeline_model_parallel_rank(),
                "params": _bytes(p for c in actor.model for p in c.parameters()), "grads": _bytes(grads),
                "optimizer": _bytes(device), "host": _bytes(host)}
    finally:
        for child in multiprocessing.active_children():
            child.terminate()
            child.join(5)


CASES = {"dp2": (1.0, []), "dp2-plain": (0.0, []), "pp2": (1.0, layout(pp=2)),
         "ep2-moe": (1.0, [MOE, *layout(ep=2)]), "dp2-half": (0.5, [])}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_plan_matches_megatrons_allocations(case):
    fraction, extra = CASES[case]
    offload = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=fraction) if fraction else {}
    job = named_job("checkpoint_actor", "model.num_layers=2", *extra,
                    *knobs(use_distributed_optimizer=True, bf16=True, **offload))
    plan = memory_plan(memory_job(job, 2), MemoryOptions(params_bytes=2, optimizer_offload_fraction=fraction))
    got = run_ranks(_measure, 2, job, timeout=400)
    for g in got:
        st = plan.stages[g["stage"]]
        assert g["params"] == st.params, (case, g, st)
        assert g["grads"] == pytest.approx(st.grads, rel=5e-3), (case, g)
        if fraction in (0.0, 1.0):
            assert g["optimizer"] == pytest.approx(st.optimizer, rel=5e-3, abs=1), (case, g, st.optimizer)
            assert g["host"] == pytest.approx(st.host, rel=5e-3, abs=1), (case, g, st.host)
        else:  # whole parameters vs a share of the elements: the rank's optimizer elements
            assert g["optimizer"] / 12 + g["host"] / 16 == pytest.approx(st.optimizer / 12 + st.host / 16, rel=5e-3)
            assert 0 < g["host"] and 0 < g["optimizer"], g
