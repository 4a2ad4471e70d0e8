"""Weight sync with tensors left in pieces (``convert.pieces``): the TP / ETP pieces gathered through shared memory in
batches and a fused qkv's q / k / v go straight into a bf16 engine's weights.

* 1 rank, TP2 (dense) and TP2 x EP2 (MoE: dense pieces over TP, experts from two senders), tiny buckets (many
  batches and fences): after each of two syncs -- the second after the trainer's parameters are doubled, on every
  rank -- every engine tensor equals the checkpoint (x2) cast to bf16, bit for bit: read by safetensors (dense), or
  as transformers loads it into the same model in fp32 (MoE: its fused expert tensors).
* TP2 x ETP2 (MoE: the experts' pieces over their own group, batches interleaved with the dense ones) and a TP2
  delta sync (``rollout.weight_sync_delta``: the packer reads the gathered tensors assembled): the same equality.
* TP2 with one batch per sync: the rank that only writes pieces waits for its group a couple of times per sync,
  not once per split parameter (main before this change: 27 waits in two syncs of the 2-layer model).
* A rank that stalls before a batch: the sender gives up at ``rollout.weight_sync_timeout_s`` and every rank
  raises it.
* A rank whose pieces cannot be written in the middle of a sync (its slot cut short: the second batch fails) ends the
  sync on every rank, naming that rank and the cause, before ``rollout.weight_sync_timeout_s`` (a wait for the
  lost batch would outlast the test's bound); the engine refuses to generate, and no segment of the failed group
  stays mapped.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_weight_sync_pieces.py -q``
"""
import os
import time

import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import layout, named_job
from megatron_rl.testing.tiny_hf import build_tiny_hf_model
from megatron_rl.weight_sync import shm

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not shm.available(), reason="needs memfd_create and /proc")

JOB = ("rollout.weight_sync=tensor", "rollout.weight_sync_bucket_mb=0.02", "rollout.weight_sync_verify_tensors=-1")


def _mapped_segments():
    with open("/proc/self/maps") as fh:
        return sorted({line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                       for line in fh if "megatron_rl_ws_tp" in line})


def _body(rank, world, job, engine_dir, cut_slot=False, count=False, stall_s=0.0):
    import gc

    from megatron_rl.actor import MegatronActor
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.plan import actor_spec
    from megatron_rl.rollout.base import WeightSyncError
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.trainer.sync_settings import weight_sync_settings
    from megatron_rl.weight_sync import gather
    from megatron_rl.weight_sync.publisher import build_weight_publisher

    initialize_model_parallel(job.parallel, seed=3, model=job.model)
    actor = MegatronActor(actor_spec(job))
    engine = EmbeddedEngine(engine_dir, dtype="bfloat16", seed=0, weight_version="step-0") if rank == 0 else None
    settings = weight_sync_settings(job)
    assert settings.tp_gather == "shm" and settings.sender_transport == "shm"
    if cut_slot and rank == 1:  # its segment cut 64 bytes into slot 1: the second batch's pieces do not fit
        made = gather._Slots.__init__

        def cut(self, *args):
            made(self, *args)
            self.mine.tensor = self.mine.tensor[: self.slot + 64]
        gather._Slots.__init__ = cut
    if stall_s and rank == 1:  # this rank stalls before its second batch (a hung rank)
        many = gather._ShmGather.gather_many
        calls = [0]

        def stalled(self, *args):
            calls[0] += 1
            if calls[0] == 2:
                time.sleep(stall_s)
            return many(self, *args)
        gather._ShmGather.gather_many = stalled
    pub = build_weight_publisher(settings, actor, engine)
    out = {"states": [], "group_calls": 0}
    if count:  # every barrier / all_gather of a TP rank that is not a sender: its pieces' waits
        import torch.distributed as dist

        for fn in ("barrier", "all_gather", "all_gather_object"):
            def counted(*args, _fn=getattr(dist, fn), **kwargs):
                out["group_calls"] += 1
                return _fn(*args, **kwargs)
            setattr(dist, fn, counted)
    for version in ("step-1", "step-2"):
        try:
            out["metrics"] = pub.publish(version)
        except WeightSyncError as exc:
            out["error"] = str(exc)
            break
        if rank == 0:
            out["states"].append({k: v.clone() for k, v in engine.model.state_dict().items()
                                  if not k.endswith("inv_freq")})
        with torch.no_grad():
            for chunk in actor.model:
                for p in chunk.parameters():
                    p.mul_(2)  # exact in fp32 and bf16: the next version's reference is the checkpoint x2
    gc.collect()
    out["mapped"] = _mapped_segments()
    if rank == 0:
        out["invalid"] = engine._invalid
    return out


def _reference(hf_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(hf_dir, "model.safetensors"))


def _check(got_states, ref):
    assert len(got_states) == 2
    for i, got in enumerate(got_states):
        assert set(got) == set(ref)
        bad = [k for k in ref if not torch.equal(got[k], (ref[k] * 2 ** i).to(torch.bfloat16))]
        assert bad == [], (i, bad)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("pieces_dense")
    return (build_tiny_hf_model(root / "actor", arch="qwen2", seed=1, num_hidden_layers=2),
            build_tiny_hf_model(root / "other", arch="qwen2", seed=2, num_hidden_layers=2))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,parallel", [(1, {}), (2, {"tp": 2})])
