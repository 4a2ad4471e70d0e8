"""Bounded waits of the reward endpoints against a server that trickles one byte per 0.2 s (never tripping a
per-read timeout): the RM's /classify client gives up within its timeout, and the judge client leaves no thread
that would keep the process from exiting."""
import socket
import threading
import time

import pytest

from megatron_rl.tasks.judge_client import EndpointClient
from megatron_rl.tasks.rm_backends import RMError, SGLangRM


@pytest.fixture
def trickling_url():
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    stop = threading.Event()

    def handle(c):
        try:
            c.recv(65536)
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
            while not stop.is_set():
                c.sendall(b" ")
                time.sleep(0.2)
        except OSError:
            pass
        finally:
            c.close()

    def serve():
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            threading.Thread(target=handle, args=(c,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    srv.close()


def test_rm_server_that_trickles_times_out_within_the_bound(trickling_url):
    rm, out = SGLangRM([trickling_url], timeout_s=0.5, retries=1), []

    def call():
        try:
            rm.scores([[1, 2, 3]])
        except RMError as e:
            out.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(2 * 0.5 + 1.5)   # two tries of timeout_s, the backoff-free retry, slack
    assert not t.is_alive(), "SGLangRM.scores still waits on a server that trickles bytes"
    assert out and out[0].timed_out and "after 2 tries" in str(out[0]) and trickling_url in str(out[0])


def test_judge_client_leaves_no_thread_that_blocks_exit(trickling_url):
    before = set(threading.enumerate())
    c = EndpointClient([trickling_url], timeout_s=0.5, max_retries=0, max_concurrent=2)
    res = c.post_many("/x", [{}, {}, {}])
    assert [r.error_kind for r in res] == ["timeout"] * 3
    left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert left and all(t.daemon for t in left), [(t.name, t.daemon) for t in left]


def test_check_names_an_unset_api_key_variable(monkeypatch):
    """``check`` on a judge whose key variable is not set here: a problem naming reward.judge.api_key_env (the job
    fails at start with the same), not a traceback; the key's value is never printed."""
    from megatron_rl.tasks import build_char_tokenizer, build_task
    from megatron_rl.tasks.judge_check import judge_check
    from megatron_rl.tasks.judge_config import JudgeConfig
    task = build_task("copy", build_char_tokenizer())
    monkeypatch.delenv("RV_JUDGE_KEY", raising=False)
    cfg = JudgeConfig(enable=True, urls=["http://127.0.0.1:9"], api_key_env="RV_JUDGE_KEY")
    problems, _ = judge_check(cfg, task)
    assert len(problems) == 1 and problems[0].startswith("reward.judge.api_key_env:") and "RV_JUDGE_KEY" in problems[0]
    monkeypatch.setenv("RV_JUDGE_KEY", "s3cr3t-value")
    problems, lines = judge_check(cfg, task)
    assert problems == [] and "note: unreachable" in lines[-1]
    assert not any("s3cr3t-value" in x for x in problems + lines)


def test_judge_batch_ends_within_its_step_budget(trickling_url):
    """A judge that holds every call (bytes trickle, so no read times out) with timeout_s=5, 2 retries, one call at a
    time: the batch's own bound is 3 x (3 x 5 s + backoff) = 52.5 s, past which the rollout phase's watchdog could
    fire first. With the step's budget (half of trainer.phase_timeout_s, trainer/job.py) the batch ends in it, every
    row a counted timeout -- the reward-failure policy, not the watchdog, ends the step."""
    from megatron_rl.tasks.base import Prompt
    from megatron_rl.tasks.judge import JudgedTask
    from megatron_rl.tasks.judge_config import JudgeConfig

    class _Inner:
        name, tokenizer = "t", None

    class _Tok:
        eos_token_id = 1

        def decode(self, ids, skip_special_tokens=True):
            return "x"

    inner = _Inner()
    inner.tokenizer = _Tok()
    cfg = JudgeConfig(enable=True, urls=[trickling_url], timeout_s=5, max_retries=2, max_concurrent=1)
    task = JudgedTask(inner, cfg, batch_budget_s=1.0)
    t0 = time.monotonic()
    res = task.score([Prompt([0], "1", "q")] * 3, [[2]] * 3)
    assert time.monotonic() - t0 < 2.5
    assert res.timed_out == 3 and res.failed == 0 and "1 s" in res.errors[0]


def test_judge_budget_is_half_the_phase_watchdog():
    from megatron_rl.config.load import build_job_config
    from megatron_rl.config.timeouts import judge_batch_budget_s
    cfg, _ = build_job_config({"trainer": {"phase_timeout_s": 600}})
    assert judge_batch_budget_s(cfg) == 300
    cfg, _ = build_job_config({"trainer": {"phase_timeout_s": 0}})
    assert judge_batch_budget_s(cfg) is None


def test_rm_stops_starting_batches_past_its_step_budget(tmp_path):
    """reward.model scores batch after batch; with the step's budget spent (a slow server), the batches not started
    are counted timeouts, not waited for: 6 batches of 0.4 s each under a 1 s budget end in about 1.2 s."""
    import random

    from megatron_rl.config.reward_section import RewardModelConfig
    from megatron_rl.tasks import DigitTask, build_char_tokenizer
    from megatron_rl.tasks.rm_task import RewardModelTask
    from megatron_rl.testing.tiny_rm import build_tiny_rm

    class _Slow:
        calls = 0

        def scores(self, batch):
            _Slow.calls += 1
            time.sleep(0.4)
            return [0.5] * len(batch)

    task = DigitTask("copy", build_char_tokenizer())
    prompts = task.sample(6, random.Random(0))
    responses = [task.tokenizer.encode(p.answer, add_special_tokens=False) for p in prompts]
    cfg = RewardModelConfig(enable=True, path=build_tiny_rm(tmp_path / "rm"), backend="sglang",
                            urls=["http://127.0.0.1:9"], max_rows_per_batch=1)
    t0 = time.monotonic()
    res = RewardModelTask(task, cfg, backend=_Slow(), batch_budget_s=1.0).score(prompts, responses)
    assert time.monotonic() - t0 < 2.0 and _Slow.calls == 3
    assert res.timed_out == 3 and res.failed == 0 and res.rewards[:3] == [0.5] * 3
    assert "budget" in res.errors[0]
