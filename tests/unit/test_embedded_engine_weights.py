"""EmbeddedEngine: weight sync (directory and in-process state dict), versions, EOS / stop handling, the
all-or-nothing contract and bad input. References: engines / HF models freshly loaded from the other
checkpoint; greedy outputs of a model whose EOS id is set to a token it is known to emit.

Run: ``OMP_NUM_THREADS=1 pytest tests/unit/test_embedded_engine_weights.py -q``
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.rollout.base import RolloutError, SamplingParams, WeightSyncError
from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.testing.tiny_hf import build_tiny_hf_model

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [40]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("embw")
    return {
        "a": build_tiny_hf_model(root / "a", arch="qwen2", seed=0),
        "b": build_tiny_hf_model(root / "b", arch="qwen2", seed=1),
        "tied": build_tiny_hf_model(root / "tied", arch="llama", seed=2, tie_word_embeddings=True),
        "tied_b": build_tiny_hf_model(root / "tied_b", arch="llama", seed=3, tie_word_embeddings=True),
    }


def _outputs(rollouts):
    return [(r.response_ids, r.rollout_log_probs) for r in rollouts]


def test_update_weights_from_dir_changes_outputs_and_version(dirs):
    eng = EmbeddedEngine(dirs["a"], dtype="bfloat16", weight_version="v0")
    before = eng.generate(PROMPTS, GREEDY)
    assert {r.weight_version for r in before} == {"v0"} and eng.weight_version == "v0"
    eng.update_weights(dirs["b"], version="v1")
    after = eng.generate(PROMPTS, GREEDY)
    fresh_b = EmbeddedEngine(dirs["b"], dtype="bfloat16").generate(PROMPTS, GREEDY)
    assert {r.weight_version for r in after} == {"v1"} and eng.weight_version == "v1"
    assert _outputs(after) == _outputs(fresh_b)
    assert [r.response_ids for r in after] != [r.response_ids for r in before]


@pytest.mark.parametrize("which", ["a", "tied"])
def test_update_weights_from_state_dict_fp32_actor(dirs, which):
    """The RL loop's path: an fp32 HF-named state dict of the actor (cast to the engine dtype)."""
    other = {"a": "b", "tied": "tied_b"}[which]
    from transformers import AutoModelForCausalLM

    actor = AutoModelForCausalLM.from_pretrained(dirs[other], dtype=torch.float32)
    sd = actor.state_dict()
    if which == "tied":  # tied checkpoints may omit lm_head.weight
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    eng = EmbeddedEngine(dirs[which], dtype="bfloat16")
    eng.update_weights_from_state_dict(sd, version="7")
    got = eng.generate(PROMPTS, GREEDY)
    want = EmbeddedEngine(dirs[other], dtype="bfloat16").generate(PROMPTS, GREEDY)
    assert _outputs(got) == _outputs(want)
    assert {r.weight_version for r in got} == {"7"}


@pytest.mark.parametrize("corrupt,needle", [
    ("drop", r"1 missing tensor\(s\)"),
    ("extra", r"1 unexpected tensor\(s\)"),
    ("shape", r"1 shape mismatch\(es\)"),
    ("type", "not a tensor"),
])
def test_bad_state_dict_leaves_weights_and_version(dirs, corrupt, needle):
    eng = EmbeddedEngine(dirs["a"], dtype="float32", weight_version="v0")
    before = eng.generate(PROMPTS, GREEDY)
    sd = load_file(os.path.join(dirs["b"], "model.safetensors"))
    key = "model.layers.1.mlp.down_proj.weight"
    if corrupt == "drop":
        del sd[key]
    elif corrupt == "extra":
        sd["model.layers.9.mlp.down_proj.weight"] = sd[key].clone()
    elif corrupt == "shape":
        sd[key] = sd[key][:, :-1].contiguous()
    else:
        sd[key] = sd[key].tolist()
    with pytest.raises(WeightSyncError, match=needle) as ei:
        eng.update_weights_from_state_dict(sd, version="v1")
    if corrupt != "extra":
        assert key in str(ei.value)
    assert eng.weight_version == "v0"
    assert _outputs(eng.generate(PROMPTS, GREEDY)) == _outputs(before)


def test_update_weights_bad_directory(dirs, tmp_path):
    eng = EmbeddedEngine(dirs["a"], dtype="float32", weight_version="v0")
    with pytest.raises(WeightSyncError, match="not a directory"):
        eng.update_weights(str(tmp_path / "nope"), version="v1")
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightSyncError, match="no model.safetensors"):
        eng.update_weights(str(tmp_path / "empty"), version="v1")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(WeightSyncError, match="could not read"):
        eng.update_weights(str(tmp_path / "bad"), version="v1")
    assert eng.weight_version == "v0"


