"""``megatron-rl check`` counts the weight sync's shared-memory segments (``ops.weight_sync_plan.sync_segments``,
``weight_sync.shm.segment_bytes``) as a real sync creates them.

A tiny Qwen2 at TP2 x PP2 (4 gloo ranks) syncs into the embedded engine in rank 0's process with the job's own
settings (``tp_gather`` shm, ``sender_transport`` shm on a CPU host). Independent reference: every rank lists the
``memfd:megatron_rl_ws_*`` files it holds in ``/proc/self/fd`` (their sizes, ``fstat``) and the resident pages of
their mappings (``/proc/self/smaps`` Rss); the plan's segments -- which rank holds one, its size, at most how much of
it is written -- must match those, rank by rank.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_check_shm_segments.py -q``
"""
import os
import re

import pytest

import megatron.core  # noqa: F401
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import layout, named_job
from megatron_rl.testing.tiny_hf import build_tiny_hf_model
from megatron_rl.weight_sync import shm

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not shm.available(), reason="needs memfd_create and /proc")

JOB = ("rollout.engine=embedded", "rollout.weight_sync=tensor", "rollout.weight_sync_bucket_mb=0.02",
       "rollout.dtype=float32", "cluster.device=cpu", "cluster.nodes=1", "cluster.gpus_per_node=4")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _segments():
    """[[label, size, resident bytes]] of the weight-sync memfd files this process created (its own segments; the
    key in a memfd's name tells them apart, and its pid who created it: ``mmap`` keeps a dup of a mapped peer's
    descriptor too)."""
    name = re.compile(r"/memfd:megatron_rl_ws_(\w+?)_(\d+)_([0-9a-f]+)")
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        mine = name.match(target)
        if mine and mine.group(1) != "probe" and int(mine.group(2)) == os.getpid():
            out[mine.group(3)] = [mine.group(1), os.fstat(int(fd)).st_size, 0]
    cur = None
    with open("/proc/self/smaps") as f:  # the mappings' resident pages
        for line in f:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):  # a mapping's header line
                mine = name.search(line)
                cur = mine.group(3) if mine else None
            elif cur in out and line.startswith("Rss:"):
                out[cur][2] = max(out[cur][2], int(line.split()[1]) * 1024)
    return sorted(out.values())


def _body(rank, world, job, engine_dir):
    from megatron_rl.actor import MegatronActor
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.plan import actor_spec
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.trainer.sync_settings import weight_sync_settings
    from megatron_rl.weight_sync.publisher import build_weight_publisher

    initialize_model_parallel(job.parallel, seed=3, model=job.model)
    actor = MegatronActor(actor_spec(job))
    engine = EmbeddedEngine(engine_dir, dtype="float32", seed=0, weight_version="step-0") if rank == 0 else None
    settings = weight_sync_settings(job)
    assert settings.sender_transport == "shm" and settings.tp_gather == "shm"  # the job's choice on a CPU host
    metrics = build_weight_publisher(settings, actor, engine).publish("step-1")
    return {"segments": _segments(), "senders": metrics.get("weight_sync/senders") if rank == 0 else None}


# (name, layout, HF model kwargs, the plan's holders -> the global rank holding each: TP innermost, stage s of a
# PP2 job is ranks 2s, 2s + 1; an MoE's EP rank e is ranks 2e, 2e + 1 of its stage)
CASES = [
    ("tp2_pp2", dict(tp=2, pp=2), dict(arch="qwen2", num_hidden_layers=2),
     {"stage 0 TP rank 1": 1, "stage 1 TP rank 1": 3, "sender stage 1": 2}),
    ("moe_tp2_ep2_etp2", dict(tp=2, ep=2, etp=2, sp=True),
     dict(arch="qwen3_moe", num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
     {"stage 0 TP rank 1": 1, "stage 0 EP rank 0 ETP rank 1": 1, "stage 0 EP rank 1 ETP rank 1": 3,
      "sender stage 0 EP rank 1": 2}),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name, shape, hf, rank_of", CASES, ids=[c[0] for c in CASES])
def test_check_counts_the_segments_a_sync_creates(tmp_path, name, shape, hf, rank_of):
    from megatron_rl.plan.sizing import job_sync_plan

    actor = build_tiny_hf_model(tmp_path / "actor", seed=1, **hf)
    other = build_tiny_hf_model(tmp_path / "other", seed=2, **hf)
    job = named_job("actor", *JOB, *layout(**shape), hf=actor)
    out = run_ranks(_body, 4, job, other, timeout=300)
    assert out[0]["senders"] == 2.0
    plan = job_sync_plan(job, world_size=4)
    assert sorted(g.holder for g in plan.segments) == sorted(rank_of), plan.segments
    for r, o in enumerate(out):
        # this rank's segments, planned and measured, as (kind, size, written bytes), in the same order
        planned = sorted(("sender" if g.is_sender else "tp", g.nbytes, g.resident) for g in plan.segments
                         if rank_of[g.holder] == r)
        measured = sorted(("sender" if label.startswith("sender") else "tp", size, rss)
                          for label, size, rss in o["segments"])
        assert [p[:2] for p in planned] == [m[:2] for m in measured], (r, planned, measured)
        assert all(label in (f"tp{r}", f"sender{r}") for label, _, _ in o["segments"]), o["segments"]
        for (_, _, resident), (_, _, rss) in zip(planned, measured):
            assert rss <= resident + 2 * PAGE, (r, planned, measured)  # pages are taken as written (a page per slot)
            assert rss >= resident / 4, (r, planned, measured)  # and the plan's "written" is not a loose bound either
    assert all(g.rank0_host for g in plan.segments)
    assert f"{len(rank_of)} segment(s)" in plan.line()
