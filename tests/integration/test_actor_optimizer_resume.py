"""What a resume restores of the optimizer when the optimizer or its settings change (CPU, gloo, real megatron-core
torch_dist checkpoints).

* ``actor.use_distributed_optimizer`` switched across a resume (either direction, bf16 and fp32 actors, DP2; bf16
  at MoE EP2 and with the layout changed at once: DP2 <-> TP2, DP2 <-> PP2): the fp32 main parameters and both Adam
  moments are converted exactly. Reference: the tensors of the checkpoint file
  itself, read with ``torch.distributed.checkpoint`` (no megatron): the loaded state, saved again at once by the
  other optimizer, holds bit for bit the same fp32 main parameters and moments; one more step equals the
  uninterrupted run's next step (to fp32 reduction order: reduce-scatter vs all-reduce), which also checks Adam's
  step count (bias correction).
* A resume with every optimizer key of ``actor`` changed (lr, min_lr, weight_decay, adam_beta1, adam_beta2,
  clip_grad and the lr schedule, warm-up steps and warm-up fraction): the job runs with the config's values, not the
  checkpoint's — checked against AdamW's update written out here from the saved moments, the clipped gradient's
  norm included — and one line on rank 0 names each changed key. At MoE EP2 with the optimizer switched too: every
  param group holds the config's values.
* ``actor.load_hf`` of an fp32 HF checkpoint into a bf16 actor (DP1, DP2 with the distributed optimizer, and
  qwen3_moe at EP2, TP2, PP2): the fp32 main parameters are the source's values bit for bit (the fp32 actor's saved
  weights), not their rounding; the KL reference holds its bf16 weights only (no
  gradients, DDP buffers or optimizer) and gives the same log-probs.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_actor_optimizer_resume.py -q``
"""
import contextlib
import io
import multiprocessing
import os
import re

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import megatron.core  # noqa: F401
from megatron_rl.actor import MegatronActor
from megatron_rl.plan import actor_spec
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.testing.actor_reference import checkpoint_batch, checkpoint_step
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import CHECKPOINT_MODEL, knobs, layout, named_job, setting, settings

TWO_LAYERS = "model.num_layers=2"
#: a tiny MoE model (4 experts, top-2); with EP2 megatron chains a dense and an expert optimizer
MOE = setting("model", dict(CHECKPOINT_MODEL, num_layers=2, num_moe_experts=4, moe_ffn_hidden_size=32,
                            moe_router_topk=2, moe_router_load_balancing_type="none", qk_layernorm=True,
                            kv_channels=16))
_CHAINED = r"(?:chained_\d+\.)?"
_MAIN = re.compile(rf"^{_CHAINED}optimizer\.state\.(?:fp32_param|param)\.(.+)$")
_MOMENT = re.compile(rf"^{_CHAINED}optimizer\.state\.(exp_avg|exp_avg_sq)\.(.+)$")





def _reap_children() -> None:
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(5)


def _save_every_step(rank, world, job, steps, root, load_dir=None):
    """Load ``load_dir`` (if given), save at once, then save after each of ``steps`` train steps."""
    try:
        initialize_model_parallel(job.parallel, seed=7, model=job.model)
        actor = MegatronActor(actor_spec(job))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            start = actor.load_checkpoint(load_dir)[0] if load_dir else 0
        actor.save_checkpoint(root, start)
        for s in range(start, start + steps):
            checkpoint_step(actor, 100 + s)
            actor.save_checkpoint(root, s + 1)
        return start, out.getvalue()
    finally:
        _reap_children()


def _read_tensors(iter_dir):
    """Every tensor of a checkpoint's torch_dist part, read with torch.distributed.checkpoint alone."""
    path = os.path.join(iter_dir, "dist")
    meta = FileSystemReader(path).read_metadata()
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
          if isinstance(m, TensorStorageMetadata)}
    dcp_load(sd, storage_reader=FileSystemReader(path), no_dist=True)
    return sd


