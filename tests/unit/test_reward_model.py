"""``reward.model``: a scalar reward model (issue 50). The reference for every score is HF transformers' own
``*ForSequenceClassification`` forward on one unpadded row, on text rendered here with the RM tokenizer's
``apply_chat_template``; faults a real server cannot produce on demand (a malformed answer, a slow answer) come
from a scripted HTTP server in this process.
"""
import http.server
import json
import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from megatron_rl.config import ConfigError
from megatron_rl.plan import load_job_config
from megatron_rl.config.reward_section import RewardModelConfig
from megatron_rl.tasks import DigitTask, build_char_tokenizer
from megatron_rl.tasks.rm_backends import SGLangRM, parse_classify
from megatron_rl.tasks.rm_render import rm_tokenizer, token_batches
from megatron_rl.tasks.rm_task import RewardModelTask, map_scores
from megatron_rl.testing.tiny_rm import build_tiny_rm
from megatron_rl.trainer.reward_failures import reward_failure_error


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    return build_tiny_rm(tmp_path_factory.mktemp("rm") / "rm", arch="qwen2", seed=0)


@pytest.fixture(scope="module")
def hf_rm(rm_path):
    return AutoModelForSequenceClassification.from_pretrained(rm_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def copy_task():
    return DigitTask("copy", build_char_tokenizer())


def _rm(path, **kw):
    return RewardModelConfig(enable=True, path=path, **kw)


def _rows(task, n=6, seed=0):
    """Prompts and varied responses (some right, some wrong, one ending in EOS)."""
    rng = random.Random(seed)
    prompts = task.sample(n, rng)
    tok = task.tokenizer
    out = []
    for i, p in enumerate(prompts):
        text = p.answer if i % 2 == 0 else str(rng.randrange(1000))
        ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if i == 0 else [])
        out.append(ids)
    return prompts, out


def _hf_reference(hf_rm, rm_path, task, prompts, responses):
    """HF's forward, one row at a time, on (user prompt, assistant response) rendered by the RM's template."""
    tok = rm_tokenizer(rm_path)
    scores = []
    for p, r in zip(prompts, responses):
        ids = [t for t in r]
        if task.tokenizer.eos_token_id in ids:
            ids = ids[:ids.index(task.tokenizer.eos_token_id)]
        text = task.tokenizer.decode(ids, skip_special_tokens=True)
        conv = [{"role": "user", "content": p.text}, {"role": "assistant", "content": text}]
        enc = tok.encode(tok.apply_chat_template(conv, tokenize=False), add_special_tokens=False)
        with torch.no_grad():
            scores.append(float(hf_rm(torch.tensor([enc])).logits[0, 0]))
    return scores


def test_local_rm_rewards_equal_hf_forward_in_token_batches(rm_path, hf_rm, copy_task):
    prompts, responses = _rows(copy_task, n=6)
    ref = _hf_reference(hf_rm, rm_path, copy_task, prompts, responses)
    assert len(set(round(s, 4) for s in ref)) > 1                     # the RM tells the responses apart
    task = RewardModelTask(copy_task, _rm(rm_path, max_tokens_per_batch=60, max_rows_per_batch=4))
    result = task.score(prompts, responses)
    assert result.failed == result.timed_out == 0
    assert result.rewards == pytest.approx(ref, abs=1e-5)
    assert result.metrics["reward/rm_batches"] > 1                     # several batches, padded
    assert [e["rm_score"] for e in result.extras] == pytest.approx(ref, abs=1e-5)
    assert result.metrics["reward/rm_score_mean"] == pytest.approx(sum(ref) / len(ref), abs=1e-5)
    assert result.metrics["reward/rm_score_min"] == pytest.approx(min(ref), abs=1e-5)
    assert result.metrics["reward/rm_latency_s"] >= 0
    again = RewardModelTask(copy_task, _rm(rm_path, max_tokens_per_batch=10_000)).score(prompts, responses)
    assert again.rewards == pytest.approx(result.rewards, abs=1e-5)   # batching does not change a score
    assert task.score(prompts, responses).rewards == result.rewards   # deterministic


