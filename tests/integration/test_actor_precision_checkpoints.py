"""Checkpoints of the mixed-precision actor (``actor.bf16``) and of megatron's distributed optimizer
(``actor.use_distributed_optimizer``: fp32 main parameters and Adam state sharded over the data-parallel ranks) on
CPU, gloo.

Distributed optimizer (DP2, fp32 parameters):

* same training: 3 optimizer steps with it equal 3 steps without it (weights <= 1e-6: fp32 reduction order;
  reduce-scatter + all-gather instead of all-reduce), metrics to the same tolerance, and each rank holds only
  its shard of the Adam state (about half of the elements);
* 2 steps in one go == 1 step, save, a fresh set of processes loads, 1 step (bitwise: weights, metrics); the
  checkpoint loads at another DP size (DP2 -> DP1: same weights, next step equal to the uninterrupted run to fp32
  reduction order); ``megatron-rl convert mcore-to-hf`` of it (``export_checkpoint_to_hf``) equals the live
  actor's HF state dict bitwise.

bf16 (with and without the distributed optimizer):

* resume is bit-exact: weights, fp32 main parameters and metrics of 1 + save/load + 1 steps == 2 steps;
* an fp32 checkpoint loads into a bf16 run: model weights are the saved fp32 weights rounded to bf16, the fp32
  main parameters and the Adam moments are the saved ones exactly (no double rounding), and the next step is
  within bf16 tolerance of the fp32 run's next step;
* a bf16 checkpoint into an fp32 run is refused by name (``actor.bf16``), before any tensor is read;
* ``actor.fp32_output_layer`` with the distributed optimizer (a param group mixing fp32 and bf16 weights) resumes
  bit-exactly.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_actor_precision_checkpoints.py -q``
"""
import multiprocessing
import re

import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.actor import MegatronActor
from megatron_rl.plan import actor_spec
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.testing.actor_reference import assert_state_dicts_close, checkpoint_step
from megatron_rl.testing.distributed import RankError, run_ranks
from megatron_rl.testing.jobs import knobs, named_job, setting

#: the table's checkpoint_actor row at 2 layers (the model of these tests)
TWO_LAYERS = "model.num_layers=2"





def _adam_numel(actor) -> int:
    """Elements of Adam's exp_avg held by this rank."""
    return sum(st["exp_avg"].numel() for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
               for st in o.optimizer.state.values() if "exp_avg" in st)


def _optimizers(actor):
    return getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])


def _main_params(actor) -> torch.Tensor:
    """This rank's fp32 main parameters (what the torch Adam inside megatron's optimizer steps), flattened."""
    return torch.cat([p.detach().flatten() for o in _optimizers(actor) for g in o.optimizer.param_groups
                      for p in g["params"]])


def _named_main_state(actor) -> dict:
    """Non-distributed optimizers: {model parameter name: {param, exp_avg, exp_avg_sq}} of the fp32 main copy."""
    names = {id(p): n for c in actor.model for n, p in c.module.named_parameters()}
    out = {}
    for o in _optimizers(actor):
        pairs = ([(p, p) for g in o.optimizer.param_groups for p in g["params"]] if not hasattr(o, "float16_groups")
                 else [pm for mg, fg in zip(o.float16_groups, o.fp32_from_float16_groups) for pm in zip(mg, fg)]
                 + [(p, p) for g in o.fp32_from_fp32_groups for p in g])
        for model_p, main in pairs:
            st = o.optimizer.state.get(main, {})
            out[names[id(model_p)]] = {"param": main.detach().clone(),
                                       **{k: st[k].clone() for k in ("exp_avg", "exp_avg_sq") if k in st}}
    return out


def _reap_children() -> None:
    """End the worker processes megatron's checkpoint writer may have left in this rank."""
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(5)


def _rank(rank, world, job, steps, save_dir=None, load_dir=None, init_seed=7):
    try:
        initialize_model_parallel(job.parallel, seed=init_seed, model=job.model)
        actor = MegatronActor(actor_spec(job))
        start = actor.load_checkpoint(load_dir)[0] if load_dir else 0
        loaded = actor.full_state_dict_hf()
        distributed = job.actor.use_distributed_optimizer
        loaded_main = None if distributed else _named_main_state(actor)
        metrics = [checkpoint_step(actor, 100 + s) for s in range(start, start + steps)]
        ckpt = actor.save_checkpoint(save_dir, start + steps) if save_dir else None
        return {"metrics": metrics, "weights": actor.full_state_dict_hf(), "loaded": loaded, "ckpt": ckpt,
                "adam_numel": _adam_numel(actor), "start": start, "main": _main_params(actor),
                "loaded_main": loaded_main, "final_main": None if distributed else _named_main_state(actor)}
    finally:
        _reap_children()


