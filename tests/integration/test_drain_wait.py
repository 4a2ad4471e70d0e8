"""The other ranks' wait for rank 0's async checkpoint drain covers the drain's bound, which covers every
generation round dynamic sampling may take (``config.timeouts``), and a wait that fails names its cause.

Two gloo ranks; the default group's timeout is ``trainer.collective_timeout_s`` (1.5 s), as the trainer makes it;
``trainer.checkpoint_timeout_s`` 4 s and ``max_num_gen_batches`` 2: rank 0's drain may take 2 x 4 / 2 = 4 s, the
other ranks wait 4 + 1.5 s. The source is built as the job builds it (``build_rollout_source``) with a stand-in
producer whose snapshot takes ``snapshot_s``; ``Job.checkpoint`` runs the drain (the save is a barrier).

* a drain of 3 s (longer than the collective timeout and than half of checkpoint_timeout_s, within the 4 s of two
  rounds): both ranks checkpoint without an error;
* rank 0 stuck for 9 s (past every bound): rank 1's wait ends after 5.5 s with an error naming what it waited for
  and the keys that bound it, not only gloo's timeout.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_drain_wait.py -q``
"""
import datetime
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from megatron_rl.testing.distributed import run_ranks


def _checkpoint(rank, world, snapshot_s, honour_bound):
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    from megatron_rl.config import job_config_from_dict
    from megatron_rl.trainer import job as job_mod
    from megatron_rl.trainer import rollout_source
    from megatron_rl.trainer.async_rollout import SnapshotTimeout

    class Producer:
        def __init__(self, *args, **kwargs):
            pass

        def start_thread(self):
            return self

        def snapshot(self, next_step, timeout_s=None, ready_only=False):
            if honour_bound and timeout_s is not None and snapshot_s > timeout_s:
                time.sleep(timeout_s)
                raise SnapshotTimeout()
            time.sleep(snapshot_s)
            return {}

        def close(self):
            pass

    class Watchdog:
        @contextmanager
        def phase(self, name, step, timeout_s=None, config_key=None):
            yield

    _set_pg_timeout(datetime.timedelta(seconds=1.5), None)  # init_distributed's: collective_timeout_s
    rollout_source.RolloutProducer = Producer
    job_mod.save = lambda *args, **kwargs: dist.barrier() or "ckpt"
    cfg = job_config_from_dict({
        "trainer": {"collective_timeout_s": 1.5, "phase_timeout_s": 1.5, "checkpoint_timeout_s": 4.0, "steps": 10},
        "rollout": {"mode": "async", "max_staleness": 1, "n_samples_per_prompt": 2},
        "algorithm": {"filter_groups": {"enable": True, "max_num_gen_batches": 2}},
        "data": {"prompts_per_step": 2}})
    actor = SimpleNamespace(dp_rank=rank, dp_size=world, batcher=SimpleNamespace(balances_dp_tokens=False),
                            routing=None)
    source = rollout_source.build_rollout_source(cfg, None, None, actor, None, 0, {}, rank == 0,
                                                 deferred=SimpleNamespace(producer=None))
    job = job_mod.Job(cfg=cfg, plan=None, actor=None, reference=None, source=source, watchdog=Watchdog(), sinks=None,
                      stop=SimpleNamespace(signum=None), start_step=0, pad_id=0, rank0=rank == 0)
    t0 = time.monotonic()
    try:
        job.checkpoint(2, stopping=False)
        return None, time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001 - the outcome is what is tested
        return f"{type(exc).__name__}: {exc}", time.monotonic() - t0


@pytest.mark.timeout(90)
def test_drain_within_its_rounds_bound_is_waited_for():
    out = run_ranks(_checkpoint, 2, 3.0, True, timeout=80)
    assert [err for err, _ in out] == [None, None], out
    assert out[1][1] > 3.0                                   # rank 1 did wait past the collective timeout


@pytest.mark.timeout(90)
def test_failed_drain_wait_names_its_cause():
    out = run_ranks(_checkpoint, 2, 9.0, False, timeout=80)
    err, took = out[1]
    assert err is not None and 5.0 < took < 9.0, out
    for part in ("rank 1: waiting for rank 0 to hand over the async rollouts the checkpoint of step 2 holds",
                 "up to 2 generation rounds", "bounded by 5.5 s", "trainer.checkpoint_timeout_s=4",
                 "trainer.collective_timeout_s=1.5", "Timed out"):
        assert part in err, err
