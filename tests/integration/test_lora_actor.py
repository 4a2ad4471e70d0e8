"""A LoRA actor (``actor.lora``): only the adapters train, the KL reference is the base with them off, and its
checkpoints hold the adapters (layout-free) with the base fingerprinted.

* training: every parameter with ``requires_grad`` / in the optimizer is an adapter; a train step leaves every base
  weight bitwise unchanged and moves B off zero; with the adapters off the log-probs are the untouched base's
  (bitwise), with them on they differ (B = 0 at init: on == off bitwise before the step);
* layout independence: adapters saved at TP2+SP x EP2 (Qwen3-MoE, experts keyed by global index) load at TP1 x EP4
  with the same log-probs, and the reverse; TP2+SP x EP2 -> TP1 x EP1 is refused naming both expert-parallel sizes
  (megatron chains a separate expert optimizer only at EP > 1, and the actor's checkpoints do not convert between
  the two; docs/lora.md), while the model part alone (``load_model_state``: the adapters) loads TP2+SP x EP2 <->
  TP1 x EP1 with the saver's log-probs;
* resume is bit-exact: 2 steps == 1 step, save, a fresh process loads, 1 step (adapters and log-probs bitwise);
* a resume on another base is refused naming both fingerprints; another ``actor.lora.rank`` naming the key.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_lora_actor.py -q``
"""
import pytest
import torch

import megatron.core  # noqa: F401  (imported once in the parent: forked ranks start fast)
from megatron_rl.testing.actor_reference import actor_job, checkpoint_batch
from megatron_rl.testing.distributed import run_ranks

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["all-linear"]}
ACTOR = {"lr": 5e-3, "micro_batch_size": 2, "clip_grad": 1.0}
MOE_TP2_EP2 = {"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_model_parallel_size": 2,
               "expert_tensor_parallel_size": 1}
MOE_EP4 = {"expert_model_parallel_size": 4}


@pytest.fixture(scope="module")
def dense_dir(tiny_hf_model):
    return tiny_hf_model("qwen2", seed=3, num_hidden_layers=2)


@pytest.fixture(scope="module")
def moe_dir(tiny_hf_model):
    return tiny_hf_model("qwen3_moe", seed=5)


def _job(hf_dir, parallel=None, lora=LORA, **actor):
    return actor_job(hf_dir, {**ACTOR, **actor, "lora": dict(lora)}, parallel=parallel or {})


def _actor(job, seed=5):
    from megatron_rl.actor import MegatronActor
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.plan import actor_spec

    initialize_model_parallel(job.parallel, seed=seed, model=job.model)
    return MegatronActor(actor_spec(job))


def _step(actor, seed):
    batch, adv = checkpoint_batch(seed, rows=4)
    old, _ = actor.compute_log_probs(batch, 1.0)
    return actor.train_step(batch, old, adv, batch.response_mask, None, 1.0)


def _probe(actor):
    batch, _ = checkpoint_batch(999, rows=4)
    return actor.compute_log_probs(batch, 1.0, compute_entropy=False)[0]


def _params(actor, adapters: bool):
    from megatron_rl.lora.checkpoint import is_adapter_key

    return {f"{i}.{n}": p.detach().clone() for i, c in enumerate(actor.model) for n, p in c.module.named_parameters()
            if is_adapter_key(n) == adapters}


def _train_rank(rank, world, job):
    from megatron_rl.actor.chained import torch_optimizers

    actor = _actor(job)
    trainable = [n for c in actor.model for n, p in c.module.named_parameters() if p.requires_grad]
    in_opt = sum(1 for o in torch_optimizers(actor.optimizer) for g in o.param_groups for _ in g["params"])
    base0, ad0 = _params(actor, False), _params(actor, True)
    on0 = _probe(actor)
    with actor.adapters_off():
        off0 = _probe(actor)
    _step(actor, 1)
    with actor.adapters_off():
        off1 = _probe(actor)
    on1 = _probe(actor)
    from megatron_rl.trainer.job import KLReference

    ref = KLReference(actor, adapters_off=True).log_probs(checkpoint_batch(999, rows=4)[0], 1.0)
    return {"ref": ref, "trainable": trainable, "in_opt": in_opt, "base0": base0, "base1": _params(actor, False), "ad0": ad0,
            "ad1": _params(actor, True), "on0": on0, "off0": off0, "off1": off1, "on1": on1}