def _weights(results, key="weights"):
    sds = [r[key] for r in results if r[key] is not None]
    assert len(sds) == 1
    return sds[0]



@pytest.mark.timeout(240)
def test_same_training_as_without_it_and_adam_state_sharded():
    plain = run_ranks(_rank, 2, named_job("checkpoint_actor", TWO_LAYERS, *knobs(use_distributed_optimizer=False)), 3,
                      timeout=200)
    dist = run_ranks(_rank, 2, named_job("checkpoint_actor", TWO_LAYERS, *knobs(use_distributed_optimizer=True)), 3,
                     timeout=200)
    assert_state_dicts_close(_weights(dist), _weights(plain), atol=1e-6)
    for a, b in zip(dist[0]["metrics"], plain[0]["metrics"]):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k
    moved = [k for k in _weights(plain) if not torch.equal(_weights(plain)[k], _weights(plain, "loaded")[k])]
    assert len(moved) > 5, "the steps must change the weights for the comparison to mean anything"
    full = plain[0]["adam_numel"]
    assert all(r["adam_numel"] == full for r in plain)
    # each rank's shard of the Adam state: about half of the buffer (shard bounds cut through parameters)
    assert all(0.45 * full < r["adam_numel"] < 0.55 * full for r in dist), ([r["adam_numel"] for r in dist], full)
    assert sum(r["adam_numel"] for r in dist) >= full


def _host_state_rank(rank, world, job):
    """Bytes of the CPU tensors megatron's distributed optimizer allocates when loading / saving a fully_reshardable
    checkpoint (``get_parameter_state_dp_zero`` as ``sharded_param_state_fully_reshardable`` calls it), and this
    rank's parameter count."""
    try:
        initialize_model_parallel(job.parallel, seed=7, model=job.model)
        actor = MegatronActor(actor_spec(job))
        checkpoint_step(actor, 100)
        opts = _optimizers(actor)

        def world_bytes(**kw):
            total = 0
            for o in opts:
                state = o.get_parameter_state_dp_zero(use_gloo_comm=True, **kw)
                for gbuf, per_dtype in (state or {}).items():
                    if gbuf == "buckets_coalesced":
                        continue
                    for tensors in per_dtype.values():
                        total += sum(t.numel() * t.element_size() for t in tensors.values() if torch.is_tensor(t))
            return total

        return {"load": world_bytes(empty_data=True, return_on_all_ranks=True),
                "save": world_bytes(),
                "params": sum(p.numel() for c in actor.model for p in c.module.parameters())}
    finally:
        _reap_children()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_checkpoint_host_memory_plan_matches_megatron(bf16):
    """``ops.memory.checkpoint_host_bytes`` (what ``check`` prints) against the CPU tensors megatron allocates:
    12 bytes per parameter of the rank on every rank when loading, on DP rank 0 only when saving."""
    from megatron_rl.ops.memory import MemoryOptions, checkpoint_host_bytes, memory_plan
    from megatron_rl.plan.sizing import memory_job

    job = named_job("checkpoint_actor", TWO_LAYERS, *knobs(use_distributed_optimizer=True, bf16=bf16))
    res = run_ranks(_host_state_rank, 2, job, timeout=200)
    plan = memory_plan(memory_job(job, 2), MemoryOptions(distributed_optimizer=True, params_bytes=2 if bf16 else 4))
    planned = checkpoint_host_bytes(plan)
    for r in res:
        assert r["load"] == 12 * r["params"] == planned["load"], (r, planned)
    assert res[0]["save"] == res[0]["load"] and res[1]["save"] == 0  # gathered on DP rank 0 only
    assert planned["save"] > planned["load"]  # + the gather's buffers
    off = memory_plan(memory_job(job, 2), MemoryOptions(distributed_optimizer=False))
    assert checkpoint_host_bytes(off) == {"load": 0.0, "save": 0.0}


