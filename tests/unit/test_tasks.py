"""Tasks: the char tokenizer, the digit tasks (prompts, answers, rewards vs independent Python references),
JSONL / Parquet prompt files, ``module:function`` rewards and their errors, ``build_task`` and
``build_task_model`` (an HF model the EmbeddedEngine can load).

Run: ``OMP_NUM_THREADS=1 pytest tests/unit/test_tasks.py -q``
"""
from __future__ import annotations

import json
import pathlib
import random
import sys

import pytest

from megatron_rl.tasks import (
    DigitTask,
    FileTask,
    build_char_tokenizer,
    build_task,
    build_task_model,
    load_records,
    load_reward_fn,
)
from megatron_rl.tasks.char_tokenizer import DIGIT_VOCAB as VOCAB  # the digit tasks' tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def ids_of(tok, s, eos=True):
    return tok.encode(s, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])


def test_char_tokenizer_roundtrip_and_save(tok, tmp_path):
    assert tok.encode("copy:123=", add_special_tokens=False) == [VOCAB.index(t) for t in
                                                                   ("copy", ":", "1", "2", "3", "=")]
    assert tok.encode("add:12+3=", add_special_tokens=False)[0] == VOCAB.index("add")
    assert tok.eos_token_id == 1 and tok.pad_token_id == 0 and len(tok) == len(VOCAB)
    assert tok.decode(tok.encode("reverse:907=", add_special_tokens=False)) == "reverse:907="
    build_char_tokenizer(tmp_path)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(str(tmp_path))
    assert again.encode("sort:4401=", add_special_tokens=False) == tok.encode("sort:4401=", add_special_tokens=False)


def test_every_model_id_decodes_to_text_the_reward_scores_wrong(tok, tmp_path):
    """The ids above the digit alphabet (the model's vocabulary padded to 24, from its config) decode to visible
    reserved tokens, also with skip_special_tokens; a sampled one costs reward (it decoded to nothing before:
    "4<id22>0<eos>" scored like "40<eos>")."""
    cfg = json.loads((pathlib.Path(build_task_model(tmp_path / "m", hidden_size=32, num_layers=1))
                      / "config.json").read_text())
    assert cfg["vocab_size"] == len(tok) == 24
    task = DigitTask("copy", tok)
    p = task.make_prompt("40")
    four, zero = tok.convert_tokens_to_ids(["4", "0"])
    assert task.reward(p, [four, zero, tok.eos_token_id]) == 1.0
    for i in range(21, cfg["vocab_size"]):
        text = tok.decode([i], skip_special_tokens=True)
        assert text == f"<r{i}>" and tok.decode([four, i, zero], skip_special_tokens=True) == f"4<r{i}>0"
        # partial credit: 8 positions "4<r2N>0" + EOS against "40" + EOS, only the first right
        assert task.reward(p, [four, i, zero, tok.eos_token_id]) == 1 / 8


@pytest.mark.parametrize("name", ["copy", "reverse", "sort", "add"])
def test_digit_task_prompts_and_answers(tok, name):
    task = DigitTask(name, tok, min_digits=2, max_digits=4)
    prompts = task.sample(50, random.Random(1))
    assert prompts == task.sample(50, random.Random(1))  # deterministic given the rng state
    for p in prompts:
        assert p.text.startswith(f"{name}:") and p.text.endswith("=")
        assert p.prompt_ids == tok.encode(p.text, add_special_tokens=False)
        body = p.text[len(name) + 1:-1]
        if name == "add":
            a, b = body.split("+")
            assert 2 <= len(a) <= 4 and 2 <= len(b) <= 4 and a[0] != "0" and b[0] != "0"
            assert p.answer == str(int(a) + int(b))
        else:
            assert 2 <= len(body) <= 4 and body.isdigit()
            assert p.answer == {"copy": body, "reverse": body[::-1], "sort": "".join(sorted(body))}[name]
    lengths = {len(p.text) for p in prompts}
    assert len(lengths) > 1  # lengths vary in the range


