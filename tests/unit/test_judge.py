"""The judge's parts that need no server: the template, the parsers, the score mapping, the combination with the
rule reward and the failure accounting (a client stand-in answers with fixed OpenAI bodies; the real-server proof
is tests/integration/test_judge_sglang.py)."""
import json

import pytest

from megatron_rl.tasks.base import Prompt
from megatron_rl.tasks.judge import JudgedTask, JudgeParseError, Judge, answer_text, parse_answer, parse_score, \
    render_prompt
from megatron_rl.tasks.judge_client import CallResult
from megatron_rl.tasks.judge_config import JudgeConfig
from megatron_rl.tasks.reward_pool import RewardResult


def cfg(**kw):
    return JudgeConfig(enable=True, urls=["http://127.0.0.1:1"], **kw)


def test_template_placeholders_only_once_and_braces_are_text():
    t = "Q={question} R={response} G={ground_truth} put it in \\boxed{} or {other}"
    assert render_prompt(t, "q{response}", "r", 12) == "Q=q{response} R=r G=12 put it in \\boxed{} or {other}"


@pytest.mark.parametrize("parser,text,want", [
    ("boxed", "thinking \\boxed{0} no wait \\boxed{ 1 }", "1"),
    ("tag:score", "<score>3</score> then <score> 7 </score>", "7"),
    ("json:score", 'x {"a": 1} y {"score": 0.5, "why": "ok"} z', "0.5"),
])
def test_parsers(parser, text, want):
    assert parse_answer(parser, text) == want


@pytest.mark.parametrize("parser,text", [("boxed", "the answer is 1"), ("tag:score", "<score></score>"),
                                         ("json:score", '{"grade": 1}'), ("tag:score", "<score>1")])
def test_no_score_is_a_named_failure(parser, text):
    with pytest.raises(JudgeParseError) as e:
        parse_answer(parser, text)
    assert e.value.kind == "no_score"


def test_score_mapping_range_and_normalize():
    assert parse_score(cfg(parser="tag:v", score_map={"Yes": 1, "no": 0}), "<v> YES </v>") == 1.0
    with pytest.raises(JudgeParseError, match="score_map"):
        parse_score(cfg(parser="tag:v", score_map={"yes": 1}), "<v>maybe</v>")
    assert parse_score(cfg(score_range=[0, 10], normalize=True), "\\boxed{7.5}") == 0.75
    with pytest.raises(JudgeParseError) as e:
        parse_score(cfg(score_range=[0, 10]), "\\boxed{11}")
    assert e.value.kind == "out_of_range"
    with pytest.raises(JudgeParseError, match="not a number"):
        parse_score(cfg(), "\\boxed{good}")


def test_answer_text_formats():
    assert answer_text({"choices": [{"message": {"content": "a"}}]}) == "a"
    assert answer_text({"choices": [{"text": "b"}]}) == "b"
    with pytest.raises(JudgeParseError) as e:
        answer_text({"error": "x"})
    assert e.value.kind == "garbage"


def test_config_errors_name_keys():
    errs = JudgeConfig(enable=True, parser="regex", api="x", prompt_template="no answer here", combine="and",
                       normalize=True, max_concurrent=0, sampling_kwargs={"temperature": 1}).errors()
    text = "\n".join(errs)
    for key in ("urls", "parser", "api", "prompt_template", "combine", "normalize", "max_concurrent",
                "sampling_kwargs"):
        assert f"reward.judge.{key}:" in text, key
    assert JudgeConfig().errors() == []          # off: nothing checked


class _Client:
    """Answers request i with bodies[i] (or a failure), recording the payloads."""

    def __init__(self, outcomes):
        self.outcomes, self.payloads = outcomes, []

    def post_many(self, path, payloads):
        self.path = path
        self.payloads += payloads
        out = []
        for o in self.outcomes[:len(payloads)]:
            out.append(CallResult(error_kind=o[0], error="boom", latency_s=0.5) if isinstance(o, tuple)
                       else CallResult(body={"choices": [{"text": o}]}, latency_s=0.25))
        return out

    def close(self):
        pass


class _Rule:
    """A task whose rule reward is the i-th of ``rewards``."""

    name, tokenizer = "rule", None

    def __init__(self, rewards):
        self.rewards = rewards

    def score(self, prompts, responses):
        return RewardResult(rewards=list(self.rewards), extras=[{} for _ in self.rewards])


class _Tok:
    eos_token_id = 1

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def _task(outcomes, rule, **kw):
    inner = _Rule(rule)
    inner.tokenizer = _Tok()
    c = cfg(api="completions", **kw)
    client = _Client(outcomes)
    return JudgedTask(inner, c, judge=Judge(c, client=client)), client


