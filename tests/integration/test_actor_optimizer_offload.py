"""``actor.optimizer_cpu_offload`` (megatron-core's ``HybridDeviceOptimizer``): the job trains as without it, and a
checkpoint saved with it resumes exactly.

On a GPU megatron offloads the optimizer state of CUDA parameters to the host. On this CPU run every tensor is in
host memory already; megatron's class only offloads ``param.is_cuda`` tensors, so a CPU job's actor makes the CPU
its device (``platform/cpu_hybrid_optimizer``: every offloaded parameter still copied to a separate host tensor,
stepped by its CPU AdamW and copied back by its hooks -- the code path a GPU job runs, minus the device transfers).
The tests run the actor as a CPU job does: nothing of megatron's is patched here.

* DP1: bit-identical bf16 weights to megatron's distributed optimizer without offload after 3 steps.
* DP2: within one bf16 ulp on at most 0.01% of the elements (fp32 rounding: the precision-aware path reduces the
  gradient norm and applies the clipped gradient in another order; measured: 1 element of 94528 after 3 steps).
* save after one step, load into a fresh offloaded actor, one more step == the uninterrupted offloaded run.
* offload switched on or off across a resume: the next step within the DP2 tolerance above.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_actor_optimizer_offload.py -q``
"""
import gc
import multiprocessing
import weakref

import pytest
import torch

import megatron.core  # noqa: F401
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
from megatron_rl.actor import MegatronActor
from megatron_rl.plan import actor_spec
from megatron_rl.actor.optimizer import offload_errors
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.testing.actor_reference import checkpoint_step
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import CHECKPOINT_MODEL, knobs, layout, named_job, setting

TWO_LAYERS = "model.num_layers=2"
#: a tiny MoE (4 experts, top-2): at EP2 megatron chains a dense and an expert optimizer, both offloaded
MOE = setting("model", dict(CHECKPOINT_MODEL, num_layers=2, num_moe_experts=4, moe_ffn_hidden_size=32,
                            moe_router_topk=2, moe_router_load_balancing_type="none", qk_layernorm=True,
                            kv_channels=16))


def _job(offload, *extra):
    return named_job("checkpoint_actor", TWO_LAYERS, *extra,
                     *knobs(use_distributed_optimizer=True, bf16=True, optimizer_cpu_offload=offload))



def _train(rank, world, job, steps, save=None, load=None, first=0):
    try:
        initialize_model_parallel(job.parallel, seed=7, model=job.model)
        actor = MegatronActor(actor_spec(job))
        kinds = {type(o.optimizer).__name__ for o in getattr(actor.optimizer, "chained_optimizers", None)
                 or [actor.optimizer]}  # (a ChainedOptimizer's .optimizer asserts it holds one)
        if load:
            first = actor.load_checkpoint(load)[0]
        for s in range(first, first + steps):
            checkpoint_step(actor, 100 + s)
        if save:
            actor.save_checkpoint(save, first + steps)
        return {n: p.detach().clone() for c in actor.model for n, p in c.named_parameters()}, kinds
    finally:
        for child in multiprocessing.active_children():
            child.terminate()
            child.join(5)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2], ids=["dp1", "dp2"])
def test_offloaded_optimizer_trains_as_without(world):
    want, plain = run_ranks(_train, world, _job(False), 3, timeout=300)[0]
    got, kinds = run_ranks(_train, world, _job(True), 3, timeout=300)[0]
    assert "HybridDeviceOptimizer" in kinds and "HybridDeviceOptimizer" not in plain, (kinds, plain)
    init, _ = run_ranks(_train, 1, _job(False), 0, timeout=300)[0]
    assert sum(int((want[k] != init[k]).sum()) for k in want) > 0.5 * sum(w.numel() for w in want.values())
    differ = 0
    for k, w in want.items():
        ulp = torch.finfo(torch.bfloat16).eps * w.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
        assert ((got[k].float() - w.float()).abs() <= ulp).all(), k
        differ += int((got[k] != w).sum())
    print(f"world {world}: {differ} of {sum(w.numel() for w in want.values())} weights differ (one bf16 ulp)")
    assert differ <= 1e-4 * sum(w.numel() for w in want.values()), differ


