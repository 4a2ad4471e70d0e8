"""Actor checkpoints (megatron dist_checkpointing, torch_dist) on CPU.

* Resume is exact: 2 train steps in one go == 1 step, save, a fresh set of processes loads, 1 step
  (bitwise: weights, Adam state, metrics), at TP1, TP2xPP2 (4 gloo ranks) and MoE EP2 — in the middle of a
  learning-rate warm-up, whose per-step lr equals megatron-core's ``OptimizerParamScheduler`` driven here.
* A different layout loads by resharding: saved at TP2xPP2, loaded at TP1 (and the reverse) —
  weights equal the saved ones bitwise and the next step (resharded Adam state) equals the
  uninterrupted run at the saver's layout (<= 1e-6).
* A model that does not match the checkpoint fails with ``CheckpointLayoutError`` naming the keys.

megatron's checkpoint writer starts a multiprocessing Manager in each saving rank (run_ranks' ranks are
non-daemonic so they may); each rank also stops its own child processes before returning.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_actor_checkpoint.py -q``
"""
import multiprocessing

import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.actor import MegatronActor
from megatron_rl.plan import actor_spec
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.testing.actor_reference import assert_state_dicts_close, checkpoint_batch
from megatron_rl.testing.distributed import RankError, run_ranks
from megatron_rl.testing.jobs import CHECKPOINT_MODEL, layout, named_job, setting, settings

MOE = dict(CHECKPOINT_MODEL, num_layers=2, num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
           moe_router_load_balancing_type="none", qk_layernorm=True, kv_channels=16)


#: a warm-up of 3 optimizer steps from 2e-4, then cosine decay: the resume below happens mid-warm-up
SCHEDULE = {"lr_warmup_steps": 3, "lr_warmup_init": 2e-4, "lr_decay_style": "cosine", "lr_decay_steps": 8}
#: SCHEDULE as overrides of the table's checkpoint_actor row
SCHEDULE_KEYS = settings("actor", **SCHEDULE)


