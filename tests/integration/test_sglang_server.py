"""SGLangEngine against a REAL SGLang server (python -m sglang.launch_server, CPU, bf16) serving a tiny model
built offline by megatron_rl.testing.tiny_hf. One server for the whole module (start-up 16-90 s on 2 busy
cores); the last test kills it mid rollout loop (the fixture restarts it if a test needs it afterwards).

References are independent of the code under test: Hugging Face transformers forward passes of the same
checkpoint in fp32/float64 on prompt+response, ``log_softmax(logits / T)`` gathered at the sampled tokens.

Tolerance (bf16 serving): the server runs the model in bfloat16 (8-bit mantissa, relative rounding 2^-8);
rounding errors in the final logits scale with |logits| / T. For this model (|logits| <= ~3.5) we measured
max |delta| ~0.035 / mean ~0.006 at T=1 and max ~0.053 / mean ~0.012 at T=0.5. Tests allow
max <= 0.1 / T and mean <= 0.025 / T, and also check that the WRONG semantics (no temperature, or top-k
renormalised) are off by far more than that, so the comparison can fail.

Skipped (with the reason) only if sglang is not importable by the server interpreter
($MEGATRON_RL_SGLANG_PYTHON or this one); the test command installs it (tools/install_sglang_cpu.sh).
Run: OMP_NUM_THREADS=1 pytest tests/integration/test_sglang_server.py
"""
import math
import shutil
import threading
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_rl.rollout.base import (EngineUnavailableError, RolloutError, SamplingParams,  # noqa: E402
                                      StaleRolloutError, WeightSyncError)
from megatron_rl.rollout.sglang_engine import RetryPolicy, SGLangEngine  # noqa: E402
from megatron_rl.rollout.sglang_server import sglang_available  # noqa: E402
from megatron_rl.testing.sglang_script import SharedServer, group_gone  # noqa: E402
from megatron_rl.testing.tiny_hf import build_tiny_hf_model  # noqa: E402

_OK, _REASON = sglang_available()
pytestmark = [pytest.mark.skipif(not _OK, reason=_REASON), pytest.mark.slow, pytest.mark.timeout(900)]

INIT = 0.1        # weight init std: peaked enough that temperature matters, small enough for bf16
LM_HEAD_SCALE = 2.0  # the "new" weights of the weight-sync test


def tol(T):
    """(max, mean) allowed |server - fp32 reference| log-prob error for bf16 serving at temperature T."""
    return 0.1 / T, 0.025 / T


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("sglang_models")
    v1 = build_tiny_hf_model(base / "v1", arch="qwen2", seed=0, initializer_range=INIT)
    v2 = str(base / "v2")
    shutil.copytree(v1, v2)
    m = transformers.AutoModelForCausalLM.from_pretrained(v1)
    with torch.no_grad():
        m.lm_head.weight.mul_(LM_HEAD_SCALE)
    m.save_pretrained(v2)
    refs = {"v1": transformers.AutoModelForCausalLM.from_pretrained(v1, dtype=torch.float64).eval(),
            "v2": transformers.AutoModelForCausalLM.from_pretrained(v2, dtype=torch.float64).eval()}
    return {"v1": v1, "v2": v2, "refs": refs}


@pytest.fixture(scope="module")
def _shared_server(models, tmp_path_factory):
    with SharedServer(models["v1"], tmp_path_factory.mktemp("sglang_log"), extra_args=["--random-seed", "0"],
                      ready_timeout=600, max_total_tokens=32768) as shared:
        yield shared


@pytest.fixture
def server(_shared_server):
    """The module's server; (re)started on demand, so the kill test (last in the file) may run in any order."""
    return _shared_server.get()


@pytest.fixture
def engine(server, models):
    """An engine whose server serves weights 'v1' (tests that change weights restore them through this)."""
    eng = SGLangEngine(server.url, request_timeout=120, retry=RetryPolicy(max_attempts=2, backoff_initial=0.5))
    eng.update_weights(models["v1"], "v1")
    yield eng
    eng.close()


