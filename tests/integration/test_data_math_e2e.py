"""configs/math_tiny_cpu.yaml end to end: ``megatron-rl train`` under torchrun (1 gloo rank) runs 2 steps of
the reasoning-task path — verl-format JSONL -> ChatML template (enable_thinking passed) -> embedded engine
-> math-verify reward in a worker process -> GRPO update — with the tiny chat model built offline.
Learning is not expected; the run must finish, write both steps' metrics and a checkpoint.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_data_math_e2e.py -q``   (about 1-2 min on 2 cores)
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_math_tiny_cpu_two_steps_under_megatron_rl_train(tmp_path):
    pytest.importorskip("math_verify")
    from megatron_rl.tasks.chat_model import build_chat_model

    model = build_chat_model(tmp_path / "model", seed=0)
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           "-m", "megatron_rl.cli", "train", "--config", os.path.join(ROOT, "configs", "math_tiny_cpu.yaml"),
           f"actor.load_hf={model}", f"trainer.run_dir={run}", "trainer.steps=2", "trainer.dump_rollouts=true"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=800)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    records = [json.loads(line) for line in open(run / "metrics.jsonl") if line.strip()]
    assert [m["step"] for m in records] == [1, 2]
    for m in records:
        assert math.isfinite(m["reward/mean"]) and -0.5 <= m["reward/mean"] <= 1.0
    assert os.path.isfile(run / "checkpoints" / "step_2" / "COMPLETE")
    # the prompts the engine got are the chat-templated sample rows (enable_thinking: false adds the empty
    # think block), within max_prompt_length; no reward failed or timed out (nothing printed about it)
    # the tokenizer the model directory holds (transformers' own fast tokenizer over its tokenizer.json;
    # AutoTokenizer would swap in Qwen2Tokenizer's digit-splitting pre-tokenizer for model_type qwen2)
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(model)
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "examples", "math_tiny", "train.jsonl"))]
    rendered = {tuple(tok.encode(tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True,
                                                         enable_thinking=False), add_special_tokens=False))
                for r in rows}
    dumped = [json.loads(line) for line in open(run / "rollouts.jsonl")]
    assert len(dumped) == 2 * 4 * 4
    for d in dumped:
        assert tuple(d["prompt_ids"]) in rendered and len(d["prompt_ids"]) <= 192
        assert tok.decode(d["prompt_ids"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert 1 <= len(d["response_ids"]) <= 24
    assert "reward(s) failed" not in r.stderr and "malformed row" not in r.stderr
