"""The LLM judge against a REAL SGLang server on CPU (one per module) serving a tiny random Qwen2 built offline.

The judge model is random, so what it "prefers" is arbitrary -- but it is a real model on a real server: with
SGLang's regex-constrained decoding (``sampling_kwargs: {regex: ...}``) its greedy answer is always ``\\boxed{d}``
with a digit d that depends on the prompt. That is enough to prove the plumbing: rewards equal those of the same
server called directly (requests + re here, not our client) on the same rows; two runs give identical rewards at
temperature 0; and the faults -- an answer without a score (the regex without \\boxed), a slow judge (a proxy that
delays: a real server cannot be slowed on demand), the judge killed mid-run -- each end as counted failures that the
reward-failure policy turns into a named error past ``data.max_reward_failure_frac``. Training jobs
(``python -m megatron_rl.train``: sync, async, multi-turn) score with it and log ``reward/judge_*``; a job rewarded by
the judge alone learns what the judge prefers. Whether a tiny model can judge the copy task well enough to teach
it: not claimed (docs/reward_models.md).

Run: OMP_NUM_THREADS=1 pytest tests/integration/test_judge_sglang.py   (server start 16-110 s, then ~6 min on 2 cores)
"""
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from megatron_rl.rollout.sglang_server import sglang_available
from megatron_rl.tasks.base import Prompt
from megatron_rl.tasks.judge import Judge, JudgedTask, JudgeRow
from megatron_rl.tasks.judge_config import JudgeConfig
from megatron_rl.testing.sglang_script import SharedServer
from megatron_rl.testing.tiny_hf import build_tiny_hf_model
from megatron_rl.trainer.reward_failures import reward_failure_error