def _optimizer_state(iter_dir):
    """{(what, model weight): tensor} of a checkpoint: what = main (the fp32 main parameter; an fp32 actor's
    non-distributed optimizer keeps none: its model weight is it), exp_avg, exp_avg_sq."""
    sd = _read_tensors(iter_dir)
    out = {}
    for k, v in sd.items():
        m, moment = _MAIN.match(k), _MOMENT.match(k)
        if m:
            out[("main", m.group(1))] = v
        elif moment:
            out[moment.groups()] = v
    for (what, name) in list(out):
        if ("main", name) not in out:
            out[("main", name)] = sd[name]
    return out, {k: v for k, v in sd.items() if not re.match(rf"^{_CHAINED}optimizer\.", k)}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("bf16,saved_dist", [(True, True), (True, False), (False, True), (False, False)],
                         ids=["bf16-distributed-to-plain", "bf16-plain-to-distributed", "fp32-distributed-to-plain",
                              "fp32-plain-to-distributed"])
def test_switching_the_distributed_optimizer_converts_exactly(tmp_path, bf16, saved_dist):
    saver = named_job("checkpoint_actor", TWO_LAYERS, *knobs(use_distributed_optimizer=saved_dist, bf16=bf16))
    loader = named_job("checkpoint_actor", TWO_LAYERS, *knobs(use_distributed_optimizer=not saved_dist, bf16=bf16))
    a, b = tmp_path / "a", tmp_path / "b"
    run_ranks(_save_every_step, 2, saver, 2, str(a), timeout=400)
    start, printed = run_ranks(_save_every_step, 2, loader, 1, str(b), str(a / "iter_0000001"), timeout=400)[0]
    assert start == 1 and "optimizer settings" not in printed, printed  # the same settings: nothing to report
    saved, saved_w = _optimizer_state(a / "iter_0000001")
    again, again_w = _optimizer_state(b / "iter_0000001")
    assert sorted(saved) == sorted(again) and len(saved) == 3 * len(saved_w)
    for key, want in saved.items():
        assert want.dtype == torch.float32 and again[key].dtype == torch.float32, key
        assert torch.equal(again[key], want), f"{key}: max diff {(again[key] - want).abs().max().item():.3g}"
    for k, w in saved_w.items():
        assert torch.equal(again_w[k], w), k
    # the next step from the converted state == the uninterrupted run's next step (Adam's step count included)
    full, full_w = _optimizer_state(a / "iter_0000002")
    nxt, nxt_w = _optimizer_state(b / "iter_0000002")
    moved = 0
    for key, want in full.items():
        torch.testing.assert_close(nxt[key], want, rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")
        moved += key[0] == "main" and not torch.equal(want, saved[key])
    assert moved > 5, "the step must move the main parameters for the comparison to mean anything"
    for k, w in full_w.items():
        tol = dict(rtol=0, atol=1e-2 * w.abs().max().item()) if bf16 else dict(rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(nxt_w[k].float(), w.float(), **tol, msg=lambda m: f"{k}: {m}")


def _dense(*over):
    return ["model.num_layers=2", *over]


#: saved job, loaded job (bf16 throughout): the optimizer switched, at MoE EP2 or with the layout changed at once
SWITCHES = {
    "moe-ep2-distributed-to-plain": ([MOE, *layout(ep=2)], True, [MOE, *layout(ep=2)]),
    "moe-ep2-plain-to-distributed": ([MOE, *layout(ep=2)], False, [MOE, *layout(ep=2)]),
    "dp2-plain-to-tp2-distributed": (_dense(), False, _dense(*layout(tp=2))),
    "tp2-distributed-to-dp2-plain": (_dense(*layout(tp=2)), True, _dense()),
    "pp2-distributed-to-dp2-plain": (_dense(*layout(pp=2)), True, _dense()),
    "dp2-plain-to-pp2-distributed": (_dense(), False, _dense(*layout(pp=2))),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", sorted(SWITCHES))
def test_switching_at_moe_ep2_and_across_layouts_converts_exactly(tmp_path, case):
    """The loaded state, saved again at once by the other optimizer at the other layout, holds bit for bit the
    checkpoint's fp32 main parameters and both moments (read with torch alone, chained optimizers' keys too)."""
    saved_over, saved_dist, loaded_over = SWITCHES[case]
    saver = named_job("checkpoint_actor", *saved_over, *knobs(use_distributed_optimizer=saved_dist, bf16=True))
    loader = named_job("checkpoint_actor", *loaded_over, *knobs(use_distributed_optimizer=not saved_dist, bf16=True))
    a, b = tmp_path / "a", tmp_path / "b"
    run_ranks(_save_every_step, 2, saver, 1, str(a), timeout=400)
    run_ranks(_save_every_step, 2, loader, 0, str(b), str(a / "iter_0000001"), timeout=400)
    saved, saved_w = _optimizer_state(a / "iter_0000001")
    again, again_w = _optimizer_state(b / "iter_0000001")
    assert sorted(saved) == sorted(again) and len(saved) == 3 * len(saved_w), set(saved) ^ set(again)
    if case.startswith("moe"):
        assert sum("experts" in name for _, name in saved) > 5, "the expert optimizer's state must be compared"
    bad = [k for k, want in saved.items() if want.dtype != torch.float32 or not torch.equal(again[k], want)]
    assert not bad, bad[:5]
    assert all(torch.equal(again_w[k], w) for k, w in saved_w.items())


# ------------------------------------------------------------------------------------------------ item: settings

#: every optimizer key of ``actor``: the saving run's values, and the resuming run's (each one different)
SAVED = dict(lr=1e-3, min_lr=0.0, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, clip_grad=1.0,
             lr_warmup_steps=1, lr_warmup_fraction=None, lr_warmup_init=0.0, lr_decay_style="constant",
             lr_decay_steps=20)
RESUMED = dict(lr=2e-3, min_lr=1e-4, weight_decay=0.05, adam_beta1=0.8, adam_beta2=0.95, clip_grad=0.5,
               lr_warmup_steps=0, lr_warmup_fraction=0.3, lr_warmup_init=2e-4, lr_decay_style="cosine",
               lr_decay_steps=10)
WARMUP_STEPS = 3  # RESUMED's warm-up: int(lr_warmup_fraction x lr_decay_steps) optimizer steps
EPS = 1e-8  # megatron's adam_eps (not an actor key)


def _expected_lr(step):
    """The lr of optimizer step ``step`` under RESUMED's schedule: megatron-core's own scheduler, driven here."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    r = RESUMED
    sched = OptimizerParamScheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0),
                                    init_lr=r["lr_warmup_init"], max_lr=r["lr"], min_lr=r["min_lr"],
                                    lr_warmup_steps=WARMUP_STEPS, lr_decay_steps=r["lr_decay_steps"],
                                    lr_decay_style=r["lr_decay_style"], start_wd=r["weight_decay"],
                                    end_wd=r["weight_decay"], wd_incr_steps=10, wd_incr_style="constant")
    sched.step(increment=step)
    return sched.optimizer.param_groups[0]["lr"]


def _named_adam(actor):
    """{parameter name: {param, exp_avg, exp_avg_sq}} of an fp32 actor's non-distributed optimizer."""
    names = {id(p): n for c in actor.model for n, p in c.module.named_parameters()}
    opt = actor.optimizer.optimizer
    return {names[id(p)]: {"param": p.detach().clone(),
                           **{k: opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")}}
            for g in opt.param_groups for p in g["params"]}


def _settings_rank(rank, world, job, root, load_dir, old=False):
    try:
        initialize_model_parallel(job.parallel, seed=7, model=job.model)
        actor = MegatronActor(actor_spec(job))
        out = io.StringIO()
        if load_dir is None:
            checkpoint_step(actor, 100)
            d = actor.save_checkpoint(root, 1)
            if old:  # a checkpoint written before the optimizer settings were recorded
                extra = torch.load(os.path.join(d, "extra_state.pt"), weights_only=False)
                del extra["optimizer_settings"]
                torch.save(extra, os.path.join(d, "extra_state.pt"))
            return {"state": _named_adam(actor)}
        with contextlib.redirect_stdout(out):
            actor.load_checkpoint(load_dir)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in actor.optimizer.param_groups]
        metrics = checkpoint_step(actor, 101)
        return {"groups": groups, "state": _named_adam(actor), "stdout": out.getvalue(), "metrics": metrics}
    finally:
        _reap_children()


#: what the rank-0 line names for a checkpoint without recorded settings: its param groups' and scheduler's
OLD_NAMES = {"actor.lr": (1e-3, 2e-3), "actor.min_lr": (0.0, 1e-4), "actor.weight_decay": (0.01, 0.05),
             "actor.adam_beta1": (0.9, 0.8), "actor.adam_beta2": (0.999, 0.95),
             "actor.lr_decay_style": ("constant", "cosine"),
             "lr warm-up optimizer steps (actor.lr_warmup_steps / lr_warmup_fraction)": (1, WARMUP_STEPS),
             "lr decay optimizer steps (actor.lr_decay_steps)": (20, 10)}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("unrecorded", [False, True], ids=["recorded-settings", "checkpoint-without-recorded-settings"])
def test_resume_runs_with_the_configs_optimizer_settings(tmp_path, unrecorded):
    saver = named_job("checkpoint_actor", TWO_LAYERS, *settings("actor", **SAVED))
    loader = named_job("checkpoint_actor", TWO_LAYERS, *settings("actor", **RESUMED))
    before = run_ranks(_settings_rank, 1, saver, str(tmp_path / "ck"), None, unrecorded, timeout=200)[0]["state"]
    res = run_ranks(_settings_rank, 1, loader, None, str(tmp_path / "ck"), timeout=200)[0]
    r = RESUMED
    lr = _expected_lr(1)  # the checkpoint made one optimizer step
    assert res["metrics"]["actor/lr"] == pytest.approx(lr, rel=1e-12)
    for g in res["groups"]:
        assert tuple(g["betas"]) == (r["adam_beta1"], r["adam_beta2"]), g
        assert g["eps"] == EPS and g["max_lr"] == r["lr"] and g["min_lr"] == r["min_lr"], g
        assert g["lr"] == pytest.approx(lr, rel=1e-12), g
    # AdamW's update at step 2 with the config's betas, lr, weight decay, from the moments the checkpoint holds
    b1, b2, t = r["adam_beta1"], r["adam_beta2"], 2
    checked, sq = 0, 0.0
    for name, old in before.items():
        new = res["state"][name]
        g = (new["exp_avg"] - b1 * old["exp_avg"]) / (1 - b1)  # the gradient Adam stepped with (after clipping)
        sq += float((g.double() ** 2).sum())
        torch.testing.assert_close(new["exp_avg_sq"], b2 * old["exp_avg_sq"] + (1 - b2) * g * g,
                                   rtol=1e-4, atol=1e-12, msg=lambda m: f"{name} exp_avg_sq: {m}")
        wd = 0.0 if old["param"].dim() == 1 else r["weight_decay"]
        denom = (new["exp_avg_sq"] / (1 - b2 ** t)).sqrt() + EPS
        want = old["param"] * (1 - lr * wd) - lr * (new["exp_avg"] / (1 - b1 ** t)) / denom
        torch.testing.assert_close(new["param"], want, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name} param: {m}")
        checked += 1
    assert checked > 5
    # clipped to the config's clip_grad (0.5), not the checkpoint's (1.0): the gradient was longer than both
    assert res["metrics"]["actor/grad_norm"] > SAVED["clip_grad"], res["metrics"]
    assert sq ** 0.5 == pytest.approx(r["clip_grad"], rel=1e-4)
    # one line on rank 0 names every changed key, saved -> now
    lines = [ln for ln in res["stdout"].splitlines() if "optimizer settings" in ln]
    assert len(lines) == 1, res["stdout"]
    names = OLD_NAMES if unrecorded else {f"actor.{k}": (SAVED[k], RESUMED[k]) for k in SAVED}
    for name, (a, b) in names.items():
        assert f"{name} {a!r} -> {b!r}" in lines[0], (name, lines[0])


def _groups_rank(rank, world, job, root, load_dir):
    """Save after one step, or load and return every param group's settings (chained optimizers: all of them)."""
    try:
        initialize_model_parallel(job.parallel, seed=7, model=job.model)
        actor = MegatronActor(actor_spec(job))
        if load_dir is None:
            checkpoint_step(actor, 100)
            actor.save_checkpoint(root, 1)
            return None
        with contextlib.redirect_stdout(io.StringIO()):
            actor.load_checkpoint(load_dir)
        return [{k: v for k, v in g.items() if k != "params"} for g in actor.optimizer.param_groups]
    finally:
        _reap_children()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("saved_dist", [True, False], ids=["distributed-to-plain", "plain-to-distributed"])
def test_resume_at_moe_ep2_runs_with_the_configs_settings(tmp_path, saved_dist):
    base = [MOE, *layout(ep=2)]
    saver = named_job("checkpoint_actor", *base, *settings("actor", **SAVED),
                      *knobs(use_distributed_optimizer=saved_dist, bf16=True))
    loader = named_job("checkpoint_actor", *base, *settings("actor", **RESUMED),
                       *knobs(use_distributed_optimizer=not saved_dist, bf16=True))
    run_ranks(_groups_rank, 2, saver, str(tmp_path / "ck"), None, timeout=300)
    per_rank = run_ranks(_groups_rank, 2, loader, None, str(tmp_path / "ck"), timeout=300)
    r, lr = RESUMED, _expected_lr(1)
    for groups in per_rank:
        assert len(groups) >= 2 and any(g["is_expert_parallel"] for g in groups), groups
        for g in groups:
            assert tuple(g["betas"]) == (r["adam_beta1"], r["adam_beta2"]) and g["eps"] == EPS, g
            assert g["max_lr"] == r["lr"] and g["min_lr"] == r["min_lr"], g
            assert g["lr"] == pytest.approx(lr, rel=1e-12), g


# ------------------------------------------------------------------------------------------------ item: load_hf

def _save_at_once(rank, world, job, root, frozen=False):
    try:
        initialize_model_parallel(job.parallel, seed=7, model=job.model)
        MegatronActor(actor_spec(job), frozen=frozen).save_checkpoint(root, 0)
    finally:
        _reap_children()


HF_CASES = {"bf16": ("qwen2", False, {}), "bf16-distributed-dp2": ("qwen2", True, {}),
            "qwen3_moe-ep2-distributed": ("qwen3_moe", True, dict(ep=2)),
            "qwen3_moe-tp2-sp": ("qwen3_moe", False, dict(tp=2, sp=True)),
            "qwen3_moe-pp2-distributed": ("qwen3_moe", True, dict(pp=2))}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", list(HF_CASES))
def test_fp32_hf_weights_are_the_bf16_actors_main_params(tmp_path, tiny_hf_model, case):
    """``actor.load_hf`` of an fp32 HF checkpoint into an ``actor.bf16`` actor: the fp32 main parameters are the
    checkpoint's fp32 values (the fp32 actor's weights, as saved), not their bf16 rounding; the bf16 weights are
    those values rounded. Read from the saved checkpoints with torch alone."""
    arch, dist_opt, lay = HF_CASES[case]
    world = 1 if case == "bf16" else 2
    model = tiny_hf_model(arch, seed=21)
    run_ranks(_save_at_once, 1, named_job("actor", hf=model), str(tmp_path / "fp32"), timeout=200)
    bf16 = named_job("actor", *layout(**lay), *knobs(bf16=True, use_distributed_optimizer=dist_opt), hf=model)
    run_ranks(_save_at_once, world, bf16, str(tmp_path / "bf16"), timeout=200)
    _, want = _optimizer_state(tmp_path / "fp32" / "iter_0000000")
    got, got_w = _optimizer_state(tmp_path / "bf16" / "iter_0000000")
    assert sorted(want) == sorted(got_w)
    lost = 0
    for name, w in want.items():
        assert w.dtype == torch.float32 and got_w[name].dtype == torch.bfloat16, name
        assert torch.equal(got_w[name], w.to(torch.bfloat16)), name
        main = got[("main", name)]
        assert main.dtype == torch.float32 and torch.equal(main, w), \
            f"{name}: main parameter off the fp32 source by {(main - w).abs().max().item():.3g}"
        lost += not torch.equal(w.to(torch.bfloat16).float(), w)
    assert lost > 5, "the source must hold values bf16 cannot for the comparison to mean anything"


def _reference_and_actor_log_probs(rank, world, job):
    """(the frozen actor's log-probs, the trained actor's log-probs of the same weights, what the frozen one holds)."""
    try:
        initialize_model_parallel(job.parallel, seed=7, model=job.model)
        batch, _ = checkpoint_batch(5, rows=4)
        ref = MegatronActor(actor_spec(job), frozen=True)
        held = {"optimizer": ref.optimizer, "scheduler": ref.scheduler,
                "wrapped": [type(c).__name__ for c in ref.model],
                "requires_grad": [n for c in ref.model for n, p in c.named_parameters() if p.requires_grad],
                "grad_buffers": [n for c in ref.model for n, p in c.named_parameters()
                                 if getattr(p, "main_grad", None) is not None or p.grad is not None],
                "dtypes": sorted({str(p.dtype) for c in ref.model for p in c.parameters()})}
        ref_lp, _ = ref.compute_log_probs(batch, 1.0)
        try:
            ref.train_step(batch, ref_lp, torch.zeros(4), batch.response_mask, None, 1.0)
        except RuntimeError as e:
            held["train_step"] = str(e)
        actor_lp, _ = MegatronActor(actor_spec(job)).compute_log_probs(batch, 1.0)
        return ref_lp, actor_lp, held
    finally:
        _reap_children()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lay", [{}, dict(pp=2), dict(pp=4, vpp=2)], ids=["dp1", "pp2", "pp4-vpp2"])
def test_the_kl_reference_holds_weights_only(tiny_hf_model, lay):
    """The KL reference (``MegatronActor(cfg, frozen=True)``) holds its bf16 weights only, sharded like the actor: no
    parameter requires a gradient, none has a DDP gradient buffer, no DDP wrapper, no optimizer (so no fp32 main
    copy, no Adam state); its log-probs equal those of a trained actor built from the same weights (DDP-wrapped, with
    an optimizer: what the reference was before), bit for bit; it refuses a train step."""
    model = tiny_hf_model("qwen2", seed=21, **({"num_hidden_layers": 8} if "vpp" in lay else {}))
    job = named_job("actor", *layout(**lay), *knobs(bf16=True, micro_batch_size=1), hf=model)
    world = lay.get("pp", 1)
    for ref_lp, actor_lp, held in run_ranks(_reference_and_actor_log_probs, world, job, timeout=250):
        assert held["optimizer"] is None and held["scheduler"] is None
        assert held["wrapped"] and "DistributedDataParallel" not in held["wrapped"], held["wrapped"]
        assert held["requires_grad"] == [] and held["grad_buffers"] == [], held
        assert held["dtypes"] == ["torch.bfloat16"], held["dtypes"]
        assert "frozen" in held.get("train_step", ""), held
        assert ref_lp.abs().sum() > 0 and torch.equal(ref_lp, actor_lp)