@pytest.mark.timeout(120)
def test_only_adapters_train_and_the_reference_is_the_base(dense_dir):
    from megatron_rl.lora.checkpoint import is_adapter_key

    (r,) = run_ranks(_train_rank, 1, _job(dense_dir), timeout=100)
    assert r["trainable"] and all(is_adapter_key(n) for n in r["trainable"]), r["trainable"]
    assert len(r["trainable"]) == 2 * 4 * 2  # A and B of qkv / proj / fc1 / fc2 in 2 layers
    assert r["in_opt"] == len(r["trainable"])  # no main parameter / Adam state for the base
    for k, v in r["base0"].items():
        assert torch.equal(v, r["base1"][k]), f"base weight {k} changed"
    assert all(not v.any() for k, v in r["ad0"].items() if k.endswith("lora_B.weight"))  # B = 0 at init
    assert all(r["ad1"][k].any() for k in r["ad0"] if k.endswith("lora_B.weight")), "B did not move"
    assert torch.equal(r["on0"], r["off0"])  # B = 0: the adapted policy is the base
    assert torch.equal(r["off1"], r["off0"])  # adapters off after training: still the base
    assert torch.equal(r["ref"], r["off0"])  # the trainer's KL reference of a LoRA actor
    assert not torch.allclose(r["on1"], r["off1"])  # the trained adapters change the policy


def _ckpt_rank(rank, world, job, steps, save_dir, load_dir):
    actor = _actor(job)
    if isinstance(load_dir, tuple):  # ("model", dir): the model part alone
        start = actor.load_model_state(load_dir[1])
    else:
        start = actor.load_checkpoint(load_dir)[0] if load_dir else 0
    for s in range(start, start + steps):
        _step(actor, 100 + s)
    if save_dir:
        actor.save_checkpoint(save_dir, start + steps)
    return {"probe": _probe(actor), "adapters": _params(actor, True) if world == 1 else None}


@pytest.mark.timeout(300)
def test_adapters_load_at_another_layout(moe_dir, tmp_path):
    """TP2+SP x EP2 -> TP1 x EP4 and the reverse: the loaded adapters give the saver's log-probs."""
    a, b = _job(moe_dir, MOE_TP2_EP2), _job(moe_dir, MOE_EP4)
    saved = run_ranks(_ckpt_rank, 2, a, 1, str(tmp_path / "a"), None, timeout=150)
    loaded = run_ranks(_ckpt_rank, 4, b, 0, None, str(tmp_path / "a"), timeout=150)
    torch.testing.assert_close(loaded[0]["probe"], saved[0]["probe"], rtol=0, atol=2e-5)
    saved1 = run_ranks(_ckpt_rank, 4, b, 2, str(tmp_path / "b"), None, timeout=150)
    loaded1 = run_ranks(_ckpt_rank, 2, a, 0, None, str(tmp_path / "b"), timeout=150)
    torch.testing.assert_close(loaded1[0]["probe"], saved1[0]["probe"], rtol=0, atol=2e-5)
    assert not torch.allclose(saved1[0]["probe"], saved[0]["probe"])  # two different trained adapters
    # EP2 -> EP1: megatron's optimizer is chained (a separate expert optimizer) only at EP > 1; refused by name
    # before the load, not failed inside it
    from megatron_rl.testing.distributed import RankError

    with pytest.raises(RankError, match=r"another chaining of megatron's optimizers \('chained_\d\.optimizer\.state\..*"
                                        r"expert_model_parallel_size saved 2, now 1"):
        run_ranks(_ckpt_rank, 1, _job(moe_dir), 0, None, str(tmp_path / "a"), timeout=100)
    # ... while the model part alone (the adapters) loads across it, both ways, with the saver's log-probs
    (ep1,) = run_ranks(_ckpt_rank, 1, _job(moe_dir), 0, None, ("model", str(tmp_path / "a")), timeout=100)
    torch.testing.assert_close(ep1["probe"], saved[0]["probe"], rtol=0, atol=2e-5)
    (saved2,) = run_ranks(_ckpt_rank, 1, _job(moe_dir), 3, str(tmp_path / "e"), None, timeout=100)
    loaded2 = run_ranks(_ckpt_rank, 2, a, 0, None, ("model", str(tmp_path / "e")), timeout=150)
    torch.testing.assert_close(loaded2[0]["probe"], saved2["probe"], rtol=0, atol=2e-5)
    assert not torch.allclose(saved2["probe"], saved[0]["probe"])  # not the adapters of "a"
    # training continues from the loaded adapters (the optimizer's main parameters are them): one Adam step moves
    # each element by at most lr (stale main parameters -- B at zero -- would land lr from zero instead)
    for dist_opt in (False, True):
        (cont,) = run_ranks(_ckpt_rank, 1, _job(moe_dir, use_distributed_optimizer=dist_opt), 1, None,
                            ("model", str(tmp_path / "e")), timeout=100)
        moved = max(float((cont["adapters"][k] - v).abs().max()) for k, v in saved2["adapters"].items())
        assert 0 < moved <= 1.01 * ACTOR["lr"], (dist_opt, moved)
    with pytest.raises(RankError, match=r"model-only load needs an fp32 checkpoint and actor.*actor bf16=True"):
        run_ranks(_ckpt_rank, 1, _job(moe_dir, bf16=True), 0, None, ("model", str(tmp_path / "e")), timeout=100)