def test_digit_reward_exact_and_partial(tok):
    task = DigitTask("reverse", tok)
    p = task.make_prompt("123")
    assert p.answer == "321"
    r = lambda s, eos=True: task.reward(p, ids_of(tok, s, eos))  # noqa: E731
    assert r("321") == 1.0
    # partial credit: matches against "3 2 1 <eos>" / max(len(target)=4, len(got))
    assert r("321", eos=False) == pytest.approx(3 / 4)
    assert r("32") == pytest.approx(2 / 4)   # "3 2 <eos>" vs "3 2 1 <eos>"
    assert r("391") == pytest.approx(3 / 4)
    assert r("3210") == pytest.approx(3 / 5)
    assert r("") == 0.0
    assert task.reward(p, []) == 0.0
    # tokens after EOS are ignored; special tokens are not skipped (no padding hack)
    assert task.reward(p, ids_of(tok, "321") + ids_of(tok, "99")) == 1.0
    assert task.reward(p, ids_of(tok, "3", eos=False) + [tok.pad_token_id] + ids_of(tok, "21")) < 1.0
    strict = DigitTask("reverse", tok, partial_credit=False)
    assert strict.reward(p, ids_of(tok, "321")) == 1.0 and strict.reward(p, ids_of(tok, "391")) == 0.0
    assert strict.reward(p, ids_of(tok, "321", eos=False)) == 0.0
    for s in ("", "3", "32", "321", "3210", "999", "12"):
        for eos in (True, False):
            assert 0.0 <= r(s, eos) <= 1.0
            assert (r(s, eos) == 1.0) == (s == "321" and eos)


def test_digit_task_memo_gives_what_the_tokenizer_gives(tok, monkeypatch):
    """The task remembers prompt encodings and the reward of each (answer, response) (a step repeats them):
    every prompt and score equals what the tokenizer and ``score_text`` give, also with the memo full and
    refilled."""
    import megatron_rl.tasks.synthetic as synthetic
    from megatron_rl.tasks.base import response_text

    monkeypatch.setattr(synthetic, "MEMO_ENTRIES", 3)
    task = DigitTask("copy", tok, prefix_credit=True)
    rng = random.Random(0)
    prompts = [task.make_prompt(s) for s in ("7", "45", "7", "123", "45", "908")]
    assert [p.prompt_ids for p in prompts] == [tok.encode(p.text, add_special_tokens=False) for p in prompts]
    responses = [ids_of(tok, s, eos=rng.random() < 0.7) for s in ("7", "4", "7", "124", "45", "45", "7", "9")]
    rows = [(p, r) for p in prompts for r in responses] * 2  # every response again, the memo warm
    got = task.score([p for p, _ in rows], [r for _, r in rows]).rewards
    want = []
    for p, r in rows:
        text, terminated = response_text(tok, r, skip_special_tokens=False)
        want.append(synthetic.score_text(text, terminated, p.answer, True, True, True))
    assert got == want
    assert len(task._rewards) <= 3 and len(task._prompt_ids) <= 3


def test_digit_task_with_bpe_tokenizer(tmp_path):
    """The digit tasks work with any tokenizer that encodes the prompt alphabet (here the byte-level BPE)."""
    from megatron_rl.testing.tiny_hf import build_tiny_tokenizer

    bpe = build_tiny_tokenizer(tmp_path)
    task = DigitTask("sort", bpe)
    p = task.make_prompt("312")
    assert task.reward(p, bpe.encode("123", add_special_tokens=False) + [bpe.eos_token_id]) == 1.0