def test_eos_and_stop_ids(dirs, tmp_path):
    """Greedy run of model A gives tokens g; the same weights with eos_token_id = g[2] stop right there."""
    base = EmbeddedEngine(dirs["a"], dtype="float32").generate([PROMPTS[0]], GREEDY)[0].response_ids
    eos = base[2]
    assert eos not in base[:2], "test needs a fresh token at position 2"
    d = build_tiny_hf_model(tmp_path / "eos", arch="qwen2", seed=0, eos_token_id=eos)
    assert json.loads(open(os.path.join(d, "config.json")).read())["eos_token_id"] == eos
    eng = EmbeddedEngine(d, dtype="float32")
    r = eng.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=8))[0]
    assert r.response_ids == base[:3] and r.finish_reason == "stop" and r.info["matched_stop"] == eos
    assert len(r.rollout_log_probs) == 3
    # ignore_eos keeps going to max_new_tokens
    r = eng.generate([PROMPTS[0]], GREEDY)[0]
    assert r.response_ids == base and r.finish_reason == "length"
    # the EOS as the last allowed token ends the response: "stop" (as SGLang 0.5.23 reports; never continued)
    r = eng.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=3))[0]
    assert r.response_ids == base[:3] and r.finish_reason == "stop" and r.info["matched_stop"] == eos
    # extra stop ids (on the original model, whose EOS is never emitted here)
    eng_a = EmbeddedEngine(dirs["a"], dtype="float32")
    r = eng_a.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=8,
                                                    stop_token_ids=(base[1],)))[0]
    assert r.response_ids == base[:2] and r.finish_reason == "stop"
    r = eng_a.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=8))[0]
    assert r.finish_reason == "length" and len(r.response_ids) == 8


def test_rows_stop_independently_in_a_batch(dirs):
    """A stopped row does not stop the others; each row's tokens equal its solo run."""
    eng = EmbeddedEngine(dirs["a"], dtype="float32")
    solo = [eng.generate([p], GREEDY)[0].response_ids for p in PROMPTS]
    stop = solo[0][1]
    sp = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop,))
    batch = eng.generate(PROMPTS, sp)
    for r, s in zip(batch, solo):
        k = s.index(stop) + 1 if stop in s else len(s)
        assert r.response_ids == s[:k]
        assert r.finish_reason == ("stop" if stop in s else "length")


def test_non_finite_logits_raise_rollout_error(dirs):
    eng = EmbeddedEngine(dirs["a"], dtype="float32")
    sd = load_file(os.path.join(dirs["a"], "model.safetensors"))
    sd["lm_head.weight"][3] = float("nan")
    eng.update_weights_from_state_dict(sd, version="nan")
    with pytest.raises(RolloutError, match="non-finite logits"):
        eng.generate(PROMPTS, GREEDY)


def test_bad_input_rejected_before_work(dirs):
    eng = EmbeddedEngine(dirs["a"], dtype="float32")
    with pytest.raises(ValueError, match="non-empty list"):
        eng.generate([], GREEDY)
    with pytest.raises(ValueError, match=r"prompt_ids\[1\]\[0\]"):
        eng.generate([[1], [eng.vocab_size]], GREEDY)
    with pytest.raises(ValueError, match="n=0"):
        eng.generate([[1]], GREEDY, n=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        eng.generate([[1] * 510], SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="SamplingParams"):
        eng.generate([[1]], {"temperature": 1.0})
    with pytest.raises(ValueError, match="dtype"):
        EmbeddedEngine(dirs["a"], dtype="fp8")
    with pytest.raises(ValueError, match="not a directory"):
        EmbeddedEngine(dirs["a"] + "_missing")
    eng.close()
    assert eng.health() == {"embedded": False}
    with pytest.raises(RolloutError, match="closed"):
        eng.generate([[1]], GREEDY)


def test_chunked_batches_equal_one_batch(dirs):
    """max_batch_rows splits the rows into chunks without changing any rollout (per-row random streams)."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=6)
    a = EmbeddedEngine(dirs["a"], dtype="float32").generate(PROMPTS, sp, n=3, seed=9)
    b = EmbeddedEngine(dirs["a"], dtype="float32", max_batch_rows=2).generate(PROMPTS, sp, n=3, seed=9)
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    assert all(max(abs(x - y) for x, y in zip(p.rollout_log_probs, q.rollout_log_probs)) <= 1e-5
               for p, q in zip(a, b))
