"""Delta weight sync (``rollout.weight_sync_delta``) into the embedded engine, against a full sync.

A PP2 actor (its second stage's deltas travel to rank 0 as ``DeltaBucket``s) trains at lr 1e-6 and publishes
every version to two bf16 embedded engines that start from another checkpoint: one through delta syncs, one
through full (bucketed) syncs -- the reference. After every version both engines' tensors are equal bit for bit
(integer views: -0.0 / NaN-aware). The delta engine is sent <= 10 % of the full sync's bytes per training step;
the first version, the version after a failed sync (the link lost after a first bucket was applied) and the
version after a skipped one (the engine loaded other weights in between) are full
syncs -- byte counts equal to the full sync's -- and still equal bit for bit. At the end, the copies each sender
rank held (measured on its real tensors: host tensors, engine dtype, the checkpoint's HF names) equal what
``megatron-rl check`` plans for that sender (``ops.weight_sync_plan``).

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_weight_sync_delta.py -q``
"""
import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.actor import MegatronActor
from megatron_rl.plan import actor_spec
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.rollout.base import WeightSyncError
from megatron_rl.testing.actor_reference import policy_data
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import knobs, named_job, settings
from megatron_rl.weight_sync.publisher import DeltaPublisher, build_weight_publisher
from megatron_rl.trainer.sync_settings import weight_sync_settings

transformers = pytest.importorskip("transformers")
from megatron_rl.rollout.embedded import EmbeddedEngine  # noqa: E402  (imported here: the forked ranks share it)


def _bits(sd):
    return {k: v.view(torch.int16) if v.element_size() == 2 else v.view(torch.int32) for k, v in sd.items()
            if not k.endswith("inv_freq")}


def _body(rank, world, job_delta, job_full, other_dir, seed):
    initialize_model_parallel(job_delta.parallel, seed=3, model=job_delta.model)
    actor = MegatronActor(actor_spec(job_delta))
    eng_d = EmbeddedEngine(other_dir, dtype="bfloat16", seed=0, weight_version="init") if rank == 0 else None
    eng_f = EmbeddedEngine(other_dir, dtype="bfloat16", seed=0, weight_version="init") if rank == 0 else None
    pub_d = build_weight_publisher(weight_sync_settings(job_delta), actor, eng_d)
    pub_f = build_weight_publisher(weight_sync_settings(job_full), actor, eng_f)
    assert isinstance(pub_d, DeltaPublisher) and not isinstance(pub_f, DeltaPublisher)
    batch, old, adv, mask, _ = policy_data(job_delta.model.vocab_size, 4, seed, (2, 5), (3, 7), False)
    log = []

    def train():
        actor.train_step(batch, old, adv, mask, None, 1.0)

    def sync(version, fail=False):
        if fail:
            def corrupt(bucket):  # the link to the engine breaks after some of the version was applied
                if pub_d.sent:
                    raise WeightSyncError("injected: connection lost")
                pub_d.sent = True
            pub_d.corrupt, pub_d.sent = corrupt, False
            with pytest.raises(WeightSyncError, match="injected"):
                pub_d.publish(version)
            pub_d.corrupt = None
            m_d = None
        else:
            m_d = pub_d.publish(version)
        m_f = pub_f.publish(version)
        equal = None
        if rank == 0:
            a, b = _bits(eng_d.model.state_dict()), _bits(eng_f.model.state_dict())
            equal = None if fail else [k for k in b if not torch.equal(a[k], b[k])]
        log.append((version, m_d, m_f, equal))

    sync("step-0")                                  # first: full
    for v in (1, 2):
        train()
        sync(f"step-{v}")                           # deltas
    train()
    sync("step-3", fail=True)                       # failed version (engine invalid)
    train()
    sync("step-4")                                  # full after the failure
    train()
    sync("step-5")                                  # delta again
    if rank == 0:
        eng_d.update_weights(other_dir, "elsewhere")  # the engine leaves the sequence (a version skipped)
    train()
    sync("step-6")                                  # full after the skip
    held = {n: (tuple(t.shape), t.dtype, t.device.type, t.numel() * t.element_size())
            for n, t in pub_d.sender.base.items()}  # this rank's delta copies, as they are
    return log, held


@pytest.mark.timeout(300)
def test_delta_sync_equals_full_sync_and_falls_back(tiny_hf_model):
    actor_dir = tiny_hf_model("qwen2", seed=41, num_hidden_layers=4)
    other_dir = tiny_hf_model("qwen2", seed=42, num_hidden_layers=4)

    def job(delta):
        return named_job("actor", *knobs(pp=2, lr=1e-6), *settings("rollout", engine="embedded", weight_sync="tensor",
                         weight_sync_delta=delta, weight_sync_bucket_mb=0.02), hf=actor_dir)

    out = run_ranks(_body, 2, job(True), job(False), other_dir, 5, timeout=280)
    log = {v: (m_d, m_f, eq) for v, m_d, m_f, eq in out[0][0]}
    assert [v for v, *_ in out[1][0]] == list(log)  # every rank took part in every version
    _check_counts_the_copies_held(job(True), actor_dir, [held for _, held in out])
    full_kind = {"step-0", "step-4", "step-6"}
    fracs = {}
    for v, (m_d, m_f, eq) in log.items():
        if m_d is None:
            continue
        assert eq == [], (v, eq[:5])  # bit for bit equal to the full sync
        assert m_d["weight_sync/verified"] == 1.0 and m_f["weight_sync/verified"] == 1.0
        frac = m_d["weight_sync/bytes_sent"] / m_f["weight_sync/bytes_sent"]
        if v in full_kind:
            assert frac == 1.0 and m_d["weight_sync/changed_frac"] == 1.0, v
        else:
            fracs[v] = frac
            assert 0 < m_d["weight_sync/changed_frac"] < 0.05, (v, m_d)
    assert set(fracs) == {"step-1", "step-2", "step-5"}
    assert max(fracs.values()) <= 0.10, fracs
    print("delta bytes / full bytes per step at lr 1e-6:", {k: round(f, 4) for k, f in fracs.items()})


def _check_counts_the_copies_held(cfg, actor_dir, held):
    """``megatron-rl check``'s delta copies (``weight_sync_plan``) equal the bytes each sender rank held (PP2:
    rank r is stage r's sender), measured on its real tensors; every copy is a host tensor in the engine's dtype,
    one per HF tensor of the checkpoint (its safetensors names: an independent list)."""
    import dataclasses
    import os

    from megatron_rl.ops.memory import total_parameters
    from megatron_rl.plan.sizing import job_sync_plan

    plan = job_sync_plan(cfg, total_parameters(cfg.model))
    assert [b for _, b in plan.senders] == plan.delta_copy_bytes
    assert plan.delta_copy_bytes == [sum(x[3] for x in h.values()) for h in held], (plan.delta_copy_bytes, held)
    assert {x[2] for h in held for x in h.values()} == {"cpu"}
    assert {x[1] for h in held for x in h.values()} == {torch.bfloat16}
    from safetensors import safe_open

    with safe_open(os.path.join(actor_dir, "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
    assert sorted(n for h in held for n in h) == names
    plain = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, weight_sync_delta=False))
    extra = plan.rank0_host_bytes - job_sync_plan(plain, total_parameters(cfg.model)).rank0_host_bytes
    assert extra == pytest.approx(sum(x[3] for x in held[0].values()), abs=1e-3)  # rank 0's host total counts it