_OK, _REASON = sglang_available()
pytestmark = [pytest.mark.skipif(not _OK, reason=_REASON), pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REGEX = r"\\boxed\{[0-9]\}"
TEMPLATE = "Grade the answer to {question} (reference {ground_truth}): {response}. Score:"
ROWS = [JudgeRow(f"copy:{q}=", r, q) for q, r in [("12", "12"), ("12", "21"), ("907", "907"), ("5", "55"),
                                                   ("33", "3"), ("4410", "4410"), ("8", ""), ("61", "16")]]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    model = build_tiny_hf_model(tmp_path_factory.mktemp("judge_model") / "m", arch="qwen2", seed=0,
                                initializer_range=0.1)
    with SharedServer(model, tmp_path_factory.mktemp("judge_log"), extra_args=["--random-seed", "0"],
                      ready_timeout=600) as s:
        yield s


def judge_cfg(url, **kw):
    base = dict(enable=True, urls=[url] if isinstance(url, str) else url, api="completions", prompt_template=TEMPLATE,
                max_tokens=16, sampling_kwargs={"regex": REGEX}, timeout_s=60, max_retries=1, max_concurrent=4)
    base.update(kw)
    return JudgeConfig(**base)


def direct_scores(url, rows):
    """The reference: the same server called with plain requests, the prompt built with str.replace, the digit
    read with a regex."""
    out = []
    for r in rows:
        prompt = TEMPLATE.replace("{question}", r.question).replace("{ground_truth}", str(r.ground_truth)) \
            .replace("{response}", r.response)
        body = requests.post(url + "/v1/completions", json={"model": "default", "prompt": prompt, "max_tokens": 16,
                                                           "temperature": 0.0, "regex": REGEX}, timeout=120).json()
        out.append(float(re.fullmatch(r"\\boxed\{(\d)\}", body["choices"][0]["text"]).group(1)))
    return out


def test_rewards_equal_direct_calls_and_repeat(shared):
    url = shared.get().url
    want = direct_scores(url, ROWS)
    assert len(set(want)) > 1, want                                # the judge's answer depends on the row
    got = Judge(judge_cfg(url)).judge(ROWS)
    assert got.failures == [None] * len(ROWS) and got.scores == want
    again = Judge(judge_cfg([url, url], max_concurrent=1)).judge(ROWS)  # other concurrency, round-robin
    assert again.scores == want
    assert all(a.startswith("\\boxed{") for a in got.answers)


def test_judged_task_rewards_and_rule_combination(shared, tmp_path):
    """The copy task's prompts and responses through ``JudgedTask`` (decoding, template, combine)."""
    from megatron_rl.tasks import build_char_tokenizer, build_task
    url = shared.get().url
    tok = build_char_tokenizer()
    task = build_task("copy", tok)
    prompts = [Prompt(tok.encode(r.question), r.ground_truth, r.question) for r in ROWS]
    responses = [tok.encode(r.response) + [tok.eos_token_id] for r in ROWS]
    want = direct_scores(url, ROWS)
    rule = task.rewards(prompts, responses)                        # the copy task's own (partial-credit) reward
    judged = JudgedTask(task, judge_cfg(url), samples_path=str(tmp_path / "s.jsonl"))
    res = judged.score(prompts, responses)
    assert res.rewards == want and res.failed == res.timed_out == 0
    assert res.metrics["reward/judge_score_mean"] == pytest.approx(sum(want) / len(want))
    both = JudgedTask(task, judge_cfg(url, combine="weighted_sum", rule_weight=2.0, judge_weight=0.5))
    assert both.score(prompts, responses).rewards == [2 * a + 0.5 * b for a, b in zip(rule, want)]
    anded = JudgedTask(task, judge_cfg(url, combine="rule_and_judge"))
    assert anded.score(prompts, responses).rewards == [min(a, b) for a, b in zip(rule, want)]
    assert len((tmp_path / "s.jsonl").read_text().splitlines()) == 4


def test_answer_without_score_is_a_counted_failure(shared):
    url = shared.get().url
    bad = Judge(judge_cfg(url, sampling_kwargs={"regex": "[0-9]"})).judge(ROWS)   # a digit, no \boxed{}
    assert [f[0] for f in bad.failures] == ["no_score"] * len(ROWS)
    task = JudgedTask(_Inner(), judge_cfg(url, sampling_kwargs={"regex": "[0-9]"}))
    res = task.score_texts([Prompt([0], r.ground_truth, r.question) for r in ROWS], [r.response for r in ROWS])
    assert res.failed == len(ROWS) and res.rewards == [0.0] * len(ROWS)
    err = reward_failure_error({"reward/failed": res.failed, "reward/timed_out": res.timed_out}, len(ROWS), 0.5, 1)
    assert err is not None and "8 reward(s) failed" in str(err)


class _Inner:
    name, tokenizer = "inner", type("T", (), {"eos_token_id": 1})()


class _SlowProxy:
    """A TCP proxy that waits ``delay`` s before forwarding each connection (a slow judge)."""

    def __init__(self, target_port, delay):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.target, self.delay = target_port, delay
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(c,), daemon=True).start()

    def _pipe(self, c):
        time.sleep(self.delay)
        try:
            u = socket.create_connection(("127.0.0.1", self.target))
        except OSError:
            c.close(); return
        for a, b in ((c, u), (u, c)):
            threading.Thread(target=self._copy, args=(a, b), daemon=True).start()

    @staticmethod
    def _copy(a, b):
        try:
            while (data := a.recv(65536)):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.sock.close()


def test_slow_judge_times_out_and_is_counted(shared):
    port = int(shared.get().url.rsplit(":", 1)[1])
    proxy = _SlowProxy(port, delay=3.0)
    try:
        t0 = time.monotonic()
        task = JudgedTask(_Inner(), judge_cfg(proxy.url, timeout_s=0.5, max_retries=1, max_concurrent=8))
        res = task.score_texts([Prompt([0], r.ground_truth, r.question) for r in ROWS], [r.response for r in ROWS])
        assert time.monotonic() - t0 < 2.5                       # bounded by 2 x 0.5 s (+ backoff), not the judge
        assert res.timed_out == len(ROWS) and res.failed == 0 and res.metrics["reward/judge_failures"] == len(ROWS)
        err = reward_failure_error({"reward/timed_out": res.timed_out}, len(ROWS), 0.5, 2)
        assert "8 timed out of 8" in str(err)
        # a slow but sufficient timeout: the same scores as direct calls
        ok = Judge(judge_cfg(proxy.url, timeout_s=60)).judge(ROWS[:2])
        assert ok.scores == direct_scores(shared.get().url, ROWS[:2])
    finally:
        proxy.close()


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return env