@pytest.mark.timeout(600)
def test_offloaded_optimizer_resumes_exactly(tmp_path):
    job = _job(True)
    want, _ = run_ranks(_train, 2, job, 2, timeout=300)[0]
    run_ranks(_train, 2, job, 1, str(tmp_path), timeout=300)
    got, _ = run_ranks(_train, 2, job, 1, None, str(tmp_path / "iter_0000001"), timeout=300)[0]
    for k, w in want.items():
        assert torch.equal(got[k], w), f"{k}: {(got[k].float() - w.float()).abs().max().item():.3g}"


def test_offload_needs_what_megatron_needs():
    """The refusals name the key and what it needs (config validation, before any model is built)."""
    from megatron_rl.config.sections import ActorConfig

    ok = ActorConfig(bf16=True, use_distributed_optimizer=True, optimizer_cpu_offload=True)
    assert offload_errors(ok) == []
    assert any("needs actor.use_distributed_optimizer" in e for e in
               offload_errors(ActorConfig(bf16=True, optimizer_cpu_offload=True)))
    assert any("needs actor.bf16" in e for e in
               offload_errors(ActorConfig(use_distributed_optimizer=True, optimizer_cpu_offload=True)))
    assert any("not with actor.fp32_output_layer" in e for e in  # megatron: "can't optimize a non-leaf Tensor"
               offload_errors(ActorConfig(bf16=True, use_distributed_optimizer=True, optimizer_cpu_offload=True,
                                          fp32_output_layer=True)))
    assert any("actor.optimizer_offload_fraction: must be in (0, 1]" in e for e in
               offload_errors(ActorConfig(bf16=True, use_distributed_optimizer=True, optimizer_cpu_offload=True,
                                          optimizer_offload_fraction=0.0)))
    old = offload_errors(ok, optimizer_fields={"lr", "optimizer"})  # a megatron-core without it
    assert len(old) == 1 and "the installed megatron-core" in old[0] and "optimizer_cpu_offload" in old[0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("saved_with", [True, False], ids=["offload-to-plain", "plain-to-offload"])
def test_offload_switched_across_a_resume(tmp_path, saved_with):
    """A checkpoint holds megatron's distributed-optimizer state either way: saved with offload it resumes without,
    and the reverse; the next step equals the uninterrupted run's (within the tolerance of the first test)."""
    want, _ = run_ranks(_train, 2, _job(saved_with), 2, timeout=300)[0]
    run_ranks(_train, 2, _job(saved_with), 1, str(tmp_path), timeout=300)
    got, kinds = run_ranks(_train, 2, _job(not saved_with), 1, None, str(tmp_path / "iter_0000001"), timeout=300)[0]
    assert ("HybridDeviceOptimizer" in kinds) == (not saved_with)
    moved = 0
    for k, w in want.items():
        ulp = torch.finfo(torch.bfloat16).eps * w.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
        assert ((got[k].float() - w.float()).abs() <= ulp).all(), k
        moved += int((got[k] != w).sum())
    assert moved <= 1e-4 * sum(w.numel() for w in want.values()), moved


def _main_params(rank, world, job):
    """Each bf16 parameter's fp32 main shard, in the optimizer's order (the distributed optimizer's own copy, or
    with offload the HybridDeviceOptimizer's fp32 copy it steps), and the bf16 weights."""
    try:
        initialize_model_parallel(job.parallel, seed=7, model=job.model)
        actor = MegatronActor(actor_spec(job))
        out = []
        for o in getattr(actor.optimizer, "chained_optimizers", None) or [actor.optimizer]:
            fp32 = getattr(o.optimizer, "param_to_fp32_param", None)
            for shard_group, main_group in zip(o.shard_float16_groups, o.shard_fp32_from_float16_groups):
                for shard, main in zip(shard_group, main_group):
                    out.append((fp32[shard] if fp32 is not None else main).detach().clone())
        return out, [p.detach().clone() for c in actor.model for p in c.parameters()]
    finally:
        for child in multiprocessing.active_children():
            child.terminate()
            child.join(5)


@pytest.mark.timeout(600)
def test_offloaded_main_params_are_the_loaded_fp32_values(tiny_hf_model):
    """An fp32 HF checkpoint loaded into a bf16 actor: the fp32 main parameters the offloaded optimizer steps are
    the loaded values (as without offload: actor/main_params.py), not their bf16 rounding (DP2: each rank's
    slice)."""
    hf = tiny_hf_model("qwen2", seed=21)

    def job(offload):
        return named_job("actor", *knobs(use_distributed_optimizer=True, bf16=True, optimizer_cpu_offload=offload),
                         hf=hf)

    want = run_ranks(_main_params, 2, job(False), timeout=300)
    got = run_ranks(_main_params, 2, job(True), timeout=300)
    for (w, weights), (g, _) in zip(want, got):
        assert len(g) == len(w) > 0
        assert any(not torch.equal(m, m.bfloat16().float()) for m in w), "the source's weights are all bf16"
        for a, b in zip(g, w):
            assert torch.equal(a.float(), b), (a - b).abs().max()


def _within_one_ulp(got, want):
    moved = 0
    for k, w in want.items():
        ulp = torch.finfo(torch.bfloat16).eps * w.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
        assert ((got[k].float() - w.float()).abs() <= ulp).all(), k
        moved += int((got[k] != w).sum())
    assert moved <= 1e-4 * sum(w.numel() for w in want.values()), moved


@pytest.mark.timeout(600)
@pytest.mark.parametrize("lay", [layout(pp=2), [MOE, *layout(ep=2)]], ids=["pp2", "moe-ep2"])
def test_offload_with_pipeline_and_experts_and_two_optimizer_steps_per_step(lay):
    """PP2 (each stage its own optimizer) and a MoE at EP2 (megatron's expert optimizer offloaded as well), two
    mini-batches per step: the same weights as without offload (tolerance of the DP2 test; measured: identical)."""
    two = ("actor.ppo_mini_batches=2",)
    want, plain = run_ranks(_train, 2, _job(False, *lay, *two), 2, timeout=300)[0]
    got, kinds = run_ranks(_train, 2, _job(True, *lay, *two), 2, timeout=300)[0]
    assert kinds == {"HybridDeviceOptimizer"} and "HybridDeviceOptimizer" not in plain, (kinds, plain)
    _within_one_ulp(got, want)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("saved, loaded", [(1.0, 0.5), (0.5, 1.0)])
def test_offload_fraction_changed_across_a_resume(tmp_path, saved, loaded):
    """A checkpoint saved at one optimizer_offload_fraction resumes at another: the next step equals the
    uninterrupted run's (megatron's class re-splits its parameters between host and device at load)."""
    frac = "actor.optimizer_offload_fraction={}"
    want, _ = run_ranks(_train, 2, _job(True, frac.format(saved)), 2, timeout=300)[0]
    run_ranks(_train, 2, _job(True, frac.format(saved)), 1, str(tmp_path), timeout=300)
    got, _ = run_ranks(_train, 2, _job(True, frac.format(loaded)), 1, None, str(tmp_path / "iter_0000001"),
                       timeout=300)[0]
    _within_one_ulp(got, want)


def _hybrid_optimizers_alive(rank, world, job):
    try:
        initialize_model_parallel(job.parallel, seed=7, model=job.model)
        gc.disable()  # whether Python's own collector ran during the build is chance: here it does not
        actor = MegatronActor(actor_spec(job))
        alive = [weakref.ref(o) for o in gc.get_objects() if isinstance(o, HybridDeviceOptimizer)]  # no collection
        used = [o.optimizer for o in getattr(actor.optimizer, "chained_optimizers", None) or [actor.optimizer]]
        return [r() is not None and any(r() is u for u in used) for r in alive]
    finally:
        gc.enable()
        for child in multiprocessing.active_children():
            child.terminate()
            child.join(5)


@pytest.mark.timeout(300)
def test_no_second_offload_optimizer_lingers():
    """megatron builds a HybridDeviceOptimizer over the whole (unsharded) parameters, then its distributed optimizer
    replaces it by one over the rank's shards; the first -- fp32 copies of every parameter, on the device for the
    share not offloaded -- is in a reference cycle (its step hooks), freed only by Python's cyclic collector. The
    actor frees it when it builds the optimizer: only the optimizers in use are alive."""
    job = _job(True, "actor.optimizer_offload_fraction=0.5")
    [alive] = run_ranks(_hybrid_optimizers_alive, 1, job, timeout=250)
    assert alive and all(alive), alive