@pytest.mark.parametrize("kwargs,needle", [
    (dict(min_digits=0), "min_digits=0"),
    (dict(min_digits=3, max_digits=2), "min_digits=3 > max_digits=2"),
    (dict(max_digits="3"), "max_digits='3'"),
    (dict(partial_credit="yes"), "partial_credit"),
])
def test_digit_task_bad_kwargs(tok, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        DigitTask("copy", tok, **kwargs)


def test_build_task_errors_name_the_key(tok, tmp_path):
    with pytest.raises(ValueError, match="data.task='mul'"):
        build_task("mul", tok)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['digits'\]"):
        build_task("copy", tok, task_kwargs={"digits": 3})
    with pytest.raises(ValueError, match="needs data.path"):
        build_task("file", tok)
    with pytest.raises(TypeError, match="random.Random"):
        build_task("copy", tok).sample(2, 0)


# ---------------------------------------------------------------- files

def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return path


def test_jsonl_and_parquet_give_same_prompts(tok, tmp_path):
    rows = [{"q": f"copy:{i}{i}=", "a": f"{i}{i}", "extra": i} for i in range(5)]
    j = _write_jsonl(tmp_path / "p.jsonl", rows)
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "p.parquet"))
    tj = build_task("file", tok, path=str(j), prompt_key="q", answer_key="a")
    tp = build_task("file", tok, path=str(tmp_path / "p.parquet"), prompt_key="q", answer_key="a")
    assert [p for p in tj.prompts] == [p for p in tp.prompts]
    assert tj.prompts[3].prompt_ids == tok.encode("copy:33=") and tj.prompts[3].answer == "33"
    assert load_records(j)[2]["extra"] == 2
    # default reward: exact match of the decoded response with the answer
    p = tj.prompts[3]
    assert tj.reward(p, ids_of(tok, "33")) == 1.0 and tj.reward(p, ids_of(tok, "34")) == 0.0
    # sampling: distinct while n <= N, deterministic
    s = tj.sample(5, random.Random(0))
    assert sorted(x.answer for x in s) == sorted(r["a"] for r in rows)
    assert [x.answer for x in tj.sample(12, random.Random(3))] == [x.answer for x in tj.sample(12, random.Random(3))]


def test_token_id_prompts(tok, tmp_path):
    ids = [VOCAB.index(t) for t in ("copy", ":", "1", "=")]
    j = _write_jsonl(tmp_path / "ids.jsonl", [{"prompt": ids, "answer": "1"}])
    t = FileTask(j, tok)
    assert t.prompts[0].prompt_ids == ids and t.prompts[0].text == "copy:1="


@pytest.mark.parametrize("content,needle", [
    ('{"prompt": "x", "answer": 1}\n{"prompt": \n', ":2: not valid JSON"),
    ('[1, 2]\n', ":1: expected a JSON object"),
    ('{"question": "x", "answer": 1}\n', r"no usable rows \(1 malformed: row 0 \(line 1\): no data.prompt_key='prompt'"),
    ('{"prompt": "x"}\n', r"row 0 \(line 1\): no ground truth: neither reward_model.ground_truth nor "
                          "data.answer_key='answer'"),
    ('{"prompt": "", "answer": 1}\n', r"row 0 \(line 1\): 'prompt' is empty"),
    ('{"prompt": [1, 999], "answer": 1}\n', f"token ids < {len(VOCAB)}"),
    ('\n', "has no records"),
])
def test_bad_files(tok, tmp_path, content, needle):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(ValueError, match=needle):
        FileTask(f, tok)


def test_missing_file_and_extension(tok, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_records(tmp_path / "none.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported extension '.csv'"):
        load_records(tmp_path / "x.csv")


def test_parquet_without_pyarrow_names_the_package(tmp_path, monkeypatch):
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError, match="needs the 'pyarrow' package"):
        load_records(tmp_path / "x.parquet")


# ---------------------------------------------------------------- module:function rewards

REWARD_MODULE = '''
def length_match(prompt_text, response_text, answer):
    return 1.0 if len(response_text) == len(str(answer)) else 0.25

def returns_str(prompt_text, response_text, answer):
    return "1.0"

def returns_nan(prompt_text, response_text, answer):
    return float("nan")

def raises(prompt_text, response_text, answer):
    raise KeyError("boom")

NOT_CALLABLE = 3
'''


@pytest.fixture()
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards_mod", None)
    return tmp_path / "my_rewards_mod.py"


def test_reward_fn_override_on_builtin_and_file_tasks(tok, tmp_path, reward_module):
    task = build_task("copy", tok, reward_fn="my_rewards_mod:length_match")
    p = task.sample(1, random.Random(0))[0]
    wrong_same_len = "9" * len(p.answer)
    assert task.reward(p, ids_of(tok, wrong_same_len)) == 1.0
    assert task.reward(p, ids_of(tok, wrong_same_len + "9")) == 0.25
    j = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "copy:12=", "answer": "12"}])
    ft = build_task("file", tok, path=str(j), reward_fn=f"{reward_module}:length_match")
    assert ft.reward(ft.prompts[0], ids_of(tok, "77")) == 1.0


