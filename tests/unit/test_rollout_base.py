"""The engine-independent rollout types (megatron_rl.rollout.base): SamplingParams -> SGLang JSON, prompt
validation, Rollout invariants and its JSON round trip.

Run: OMP_NUM_THREADS=1 pytest tests/unit/test_rollout_base.py
"""
import json

import numpy as np
import pytest
import torch

from megatron_rl.rollout.base import Rollout, SamplingParams, validate_n, validate_prompts


def test_sampling_params_to_sglang_json():
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=5, stop_token_ids=[3, 4])
    assert sp.stop_token_ids == (3, 4)  # normalised to a tuple (hashable, frozen)
    assert sp.to_sglang(n=4) == {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 5, "n": 4,
                                 "stop_token_ids": [3, 4]}
    assert SamplingParams(ignore_eos=True).to_sglang()["ignore_eos"] is True
    assert "stop_token_ids" not in SamplingParams().to_sglang()
    json.dumps(sp.to_sglang(2))


def test_validate_prompts_accepts_arrays_and_names_bad_entries():
    out = validate_prompts([np.array([1, 2]), torch.tensor([3]), (4, 5, 6)], vocab_size=10)
    assert out == [[1, 2], [3], [4, 5, 6]] and all(type(t) is int for row in out for t in row)
    with pytest.raises(ValueError, match=r"prompt_ids\[0\]\[0\]=True"):
        validate_prompts([[True]])
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] must be a non-empty list of token ids, got str"):
        validate_prompts([[1], "abc"])
    with pytest.raises(ValueError, match="n=1.5"):
        validate_n(1.5)


def test_rollout_invariants_and_json_round_trip():
    r = Rollout(prompt_index=2, prompt_ids=[1, 2], response_ids=[5, 6, 0], rollout_log_probs=[-0.5, -1.0, -2.0],
                finish_reason="stop", weight_version="v3", source="http://x", info={"matched_stop": 0})
    back = Rollout.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back == r
    with pytest.raises(ValueError, match="3 response_ids but 2 rollout_log_probs"):
        Rollout(0, [1], [1, 2, 3], [-1.0, -1.0], "length", "v")
    with pytest.raises(ValueError, match="finish_reason='abort'"):
        Rollout(0, [1], [1], [-1.0], "abort", "v")
    d = r.to_dict()
    del d["weight_version"]
    with pytest.raises(ValueError, match="rollouts.jsonl line 7: missing field 'weight_version'"):
        Rollout.from_dict(d, where="rollouts.jsonl line 7")
    d = r.to_dict()
    d["rollout_log_probs"][1] = 0.3
    with pytest.raises(ValueError, match=r"rollout_log_probs\[1\]=0.3 is not a log-probability"):
        Rollout.from_dict(d)
    d = r.to_dict()
    d["response_ids"] = [5, 6]
    with pytest.raises(ValueError, match="2 response_ids but 3 rollout_log_probs"):
        Rollout.from_dict(d)
