"""A task model directory (``python -m megatron_rl.tasks DIR``) and a trained model exported from it load
correctly the standard way, ``AutoTokenizer`` + ``AutoModelForCausalLM`` (issue 20, item 8: AutoTokenizer gave
a Qwen2Tokenizer that dropped the task word, so a trained model looked untrained).

* ``AutoTokenizer`` encodes 400 random strings over the vocabulary and decodes 400 random id sequences exactly
  as the project's tokenizer (``build_char_tokenizer``, built in memory) does;
* a model trained on copy (a few hundred teacher-forced steps: the test needs a model that earns reward),
  exported with the exporter's writer (weights + the source directory's config / tokenizer files), loaded with
  ``AutoTokenizer`` + ``AutoModelForCausalLM`` and decoded greedily with ``generate`` on text prompts, gets
  per prompt the same greedy response and reward as the training-side evaluation (embedded engine on the
  task's prompt ids, ``task.reward``) — and that reward is clearly above zero;
* every id of the model's (padded) vocabulary, read from its ``config.json``, decodes with ``AutoTokenizer`` to
  the project tokenizer's text, visible (non-empty) for all but the special tokens also with
  ``skip_special_tokens`` — the copy model's ids 21-23 are its reserved tokens (issue 23);
* a task model directory built before either fix (tokenizer without added tokens; a 21-entry vocabulary
  without the reserved tokens) is repaired by ``ensure_task_model``, its weights untouched.
"""
import json
import os
import random
import subprocess
import sys

import pytest
import torch

from megatron_rl.convert.storage import write_hf_model_dir
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.tasks import DigitTask, build_char_tokenizer, ensure_task_model
from megatron_rl.tasks.char_tokenizer import RESERVED, SPECIAL, VOCAB, task_vocabulary
from megatron_rl.tasks.synthetic import score_text

pytestmark = pytest.mark.timeout(600)


