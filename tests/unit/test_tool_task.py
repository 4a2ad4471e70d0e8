"""The ``lookup`` tool task and its environment (``tasks/tool_lookup.py``, ``envs/lookup.py``): prompts and the
held-out split, the environment's answers (the table written out independently here), malformed calls, the
reward of every path (call + answer, guess, wrong key), the Hermes format, the vocabulary edit that keeps the
task models' weights, and one episode through the real driver and pool.

    pytest tests/unit/test_tool_task.py
"""
from __future__ import annotations

import json
import random
import zlib

import pytest

from megatron_rl.envs.base import EnvStep, load_env_class
from megatron_rl.envs.lookup import LookupEnv
from megatron_rl.tasks import build_char_tokenizer, build_task, response_text
from megatron_rl.tasks.char_tokenizer import VOCAB, task_model_config


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(task="lookup")


@pytest.fixture(scope="module")
def task(tok):
    return build_task("lookup", tok, task_kwargs={"min_key_digits": 1, "max_key_digits": 2, "heldout_frac": 0.1})


def _value(table_seed, key, lo=1, hi=2):
    """The table written out from the documented rule: random.Random(crc32("<seed>:<key>")), a length, digits."""
    rng = random.Random(zlib.crc32(f"{table_seed}:{key}".encode()))
    return "".join(str(rng.randint(0, 9)) for _ in range(rng.randint(lo, hi)))


def _row(p):
    """The row the multi-turn generator hands the environment (prompt text, answer, meta)."""
    return {"prompt": p.text, "answer": p.answer, "data_source": p.data_source, "extra_info": p.extra_info, "seed": 0}


def test_vocabulary_keeps_padded_size_and_old_ids(tok):
    # the three new entries fill the padding of the 21-entry vocabulary: task models keep their weight shapes
    assert len(VOCAB) == 24 and task_model_config(hidden_size=32, num_layers=1).vocab_size == 24
    assert VOCAB[:21] == ("<pad>", "<eos>", "<unk>", *"0123456789", ":", "=", "+", " ", "copy", "reverse", "sort",
                          "add")
    ids = tok.encode("lookup:37=?37", add_special_tokens=False)
    assert ids == [VOCAB.index(t) for t in ("lookup", ":", "3", "7", "=", "?", "3", "7")]
    assert tok.unk_token_id not in tok.encode(">529=", add_special_tokens=False)


def test_prompts_hold_an_unknowable_value(task, tok):
    prompts = task.sample(400, random.Random(0))
    for p in prompts[:50]:
        key = p.text[len("lookup:"):-1]
        assert p.text == f"lookup:{key}=" and key.isdigit() and 1 <= len(key) <= 2
        assert p.extra_info["key"] == key
        assert p.answer == _value(p.extra_info["table_seed"], key)
        assert p.prompt_ids == tok.encode(p.text, add_special_tokens=False)
    # the same key gets different values in different prompts (random per prompt, not a table to memorise)
    by_key = {}
    for p in prompts:
        by_key.setdefault(p.extra_info["key"], set()).add(p.answer)
    assert max(len(v) for v in by_key.values()) >= 3


def test_heldout_keys_are_the_split_and_never_sampled(task):
    ref = {f"{k}" for n in (1, 2) for k in (str(i).zfill(n) for i in range(10 ** n))
           if zlib.crc32(f"lookup:{k}".encode()) % 10_000 < 1000}
    held = task.heldout_prompts()
    assert {p.extra_info["key"] for p in held} == ref and 0 < len(ref) < 30
    drawn = {p.extra_info["key"] for p in task.sample(5000, random.Random(1))}
    assert not drawn & ref and len(drawn) == 110 - len(ref)
    # fixed table per held-out key: the same evaluation everywhere
    assert [p.answer for p in held] == [p.answer for p in task.heldout_prompts()]
    assert all(p.answer == _value(zlib.crc32(p.extra_info["key"].encode()), p.extra_info["key"]) for p in held)


@pytest.mark.parametrize("kwargs, match", [({"min_key_digits": 0}, "min_key_digits"),
                                           ({"min_value_digits": 3, "max_value_digits": 2}, "min_value_digits"),
                                           ({"heldout_frac": 0.7}, "heldout_frac"),
                                           ({"max_digits": 2}, r"unknown key\(s\) \['max_digits'\]")])