def reference_logprobs(model, prompt, response, T):
    """float64 HF log_softmax(logits / T) at the response tokens (teacher-forced on prompt + response)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].double()
    return logits, torch.log_softmax(logits / T, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


PROMPTS = [[5, 6, 7, 8, 9, 10], [30, 31], [100, 101, 102, 103]]


def test_generate_returns_tokens_and_logprobs_of_the_right_shape(engine, models, server):
    vocab = models["refs"]["v1"].config.vocab_size
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    rs = engine.generate(PROMPTS, sp, n=3)
    assert len(rs) == len(PROMPTS) * 3
    assert [r.prompt_index for r in rs] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for r in rs:
        assert r.prompt_ids == PROMPTS[r.prompt_index]
        assert len(r.response_ids) == 8 == len(r.rollout_log_probs) and r.finish_reason == "length"
        assert all(0 <= t < vocab for t in r.response_ids)
        assert all(math.isfinite(x) and x <= 0 for x in r.rollout_log_probs)
        assert r.weight_version == "v1" and r.source == server.url
    # two "servers" (the same one twice): the batch is split in chunks and reassembled in prompt order
    rs2 = SGLangEngine([server.url, server.url], weight_version="v1").generate(PROMPTS, sp, n=2)
    assert [r.prompt_ids for r in rs2] == [p for p in PROMPTS for _ in range(2)]


@pytest.mark.parametrize("T", [1.0, 0.5])
def test_logprobs_match_hf_reference_with_temperature(engine, models, T):
    ref = models["refs"]["v1"]
    rs = engine.generate(PROMPTS, SamplingParams(temperature=T, max_new_tokens=24, ignore_eos=True), n=4)
    err, err_no_temp = [], []
    for r in rs:
        logits, lp = reference_logprobs(ref, r.prompt_ids, r.response_ids, T)
        got = torch.tensor(r.rollout_log_probs, dtype=torch.float64)
        err.append((got - lp).abs())
        raw = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.response_ids)[:, None])[:, 0]
        err_no_temp.append((got - raw).abs())
    err, err_no_temp = torch.cat(err), torch.cat(err_no_temp)
    max_tol, mean_tol = tol(T)
    assert err.max() <= max_tol and err.mean() <= mean_tol, (err.max().item(), err.mean().item())
    if T != 1.0:  # the comparison discriminates: ignoring the temperature is far outside the tolerance
        assert err_no_temp.mean() > 5 * mean_tol, err_no_temp.mean().item()


def test_topk_logprobs_are_over_the_full_vocab_not_renormalised(engine, models):
    ref = models["refs"]["v1"]
    k, T = 5, 1.0
    rs = engine.generate(PROMPTS, SamplingParams(temperature=T, top_k=k, max_new_tokens=16, ignore_eos=True), n=2)
    err, err_renorm = [], []
    for r in rs:
        logits, lp = reference_logprobs(ref, r.prompt_ids, r.response_ids, T)
        got = torch.tensor(r.rollout_log_probs, dtype=torch.float64)
        top = logits.topk(k, -1)
        ranks = (logits > logits.gather(-1, torch.tensor(r.response_ids)[:, None])).sum(-1)
        assert (ranks < k + 2).all(), "sampled tokens must be (up to bf16 near-ties) in the top k"
        renorm = lp - torch.logsumexp(torch.log_softmax(logits / T, -1).gather(-1, top.indices), -1)
        err.append((got - lp).abs())
        err_renorm.append((got - renorm).abs())
    err, err_renorm = torch.cat(err), torch.cat(err_renorm)
    assert err.max() <= tol(T)[0] and err.mean() <= tol(T)[1]
    assert err_renorm.mean() > 10 * tol(T)[1]


def test_sampling_follows_the_temperature(engine, models):
    """Mean log p_T(sampled first token) must equal -entropy(p_T) (z-test, 5 sigma) for T = 0.5 and 1.5."""
    ref = models["refs"]["v1"]
    prompt = [5, 6, 7, 8, 9, 10]
    with torch.no_grad():
        logits = ref(torch.tensor([prompt])).logits[0, -1].double()
    N = 256
    for T in (0.5, 1.5):
        rs = engine.generate([prompt], SamplingParams(temperature=T, max_new_tokens=1, ignore_eos=True), n=N)
        logp = torch.log_softmax(logits / T, -1)
        sampled = logp[torch.tensor([r.response_ids[0] for r in rs])]
        p = logp.exp()
        mean = (p * logp).sum()
        std = ((p * (logp - mean) ** 2).sum() / N).sqrt()
        assert abs(sampled.mean() - mean) < 5 * std + 0.02, (T, sampled.mean().item(), mean.item(), std.item())
        other = 2.0 if T == 0.5 else 0.5  # a server ignoring T would sit near another temperature's entropy
        lo = torch.log_softmax(logits / other, -1)
        assert abs((lo.exp() * logp).sum() - mean) > 5 * std + 0.02  # the test can tell temperatures apart


def test_greedy_follows_the_reference_argmax(engine, models):
    ref = models["refs"]["v1"]
    rs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True), n=1)
    checked, err = 0, []
    for r in rs:
        logits, lp = reference_logprobs(ref, r.prompt_ids, r.response_ids, 1.0)
        err.append((torch.tensor(r.rollout_log_probs, dtype=torch.float64) - lp).abs())
        top2 = logits.topk(2, -1).values
        chosen = logits.gather(-1, torch.tensor(r.response_ids)[:, None])[:, 0]
        clear = (top2[:, 0] - top2[:, 1]) > 0.05  # bf16 can flip near-ties
        assert torch.equal(chosen[clear], top2[clear, 0])
        checked += int(clear.sum())
    assert checked >= 20
    err = torch.cat(err)  # greedy (T=0) log-probs are reported at T=1: log_softmax(logits)
    assert err.max() <= tol(1.0)[0] and err.mean() <= tol(1.0)[1], (err.max().item(), err.mean().item())


def test_stop_token_ends_the_response_and_is_included(engine):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    seq = engine.generate([PROMPTS[0]], greedy)[0].response_ids
    pos = next(i for i in range(2, len(seq)) if seq[i] not in seq[:i])
    stop = seq[pos]
    r = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop,)))[0]
    assert r.finish_reason == "stop"
    assert r.response_ids == seq[:pos + 1] and len(r.rollout_log_probs) == pos + 1
    assert r.info.get("matched_stop") == stop


def test_weight_sync_changes_logprobs_and_echoes_version(engine, models, server):
    sp = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    g1 = [r.response_ids for r in engine.generate(PROMPTS, greedy)]
    stale = SGLangEngine(server.url, weight_version="v1")

    engine.update_weights(models["v2"], "v2")
    assert engine.weight_version == "v2"
    rs = engine.generate(PROMPTS, sp, n=2)
    assert {r.weight_version for r in rs} == {"v2"}
    err_v2, err_v1 = [], []
    for r in rs:
        got = torch.tensor(r.rollout_log_probs, dtype=torch.float64)
        err_v2.append((got - reference_logprobs(models["refs"]["v2"], r.prompt_ids, r.response_ids, 1.0)[1]).abs())
        err_v1.append((got - reference_logprobs(models["refs"]["v1"], r.prompt_ids, r.response_ids, 1.0)[1]).abs())
    err_v2, err_v1 = torch.cat(err_v2), torch.cat(err_v1)
    # lm_head x2 doubles the logits: bf16 rounding error doubles too (tolerance at the effective T = 1/2)
    assert err_v2.max() <= tol(1 / LM_HEAD_SCALE)[0] and err_v2.mean() <= tol(1 / LM_HEAD_SCALE)[1]
    assert err_v1.mean() > 10 * tol(1.0)[1], "the new weights must change the log-probs"
    # scaling the head does not change the argmax: greedy outputs stay (up to bf16 near-ties)
    g2 = [r.response_ids for r in engine.generate(PROMPTS, greedy)]
    assert sum(a == b for a, b in zip(g1, g2)) >= len(PROMPTS) - 1

    # an engine still expecting v1 detects that the server's rollouts are stale
    with pytest.raises(StaleRolloutError, match="'v2' but expected 'v1'"):
        stale.generate(PROMPTS[:1], sp)

    engine.update_weights(models["v1"], "v1")
    r = engine.generate(PROMPTS[:1], sp)[0]
    err = (torch.tensor(r.rollout_log_probs, dtype=torch.float64)
           - reference_logprobs(models["refs"]["v1"], r.prompt_ids, r.response_ids, 1.0)[1]).abs()
    assert r.weight_version == "v1" and err.max() <= tol(1.0)[0]


def test_failed_weight_update_raises_and_keeps_serving(engine, tmp_path):
    eng = SGLangEngine(engine.urls, check_local_paths=False, retry=RetryPolicy(max_attempts=1))
    missing = str(tmp_path / "no_such_checkpoint")
    with pytest.raises(WeightSyncError, match="did not load .*no_such_checkpoint"):
        eng.update_weights(missing, "v9")
    r = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4))[0]
    assert r.weight_version == "v1"


def test_idle_cpu_server_sleeps_instead_of_spinning(engine, server):
    """Between requests the CPU server's processes use almost no CPU (``--sleep-on-idle``): without it the
    scheduler busy-polls its sockets (measured ~0.7 of a core on 2 loaded cores, 13.8 of 20 s; asleep 0.23 s)."""
    import psutil

    assert "--sleep-on-idle" in server.command
    engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, ignore_eos=True))
    time.sleep(1.0)  # the request's tail (detokenizer, cache bookkeeping) is over
    procs = [psutil.Process(server.pid)] + psutil.Process(server.pid).children(recursive=True)

    def cpu_s():
        return sum(sum(p.cpu_times()[:2]) for p in procs)

    before, t0 = cpu_s(), time.monotonic()
    time.sleep(5.0)
    used, wall = cpu_s() - before, time.monotonic() - t0
    assert used < 0.1 * wall, f"the idle server used {used:.2f} CPU-s in {wall:.1f} s ({len(procs)} processes)"


def test_server_killed_mid_run_gives_clear_error_in_bounded_time(server):
    """Runs last: SIGKILLs the module's server (whole process group) while a rollout loop is sending requests."""
    eng = SGLangEngine(server.url, request_timeout=60,
                       retry=RetryPolicy(max_attempts=3, backoff_initial=0.2, backoff_max=1.0))
    sp = SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True)
    done, failure = [], []

    def rollout_loop():
        try:
            while True:
                done.append(eng.generate(PROMPTS, sp, n=4))
        except RolloutError as e:
            failure.append((time.monotonic(), e))

    t = threading.Thread(target=rollout_loop, daemon=True)
    t.start()
    deadline = time.monotonic() + 120
    while len(done) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(done) >= 2, f"rollout steps did not complete before the kill; log tail:\n{server.log_tail()}"
    assert all(len(step) == len(PROMPTS) * 4 for step in done)
    killed_at = time.monotonic()
    server.kill()
    t.join(timeout=60)
    assert not t.is_alive(), "generate() must not hang after the server dies"
    assert not server.alive() and group_gone(server.pid)
    when, err = failure[0]
    assert isinstance(err, EngineUnavailableError), repr(err)
    msg = str(err)
    assert server.url + "/generate" in msg and "3 attempts" in msg and "ConnectionError" in msg
    assert when - killed_at < 10, f"error took {when - killed_at:.1f} s after the kill"