def test_rule_plus_model_weighted_sum_with_scale_offset(rm_path, hf_rm, copy_task):
    prompts, responses = _rows(copy_task, n=4, seed=1)
    ref = _hf_reference(hf_rm, rm_path, copy_task, prompts, responses)
    rule = [copy_task.reward(p, r) for p, r in zip(prompts, responses)]
    assert 0 < sum(rule) < len(rule)
    cfg = _rm(rm_path, rule_weight=2.0, weight=0.5, scale=3.0, offset=-1.0)
    result = RewardModelTask(copy_task, cfg).score(prompts, responses)
    want = [2.0 * u + 0.5 * (3.0 * s - 1.0) for u, s in zip(rule, ref)]
    assert result.rewards == pytest.approx(want, abs=1e-5)


def test_batch_normalisation_is_the_population_zscore():
    raw = {0: 1.0, 2: 4.0, 3: -2.5}
    x = torch.tensor(list(raw.values()), dtype=torch.float64)
    z = ((x - x.mean()) / x.std(unbiased=False)).tolist()
    got = map_scores(raw, SimpleNamespace(normalize="batch", scale=2.0, offset=0.5))
    assert [got[i] for i in raw] == pytest.approx([2.0 * v + 0.5 for v in z])
    flat = map_scores({0: 3.0, 1: 3.0}, SimpleNamespace(normalize="batch", scale=1.0, offset=0.0))
    assert flat == {0: 0.0, 1: 0.0}


def test_token_batches_bound_tokens_and_rows():
    assert token_batches([5, 5, 5, 20, 1], max_tokens=10, max_rows=8) == [[0, 1], [2], [3], [4]]
    assert token_batches([1] * 5, max_tokens=100, max_rows=2) == [[0, 1], [2, 3], [4]]


def test_chat_rows_reach_the_rm_as_messages_not_the_policy_template(rm_path, tmp_path):
    from megatron_rl.tasks import FileTask
    from megatron_rl.tasks.chat_model import build_chat_model
    from megatron_rl.tokenizer import load_tokenizer

    policy = load_tokenizer(build_chat_model(tmp_path / "policy", seed=0))
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": "what is 2+3?"}],
                                "reward_model": {"ground_truth": "5"}}) + "\n")
    ft = FileTask(str(data), policy, options=None)
    ft.configure(ft.options)
    task = RewardModelTask(ft, _rm(rm_path))
    p = ft.prompts[0]
    assert "<|im_start|>" in p.text                                  # the policy's template made the prompt
    seen = task.rm_tokenizer.decode(task.rm_input(p, policy.encode("5", add_special_tokens=False)))
    assert seen == "[system] be brief\n[user] what is 2+3?\n[assistant] 5\n<|endoftext|>"
    ft.close()