def test_bad_task_kwargs_name_the_key(tok, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_task("lookup", tok, task_kwargs=kwargs)


def test_reward_fn_is_refused(tok):
    with pytest.raises(ValueError, match="data.reward_fn"):
        build_task("lookup", tok, reward_fn="exact")


def test_call_then_answer_pays_one(task):
    p = task.sample(1, random.Random(3))[0]
    env = LookupEnv()
    env.reset(_row(p))
    key = p.extra_info["key"]
    out = env.step(f"?{key}")
    assert out == EnvStep(observation=">" + p.answer, reward=0.0, done=False, info={"tool_calls": 1.0})
    assert env.step(p.answer) == EnvStep(observation="", reward=1.0, done=True, info={})


@pytest.mark.parametrize("table_seed", [11, 12, 13, 14])
def test_wrong_key_gets_that_keys_value_and_little_credit(task, table_seed):
    p = task.make_prompt("37", table_seed)
    env = LookupEnv(call_weight=0.3)
    env.reset(_row(p))
    other = _value(table_seed, "38")
    assert env.step("?38").observation == ">" + other
    final = env.step(other)   # repeats what the tool said for the wrong key
    # call credit: half for a call, plus half of 1 of 2 key digits right; answer credit: digits right against
    # the true value, or half for repeating the tool's answer
    want = 0.3 * (0.5 + 0.5 * 1 / 2) + 0.7 * max(_credit(other, p.answer), 0.5)
    assert final.done and final.reward == pytest.approx(want)
    env.reset(_row(p))
    env.step("?38")
    env.step("?37")           # the right key after all: the best call counts, the tool's last answer is the value
    assert env.step(p.answer).reward == pytest.approx(1.0)


def _credit(got: str, want: str) -> float:
    """Per-position credit of a terminated answer, written out: digits right over the longer of the two."""
    if got == want:
        return 1.0
    return sum(x == y for x, y in zip(got, want)) / max(len(got), len(want))


def test_guess_without_call_gets_answer_credit_only(task):
    p = task.make_prompt("5", 7)
    env = LookupEnv(call_weight=0.3)
    env.reset(_row(p))
    out = env.step(p.answer)  # right by luck: no call credit
    assert out.done and out.reward == pytest.approx(0.7)
    # the shaping: any well-formed call, then any answer, beats a wrong guess without a call
    wrong = "9" if p.answer[0] != "9" else "8"
    env.reset(_row(p))
    guess = env.step(wrong).reward
    env.reset(_row(p))
    env.step("?6")
    assert env.step(wrong).reward >= guess + 0.15
    assert task.reward(p, task.tokenizer.encode(p.answer + "<eos>", add_special_tokens=False)) == 1.0


@pytest.mark.parametrize("action", ["?", "?3=", "??", "?lookup"])
def test_malformed_compact_call_is_counted_not_fatal(task, action):
    p = task.make_prompt("3", 5)
    env = LookupEnv()
    env.reset(_row(p))
    out = env.step(action)
    assert out == EnvStep(observation=">?", reward=0.0, done=False, info={"malformed_tool_call": 1.0})
    assert env.step("?3").observation == ">" + p.answer   # the episode goes on


def test_hermes_format_plays_the_same_game(task):
    p = task.make_prompt("42", 99)
    env = LookupEnv(call_format="hermes", call_weight=0.3)
    env.reset(_row(p))
    call = '<tool_call>\n' + json.dumps({"name": "lookup", "arguments": {"key": "42"}}) + '\n</tool_call>'
    out = env.step(call)
    assert out.observation == f"<tool_response>\n{p.answer}\n</tool_response>" and out.info["tool_calls"] == 1
    bad = env.step("<tool_call>{not json</tool_call>")
    assert bad.info["malformed_tool_call"] == 1 and not bad.done
    final = env.step(f"<think>the tool said 1234</think>The value is {p.answer}.")
    assert final.done and final.reward == pytest.approx(1.0)


def test_env_errors_name_the_keys(task):
    with pytest.raises(ValueError, match="call_format"):
        LookupEnv(call_format="xml")
    with pytest.raises(ValueError, match="call_weight"):
        LookupEnv(call_weight=2)
    with pytest.raises(ValueError, match="data.task 'lookup'"):
        LookupEnv().reset({"prompt": "copy:1=", "answer": "1", "extra_info": None})
    assert load_env_class("megatron_rl.envs.lookup:LookupEnv") is LookupEnv


def test_episodes_through_driver_and_pool(task, tok):
    """The real driver and an out-of-process pool with a scripted engine: the right call and answer score 1,
    the environment's reply is the env segment (loss mask 0) ``>VALUE=`` tokenized once."""
    from megatron_rl.envs.pool import EnvPool
    from megatron_rl.rollout.base import Rollout, SamplingParams
    from megatron_rl.rollout.multi_turn import ObservationEncoder, TurnLimits, run_trajectories

    prompts = task.sample(2, random.Random(5))
    eos = tok.eos_token_id

    class Scripted:
        """Turn 1: the right call; turn 2: copy the digits of the observation."""
        eos_token_ids = (eos,)

        def generate(self, prompt_ids, sampling, n=1, seed=None):
            out = []
            for i, ids in enumerate(prompt_ids):
                for j in range(n):
                    text = tok.decode(ids)
                    if "?" not in text:
                        resp = "?" + text[len("lookup:"):text.index("=")]
                    else:
                        resp = text[text.rindex(">") + 1:-1]
                    rid = tok.encode(resp, add_special_tokens=False) + [eos]
                    out.append(Rollout(prompt_index=i, prompt_ids=list(ids), response_ids=rid,
                                       rollout_log_probs=[-0.5] * len(rid), finish_reason="stop",
                                       weight_version="step-0"))
            return out

    pool = EnvPool("megatron_rl.envs.lookup:LookupEnv", {"call_format": "compact"}, workers=1, step_timeout_s=30)
    try:
        trajs = run_trajectories(Scripted(), pool, [p.prompt_ids for p in prompts], [_row(p) for p in prompts], 2,
                                 SamplingParams(max_new_tokens=4, stop_token_ids=(eos,)), TurnLimits(3, 16, 4),
                                 ObservationEncoder(tok, "{observation}="),
                                 lambda ids: response_text(tok, ids)[0], seed=0)  # as MultiTurn.decode
    finally:
        pool.close()
    for b, t in enumerate(trajs):
        p = prompts[b // 2]
        want = f"?{p.extra_info['key']}<eos>>{p.answer}={p.answer}<eos>"
        assert tok.decode(t.response_ids) == want and t.reward == 1.0 and t.finish == "answer"
        n_call = len(p.extra_info["key"]) + 2
        obs = len(p.answer) + 2
        assert t.loss_mask == [1] * n_call + [0] * obs + [1] * (len(p.answer) + 1)
        assert t.counts.get("tool_calls") == 1.0


# a minimal chat template: tool schemas as JSON in <tools>, messages, the assistant header, a template argument
CHAT_TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
                 "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
                 "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}")


def test_chat_prompts_carry_the_tool_schema_and_template_arguments(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from megatron_rl.tasks import DataOptions
    from megatron_rl.tasks.tool_lookup import LOOKUP_TOOL

    raw = Tokenizer(models.WordLevel({"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    chat_tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="<|im_end|>")
    chat_tok.chat_template = CHAT_TEMPLATE
    task = build_task("lookup", chat_tok, task_kwargs={"min_key_digits": 4, "max_key_digits": 4,
                                                       "min_value_digits": 6, "max_value_digits": 8,
                                                       "prompt_format": "chat"})
    task.configure(DataOptions(chat_template_kwargs={"enable_thinking": False}))
    p = task.make_prompt("4711", 3)
    question = ("What is the value stored under key 4711 in the table? The table is different in every "
                "conversation: look it up with the lookup tool, then reply with the value only.")
    assert p.text == (f"<tools>{json.dumps(LOOKUP_TOOL, ensure_ascii=False)}</tools>\n<|im_start|>user\n{question}"
                      "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert p.answer == _value(3, "4711", 6, 8) and p.prompt_ids == chat_tok.encode(p.text, add_special_tokens=False)
    assert LOOKUP_TOOL["function"]["name"] == "lookup" and "key" in LOOKUP_TOOL["function"]["parameters"]["required"]
    with pytest.raises(ValueError, match="prompt_format"):
        build_task("lookup", chat_tok, task_kwargs={"prompt_format": "xml"})
