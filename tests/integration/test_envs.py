"""Environments of multi-turn rollouts (issue 24): tool-call parsing, ``ToolEnvironment``, ``EnvPool`` faults.

* ``parse_tool_calls`` / ``format_tool_response`` against what the Qwen2.5 and Qwen3 chat templates render
  (HF ``transformers.apply_chat_template`` from a local tokenizer_config, templates embedded below), plus many
  well-formed and malformed hand-written cases (the reference: ``json`` and the cases' stated meaning);
* ``ToolEnvironment`` on a small calculator (the reference: Python arithmetic);
* ``EnvPool`` with real worker processes: an environment that raises, hangs past the timeout, returns garbage,
  exits, and a malformed tool call, each named and counted; the pool still serves afterwards (a replaced worker
  serves the next call); ``close()`` kills every worker; a ``module:Class`` that does not load is an error naming
  ``multi_turn.env``.

Run: OMP_NUM_THREADS=1 pytest -q tests/integration/test_envs.py   (~30 s; worker start-up dominates)
"""
import json
import os
import textwrap
import time

import pytest

from megatron_rl.envs.base import EnvFailure, Environment, EnvStep, env_import_error, load_env_class
from megatron_rl.envs.pool import EnvPool
from megatron_rl.envs.tool_calls import ToolCall, format_tool_response, parse_tool_calls
from megatron_rl.envs.tool_env import ToolEnvironment
from megatron_rl.testing import processes

pytestmark = pytest.mark.timeout(300)

# Qwen2.5-Instruct's chat template (tokenizer_config.json of Qwen/Qwen2.5-*-Instruct), verbatim.
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# The tool-call and tool-message branches of Qwen3's chat template, verbatim (its thinking / system-prompt
# branches left out: they do not touch tool calls).
QWEN3_TOOL_TEMPLATE = r"""{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]

CALLS = [("add", {"a": 12, "b": -3.5}),
         ("lookup", {"query": 'say "hi" \\ </tool_call> <tool_call> ü 名前', "opts": {"k": [1, 2, None], "x": True}}),
         ("now", {})]


def _hf_tokenizer(tmp_path, template):
    """A tiny HF fast tokenizer saved with ``template`` as its chat template, loaded back with AutoTokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    fast.chat_template = template
    fast.save_pretrained(str(tmp_path))
    return AutoTokenizer.from_pretrained(str(tmp_path))


def _conversation(results, content="Let me compute that.", string_args=False):
    calls = [{"type": "function", "function": {"name": n, "arguments": json.dumps(a) if string_args else a}}
             for n, a in CALLS]
    return ([{"role": "user", "content": "What is 12 + -3.5?"},
             {"role": "assistant", "content": content, "tool_calls": calls}]
            + [{"role": "tool", "content": r} for r in results])