def _megatron_lrs(n):
    """The lr of the first ``n`` optimizer steps from megatron-core's own scheduler with SCHEDULE's settings."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    sched = OptimizerParamScheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), init_lr=2e-4,
                                    max_lr=1e-3, min_lr=0.0, lr_warmup_steps=3, lr_decay_steps=8,
                                    lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=8,
                                    wd_incr_style="constant")
    out = []
    for _ in range(n):
        out.append(sched.optimizer.param_groups[0]["lr"])
        sched.step(increment=1)
    return out




def _step(actor, seed):
    batch, adv = checkpoint_batch(seed, rows=4)
    old, _ = actor.compute_log_probs(batch, 1.0)
    return actor.train_step(batch, old, adv, batch.response_mask, None, 1.0)


def _snapshot(actor):
    sd = actor.full_state_dict_hf()
    opt = actor.optimizer.state_dict()
    return {"weights": sd, "opt": opt}


def _rank(rank, world, job, steps, save_dir, load_dir, init_seed):
    try:
        initialize_model_parallel(job.parallel, seed=init_seed, model=job.model)
        actor = MegatronActor(actor_spec(job))
        start = 0
        extra = None
        if load_dir:
            start, extra = actor.load_checkpoint(load_dir)
        loaded = _snapshot(actor)
        metrics = [_step(actor, 100 + s) for s in range(start, start + steps)]
        if save_dir:
            actor.save_checkpoint(save_dir, start + steps, {"cursor": start + steps, "note": "x"})
        out = _snapshot(actor)
        out["next_lr"] = float(actor.optimizer.param_groups[0]["lr"])  # the schedule's lr for the next step
        return {"metrics": metrics, "final": out, "loaded": loaded, "extra": extra, "start": start}
    finally:
        for child in multiprocessing.active_children():
            child.terminate()
            child.join(5)


def _adam_state(opt_sd):
    """[(optimizer index, param index, name, tensor)] of a (possibly chained: list) optimizer state dict."""
    sds = opt_sd if isinstance(opt_sd, list) else [opt_sd]
    return [((o, i), n, st[n]) for o, sd in enumerate(sds) for i, st in sorted((sd.get("state") or {}).items())
            for n in sorted(st)]


def _weights(results):
    sds = [r["final"]["weights"] for r in results if r["final"]["weights"] is not None]
    assert len(sds) == 1
    return sds[0]



@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp,pp,ep,world", [(1, 1, 1, 1), (2, 2, 1, 4), (1, 1, 2, 2)],
                         ids=["tp1", "tp2pp2", "moe-ep2"])
def test_resume_is_exact(tmp_path, tp, pp, ep, world):
    moe = [setting("model", MOE)] if ep > 1 else []
    job = named_job("checkpoint_actor", *SCHEDULE_KEYS, *moe, *layout(tp=tp, pp=pp, ep=ep))
    full = run_ranks(_rank, world, job, 2, None, None, 7, timeout=150)
    run_ranks(_rank, world, job, 1, str(tmp_path / "ck"), None, 7, timeout=150)
    # a different init seed: everything that matters must come from the checkpoint
    resumed = run_ranks(_rank, world, job, 1, None, str(tmp_path / "ck"), 99, timeout=150)
    assert resumed[0]["start"] == 1 and resumed[0]["extra"] == {"cursor": 1, "note": "x"}
    assert_state_dicts_close(_weights(resumed), _weights(full))
    assert [m["actor/lr"] for m in full[0]["metrics"]] == _megatron_lrs(2) == [2e-4, pytest.approx(4.667e-4, rel=1e-3)]
    for r_full, r_res in zip(full, resumed):
        assert r_res["metrics"][0] == r_full["metrics"][1]  # actor/lr included: the warm-up continues
        assert r_res["final"]["next_lr"] == r_full["final"]["next_lr"] == _megatron_lrs(3)[2]
        sa, sb = r_full["final"]["opt"], r_res["final"]["opt"]
        flat_a, flat_b = _adam_state(sa), _adam_state(sb)
        assert len(flat_a) == len(flat_b) > 0
        for (i, n, x), (j, m, y) in zip(flat_a, flat_b):
            assert (i, n) == (j, m) and torch.equal(torch.as_tensor(x), torch.as_tensor(y)), f"Adam state {i}.{n}"
    # the checkpointed step changed the weights (non-vacuous)
    first = run_ranks(_rank, world, job, 0, None, None, 7, timeout=150)
    assert any(not torch.equal(_weights(first)[k], _weights(full)[k]) for k in _weights(full))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("saved,loaded", [((2, 2, 4), (1, 1, 1)), ((1, 1, 1), (2, 2, 4))],
                         ids=["tp2pp2-to-tp1", "tp1-to-tp2pp2"])
def test_load_at_other_layout_reshards(tmp_path, saved, loaded):
    (stp, spp, sw), (ltp, lpp, lw) = saved, loaded
    saver_job = named_job("checkpoint_actor", *SCHEDULE_KEYS, *layout(tp=stp, pp=spp))
    loader_job = named_job("checkpoint_actor", *SCHEDULE_KEYS, *layout(tp=ltp, pp=lpp))
    saver = run_ranks(_rank, sw, saver_job, 1, str(tmp_path / "ck"), None, 7, timeout=150)
    res = run_ranks(_rank, lw, loader_job, 1, None, str(tmp_path / "ck"), 99, timeout=150)
    loaded_w = [r["loaded"]["weights"] for r in res if r["loaded"]["weights"] is not None][0]
    assert_state_dicts_close(loaded_w, _weights(saver))
    full = run_ranks(_rank, sw, saver_job, 2, None, None, 7, timeout=150)  # uninterrupted, saver's layout
    assert_state_dicts_close(_weights(res), _weights(full), atol=1e-6)
    assert res[0]["metrics"][0]["actor/pg_loss"] == pytest.approx(full[0]["metrics"][1]["actor/pg_loss"], abs=1e-6)


@pytest.mark.timeout(120)
def test_save_before_first_step_resumes_like_fresh(tmp_path):
    """A checkpoint written before any optimizer step (no Adam state yet) loads, and the next step
    equals a fresh run's first step."""
    job = named_job("checkpoint_actor", *SCHEDULE_KEYS, *layout(tp=2, pp=1))
    run_ranks(_rank, 2, job, 0, str(tmp_path / "ck"), None, 7, timeout=100)
    resumed = run_ranks(_rank, 2, job, 1, None, str(tmp_path / "ck"), 99, timeout=100)
    fresh = run_ranks(_rank, 2, job, 1, None, None, 7, timeout=100)
    assert_state_dicts_close(_weights(resumed), _weights(fresh))
    assert resumed[0]["metrics"] == fresh[0]["metrics"]


@pytest.mark.timeout(120)
def test_model_mismatch_is_a_clear_error(tmp_path):
    job = named_job("checkpoint_actor", *SCHEDULE_KEYS)
    run_ranks(_rank, 1, job, 0, str(tmp_path / "ck"), None, 7, timeout=100)
    other = named_job("checkpoint_actor", *SCHEDULE_KEYS, setting("model", dict(CHECKPOINT_MODEL, ffn_hidden_size=128)))
    with pytest.raises(RankError, match=r"CheckpointLayoutError.*ffn_hidden_size \(saved 96, now 128\)"):
        run_ranks(_rank, 1, other, 0, None, str(tmp_path / "ck"), 7, timeout=100)
    with pytest.raises(RankError, match="no checkpoint at"):
        run_ranks(_rank, 1, job, 0, None, str(tmp_path / "nothing"), 7, timeout=100)
    # a damaged checkpoint: the failure names the saved and the requested layout
    dist_dir = tmp_path / "ck" / "iter_0000000" / "dist"
    for f in dist_dir.iterdir():
        if f.suffix == ".distcp":
            f.unlink()
    with pytest.raises(RankError, match=r"CheckpointLayoutError: checkpoint .* loading failed \(saved layout "
                                        r"\{.*'tensor_model_parallel_size': 1.*\}, requested layout \{.*"
                                        r"'tensor_model_parallel_size': 2"):
        run_ranks(_rank, 2, named_job("checkpoint_actor", *SCHEDULE_KEYS, *layout(tp=2)), 0, None,
                  str(tmp_path / "ck"), 7, timeout=100)