@pytest.mark.timeout(200)
def test_resume_is_bit_exact_and_refuses_another_base(dense_dir, tiny_hf_model, tmp_path):
    from megatron_rl.testing.distributed import RankError

    job = _job(dense_dir)
    (whole,) = run_ranks(_ckpt_rank, 1, job, 2, None, None, timeout=100)
    run_ranks(_ckpt_rank, 1, job, 1, str(tmp_path / "c"), None, timeout=100)
    (resumed,) = run_ranks(_ckpt_rank, 1, job, 1, None, str(tmp_path / "c"), timeout=100)
    assert torch.equal(resumed["probe"], whole["probe"])
    for k, v in whole["adapters"].items():
        assert torch.equal(resumed["adapters"][k], v), k
    other = tiny_hf_model("qwen2", seed=4, num_hidden_layers=2)  # same shapes, other weights
    with pytest.raises(RankError, match=r"another base.*sha256 [0-9a-f]{64}.*sha256 [0-9a-f]{64}"):
        run_ranks(_ckpt_rank, 1, _job(other), 0, None, str(tmp_path / "c"), timeout=100)
    with pytest.raises(RankError, match=r"rank \(saved 4, now 8\)"):
        run_ranks(_ckpt_rank, 1, _job(dense_dir, lora={**LORA, "rank": 8}), 0, None, str(tmp_path / "c"),
                  timeout=100)


@pytest.mark.timeout(200)
def test_dense_adapters_load_at_another_tp(dense_dir, tmp_path):
    """TP2 -> TP1: fc1's B (rows [gate; up] per shard) and qkv's B (grouped rows) keep their meaning."""
    saved = run_ranks(_ckpt_rank, 2, _job(dense_dir, {"tensor_model_parallel_size": 2}), 1, str(tmp_path / "d"),
                      None, timeout=150)
    (loaded,) = run_ranks(_ckpt_rank, 1, _job(dense_dir), 0, None, str(tmp_path / "d"), timeout=100)
    torch.testing.assert_close(loaded["probe"], saved[0]["probe"], rtol=0, atol=2e-5)


def _bf16_rank(rank, world, job):
    from megatron_rl.actor.chained import sub_optimizers

    actor = _actor(job)
    base0 = _params(actor, False)
    _step(actor, 1)
    mains = [m for o in sub_optimizers(actor.optimizer) for g in o.shard_fp32_from_float16_groups for m in g]
    models = [p for o in sub_optimizers(actor.optimizer) for g in o.model_float16_groups for p in g]
    names = {id(p): n for c in actor.model for n, p in c.module.named_parameters()}
    adapters = {n for n in names.values() if "lora_" in n}
    return {"main_dtypes": {str(m.dtype) for m in mains if m is not None}, "in_opt": {names[id(p)] for p in models},
            "adapters": adapters,
            "base_same": all(torch.equal(v, _params(actor, False)[k]) for k, v in base0.items()),
            "base_dtypes": {str(v.dtype) for v in base0.values()}}


@pytest.mark.timeout(150)
def test_bf16_distributed_optimizer_holds_fp32_main_adapters_only(dense_dir):
    res = run_ranks(_bf16_rank, 2, _job(dense_dir, bf16=True, use_distributed_optimizer=True), timeout=140)
    for r in res:
        assert r["main_dtypes"] == {"torch.float32"}, r
        assert r["in_opt"] <= r["adapters"] and len(r["adapters"]) == 16  # this rank's share of the adapters only
        assert r["base_same"] and r["base_dtypes"] == {"torch.bfloat16"}
    assert set().union(*(r["in_opt"] for r in res)) == res[0]["adapters"]  # every adapter has a main copy somewhere