def _assistant_turn(rendered):
    """The text of the (single) assistant turn of a rendered conversation."""
    start = rendered.index("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    return rendered[start:rendered.index("<|im_end|>", start)]


@pytest.mark.parametrize("name,template,content,string_args", [
    ("qwen2.5", QWEN25_TEMPLATE, "Let me compute that.", False),
    ("qwen2.5-no-content", QWEN25_TEMPLATE, "", False),
    ("qwen3", QWEN3_TOOL_TEMPLATE, "Let me compute that.", False),
    ("qwen3-no-content", QWEN3_TOOL_TEMPLATE, "", False),
    ("qwen3-string-arguments", QWEN3_TOOL_TEMPLATE, "", True),
])
def test_parse_matches_qwen_chat_templates(tmp_path, name, template, content, string_args):
    """The calls HF renders with the Qwen templates parse back to exactly the calls given; the tool responses
    we format are exactly the text the template puts in the user turn."""
    tok = _hf_tokenizer(tmp_path, template)
    results = ["8.5", '{"hits": ["a", "b"]}', "2026-01-01"]
    rendered = tok.apply_chat_template(_conversation(results, content, string_args), tools=TOOLS,
                                       tokenize=False, add_generation_prompt=True)
    turn = _assistant_turn(rendered)
    if content:
        assert turn.startswith(content + "\n<tool_call>\n")
    calls, malformed = parse_tool_calls(turn)
    assert malformed == 0
    assert [(c.name, c.arguments) for c in calls] == CALLS
    observation = "\n".join(format_tool_response(r) for r in results)
    assert "<|im_start|>user" + "\n" + observation + "<|im_end|>\n<|im_start|>assistant\n" in rendered
    if template is QWEN25_TEMPLATE:  # the system prompt states the same format
        assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in rendered


def _call(name, args):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


@pytest.mark.parametrize("text,calls,malformed", [
    ("The answer is 42.", [], 0),
    ("", [], 0),
    (_call("add", {"a": 1, "b": 2}), [("add", {"a": 1, "b": 2})], 0),
    ("pre " + _call("a", {}) + "\n" + _call("b", {"x": [1]}) + " post", [("a", {}), ("b", {"x": [1]})], 0),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', [("add", {"a": 1})], 0),  # no newlines
    ('<tool_call>\n  {"name": " add ", "arguments": {}}  \n\n</tool_call>', [("add", {})], 0),  # padding
    ('<tool_call>\n{"name": "now"}\n</tool_call>', [("now", {})], 0),  # missing arguments: {}
    ('<tool_call>\n{"arguments": {}, "name": "x", "id": 3}\n</tool_call>', [("x", {})], 0),  # extra keys
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>', [], 1),  # JSON error
    ('<tool_call>\n\n</tool_call>', [], 1),  # empty body
    ('<tool_call>\n["add", {"a": 1}]\n</tool_call>', [], 1),  # not an object
    ('<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>', [], 1),  # missing name
    ('<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>', [], 1),  # empty name
    ('<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>', [], 1),  # non-str name
    ('<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>', [], 1),  # non-dict arguments
    ('<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>', [], 1),  # string arguments
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}', [], 1),  # unclosed
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call', [], 1),  # broken closing tag
    (_call("a", {}) + '\n<tool_call>\n{"name": "b"', [("a", {})], 1),  # second one unclosed
    ('<tool_call>\n{"name": "a"}\n' + _call("b", {}), [("b", {})], 1),  # nested open before the close
    ('answer </tool_call>', [], 1),  # stray closing tag
    (_call("a", {}) + "</tool_call>" + _call("b", {}), [("a", {}), ("b", {})], 1),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>' * 5, [("a", {})] * 5, 0),
    (_call("a", {}) + "<tool_call>not json</tool_call>" + _call("c", {"z": None}), [("a", {}), ("c", {"z": None})], 1),
])
def test_parse_tool_calls_cases(text, calls, malformed):
    got, bad = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in got] == calls
    assert bad == malformed
    assert all(isinstance(c, ToolCall) for c in got)


def test_format_tool_response():
    assert format_tool_response("8") == "<tool_response>\n8\n</tool_response>"
    assert format_tool_response(8.5) == "<tool_response>\n8.5\n</tool_response>"
    assert format_tool_response({"a": [1, "ü"]}) == '<tool_response>\n{"a": [1, "ü"]}\n</tool_response>'
    assert format_tool_response(object()).startswith("<tool_response>\n<object object")


class Calculator(ToolEnvironment):
    """Arithmetic tools; the answer is right when it equals the row's ``answer``."""

    tools = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b, "div": lambda a, b: a / b}

    def score(self, answer_text):
        return float(answer_text.strip() == str(self.sample["answer"]))