def _cli_model(tmp_path_factory, task):
    out = str(tmp_path_factory.mktemp(f"cli_{task}") / "model")
    subprocess.run([sys.executable, "-m", "megatron_rl.tasks", out, "--task", task, "--hidden-size", "64",
                    "--num-layers", "2"], check=True, capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def cli_dir(tmp_path_factory):
    """A copy task model built by the command line, as a user builds it."""
    return _cli_model(tmp_path_factory, "copy")


def _random_strings(n, seed, vocab):
    rng = random.Random(seed)
    return ["".join(rng.choice(vocab) for _ in range(rng.randint(1, 12))) for _ in range(n)]


def _assert_auto_matches_project(model_dir, task="copy"):
    """Every string over ``task``'s vocabulary (the only strings its prompts and responses hold: characters
    outside it are ``<unk>`` here and dropped by a BPE loader, as the tokenizer's docstring says)."""
    from transformers import AutoTokenizer

    vocab = task_vocabulary(task)
    auto = AutoTokenizer.from_pretrained(model_dir)
    ref = build_char_tokenizer(task=task)
    examples = ["copy:12=", "reverse:3 45=", "add:12+345=", "sort:3141=31<eos>"]
    if task == "lookup":
        examples += ["lookup:12=?7>3<eos>", "lookup:5=?5>9<eos>9<eos>"]
    for s in _random_strings(400, 0, vocab) + examples:
        assert auto.encode(s, add_special_tokens=False) == ref.encode(s, add_special_tokens=False), \
            (s, type(auto).__name__)
    rng = random.Random(1)
    for _ in range(400):
        ids = [rng.randrange(len(vocab)) for _ in range(rng.randint(1, 10))]
        assert auto.decode(ids) == ref.decode(ids), ids
    assert (auto.eos_token_id, auto.pad_token_id) == (VOCAB.index("<eos>"), VOCAB.index("<pad>"))
    with open(os.path.join(model_dir, "config.json")) as fh:
        model_vocab = json.load(fh)["vocab_size"]
    for i in range(model_vocab):   # every id the model can emit
        assert auto.decode([i]) == ref.decode([i]) != "", i
        if i >= len(SPECIAL):
            assert auto.decode([i], skip_special_tokens=True) == ref.decode([i], skip_special_tokens=True) \
                == auto.decode([i]), i


def test_autotokenizer_of_a_cli_built_task_model_encodes_like_the_project(cli_dir):
    _assert_auto_matches_project(cli_dir)


def test_autotokenizer_of_a_cli_built_lookup_model_encodes_like_the_project(tmp_path_factory):
    """The tool task's model (its own tokens ``lookup`` ``?`` ``>``)."""
    _assert_auto_matches_project(_cli_model(tmp_path_factory, "lookup"), task="lookup")


def _old_copy(cli_dir, tmp_path, edit):
    """A copy of the task model directory whose tokenizer.json ``edit(tokenizer_json)`` turns into an older one."""
    old = str(tmp_path / "old")
    subprocess.run(["cp", "-r", cli_dir, old], check=True)
    path = os.path.join(old, "tokenizer.json")
    with open(path) as fh:
        tj = json.load(fh)
    edit(tj)
    with open(path, "w") as fh:
        json.dump(tj, fh)
    return old


def test_old_task_model_directory_is_repaired_by_ensure_task_model(cli_dir, tmp_path):
    def before_added_words(tj):  # as built before the fix
        tj["added_tokens"] = [t for t in tj["added_tokens"] if t["content"] in SPECIAL]

    old = _old_copy(cli_dir, tmp_path, before_added_words)
    weights = open(os.path.join(old, "model.safetensors"), "rb").read()
    assert ensure_task_model(old) == old
    assert open(os.path.join(old, "model.safetensors"), "rb").read() == weights   # the model is never rebuilt
    _assert_auto_matches_project(old)


def test_task_model_directory_without_reserved_tokens_is_repaired(cli_dir, tmp_path):
    """A copy model built when ids 21-23 had no tokens (decoded to nothing) gets the reserved tokens."""
    def before_reserved(tj):
        tj["model"]["vocab"] = {t: i for t, i in tj["model"]["vocab"].items() if t not in RESERVED}
        tj["added_tokens"] = [t for t in tj["added_tokens"] if t["content"] not in RESERVED]

    old = _old_copy(cli_dir, tmp_path, before_reserved)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(old).decode([21, 22, 23]) == ""   # the old directory, as built before
    weights = open(os.path.join(old, "model.safetensors"), "rb").read()
    assert ensure_task_model(old) == old
    assert open(os.path.join(old, "model.safetensors"), "rb").read() == weights
    assert AutoTokenizer.from_pretrained(old).decode([21, 22, 23]) == "<r21><r22><r23>"
    _assert_auto_matches_project(old)


def _sft_copy(model_dir, steps=300, seed=0):
    """A model that solves some copy prompts: teacher-forced training on "copy:<digits>=<digits><eos>"."""
    from transformers import AutoModelForCausalLM

    tok = build_char_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    eos = tok.eos_token_id
    for _ in range(steps):
        rows = []
        for _ in range(64):
            d = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 2)))
            p = tok.encode(f"copy:{d}=", add_special_tokens=False)
            rows.append((p, tok.encode(d, add_special_tokens=False) + [eos]))
        L = max(len(p) + len(r) for p, r in rows)
        ids = torch.full((len(rows), L), tok.pad_token_id)
        labels = torch.full((len(rows), L), -100)
        for b, (p, r) in enumerate(rows):
            ids[b, :len(p) + len(r)] = torch.tensor(p + r)
            labels[b, len(p):len(p) + len(r)] = torch.tensor(r)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_exported_trained_model_loaded_the_standard_way_gets_the_training_reward(cli_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = str(tmp_path / "export")
    write_hf_model_dir(export, _sft_copy(cli_dir), assets_dir=cli_dir)
    prompts_digits = [str(a) for a in range(10)] + [f"{a}{b}" for a in range(10) for b in range(0, 10, 3)]

    # training side: the project's tokenizer and the embedded engine (greedy), task.reward
    task = DigitTask("copy", build_char_tokenizer())
    prompts = [task.make_prompt(d) for d in prompts_digits]
    engine = EmbeddedEngine(export, dtype="float32", weight_version="trained")
    outs = engine.generate([p.prompt_ids for p in prompts], SamplingParams(temperature=0.0, max_new_tokens=4))
    train_rewards = [task.reward(p, o.response_ids) for p, o in zip(prompts, outs)]
    assert sum(r == 1.0 for r in train_rewards) >= 10, f"the model did not learn copy: {train_rewards}"

    # the standard way: text in, text out, nothing of the project
    tok = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    std_rewards = []
    for p, o in zip(prompts, outs):
        enc = tok(p.text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(**enc, do_sample=False, max_new_tokens=4, pad_token_id=tok.pad_token_id)
        resp = gen[0, enc["input_ids"].shape[1]:].tolist()
        assert resp == list(o.response_ids), (p.text, resp, o.response_ids)
        cut = resp.index(tok.eos_token_id) if tok.eos_token_id in resp else len(resp)
        std_rewards.append(score_text(tok.decode(resp[:cut]), cut < len(resp), p.answer, task.partial_credit))
    assert std_rewards == train_rewards