def test_dense_engine_equals_checkpoint_after_each_sync(dense, world, parallel):
    actor, other = dense
    job = named_job("actor", *JOB, *layout(**parallel), hf=actor)
    out = run_ranks(_body, world, job, other, timeout=300)
    assert "error" not in out[0], out[0].get("error")
    _check(out[0]["states"], _reference(actor))
    assert out[0]["metrics"]["weight_sync/verified"] == 1.0
    if world == 2:  # the segments stay mapped between syncs (so the failure test's check can see them)
        assert out[0]["mapped"] and out[1]["mapped"], (out[0]["mapped"], out[1]["mapped"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ep,etp,senders", [(2, 1, 2.0), (1, 2, 1.0)], ids=["tp2_ep2", "tp2_etp2"])
def test_moe_engine_equals_checkpoint_after_each_sync(tmp_path, ep, etp, senders):
    """MoE at TP2 x EP2 (two senders) and TP2 x ETP2 (the dense pieces and the experts' pieces travel in two groups
    of the same ranks, their batches interleaved, each its own slots): after each of two syncs the engine equals
    transformers' own load (fused experts), cast."""
    from megatron_rl.rollout.embedded import EmbeddedEngine

    def moe(path, seed):
        return build_tiny_hf_model(path, arch="qwen3_moe", seed=seed, num_hidden_layers=2, num_experts=4,
                                   num_experts_per_tok=2, tie_word_embeddings=False)

    actor, other = moe(tmp_path / "actor", 1), moe(tmp_path / "other", 2)
    job = named_job("actor", *JOB, *layout(tp=2, ep=ep, etp=etp, sp=True), hf=actor)
    out = run_ranks(_body, 2, job, other, timeout=300)
    assert "error" not in out[0], out[0].get("error")
    assert out[0]["metrics"]["weight_sync/senders"] == senders
    ref = EmbeddedEngine(actor, dtype="float32", seed=0).model.state_dict()
    _check(out[0]["states"], {k: v for k, v in ref.items() if not k.endswith("inv_freq")})


@pytest.mark.timeout(600)
def test_tp2_pieces_wait_once_per_batch_not_per_parameter(dense):
    """Buckets of 64 MiB: the tiny model's pieces make one batch per sync, so the rank that only writes pieces
    waits for its group a couple of times per sync -- not once per split parameter (dozens)."""
    actor, other = dense
    job = named_job("actor", *JOB, *layout(tp=2), "rollout.weight_sync_bucket_mb=64", hf=actor)
    out = run_ranks(_body, 2, job, other, False, True, timeout=300)
    _check(out[0]["states"], _reference(actor))
    assert out[1]["group_calls"] <= 2 * 3, out[1]["group_calls"]  # two syncs: one batch each, + the setup


@pytest.mark.timeout(600)
def test_a_rank_failing_to_write_its_pieces_ends_the_sync_on_every_rank(dense):
    actor, other = dense
    job = named_job("actor", *JOB, *layout(tp=2), "rollout.weight_sync_timeout_s=600", hf=actor)
    out = run_ranks(_body, 2, job, other, True, timeout=120)  # far below the sync's own bound
    for r in out:
        assert "writing the TP / ETP pieces failed on rank 1" in r["error"], r.get("error")
        assert "RuntimeError" in r["error"], r["error"]  # rank 1's own cause, told through its slot
        assert r["mapped"] == [], r["mapped"]
    assert "writing the TP / ETP pieces failed" in (out[0]["invalid"] or "")


@pytest.mark.timeout(600)
def test_a_stalled_rank_ends_the_sync_on_every_rank_within_the_bound(dense):
    """The rank that writes pieces stalls 3x ``rollout.weight_sync_timeout_s`` before a batch: the sender stops
    waiting at the bound and every rank raises it (the test's own bound is far below the group's default)."""
    actor, other = dense
    job = named_job("actor", *JOB, *layout(tp=2), "rollout.weight_sync_timeout_s=4", hf=actor)
    out = run_ranks(_body, 2, job, other, False, False, 12.0, timeout=120)
    for r in out:
        assert "did not exchange its pieces' status within 4 s" in r["error"], r.get("error")
    assert "within 4 s" in (out[0]["invalid"] or "")


@pytest.mark.timeout(600)
def test_tp2_delta_sync_through_the_batched_gather_equals_checkpoint(dense):
    """``rollout.weight_sync_delta`` at TP2: the delta packer reads the batched gather's tensors assembled (no
    fences); the second sync is a delta from the first, and the engine equals the checkpoint x2, cast."""
    actor, other = dense
    job = named_job("actor", *JOB, *layout(tp=2), "rollout.weight_sync_delta=true", hf=actor)
    out = run_ranks(_body, 2, job, other, timeout=300)
    assert "error" not in out[0], out[0].get("error")
    assert "weight_sync/changed_frac" in out[0]["metrics"], out[0]["metrics"]
    _check(out[0]["states"], _reference(actor))