@pytest.mark.timeout(300)
def test_checkpoint_resume_is_exact_reshards_to_dp1_and_exports(tmp_path):
    from megatron_rl.actor.hf_io import export_checkpoint_to_hf
    from megatron_rl.convert import read_hf_checkpoint

    job = named_job("checkpoint_actor", TWO_LAYERS, *knobs(use_distributed_optimizer=True))
    full = run_ranks(_rank, 2, job, 2, timeout=200)
    saved = run_ranks(_rank, 2, job, 1, str(tmp_path / "ck"), timeout=200)
    resumed = run_ranks(_rank, 2, job, 1, None, str(tmp_path / "ck"), 99, timeout=200)
    assert resumed[0]["start"] == 1
    assert_state_dicts_close(_weights(resumed), _weights(full))
    assert resumed[0]["metrics"][0] == full[0]["metrics"][1]
    # another DP size: the sharded Adam state is resharded by megatron's dist_checkpointing
    dp1 = run_ranks(_rank, 1, job, 1, None, str(tmp_path / "ck"), 99, timeout=200)
    assert_state_dicts_close(_weights(dp1, "loaded"), _weights(saved))
    assert_state_dicts_close(_weights(dp1), _weights(full), atol=1e-6)
    assert dp1[0]["metrics"][0]["actor/pg_loss"] == pytest.approx(full[0]["metrics"][1]["actor/pg_loss"], abs=1e-6)
    # HF export of the checkpoint on disk == the live actor's weights at save time
    export_checkpoint_to_hf(str(tmp_path / "ck"), str(tmp_path / "hf"))
    _, _, exported = read_hf_checkpoint(str(tmp_path / "hf"))
    assert_state_dicts_close(exported, _weights(saved))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dist_opt,world", [(False, 1), (True, 2)], ids=["bf16", "bf16-distopt-dp2"])
def test_bf16_resume_is_exact(tmp_path, dist_opt, world):
    job = named_job("checkpoint_actor", TWO_LAYERS, *knobs(use_distributed_optimizer=dist_opt, bf16=True))
    full = run_ranks(_rank, world, job, 2, timeout=200)
    run_ranks(_rank, world, job, 1, str(tmp_path / "ck"), timeout=200)
    resumed = run_ranks(_rank, world, job, 1, None, str(tmp_path / "ck"), 99, timeout=200)
    assert all(v.dtype == torch.bfloat16 for v in _weights(full).values())
    assert_state_dicts_close(_weights(resumed), _weights(full))
    assert resumed[0]["metrics"][0] == full[0]["metrics"][1]
    for r_full, r_res in zip(full, resumed):
        assert r_full["main"].dtype == torch.float32 and torch.equal(r_res["main"], r_full["main"])


def test_fp32_output_layer_needs_the_distributed_optimizer():
    """megatron's non-distributed mixed-precision optimizer numbers only the bf16 parameters in its sharded state
    dict (KeyError saving a group that holds the fp32 output layer too): the config and the actor refuse the
    combination by name, before any process group or model."""
    from megatron_rl.actor.precision import Precision
    from megatron_rl.plan import job_errors

    bad = named_job("checkpoint_actor", TWO_LAYERS,
                    *knobs(use_distributed_optimizer=False, bf16=True, fp32_output_layer=True))
    assert any(e.startswith("actor.fp32_output_layer: needs actor.use_distributed_optimizer")
               for e in job_errors(bad, 1)), job_errors(bad, 1)
    with pytest.raises(ValueError, match="actor.fp32_output_layer: needs actor.use_distributed_optimizer"):
        Precision.from_actor_config(bad.actor)
    good = named_job("checkpoint_actor", TWO_LAYERS,
                     *knobs(use_distributed_optimizer=True, bf16=True, fp32_output_layer=True))
    assert not any("fp32_output_layer" in e for e in job_errors(good, 2))
    fp32 = named_job("checkpoint_actor", TWO_LAYERS, *knobs(use_distributed_optimizer=True, fp32_output_layer=True))
    assert any("only with actor.bf16" in e for e in job_errors(fp32, 2))


def _resident_rank(rank, world, job):
    """Bytes of this rank's model parameters and of its optimizer state after one step (fp32 main parameters that
    are not the model parameters themselves, Adam's moments)."""
    try:
        initialize_model_parallel(job.parallel, seed=7, model=job.model)
        actor = MegatronActor(actor_spec(job))
        checkpoint_step(actor, 100)
        model_ptrs = {p.untyped_storage().data_ptr() for c in actor.model for p in c.module.parameters()}
        opt = 0
        for o in _optimizers(actor):
            for g in o.optimizer.param_groups:
                for p in g["params"]:
                    if p.untyped_storage().data_ptr() not in model_ptrs:
                        opt += p.numel() * p.element_size()
                    st = o.optimizer.state.get(p, {})
                    opt += sum(st[k].numel() * st[k].element_size() for k in ("exp_avg", "exp_avg_sq") if k in st)
        return {"params": sum(p.numel() * p.element_size() for c in actor.model for p in c.module.parameters()),
                "optimizer": opt}
    finally:
        _reap_children()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_memory_plan_of_the_fp32_output_layer_matches_the_actor(tied):
    """``check``'s plan with ``actor.fp32_output_layer`` (bf16, distributed optimizer, one rank): parameter bytes
    (the output layer's / shared embedding's weight at 4 bytes) and optimizer bytes (no separate main copy of that
    weight) equal what the built actor holds."""
    from megatron_rl.ops.memory import MemoryOptions, memory_plan
    from megatron_rl.plan.sizing import memory_job

    job = named_job("checkpoint_actor", TWO_LAYERS, setting("model.untie_embeddings_and_output_weights", not tied),
                    "actor.weight_decay=0.0", *knobs(bf16=True, fp32_output_layer=True, use_distributed_optimizer=True))
    got = run_ranks(_resident_rank, 1, job, timeout=150)[0]
    st = memory_plan(memory_job(job, 1), MemoryOptions(params_bytes=2, fp32_output_layer=True, distributed_optimizer=True))
    assert st.stages[0].params == got["params"] and st.stages[0].optimizer == got["optimizer"], (st.stages[0], got)
    plain = memory_plan(memory_job(job, 1), MemoryOptions(params_bytes=2, distributed_optimizer=True))
    assert plain.stages[0].params < got["params"]  # without the option the plan is short of the fp32 weight


