"""verl-format datasets: a Parquet file written like verl's GSM8K preprocessing (same columns and nesting,
built here) and its JSONL twin read as the same prompts; chat prompts equal to HF ``apply_chat_template``'s
ids with a real tokenizer built offline (template written in this test), options such as enable_thinking
passed through, plain strings left plain; malformed rows counted and reported with row numbers;
max_prompt_length filter / truncate; the committed sample dataset; ``megatron-rl data inspect``.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_data_verl_format.py -q``
"""
from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys

import pytest

from megatron_rl.tasks import DataOptions, FileTask, build_task

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A Qwen3-like ChatML template, written here independently of megatron_rl.tasks.chat_model.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
GSM8K = [
    ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
     "How many clips did Natalia sell altogether in April and May?",
     "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether "
     "in April and May.\n#### 72", "72"),
    ("Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
     "How much did she earn?", "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she "
     "earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10", "10"),
    ("Betty is saving money for a new wallet which costs $100. How much more money does she need?",
     "... \n#### 5", "5"),
]


def verl_gsm8k_rows(split="train"):
    """Rows exactly as verl's examples/data_preprocess/gsm8k.py make them (its process_fn)."""
    rows = []
    for idx, (question_raw, answer_raw, solution) in enumerate(GSM8K):
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question_raw + " " + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": solution},
            "extra_info": {"split": split, "index": idx, "answer": answer_raw, "question": question_raw},
        })
    return rows


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from megatron_rl.testing.tiny_hf import build_tiny_tokenizer

    d = tmp_path_factory.mktemp("tok")
    tok = build_tiny_tokenizer(d)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(d))
    return AutoTokenizer.from_pretrained(str(d))


def hf_chat_ids(tok, messages, **kw):
    """HF's own tokenization of the chat template (the reference)."""
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