def test_tool_environment_calculator():
    env = Calculator()
    env.reset({"prompt": "(3 + 4) * 5", "answer": 35})
    s = env.step("I'll add first.\n" + _call("add", {"a": 3, "b": 4}))
    assert s == EnvStep(observation=format_tool_response(3 + 4), reward=0.0, done=False, info={"tool_calls": 1.0})
    s = env.step(_call("mul", {"a": 7, "b": 5}) + "\n" + _call("div", {"a": 1, "b": 0}) + "\n"
                 + _call("sqrt", {"x": 2}) + "\n" + _call("add", {"a": 1}) + "\n<tool_call>oops</tool_call>")
    responses = s.observation.split("\n<tool_response>")
    assert len(responses) == 5 and not s.done
    assert responses[0] == format_tool_response(7 * 5)
    assert "ZeroDivisionError" in responses[1]
    assert "unknown tool 'sqrt'" in responses[2]
    assert "TypeError" in responses[3]
    assert "malformed tool call" in responses[4]
    assert s.info == {"tool_calls": 4.0, "tool_error": 3.0, "malformed_tool_call": 1.0}
    s = env.step("35")
    assert (s.done, s.reward, s.info) == (True, 1.0, {})
    env.reset({"answer": 36})
    assert env.step("35") == EnvStep("", reward=0.0, done=True)


# ------------------------------------------------------------------ the pool, with real worker processes

ENVS = '''
import os
import time

from megatron_rl.envs.base import Environment, EnvStep
from megatron_rl.envs.tool_env import ToolEnvironment


class Faulty(Environment):
    def __init__(self, tag="t"):
        self.tag = tag

    def reset(self, sample):
        if sample.get("fail_reset"):
            raise KeyError("no such row")
        self.sample, self.turns = sample, 0

    def step(self, action):
        self.turns += 1
        if action == "raise":
            raise ValueError("boom in " + str(self.sample["id"]))
        if action == "hang":
            time.sleep(120)
        if action == "garbage":
            return {"observation": "not an EnvStep"}
        if action == "nan":
            return EnvStep("x", reward=float("nan"), done=True)
        if action == "obs_int":
            return EnvStep(7)
        if action == "exit":
            os._exit(3)
        if action == "done":
            return EnvStep("", reward=0.5, done=True)
        return EnvStep(f"{self.tag}:{self.sample['id']}:{action}:{self.turns}:{os.getpid()}", info={"n": 1})


class Calculator(ToolEnvironment):
    tools = {"add": lambda a, b: a + b}

    def score(self, answer_text):
        return float(answer_text.strip() == str(self.sample["answer"]))


def not_an_env():
    return 1


class NotEnv:
    pass
'''

TIMEOUT = 2.0


@pytest.fixture(scope="module")
def env_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("envs") / "fault_envs.py"
    path.write_text(textwrap.dedent(ENVS))
    return str(path)


@pytest.fixture(scope="module")
def pool(env_file):
    p = EnvPool(f"{env_file}:Faulty", {"tag": "T"}, workers=2, step_timeout_s=TIMEOUT, start_timeout_s=240)
    with processes.shared(p.worker_pids):  # its workers start (and are replaced) during the tests that use it
        yield p
    p.close()


def _obs(result):
    assert isinstance(result, EnvStep), result
    tag, key, action, turns, pid = result.observation.split(":")
    return key, action, int(turns), int(pid)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_pool_state_lives_in_pinned_workers(pool):
    keys = ["a", "b", "c", "d"]
    assert pool.reset(keys, [{"id": k} for k in keys]) == [None] * 4
    pids = set(pool.worker_pids())
    assert len(pids) == 2 and os.getpid() not in pids
    first = [_obs(r) for r in pool.step(keys, ["x"] * 4)]
    second = [_obs(r) for r in pool.step(keys, ["y"] * 4)]
    assert [(k, a, t) for k, a, t, _ in first] == [(k, "x", 1) for k in keys]
    assert [(k, a, t) for k, a, t, _ in second] == [(k, "y", 2) for k in keys]  # per-env state kept
    assert [p for *_, p in first] == [p for *_, p in second]  # pinned: the same worker every turn
    assert {p for *_, p in first} == pids  # spread over both workers
    assert pool.step(["a"], ["done"]) == [EnvStep("", reward=0.5, done=True)]
    with pytest.raises(ValueError, match="'a' has no environment"):  # done: forgotten
        pool.step(["a"], ["x"])
    pool.release(["b", "c", "d"])
    with pytest.raises(ValueError, match="'b' has no environment"):
        pool.step(["b"], ["x"])