@pytest.mark.timeout(300)
def test_fp32_output_layer_with_distributed_optimizer_resumes_exactly(tmp_path):
    """bf16 + ``actor.fp32_output_layer`` + the distributed optimizer at DP2: the output layer's fp32 weight shares a
    param group with bf16 weights; megatron looks each main shard up by model order while the group holds the fp32
    shards first (``platform/distrib_optimizer``), which crashed the save (or read another parameter's state)."""
    job = named_job("checkpoint_actor", TWO_LAYERS,
                    *knobs(use_distributed_optimizer=True, bf16=True, fp32_output_layer=True))
    full = run_ranks(_rank, 2, job, 2, timeout=200)
    run_ranks(_rank, 2, job, 1, str(tmp_path / "ck"), timeout=200)
    resumed = run_ranks(_rank, 2, job, 1, None, str(tmp_path / "ck"), 99, timeout=200)
    assert_state_dicts_close(_weights(resumed), _weights(full))
    assert resumed[0]["metrics"][0] == full[0]["metrics"][1]
    for r_full, r_res in zip(full, resumed):
        assert torch.equal(r_res["main"], r_full["main"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dist_opt,world", [(False, 1), (True, 2)], ids=["to-bf16", "to-bf16-distopt-dp2"])
def test_fp32_checkpoint_loads_into_bf16_run(tmp_path, dist_opt, world):
    fp32 = named_job("checkpoint_actor", TWO_LAYERS, *knobs(use_distributed_optimizer=False))
    saved = run_ranks(_rank, world, fp32, 1, str(tmp_path / "ck"), timeout=200)
    bf16 = named_job("checkpoint_actor", TWO_LAYERS, *knobs(use_distributed_optimizer=dist_opt, bf16=True))
    res = run_ranks(_rank, world, bf16, 1, None, str(tmp_path / "ck"), 99, timeout=200)
    saved_w, loaded_w = _weights(saved), _weights(res, "loaded")
    assert sorted(saved_w) == sorted(loaded_w)
    for k, w in saved_w.items():
        assert w.dtype == torch.float32 and loaded_w[k].dtype == torch.bfloat16
        assert torch.equal(loaded_w[k], w.to(torch.bfloat16)), k
    if not dist_opt:  # the fp32 main copy and Adam's moments are the saved fp32 ones, bit for bit
        want, got = saved[0]["final_main"], res[0]["loaded_main"]
        assert sorted(want) == sorted(got)
        for name, st in want.items():
            assert sorted(st) == sorted(got[name]) == ["exp_avg", "exp_avg_sq", "param"]
            for k in st:
                assert torch.equal(got[name][k], st[k]), f"{name} {k}"
    full = run_ranks(_rank, world, fp32, 2, timeout=200)
    for k, w in _weights(full).items():
        torch.testing.assert_close(_weights(res)[k].float(), w, rtol=0, atol=2e-2 * w.abs().max().item() + 1e-3,
                                   msg=lambda m: f"{k}: {m}")
    assert res[0]["metrics"][0]["actor/pg_loss"] == pytest.approx(full[0]["metrics"][1]["actor/pg_loss"], rel=2e-2)


@pytest.mark.timeout(200)
def test_bf16_checkpoint_into_fp32_run_is_refused_by_name(tmp_path):
    bf16 = named_job("checkpoint_actor", TWO_LAYERS, *knobs(use_distributed_optimizer=False, bf16=True))
    run_ranks(_rank, 1, bf16, 0, str(tmp_path / "ck"), timeout=150)
    fp32 = named_job("checkpoint_actor", TWO_LAYERS, *knobs(use_distributed_optimizer=False))
    with pytest.raises(RankError, match=re.escape("written by a bf16 actor (actor.bf16: true)")):
        run_ranks(_rank, 1, fp32, 0, None, str(tmp_path / "ck"), timeout=150)
