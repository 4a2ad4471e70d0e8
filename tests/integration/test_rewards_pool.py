"""Rewards in worker processes: a deliberately slow checker is cut at the per-sample timeout (reward 0,
counted) without stalling the batch; raising rewards, bad return values and a worker that dies are counted
failures; the pool keeps working afterwards; a FileTask's step scoring goes through it.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_rewards_pool.py -q``   (about 20 s: worker start-ups)
"""
from __future__ import annotations

import json
import time

import pytest

from megatron_rl.tasks import DataOptions, FileTask
from megatron_rl.tasks.reward_pool import RewardJob, RewardPool

pytestmark = pytest.mark.timeout(300)

SLOW = '''
import os, time

def check(prompt_text, response_text, answer):
    if response_text == "slow":
        time.sleep(120)          # a pathological checker
    if response_text == "raise":
        raise RuntimeError("checker broke")
    if response_text == "str":
        return "1"
    if response_text == "die":
        os._exit(3)
    return 1.0 if response_text == answer else 0.0
'''


@pytest.fixture()
def slow_spec(tmp_path):
    f = tmp_path / "slow_checker.py"
    f.write_text(SLOW)
    return f"{f}:check"


def test_slow_checker_times_out_and_the_batch_finishes(slow_spec):
    pool = RewardPool(num_workers=2, timeout_s=5.0)  # generous: a loaded CI machine stalls a worker for seconds
    try:
        responses = ["7", "slow", "8", "slow", "7", "x"]
        jobs = [RewardJob(slow_spec, "q", r, "7") for r in responses]
        pool.score([RewardJob(slow_spec, "q", "7", "7")])  # workers started (start-up is not timed)
        t0 = time.monotonic()
        res = pool.score(jobs)
        elapsed = time.monotonic() - t0
        assert res.rewards == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
        assert res.timed_out == 2 and res.failed == 0
        assert any("timed out after 5 s" in e for e in res.errors)
        # the two slow samples ran in parallel in two workers: ~5 s each, never 120 s
        assert elapsed < 40, elapsed
        # the killed workers were replaced: the pool still scores
        again = pool.score([RewardJob(slow_spec, "q", "7", "7")] * 3)
        assert again.rewards == [1.0, 1.0, 1.0] and again.timed_out == 0
    finally:
        pool.close()


def test_pathological_math_answer_does_not_stall_the_step():
    """A power tower that sympy would evaluate for minutes (measured: > 60 s, math-verify's own timeouts
    are off in workers) is cut at the timeout; the other samples are scored by math-verify."""
    pytest.importorskip("math_verify")
    pool = RewardPool(num_workers=2, timeout_s=6.0)
    try:
        pool.score([RewardJob("math", "q", "\\boxed{1}", "1")] * 2)          # both workers started
        t0 = time.monotonic()
        res = pool.score([RewardJob("math", "q", "so #### 72", "72"),
                          RewardJob("math", "q", "so \\boxed{9^{9^{9^{9}}}}", "1"),
                          RewardJob("math", "q", "\\boxed{0.5}", "1/2")])
        elapsed = time.monotonic() - t0
        assert res.rewards == [1.0, 0.0, 1.0] and res.timed_out == 1 and res.failed == 0
        assert elapsed < 40, elapsed  # the tower alone runs > 60 s
    finally:
        pool.close()


def test_failures_are_counted_not_raised(slow_spec):
    pool = RewardPool(num_workers=1, timeout_s=10)
    try:
        res = pool.score([RewardJob(slow_spec, "q", r, "7") for r in ("raise", "7", "str", "die", "7")])
        assert res.rewards == [0.0, 1.0, 0.0, 0.0, 1.0]
        assert res.failed == 3 and res.timed_out == 0
        text = "\n".join(res.errors)
        assert "checker broke" in text and "returned str '1'" in text and "worker died" in text
        bad = pool.score([RewardJob("no_such_module_xyz:f", "q", "a", "a")])
        assert bad.rewards == [0.0] and bad.failed == 1 and "not found" in bad.errors[0]
    finally:
        pool.close()


def test_in_process_mode_has_same_results(slow_spec):
    jobs = [RewardJob(slow_spec, "q", r, "7") for r in ("7", "raise", "8")]
    res = RewardPool(num_workers=0).score(jobs)
    assert res.rewards == [1.0, 0.0, 0.0] and res.failed == 1 and res.timed_out == 0


def test_bad_pool_settings_name_the_key():
    with pytest.raises(ValueError, match="data.reward_workers=-1"):
        RewardPool(num_workers=-1)
    with pytest.raises(ValueError, match="data.reward_timeout_s=0"):
        RewardPool(num_workers=1, timeout_s=0)


def test_file_task_scores_a_step_in_workers(tmp_path, slow_spec):
    from megatron_rl.tasks.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"copy:{d}=", "answer": d}) for d in ("1", "2", "3")) + "\n")
    task = FileTask(path, tok, reward_fn=slow_spec, options=DataOptions(reward_workers=2, reward_timeout_s=10.0))
    try:
        p = task.prompts
        enc = lambda s: tok.encode(s, add_special_tokens=False) + [tok.eos_token_id]  # noqa: E731
        res = task.score([p[0], p[1], p[2]], [enc("1"), enc("3"), enc("3")])
        assert res.rewards == [1.0, 0.0, 1.0] and res.failed == 0 and res.timed_out == 0
    finally:
        task.close()