def test_pool_env_raises(pool, env_file):
    assert pool.reset(["r1", "r2", "bad"], [{"id": "r1"}, {"id": "r2"}, {"fail_reset": True}]) == [
        None, None, EnvFailure("env_exception", f"{env_file}:Faulty (trajectory 'bad'): reset raised "
                                                "KeyError: 'no such row'")]
    res = pool.step(["r1", "r2"], ["raise", "x"])
    assert res[0] == EnvFailure("env_exception", f"{env_file}:Faulty (trajectory 'r1'): step raised "
                                                 "ValueError: boom in r1")
    assert _obs(res[1])[:3] == ("r2", "x", 1)
    assert _obs(pool.step(["r2"], ["x"])[0])[:3] == ("r2", "x", 2)  # the pool goes on, worker kept
    assert pool.reset(["r1"], [{"id": "r1"}]) == [None]  # a failed key may be reset again
    assert _obs(pool.step(["r1"], ["x"])[0])[:3] == ("r1", "x", 1)
    pool.release(["r1", "r2"])


@pytest.mark.parametrize("action,what", [("garbage", "step returned dict"), ("nan", "EnvStep.reward is float nan"),
                                         ("obs_int", "EnvStep.observation is int 7")])
def test_pool_env_returns_garbage(pool, action, what):
    pids = pool.worker_pids()
    assert pool.reset(["g", "ok"], [{"id": "g"}, {"id": "ok"}]) == [None, None]
    bad, good = pool.step(["g", "ok"], [action, "x"])
    assert isinstance(bad, EnvFailure) and bad.kind == "env_garbage", bad
    assert what in bad.message and "(trajectory 'g')" in bad.message and ":Faulty" in bad.message
    assert _obs(good)[:3] == ("ok", "x", 1)
    assert pool.worker_pids() == pids  # garbage does not cost a worker
    pool.release(["ok"])


def test_pool_env_hangs_past_timeout(pool, env_file):
    keys = ["h", "s1", "s2", "s3"]
    assert pool.reset(keys, [{"id": k} for k in keys]) == [None] * 4
    homes = {k: _obs(r)[3] for k, r in zip(keys, pool.step(keys, ["x"] * 4))}
    hung_pid = homes["h"]
    same = [k for k in keys[1:] if homes[k] == hung_pid]
    other = [k for k in keys[1:] if homes[k] != hung_pid]
    assert same and other
    t0 = time.monotonic()
    res = dict(zip(keys, pool.step(keys, ["hang"] + ["x"] * 3)))
    took = time.monotonic() - t0
    assert TIMEOUT <= took < TIMEOUT + 20, took
    assert res["h"] == EnvFailure("env_timeout", f"{env_file}:Faulty (trajectory 'h'): step did not answer "
                                                 f"within {TIMEOUT:g} s; its worker (pid {hung_pid}) was killed")
    for k in other:  # the other worker's environments are untouched
        assert _obs(res[k])[:3] == (k, "x", 2)
    for k in same:  # lost with the killed worker: this call (queued behind) or the next one names the culprit
        r = res[k] if isinstance(res[k], EnvFailure) else pool.step([k], ["x"])[0]
        assert r.kind == "env_timeout" and "(trajectory 'h')" in r.message and f"(trajectory {k!r})" in r.message
    assert not _alive(hung_pid)
    new_pids = pool.worker_pids()
    assert hung_pid not in new_pids and all(new_pids)
    # the replaced worker serves the next call
    assert pool.reset(same + ["h"], [{"id": k} for k in same + ["h"]]) == [None] * (len(same) + 1)
    served = {_obs(r)[3] for r in pool.step(same + ["h"], ["x"] * (len(same) + 1))}
    assert served <= set(new_pids) and (set(new_pids) - {homes[other[0]]}) <= served
    pool.release(keys)


