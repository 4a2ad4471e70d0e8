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
    """{label: [size, resident bytes]} of the weight-sync memfd files this process created (its own segments)."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        mine = re.match(r"/memfd:megatron_rl_ws_(\w+?)_(\d+)_", target)  # label, the creator's pid
        if mine and mine.group(1) != "probe" and int(mine.group(2)) == os.getpid():  # (mmap keeps a dup of a
            out[mine.group(1)] = [os.fstat(int(fd)).st_size, 0]                       # mapped peer's fd too)
    cur = None
    with open("/proc/self/smaps") as f:  # the mappings' resident pages, by the memfd's label
        for line in f:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):  # a mapping's header line
                mine = re.search(r"/memfd:megatron_rl_ws_(\w+?)_(\d+)_", line)
                cur = mine.group(1) if mine and int(mine.group(2)) == os.getpid() else None
            elif cur in out and line.startswith("Rss:"):
                out[cur][1] = max(out[cur][1], int(line.split()[1]) * 1024)
    return out


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


@pytest.mark.timeout(600)
def test_check_counts_the_segments_a_tp2_pp2_sync_creates(tmp_path):
    from megatron_rl.plan.sizing import job_sync_plan

    actor = build_tiny_hf_model(tmp_path / "actor", arch="qwen2", seed=1, num_hidden_layers=2)
    other = build_tiny_hf_model(tmp_path / "other", arch="qwen2", seed=2, num_hidden_layers=2)
    job = named_job("actor", *JOB, *layout(tp=2, pp=2), hf=actor)
    out = run_ranks(_body, 4, job, other, timeout=300)
    assert out[0]["senders"] == 2.0
    plan = job_sync_plan(job, world_size=4)
    # the plan's holders -> the global rank that holds each (TP innermost: stage s is ranks 2s, 2s + 1)
    rank_of = {"stage 0 TP rank 1": 1, "stage 1 TP rank 1": 3, "sender stage 1": 2}
    planned = {rank_of[g.holder]: g for g in plan.segments}
    measured = {r: o["segments"] for r, o in enumerate(out) if o["segments"]}
    assert sorted(planned) == sorted(measured), (plan.segments, measured)
    for r, g in planned.items():
        ((label, (size, rss)),) = measured[r].items()
        assert label == ("sender2" if g.holder.startswith("sender") else f"tp{r}"), (r, label)
        assert size == g.nbytes, (g, size)
        assert rss <= g.resident + 2 * PAGE, (g, rss)  # pages are taken as written (two slots: a page each)
        assert rss >= g.resident / 2, (g, rss)  # and the plan's "written" is not a loose bound either
    assert all(g.rank0_host for g in plan.segments)
    assert "shared memory (memfd segments" in plan.line() and "3 segment(s)" in plan.line()