def write_parquet(rows, path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return path


def write_jsonl(rows, path):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_verl_gsm8k_parquet_and_jsonl(chat_tok, tmp_path):
    rows = verl_gsm8k_rows()
    pq_path = write_parquet(rows, tmp_path / "train.parquet")
    import pyarrow.parquet as pq

    import pyarrow as pa

    schema = pq.read_schema(str(pq_path))   # the nesting verl's parquet has: list<struct>, struct, struct
    prompt_t = schema.field("prompt").type
    assert pa.types.is_list(prompt_t) and pa.types.is_struct(prompt_t.value_type)
    assert {f.name for f in prompt_t.value_type} == {"role", "content"}
    assert {f.name for f in schema.field("reward_model").type} == {"style", "ground_truth"}
    assert {f.name for f in schema.field("extra_info").type} == {"split", "index", "answer", "question"}
    tp = FileTask(pq_path, chat_tok, reward_fn=None, options=DataOptions(reward_workers=0))
    tj = FileTask(write_jsonl(rows, tmp_path / "train.jsonl"), chat_tok, options=DataOptions(reward_workers=0))
    assert tp.prompts == tj.prompts and len(tp) == 3 and tp.malformed == []
    for prompt, row in zip(tp.prompts, rows):
        assert prompt.prompt_ids == hf_chat_ids(chat_tok, row["prompt"])
        assert prompt.text == chat_tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        assert prompt.answer == row["reward_model"]["ground_truth"]
        assert prompt.data_source == "openai/gsm8k" and prompt.extra_info == row["extra_info"]
        assert tp.spec_for(prompt) == "source"            # verl's dispatch: openai/gsm8k -> verl's gsm8k rule
    # the data_source dispatch scores GSM8K answers with verl's gsm8k rule: the last "#### <number>" compared with
    # the ground truth as a string ("10.00" is not "10" there; tests/unit/test_verl_scores.py checks verl's own)
    enc = lambda s: chat_tok.encode(s, add_special_tokens=False) + [chat_tok.eos_token_id]  # noqa: E731
    res = tp.score(tp.prompts, [enc("48 + 24 = 72\n#### 72"), enc("#### 10.00"), enc("#### 6")])
    assert res.rewards == [1.0, 0.0, 0.0] and res.failed == 0


def test_chat_template_kwargs_reach_the_template(chat_tok, tmp_path):
    path = write_jsonl(verl_gsm8k_rows(), tmp_path / "t.jsonl")
    on = FileTask(path, chat_tok, options=DataOptions(reward_workers=0))
    off = FileTask(path, chat_tok, options=DataOptions(reward_workers=0, chat_template_kwargs={"enable_thinking": False}))
    msgs = verl_gsm8k_rows()[0]["prompt"]
    assert off.prompts[0].prompt_ids == hf_chat_ids(chat_tok, msgs, enable_thinking=False)
    assert off.prompts[0].text.endswith("<think>\n\n</think>\n\n") and not on.prompts[0].text.endswith("</think>\n\n")
    # configure() re-renders only when the options change
    on.configure(DataOptions(reward_workers=0, chat_template_kwargs={"enable_thinking": False}))
    assert on.prompts == off.prompts


def test_plain_strings_stay_plain(chat_tok, tmp_path):
    path = write_jsonl([{"prompt": "add:12+30=", "answer": "42"}], tmp_path / "plain.jsonl")
    t = FileTask(path, chat_tok, options=DataOptions(reward_workers=0))
    assert t.prompts[0].prompt_ids == chat_tok.encode("add:12+30=", add_special_tokens=True)
    assert "<|im_start|>" not in t.prompts[0].text and t.spec_for(t.prompts[0]) == "exact"


def test_malformed_rows_are_counted_and_reported(chat_tok, tmp_path):
    good = verl_gsm8k_rows()
    bad = [
        dict(good[0], reward_model={"style": "rule"}),                      # missing ground truth
        dict(good[0], reward_model={"style": "rule", "ground_truth": ""}),  # empty ground truth
        dict(good[0], prompt=[]),                                           # empty prompt
        dict(good[0], prompt=[{"role": "user", "content": "  "}]),          # empty content
        dict(good[0], prompt=42),                                           # wrong type
        dict(good[0], prompt=[{"role": "user"}]),                           # message without content
        dict(good[0], reward_model="72"),                                   # wrong type
        dict(good[0], data_source=7),                                       # wrong type
        {"question": "no prompt at all", "answer": "1"},                    # missing prompt
    ]
    rows = [good[0], bad[0], good[1], *bad[1:], good[2]]
    bad_rows = [1] + list(range(3, 3 + len(bad) - 1))
    report = io.StringIO()
    t = FileTask(write_jsonl(rows, tmp_path / "mixed.jsonl"), chat_tok, options=DataOptions(reward_workers=0),
                 report=report)
    assert len(t) == 3 and [p.answer for p in t.prompts] == ["72", "10", "5"]
    assert [label for label, _ in t.malformed] == [f"row {i} (line {i + 1})" for i in bad_rows]
    assert t.stats()["data/malformed_rows"] == len(bad) and t.stats()["data/rows"] == 3
    text = report.getvalue()
    assert f"skipped {len(bad)} malformed row(s) of {len(rows)}" in text
    for i in bad_rows:
        assert f"row {i} (line {i + 1}):" in text
    reasons = dict(t.malformed)
    assert "no ground_truth" in reasons["row 1 (line 2)"] and "'prompt' is empty" in reasons["row 4 (line 5)"]
    assert "must be a non-empty string" in reasons["row 6 (line 7)"]
    assert "'data_source' must be a string" in reasons["row 9 (line 10)"]
    assert "no data.prompt_key='prompt'" in reasons["row 10 (line 11)"]
    # the same rows in Parquet (row numbers without line numbers); the step still samples and scores
    pq_rows = [r for r in rows if not isinstance(r.get("prompt"), int) and not isinstance(r.get("reward_model"), str)
               and not isinstance(r.get("data_source"), int) and "question" not in r]
    tp = FileTask(write_parquet(pq_rows, tmp_path / "mixed.parquet"), chat_tok, options=DataOptions(reward_workers=0),
                  report=None)
    assert len(tp) == 3 and all(label.startswith("row ") and "line" not in label for label, _ in tp.malformed)
    assert len(tp.prompts) == 3 and len(tp.sample(5, random.Random(0))) == 5


def test_config_errors_name_file_row_and_key(chat_tok, tmp_path):
    from megatron_rl.tasks.char_tokenizer import build_char_tokenizer

    rows = verl_gsm8k_rows()
    p = write_jsonl(rows, tmp_path / "g.jsonl")
    with pytest.raises(ValueError, match=r"row 0 \(line 1\): the prompt is a list of chat messages but the "
                                         r"tokenizer \(actor.load_hf\) has no chat_template. Use the tokenizer "
                                         r".*python -m megatron_rl.tasks.chat_model DIR"):
        FileTask(p, build_char_tokenizer())
    unknown = write_jsonl([dict(rows[0], data_source="my/private_set")], tmp_path / "u.jsonl")
    with pytest.raises(ValueError, match="data_source='my/private_set' has no built-in reward; set data.reward_fn"):
        FileTask(unknown, chat_tok)
    assert len(FileTask(unknown, chat_tok, reward_fn="math")) == 1
    with pytest.raises(ValueError, match="no usable rows"):
        FileTask(write_jsonl([{"prompt": ""}], tmp_path / "e.jsonl"), chat_tok, report=None)
    with pytest.raises(ValueError, match="data.reward_fn='mathh' must be one of"):
        build_task("file", chat_tok, path=str(p), reward_fn="mathh")


def test_max_prompt_length_filter_and_truncate(chat_tok, tmp_path):
    rows = verl_gsm8k_rows()
    lengths = [len(hf_chat_ids(chat_tok, r["prompt"])) for r in rows]
    limit = sorted(lengths)[1]                     # the middle length: longer prompts exceed it
    over = sum(n > limit for n in lengths)
    assert over >= 1
    path = write_jsonl(rows, tmp_path / "t.jsonl")
    f = FileTask(path, chat_tok, options=DataOptions(reward_workers=0, max_prompt_length=limit))
    assert len(f) == len(rows) - over and f.stats()["data/prompts_filtered"] == over
    assert all(len(p.prompt_ids) <= limit for p in f.prompts)
    t = FileTask(path, chat_tok, options=DataOptions(reward_workers=0, max_prompt_length=limit,
                                                     overlong_prompts="truncate"))
    assert len(t) == len(rows) and t.stats()["data/prompts_truncated"] == over
    for p, r in zip(t.prompts, rows):
        assert p.prompt_ids == hf_chat_ids(chat_tok, r["prompt"])[-limit:]
    with pytest.raises(ValueError, match="no prompt left after data.max_prompt_length=1"):
        FileTask(path, chat_tok, options=DataOptions(max_prompt_length=1))


def test_sample_dataset_is_the_generators_output_and_scores(tmp_path):
    gen = os.path.join(ROOT, "examples", "math_tiny", "make_dataset.py")
    out = tmp_path / "again.jsonl"
    subprocess.run([sys.executable, gen, "--out", str(out)], check=True, capture_output=True, timeout=120)
    committed = os.path.join(ROOT, "examples", "math_tiny", "train.jsonl")
    assert out.read_bytes() == open(committed, "rb").read()
    rows = [json.loads(line) for line in open(committed)]
    assert 200 <= len(rows) <= 400
    assert {tuple(sorted(r)) for r in rows} == {("ability", "data_source", "extra_info", "prompt", "reward_model")}
    assert any("/" in r["reward_model"]["ground_truth"] for r in rows)   # some fraction answers
    mv = pytest.importorskip("math_verify")
    for r in rows[:40]:   # each worked solution's "#### x" is its ground truth, by math-verify itself
        final = r["extra_info"]["answer"].rsplit("####", 1)[1].strip()
        assert mv.verify(mv.parse(f"${r['reward_model']['ground_truth']}$"), mv.parse(f"${final}$"))


def test_data_inspect_cli(chat_tok, tmp_path):
    rows = verl_gsm8k_rows()
    path = write_jsonl(rows + [{"prompt": [], "reward_model": {"ground_truth": "1"}}], tmp_path / "g.jsonl")
    tok_dir = tmp_path / "tok"
    chat_tok.save_pretrained(str(tok_dir))
    r = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "data", "inspect", str(path), "--tokenizer",
                        str(tok_dir), "-n", "2", "--chat-template-kwargs", '{"enable_thinking": false}'],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "3 prompt(s); 1 malformed row(s)" in out and "malformed row 3 (line 4): 'prompt' is empty" in out
    for row in rows[:2]:
        rendered = chat_tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True,
                                                enable_thinking=False)
        assert rendered in out and f'--- ground truth: "{row["reward_model"]["ground_truth"]}"' in out
    assert rows[2]["extra_info"]["question"] not in out        # -n 2
    assert "reward: verl:gsm8k (by data_source)" in out
    bad = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "data", "inspect", str(tmp_path / "none.jsonl"),
                          "--tokenizer", str(tok_dir)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "does not exist" in bad.stderr
