"""The other ranks' wait for rank 0's rollouts covers every generation round dynamic sampling may take, and a wait
that fails says what it waited for (``config.timeouts``, ``rollout_source``, ``parallel.rank0``).

Two gloo ranks; the default group's timeout is ``trainer.collective_timeout_s``, as the trainer makes it. Rank 0's
step generator is dynamic sampling (``algorithm.filter_groups``) over rounds that each take ``round_s`` and never
find a group with signal, so every round runs. The rollout source is built as the job builds it
(``build_rollout_source``):

* 4 rounds of 1.5 s (6 s) with ``collective_timeout_s`` 2.5: each round is within the per-round bound, so rank 1
  receives its rows (its wait is 4 x 2.5 s);
* 2 rounds of 2.5 s with ``collective_timeout_s`` 1.5: rank 1's wait (2 x 1.5 s) ends first, and its error names
  rank 0's rollouts, dynamic sampling's rounds and the keys that bound the wait -- not only gloo's timeout.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_rollout_wait.py -q``
"""
import datetime
import time
from types import SimpleNamespace

import pytest

from megatron_rl.testing.distributed import run_ranks


class _Slow:
    """A step generator whose rounds take ``round_s`` and whose groups all score alike (no signal)."""

    def __init__(self, round_s):
        self.round_s = round_s

    def generate(self, engine, step, version, rnd=0):
        from megatron_rl.trainer.step_batch import StepBatch

        time.sleep(self.round_s)
        rows = 4  # 2 prompt groups of 2 samples
        return StepBatch(prompt_ids=[[5, 6]] * rows, response_ids=[[7, 8, 9]] * rows,
                         rollout_log_probs=[[-0.5] * 3] * rows, rewards=[1.0] * rows, weight_version=version,
                         truncated=[False] * rows, metrics={"reward/failed": 0.0})

    def close(self):
        pass


def _wait(rank, world, collective_s, rounds, round_s):
    """One step's rollouts from rank 0 on every rank: (outcome, seconds)."""
    import warnings

    from torch.distributed.distributed_c10d import _set_pg_timeout

    from megatron_rl.config import job_config_from_dict
    from megatron_rl.trainer.dynamic_sampling import DynamicSampling
    from megatron_rl.trainer.rollout_source import build_rollout_source

    _set_pg_timeout(datetime.timedelta(seconds=collective_s), None)  # init_distributed's: collective_timeout_s
    cfg = job_config_from_dict({
        "trainer": {"collective_timeout_s": collective_s, "phase_timeout_s": collective_s},
        "algorithm": {"filter_groups": {"enable": True, "max_num_gen_batches": rounds}},
        "data": {"prompts_per_step": 2}, "rollout": {"n_samples_per_prompt": 2}})
    gen = DynamicSampling(_Slow(round_s), cfg) if rank == 0 else None
    actor = SimpleNamespace(dp_rank=rank, dp_size=world, batcher=SimpleNamespace(balances_dp_tokens=False),
                            routing=None)
    source = build_rollout_source(cfg, gen, None, actor, None, 0, {}, rank == 0)
    t0 = time.monotonic()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exhausted rounds' warning
            got = source.next(0)
        return ("rows", list(got.global_rows)), time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001 - the outcome is what is tested
        return ("error", f"{type(exc).__name__}: {exc}"), time.monotonic() - t0


@pytest.mark.timeout(90)
def test_wait_covers_every_round():
    """4 rounds of 1.5 s at collective_timeout_s 2.5: rank 1 gets its rows (DP rank 1: the second prompt group)."""
    out = run_ranks(_wait, 2, 2.5, 4, 1.5, timeout=80)
    (covered, took) = out[1]
    assert covered == ("rows", [2, 3]), covered
    assert took > 2.5 * 1.5  # it did wait past one collective_timeout_s
    assert out[0][0] == ("rows", [0, 1])


@pytest.mark.timeout(90)
def test_failed_wait_names_its_cause():
    """2 rounds of 2.5 s at collective_timeout_s 1.5: rank 1's wait (3 s) ends first, with its cause named."""
    out = run_ranks(_wait, 2, 1.5, 2, 2.5, timeout=80)
    ((kind, msg), took) = out[1]
    assert kind == "error" and took < 2 * 2.5, (kind, msg, took)
    for part in ("rank 1: waiting for rank 0's rollouts of step 1", "up to 2 generation rounds of dynamic sampling",
                 "bounded by 3 s (trainer.collective_timeout_s=1.5 per generation round x "
                 "algorithm.filter_groups.max_num_gen_batches=2)", "Timed out"):
        assert part in msg, msg