@pytest.mark.parametrize("spec,needle", [
    ("no_colon", "must be a string 'module:function'"),
    ("my_rewards_mod:", "both parts non-empty"),
    ("not_a_module_xyz:f", "module 'not_a_module_xyz' not found"),
    ("my_rewards_mod:nope", "has no attribute 'nope'"),
    ("my_rewards_mod:NOT_CALLABLE", "not callable"),
    ("/nonexistent/file.py:f", "does not exist"),
])
def test_reward_fn_load_errors_name_the_spec(reward_module, spec, needle):
    with pytest.raises(ValueError, match=needle) as ei:
        load_reward_fn(spec)
    assert repr(spec) in str(ei.value)


@pytest.mark.parametrize("fn,needle", [
    ("returns_str", "returned str '1.0'; it must return a float"),
    ("returns_nan", "non-finite"),
    ("raises", "raised KeyError"),
])
def test_reward_fn_call_errors_name_the_spec(reward_module, fn, needle):
    f = load_reward_fn(f"my_rewards_mod:{fn}")
    with pytest.raises(ValueError, match=needle) as ei:
        f("p", "r", "a")
    assert f"my_rewards_mod:{fn}" in str(ei.value)


# ---------------------------------------------------------------- the task model

def test_build_task_model_loads_in_engine(tmp_path):
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.embedded import EmbeddedEngine

    d = build_task_model(tmp_path / "m", task="copy", seed=3, hidden_size=32, num_layers=1)
    d2 = build_task_model(tmp_path / "m2", task="copy", seed=3, hidden_size=32, num_layers=1)
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == (tmp_path / "m2" / "model.safetensors").read_bytes()
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["vocab_size"] == -(-len(VOCAB) // 8) * 8 and cfg["hidden_size"] == 32 and cfg["num_hidden_layers"] == 1
    assert cfg["eos_token_id"] == 1 and cfg["pad_token_id"] == 0
    eng = EmbeddedEngine(d, dtype="bfloat16")
    task = build_task("copy", build_char_tokenizer())
    prompts = task.sample(3, random.Random(0))
    rollouts = eng.generate([p.prompt_ids for p in prompts], SamplingParams(max_new_tokens=4), n=2)
    rewards = task.rewards([prompts[r.prompt_index] for r in rollouts], [r.response_ids for r in rollouts])
    assert len(rewards) == 6 and all(0.0 <= x <= 1.0 for x in rewards)
    # ensure_task_model: builds when missing, never overwrites
    from megatron_rl.tasks import ensure_task_model

    before = (tmp_path / "m" / "model.safetensors").read_bytes()
    assert ensure_task_model(tmp_path / "m", seed=99) == str(tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == before
    d3 = ensure_task_model(tmp_path / "m3", task="copy", seed=3, hidden_size=32, num_layers=1)
    assert (tmp_path / "m3" / "model.safetensors").read_bytes() == before and d3 == str(tmp_path / "m3")
    with pytest.raises(ValueError, match="hidden_size=30 must be divisible"):
        build_task_model(tmp_path / "bad", hidden_size=30)
    with pytest.raises(ValueError, match="task='mul'"):
        build_task_model(tmp_path / "bad", task="mul")


def test_saved_task_tokenizer_reloads_as_itself(tmp_path):
    """``AutoTokenizer`` turns the task model's word-level tokenizer (saved beside a Qwen2 config) into a BPE
    Qwen2Tokenizer that drops the task word; the project's one loader must give back the tokenizer that was
    saved, token for token (reference: the in-memory tokenizer before saving)."""
    from megatron_rl.tasks.char_tokenizer import build_char_tokenizer, build_task_model
    from megatron_rl.tokenizer import load_tokenizer

    model = build_task_model(str(tmp_path / "m"), task="copy", seed=0, hidden_size=32, num_layers=1)
    ref = build_char_tokenizer()
    tok = load_tokenizer(model)
    for text in ("copy:999=", "reverse:12=", "add:3+4=", "sort:31="):
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text
    assert tok.decode(tok.encode("copy:42=", add_special_tokens=False)) == "copy:42="
    assert (tok.eos_token_id, tok.pad_token_id) == (ref.eos_token_id, ref.pad_token_id)