class _Scripted(http.server.BaseHTTPRequestHandler):
    """``/classify``: what the test's ``mode`` says (a real answer shape, garbage, slow)."""

    mode = "ok"

    def do_GET(self):  # noqa: N802
        data = json.dumps({"model_path": "tiny-rm", "is_generation": self.mode == "generation"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = len(body["input_ids"])
        if self.mode == "slow":
            time.sleep(1.0)
        if self.mode == "garbage":
            out = [{"text": "I think it is good"} for _ in range(n)]
        else:
            out = [{"embedding": [float(len(ids))], "meta_info": {}} for ids in body["input_ids"]]
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture
def scripted():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield server
    server.shutdown()
    server.server_close()


def _url(server):
    return f"http://127.0.0.1:{server.server_address[1]}"


@pytest.mark.parametrize("mode, failed, timed_out, named", [
    ("garbage", 4, 0, "has no finite 'embedding'[0] score"),
    ("slow", 0, 4, "no answer within reward.model.timeout_s=0.2"),
    ("down", 4, 0, "Connection refused"),
])
def test_server_faults_are_counted_and_trip_the_failure_policy(rm_path, copy_task, scripted, mode, failed,
                                                               timed_out, named):
    _Scripted.mode = mode
    url = _url(scripted)
    if mode == "down":                                       # the server is gone (killed): nothing listens
        scripted.shutdown()
        scripted.server_close()
    cfg = _rm(rm_path, backend="sglang", urls=[url], timeout_s=0.2, retries=1, max_rows_per_batch=2)
    prompts, responses = _rows(copy_task, n=4)
    result = RewardModelTask(copy_task, cfg).score(prompts, responses)
    assert (result.failed, result.timed_out) == (failed, timed_out)
    assert result.rewards == [0.0] * 4 and result.extras == [None] * 4
    assert named in result.errors[0] and url in result.errors[0] and "after 2 tries" in result.errors[0]
    assert result.metrics["reward/rm_failures"] == 4.0
    metrics = {"reward/failed": float(result.failed), "reward/timed_out": float(result.timed_out)}
    err = reward_failure_error(metrics, 4, 0.5, step=1)
    assert err is not None and "of 4 samples" in str(err)


def test_server_scores_and_a_server_killed_mid_run(rm_path, copy_task, scripted):
    _Scripted.mode = "ok"
    cfg = _rm(rm_path, backend="sglang", urls=[_url(scripted)], timeout_s=5, retries=0)
    task = RewardModelTask(copy_task, cfg)
    prompts, responses = _rows(copy_task, n=3)
    first = task.score(prompts, responses)
    lengths = [float(len(task.rm_input(p, r))) for p, r in zip(prompts, responses)]
    assert first.failed == 0 and first.rewards == lengths      # the server's scores, in sample order
    scripted.shutdown()
    scripted.server_close()
    second = task.score(prompts, responses)
    assert second.failed == 3 and second.rewards == [0.0] * 3


def test_round_robin_retry_reaches_the_live_server(scripted):
    _Scripted.mode = "ok"
    rm = SGLangRM(["http://127.0.0.1:9", _url(scripted)], timeout_s=2, retries=1)   # port 9: refused
    assert rm.scores([[1, 2, 3]]) == [3.0]
    assert rm.scores([[1, 2]]) == [2.0]


def test_parse_classify_names_what_is_wrong():
    assert parse_classify([{"embedding": [0.5]}], 1) == [0.5]
    with pytest.raises(ValueError, match="expected a list of 2 results, got a list of 1"):
        parse_classify([{"embedding": [0.5]}], 2)
    with pytest.raises(ValueError, match="server answered an error"):
        parse_classify({"error": "boom"}, 1)
    with pytest.raises(ValueError, match="finite"):
        parse_classify([{"embedding": [float("nan")]}], 1)


def test_config_errors_name_the_keys(copy_model):
    base = [f"actor.load_hf={copy_model}"]
    with pytest.raises(ConfigError) as e:
        load_job_config(None, base + ["reward.model.enable=true", "reward.model.backend=sglang",
                                      "reward.model.normalize=rank", "reward.model.max_tokens_per_batch=0"],
                        world_size=1)
    msg = str(e.value)
    for key in ("reward.model.path", "reward.model.urls", "reward.model.normalize", "reward.model.max_tokens_per_batch"):
        assert key in msg, msg
    with pytest.raises(ConfigError, match="reward.model.enable: a reward model scores single-turn"):
        load_job_config(None, base + ["reward.model.enable=true", "reward.model.path=/x",
                                      "multi_turn.env=megatron_rl.envs.lookup:LookupEnv", "data.task=lookup"],
                        world_size=1)
    with pytest.raises(ConfigError, match="a reward model and a judge .reward.judge.enable. in one job are not built"):
        load_job_config(None, base + ["reward.model.enable=true", "reward.model.path=/x", "reward.judge.enable=true",
                                      'reward.judge.urls=["http://127.0.0.1:1"]'], world_size=1)
    with pytest.raises(ConfigError, match="reward.model.nope: unknown key"):
        load_job_config(None, base + ["reward.model.nope=1"], world_size=1)
    cfg = load_job_config(None, base + ["reward.model.enable=true", "reward.model.path=/x",
                                        "reward.model.rule_weight=1"], world_size=1)
    assert cfg.reward.model.describe().startswith("reward = 1 * rule + 1 * (1 * rm + 0)")
    assert cfg.to_dict()["reward"]["model"]["rule_weight"] == 1.0


def test_check_renders_one_row_and_probes_the_servers(rm_path, copy_task, scripted, tmp_path):
    from megatron_rl.tasks.rm_check import check_reward_model

    _Scripted.mode = "ok"
    prompt = copy_task.sample(1, random.Random(0))[0]
    live, dead = _url(scripted), "http://127.0.0.1:9"
    problems, lines = check_reward_model(_rm(rm_path, backend="sglang", urls=[live, dead]), prompt)
    text = "\n".join(lines)
    # the tiny Qwen2 RM has no score.bias: two servers would add different constants (tests/unit/test_rm_score_bias.py)
    assert len(problems) == 1 and "score.bias" in problems[0], problems
    assert f"'[user] {prompt.text}\\n[assistant] {prompt.answer}\\n<|endoftext|>'" in text, text
    assert f"{live} (tiny-rm) scores the row" in text and f"{dead} not reachable now" in text
    _Scripted.mode = "generation"
    problems, _ = check_reward_model(_rm(rm_path, backend="sglang", urls=[live]), prompt)
    assert problems and "serves a generation model" in problems[0] and live in problems[0]
    _Scripted.mode = "garbage"
    problems, _ = check_reward_model(_rm(rm_path, backend="sglang", urls=[live]), prompt)
    assert problems and "does not score the row" in problems[0]
    problems, _ = check_reward_model(_rm(rm_path, chat_template="{{ messages[5]['content'] }}"), prompt)
    assert problems and problems[0].startswith("reward.model.chat_template: the RM's chat template fails")
    policy_dir = tmp_path / "not_an_rm"
    from megatron_rl.testing.tiny_hf import build_tiny_hf_model
    build_tiny_hf_model(policy_dir)
    problems, _ = check_reward_model(_rm(str(policy_dir)), prompt)
    assert problems and "is not a *ForSequenceClassification" in problems[0]


class _HalfFailingRule(DigitTask):
    """The copy task whose rule reward fails on the prompts listed in ``bad`` (counted, extras None, as the
    reward pool reports a failed job)."""

    def __init__(self, bad):
        super().__init__("copy", build_char_tokenizer())
        self.bad = bad

    def score(self, prompts, responses):
        from megatron_rl.tasks.reward_pool import RewardResult
        out = RewardResult(rewards=[0.0] * len(prompts), extras=[None] * len(prompts))
        for i, (p, r) in enumerate(zip(prompts, responses)):
            if i in self.bad:
                out.failed += 1
                out.errors.append(f"sample {i}: rule failed")
            else:
                out.rewards[i], out.extras[i] = self.reward(p, r), {}
        return out


def test_rule_failures_and_rm_failures_count_each_sample_once(rm_path, scripted):
    task = _HalfFailingRule(bad={1})
    prompts, responses = _rows(task, n=4)
    result = RewardModelTask(task, _rm(rm_path, rule_weight=1.0)).score(prompts, responses)
    assert result.failed == 1 and result.rewards[1] == 0.0 and result.extras[1] is None
    assert all(result.extras[i] is not None for i in (0, 2, 3))
    _Scripted.mode = "garbage"                                  # the RM fails every sample, the rule one of them
    cfg = _rm(rm_path, rule_weight=1.0, backend="sglang", urls=[_url(scripted)], retries=0)
    result = RewardModelTask(task, cfg).score(prompts, responses)
    assert result.failed == 4 and result.timed_out == 0


def test_dynamic_sampling_rounds_sum_the_rm_counts_and_time():
    from megatron_rl.trainer.dynamic_sampling import merge_round_metrics

    rounds = [({"reward/rm_failures": 1.0, "reward/rm_latency_s": 0.5, "reward/rm_batches": 2.0,
                "reward/rm_score_max": 3.0, "reward/rm_score_mean": 1.0}, 4),
              ({"reward/rm_failures": 2.0, "reward/rm_latency_s": 0.25, "reward/rm_batches": 1.0,
                "reward/rm_score_max": 2.0, "reward/rm_score_mean": 2.0}, 4)]
    m = merge_round_metrics(rounds)
    assert (m["reward/rm_failures"], m["reward/rm_latency_s"], m["reward/rm_batches"]) == (3.0, 0.75, 3.0)
    assert m["reward/rm_score_max"] == 3.0 and m["reward/rm_score_mean"] == 1.5


def test_a_relative_rm_path_is_read_beside_the_config_file(rm_path, copy_model, tmp_path):
    import shutil

    shutil.copytree(rm_path, tmp_path / "rms" / "tiny")
    job = tmp_path / "job.yaml"
    job.write_text(f"actor: {{load_hf: {copy_model}}}\nreward:\n  model: {{enable: true, path: rms/tiny}}\n")
    cfg = load_job_config(str(job), world_size=1)
    assert cfg.reward.model.path == str(tmp_path / "rms" / "tiny")


def test_a_backend_that_raises_counts_its_batch_as_failed(rm_path, copy_task):
    class Broken:
        def scores(self, batch):
            raise IndexError("index out of range in self")

    prompts, responses = _rows(copy_task, n=3)
    result = RewardModelTask(copy_task, _rm(rm_path), backend=Broken()).score(prompts, responses)
    assert result.failed == 3 and result.rewards == [0.0] * 3
    assert "reward.model: IndexError: index out of range in self" in result.errors[0]