def test_pool_worker_dies(pool, env_file):
    assert pool.reset(["e"], [{"id": "e"}]) == [None]
    pid = _obs(pool.step(["e"], ["x"])[0])[3]
    (res,) = pool.step(["e"], ["exit"])
    assert res.kind == "env_exception" and f"its worker (pid {pid}) died" in res.message
    assert "exit code 3" in res.message and "(trajectory 'e')" in res.message
    assert pid not in pool.worker_pids() and not _alive(pid)
    assert pool.reset(["e"], [{"id": "e"}]) == [None]
    assert _obs(pool.step(["e"], ["x"])[0])[:3] == ("e", "x", 1)
    pool.release(["e"])


def test_pool_tool_environment_malformed_call_and_close(env_file):
    pool = EnvPool(f"{env_file}:Calculator", None, workers=1, step_timeout_s=TIMEOUT, start_timeout_s=240)
    try:
        assert pool.reset([("s", 0)], [{"answer": 5}]) == [None]
        (s,) = pool.step([("s", 0)], ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}\n</tool_call>'])
        assert not s.done and s.info == {"tool_calls": 0.0, "malformed_tool_call": 1.0}
        assert "malformed tool call" in s.observation
        (s,) = pool.step([("s", 0)], [_call("add", {"a": 2, "b": 3})])
        assert s == EnvStep(format_tool_response(5), info={"tool_calls": 1.0})
        (s,) = pool.step([("s", 0)], ["5"])
        assert s == EnvStep("", reward=1.0, done=True)
        pids = pool.worker_pids()
        assert all(_alive(p) for p in pids)
    finally:
        pool.close()
    assert not any(_alive(p) for p in pids)
    assert pool.worker_pids() == [None]


def test_in_process_pool_same_checks(env_file):
    pool = EnvPool(f"{env_file}:Faulty", {}, workers=0)
    assert pool.reset([1, 2, 3], [{"id": 1}, {"id": 2}, {"id": 3}]) == [None] * 3
    a, b, c = pool.step([1, 2, 3], ["x", "raise", "garbage"])
    assert a.observation.startswith("t:1:x:1:") and (b.kind, c.kind) == ("env_exception", "env_garbage")


@pytest.mark.parametrize("spec,why", [
    ("no_such_module_xyz:Env", "module 'no_such_module_xyz' not found"),
    ("megatron_rl.envs.base:NoSuchEnv", "has no attribute 'NoSuchEnv'"),
    ("megatron_rl.envs.base:EnvStep", "is a class EnvStep, not a subclass of megatron_rl.envs.base.Environment"),
    ("{file}:not_an_env", "is a function, not a subclass"),
    ("{file}:NotEnv", "is a class NotEnv, not a subclass"),
    ("/no/such/envs.py:Env", "file '/no/such/envs.py' does not exist"),
    ("Faulty", "must be a string 'module:Class'"),
])
def test_bad_env_spec_names_the_key(env_file, spec, why):
    spec = spec.format(file=env_file)
    with pytest.raises(ValueError, match="multi_turn.env") as e:
        load_env_class(spec)
    assert why in str(e.value)
    assert env_import_error(spec) == str(e.value)
    with pytest.raises(ValueError, match="multi_turn.env"):
        EnvPool(spec, {}, workers=1, step_timeout_s=1.0)


def test_good_env_spec_loads(env_file):
    assert env_import_error(None) is None and env_import_error(f"{env_file}:Faulty") is None
    cls = load_env_class(f"{env_file}:Calculator")
    assert issubclass(cls, ToolEnvironment) and issubclass(cls, Environment)