def test_combinations_and_failures_counted(tmp_path):
    prompts = [Prompt([0], "gt", "question", row=f"row {i}") for i in range(4)]
    outcomes = ["\\boxed{1}", "\\boxed{0}", "no score", ("timeout",)]
    for combine, want in [("judge", [1.0, 0.0]), ("rule_and_judge", [0.0, 0.0]), ("weighted_sum", [0.5 + 2, 0.5])]:
        task, client = _task(outcomes, [0.0, 1.0, 1.0, 1.0], combine=combine, rule_weight=0.5, judge_weight=2.0) \
            if combine != "rule_and_judge" else _task(outcomes, [0.0, 1.0, 1.0, 1.0], combine=combine)
        if combine == "weighted_sum":
            task.inner.rewards = [1.0, 1.0, 0.0, 0.0]
        res = task.score(prompts, [[2, 3], [4], [5], [6, 1, 7]])
        assert res.rewards[:2] == want, combine
        assert res.rewards[2:] == [0.0, 0.0] and res.failed == 1 and res.timed_out == 1
        assert "no_score" in res.errors[0] and "timeout" in res.errors[1]
        assert res.metrics["reward/judge_failures"] == 2.0 and res.metrics["reward/judge_score_mean"] == 0.5
        assert res.extras[2] is None and res.extras[0]["judge_score"] == 1.0
    # the response is decoded up to EOS and put into the template
    assert "cd" in client.payloads[0]["prompt"] and client.payloads[3]["prompt"].count("g") >= 1
    assert client.payloads[0]["temperature"] == 0.0 and client.path == "/v1/completions"


def test_raw_answers_sampled_failures_first(tmp_path):
    path = tmp_path / "judge_samples.jsonl"
    prompts = [Prompt([0], "gt", "q", row=f"row {i}") for i in range(3)]
    task, _ = _task(["\\boxed{1}", "garbled", "\\boxed{0}"], [1, 1, 1], raw_samples_per_step=2)
    task.samples_path = str(path)
    task.score(prompts, [[2], [3], [4]])
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["failure"] == "no_score" and rows[0]["judge_answer"] == "garbled"
    assert rows[0]["row"] == "row 1" and rows[1]["score"] == 1.0


def test_the_reward_section_loads_and_its_problems_name_keys():
    from megatron_rl.testing.jobs import job_problems
    cfg, problems = job_problems("sized_model", "reward.judge.enable=true", 'reward.judge.urls=["http://j:1"]',
                                 "reward.judge.parser=tag:verdict", 'reward.judge.score_map={"yes": 1, "no": 0}',
                                 world_size=1)
    assert not [p for p in problems if p.startswith("reward")], problems
    assert cfg.reward.judge.urls == ["http://j:1"] and cfg.reward.judge.score_map == {"yes": 1, "no": 0}
    assert cfg.to_dict()["reward"]["judge"]["parser"] == "tag:verdict"
    _, problems = job_problems("sized_model", "reward.judge.enable=true", "reward.judge.temprature=0.5",
                               "reward.judge.judge_sees=trajectory", world_size=1)
    text = "\n".join(problems)
    assert "reward.judge.temprature" in text and "did you mean 'temperature'" in text
    assert "reward.judge.urls:" in text and "reward.judge.judge_sees:" in text
    _, problems = job_problems("sized_model", world_size=1)
    assert not [p for p in problems if p.startswith("reward")]           # off by default: nothing asked


def test_a_chat_rows_question_is_its_messages_not_the_policys_template():
    """A chat data row's Prompt.text is the POLICY's chat template rendered (its control tokens: a chat judge's own
    template would read them as turns); {question} is the row's messages as text, as verl's GenRM example reads the
    raw question (extra_info["question"])."""
    policy = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    one = Prompt([0], "4", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
                 messages=[{"role": "user", "content": "What is 2+2?"}])
    two = Prompt([0], "4", policy, messages=[{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "What is 2+2?"}])
    plain = Prompt([0], "4", "copy:12=")
    task, client = _task(["\\boxed{1}"] * 3, [0.0] * 3, prompt_template="Q[{question}] A[{response}]")
    task.score([one, two, plain], [[2], [2], [2]])
    got = [p["prompt"] for p in client.payloads]
    assert got[0] == "Q[What is 2+2?] A[c]"
    assert got[1] == "Q[system: Be brief.\n\nuser: What is 2+2?] A[c]"
    assert got[2] == "Q[copy:12=] A[c]"
    assert not any("<|im_start|>" in g for g in got)
