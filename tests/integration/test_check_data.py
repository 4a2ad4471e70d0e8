"""``megatron-rl check`` reads the data and the model as training will:

* a data file with no usable row (a ``question`` column where ``prompt`` is expected) is a check error, and
  training fails on it before any process group or model exists;
* the planned prompt length is the longest prompt rendered with ``data.chat_template_kwargs`` -- compared with
  the tokenizer's own ``apply_chat_template`` (transformers);
* a tiny model's parameters are printed in a readable unit and its weight-sync host memory is sized from its
  own tensors (a bucket holds at most the model), compared with the HF checkpoint's parameters;
* an unbuilt ``actor.load_hf`` prints the command that builds it -- and running that command makes check pass.

    pytest tests/integration/test_check_data.py
"""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from megatron_rl.testing.cli import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
Q7 = os.path.join(ROOT, "configs", "qwen2.5_7b_1x8.yaml")
MATH = os.path.join(ROOT, "configs", "math_tiny_cpu.yaml")
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
MATH_DATA = os.path.join(ROOT, "examples", "math_tiny", "train.jsonl")


def _cli(*args, cwd=ROOT):
    """``megatron-rl check ARGS`` in this process (tests/integration/test_check_cli.py starts the console script)."""
    return run_cli("check", *args, cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.fixture(scope="module")
def question_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "questions.jsonl"
    with open(path, "w") as fh:
        for i in range(6):
            fh.write(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from megatron_rl.tasks.chat_model import build_chat_model

    return build_chat_model(str(tmp_path_factory.mktemp("chat") / "m"), seed=0)


def test_check_fails_on_a_data_file_without_usable_rows(question_file):
    r = _cli(Q7, f"data.path={question_file}")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "config OK" not in r.stdout
    assert "data.path:" in r.stderr and "no usable rows (6 malformed" in r.stderr, r.stderr
    assert "no data.prompt_key='prompt'" in r.stderr and "question" in r.stderr, r.stderr


def test_training_fails_on_it_before_building_the_model(question_file, chat_model):
    import torch.distributed as dist

    from megatron_rl.plan import load_job_config
    from megatron_rl.trainer.loop import train

    cfg = load_job_config(MATH, [f"data.path={question_file}", f"actor.load_hf={chat_model}"], world_size=1)
    with pytest.raises(ValueError, match=r"no usable rows \(6 malformed"):
        train(cfg)
    assert not dist.is_initialized()  # failed before the process groups (and so before the actor) existed


def test_planned_prompt_length_uses_chat_template_kwargs(chat_model):
    from transformers import PreTrainedTokenizerFast

    # transformers' fast tokenizer over the directory's tokenizer.json (AutoTokenizer would swap in
    # Qwen2Tokenizer's digit-splitting pre-tokenizer for model_type qwen2 -- not what the directory holds)
    tok = PreTrainedTokenizerFast.from_pretrained(chat_model)
    longest = {}
    for kwargs in ({"enable_thinking": False}, {}):
        n = 0
        with open(MATH_DATA) as fh:
            for line in fh:
                msgs = json.loads(line)["prompt"]
                text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
                n = max(n, len(tok.encode(text, add_special_tokens=False)))
        longest[bool(kwargs)] = n
    assert longest[True] != longest[False]  # the template argument matters for this tokenizer
    r = _cli(MATH, f"actor.load_hf={chat_model}")
    assert r.returncode == 0, r.stderr
    m = re.search(r"prompt (\d+) tokens \(longest prompt of", r.stdout)
    assert m and int(m.group(1)) == longest[True], (r.stdout[-1500:], longest)


def test_tiny_model_counts_and_sync_memory(task_model):
    import torch
    from transformers import AutoModelForCausalLM

    path = task_model(task="copy", seed=0, hidden_size=64, num_layers=2)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    n = sum(p.numel() for p in hf.parameters())
    r = _cli(TINY, f"actor.load_hf={path}")
    assert r.returncode == 0, r.stderr
    assert "0.00 B parameters" not in r.stdout
    m = re.search(r"model: ([\d.]+) K parameters", r.stdout)
    assert m and abs(float(m.group(1)) * 1e3 - n) <= 0.05e3 + 1e-3 * n, (r.stdout, n)
    # bf16 engine, PP=2: rank 0 holds at most two buckets, each no larger than the model, + the embedding
    model_bytes = 2 * n
    emb_bytes = 2 * hf.get_input_embeddings().weight.numel()
    m = re.search(r"rank 0 \+([\d.]+) MiB host", r.stdout)
    assert m, r.stdout
    assert abs(float(m.group(1)) * 2**20 - (2 * model_bytes + emb_bytes)) <= 0.01 * 2**20, (r.stdout, n)
    assert "GiB host" not in r.stdout


def test_unbuilt_load_hf_names_the_command_that_builds_it(tmp_path):
    target = str(tmp_path / "init_model")
    r = _cli(TINY, f"actor.load_hf={target}")
    assert r.returncode == 2
    m = re.search(r"^hint: build actor\.load_hf first: (python -m \S+ .*)$", r.stderr, flags=re.M)
    assert m, r.stderr
    cmd = shlex.split(m.group(1))
    assert target in cmd
    built = subprocess.run([sys.executable] + cmd[1:], cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert built.returncode == 0, built.stderr
    r = _cli(TINY, f"actor.load_hf={target}")
    assert r.returncode == 0 and "config OK" in r.stdout, r.stderr


def test_the_shipped_math_config_hint_is_its_own_build_command(tmp_path):
    r = _cli(MATH, "actor.load_hf=runs/no_such_dir/init_model")  # not in the file's comments: no guess
    assert "hint: build actor.load_hf" not in r.stderr
    r = _cli(MATH)  # the file's comment names the builder of its own load_hf
    if os.path.isdir(os.path.join(ROOT, "runs", "math_tiny_cpu", "init_model")):
        pytest.skip("runs/math_tiny_cpu/init_model exists in this checkout")
    assert "hint: build actor.load_hf first: python -m megatron_rl.tasks.chat_model runs/math_tiny_cpu/init_model" \
        in r.stderr, r.stderr