def _train(run, model, url, *extra):
    args = [f"actor.load_hf={model}", f"trainer.run_dir={run}", "rollout.max_new_tokens=4",
            "rollout.n_samples_per_prompt=2", "data.prompts_per_step=2", "trainer.progress=false",
            "actor.micro_batch_size=4", "reward.judge.enable=true", f'reward.judge.urls=["{url}"]',
            "reward.judge.api=completions", f"reward.judge.prompt_template={json.dumps(TEMPLATE)}",
            "reward.judge.max_tokens=16", f"reward.judge.sampling_kwargs={json.dumps({'regex': REGEX})}",
            "reward.judge.timeout_s=30", "reward.judge.max_retries=0", *extra]
    return subprocess.run([sys.executable, "-m", "megatron_rl.train", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)


def _records(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_training_job_scores_with_the_judge_and_repeats(shared, copy_model, tmp_path, mode):
    url = shared.get().url
    extra = ("trainer.steps=2",) + (("rollout.mode=async", "rollout.max_staleness=1") if mode == "async" else ())
    curves = []
    for k in range(2):
        run = tmp_path / f"run{k}"
        r = _train(run, copy_model, url, *extra)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        recs = _records(run)
        assert all(m["reward/judge_failures"] == 0 and "reward/judge_latency_s" in m for m in recs)
        assert all(0 <= m["reward/judge_score_min"] <= m["reward/judge_score_max"] <= 9 for m in recs)
        samples = [json.loads(x) for x in (run / "judge_samples.jsonl").read_text().splitlines()]
        assert samples and all(s["judge_answer"].startswith("\\boxed{") for s in samples)
        steps = {s["step"] for s in samples}                          # sampled per training step (async: the
        assert steps == {1, 2} if mode == "sync" else {1, 2} <= steps  # producer also scored steps drawn ahead)
        curves.append([m["reward/raw_mean"] for m in recs])
    if mode == "sync":   # the embedded engine samples from its seed: the same rollouts, the same judge rewards
        assert curves[0] == curves[1]


def test_check_renders_one_row_and_asks_the_endpoint(shared):
    from megatron_rl.tasks import build_char_tokenizer, build_task
    from megatron_rl.tasks.judge_check import judge_check
    url = shared.get().url
    task = build_task("copy", build_char_tokenizer())
    first = task.sample(1, __import__("random").Random(0))[0]
    problems, lines = judge_check(judge_cfg(url), task)
    prompt = TEMPLATE.replace("{question}", first.text).replace("{ground_truth}", first.answer) \
        .replace("{response}", first.answer)
    assert problems == [] and repr(prompt)[1:-1] in lines[0] and "-> score" in lines[1]
    problems, _ = judge_check(judge_cfg(url, sampling_kwargs={"regex": "[0-9]"}), task)
    assert len(problems) == 1 and problems[0].startswith("reward.judge.parser:")
    problems, lines = judge_check(judge_cfg("http://127.0.0.1:9"), task)
    assert problems == [] and "note: unreachable" in lines[-1]


@pytest.mark.parametrize("sees", ["trajectory", "final_answer"])
def test_multi_turn_job_judges_what_judge_sees_says(shared, copy_model, tmp_path, sees):
    """A one-step multi-turn job (model turn, the environment's reply "7", model turn): each row's reward is the
    judge's score of a prompt whose response part is, decoded here with the HF tokenizer from rollouts.jsonl, the
    whole trajectory or the last model turn; the score equals the server's answer to that prompt called directly."""
    import transformers
    model, url, run = copy_model, shared.get().url, tmp_path / "run"
    env = os.path.join(os.path.dirname(os.path.abspath(__file__)), "judge_reply_env.py") + ":ReplyOnce"
    r = _train(run, model, url, "trainer.steps=1", f"multi_turn.env={env}", "multi_turn.max_turns=2",
               "multi_turn.max_total_tokens=20", "multi_turn.max_tokens_per_turn=8", "multi_turn.env_workers=0",
               'multi_turn.observation_template="{observation}="', "trainer.dump_rollouts=true",
               "rollout.max_new_tokens=20", "data.prompts_per_step=4", "rollout.n_samples_per_prompt=4",
               "actor.micro_batch_size=16", f"reward.judge.judge_sees={sees}", "reward.judge.raw_samples_per_step=100",
               'reward.judge.prompt_template="{response}|"')
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    tok = transformers.AutoTokenizer.from_pretrained(model)
    rows = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    samples = [json.loads(x) for x in (run / "judge_samples.jsonl").read_text().splitlines()]
    assert len(rows) == len(samples) == 16
    assert any(0 in row["loss_mask"] for row in rows)       # some trajectory holds a tool reply: the modes differ
    for row, smp in zip(rows, samples):
        ids = row["response_ids"]
        if sees == "trajectory":
            want = tok.decode(ids, skip_special_tokens=True)
        else:   # the last model turn: after the last env token (loss mask 0), up to its EOS
            mask = row["loss_mask"]
            start = max([i + 1 for i, m in enumerate(mask) if m == 0], default=0)
            last = ids[start:]
            last = last[:last.index(tok.eos_token_id)] if tok.eos_token_id in last else last
            want = tok.decode(last, skip_special_tokens=True)
        assert smp["judge_prompt"] == want + "|"
        body = requests.post(url + "/v1/completions", json={"model": "default", "prompt": want + "|", "max_tokens": 16,
                                                           "temperature": 0.0, "regex": REGEX}, timeout=120).json()
        assert row["reward"] == float(body["choices"][0]["text"][7])


def test_a_job_rewarded_only_by_the_judge_learns_what_the_judge_prefers(shared, copy_model, tmp_path):
    """40 steps of the copy-task policy with the judge as its only reward, the judge reading the response alone
    (its digit, 0-9 normalized to [0, 1], varies with the response: the random judge "prefers" some digit strings).
    The mean judge reward of the last 10 steps exceeds that of the first 10 (measured 0.25 -> 0.42 at seed 0,
    0.26 -> 0.40 at seed 1); the last step's rewards equal the server's answers called directly on its decoded
    responses. What is learned is the judge's arbitrary preference, not the copy task (docs/reward_models.md)."""
    import transformers
    url, run = shared.get().url, tmp_path / "run"
    r = _train(run, copy_model, url, "trainer.steps=40", "rollout.n_samples_per_prompt=8", "data.prompts_per_step=4",
               "actor.micro_batch_size=32", "actor.lr=1e-3", 'reward.judge.prompt_template="{response}"',
               "reward.judge.score_range=[0, 9]", "reward.judge.normalize=true", "reward.judge.max_concurrent=8",
               "trainer.dump_rollouts=true")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    curve = [m["reward/raw_mean"] for m in _records(run)]
    first, last = sum(curve[:10]) / 10, sum(curve[-10:]) / 10
    assert last > first + 0.08, curve
    tok = transformers.AutoTokenizer.from_pretrained(copy_model)
    rows = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    for row in [x for x in rows if x["step"] == max(y["step"] for y in rows)]:
        ids = row["response_ids"]
        text = tok.decode(ids[:ids.index(tok.eos_token_id)] if tok.eos_token_id in ids else ids,
                          skip_special_tokens=True)
        body = requests.post(url + "/v1/completions", json={"model": "default", "prompt": text, "max_tokens": 16,
                                                           "temperature": 0.0, "regex": REGEX}, timeout=120).json()
        if "choices" not in body:    # an empty response is an empty prompt, which the server refuses: a failed reward
            assert text == "" and row["reward"] == 0.0
            continue
        assert row["reward"] == pytest.approx(float(body["choices"][0]["text"][7]) / 9)


def test_judge_killed_mid_run_fails_the_run_with_the_cause(shared, copy_model, tmp_path):
    """Last in the file: kills the shared server after the first step (the fixture restarts it if needed)."""
    handle = shared.get()
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl.train", f"actor.load_hf={copy_model}",
                             f"trainer.run_dir={run}", "rollout.max_new_tokens=4", "rollout.n_samples_per_prompt=2",
                             "data.prompts_per_step=2", "trainer.progress=false", "actor.micro_batch_size=4",
                             "trainer.steps=40", "reward.judge.enable=true", f'reward.judge.urls=["{handle.url}"]',
                             "reward.judge.api=completions", f"reward.judge.prompt_template={json.dumps(TEMPLATE)}",
                             "reward.judge.max_tokens=16",
                             f"reward.judge.sampling_kwargs={json.dumps({'regex': REGEX})}",
                             "reward.judge.timeout_s=10", "reward.judge.max_retries=1"],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 400
        while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        handle.terminate()                                         # the judge dies mid-run
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out[-3000:]
    assert "RewardFailureError" in out and "data.max_reward_failure_frac" in out, out[-3000:]
    assert "judge unreachable" in out, out[-3000:]                 # the cause named, from rank 0's line
    assert len(_records(run)) < 40
