"""The rollout phase with a file task: the data section's options reach the task, responses that hit
max_new_tokens are flagged truncated, DAPO's soft overlong penalty (hand-computed here) is added to their
rewards, reward failures are 0 and counted (the step goes on), and the payload carries the data / reward /
length metrics. The engine is a stand-in that returns fixed responses.

Run: ``OMP_NUM_THREADS=1 pytest tests/unit/test_data_rollout_phase.py -q``
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from megatron_rl.config.sections import AlgorithmConfig, DataConfig, RolloutConfig
from megatron_rl.rollout.base import Rollout
from megatron_rl.tasks import build_task
from megatron_rl.tasks.char_tokenizer import build_char_tokenizer
from megatron_rl.trainer.rollout_phase import generate_step, overlong_penalty
from megatron_rl.actor.replay_modes import NoReplay

pytestmark = pytest.mark.timeout(300)

REWARD = '''
def check(prompt_text, response_text, answer):
    if response_text == "99":
        raise ValueError("bad sample")
    return 1.0 if response_text == answer else 0.0
'''


class FixedEngine:
    """Returns, per prompt, the given response strings (EOS-terminated unless they fill max_new_tokens)."""

    def __init__(self, tok, responses):
        self.tok, self.responses = tok, responses

    def generate(self, prompt_ids, sampling, n=1, seed=None):
        out = []
        for i, p in enumerate(prompt_ids):
            for s in self.responses[:n]:
                ids = self.tok.encode(s, add_special_tokens=False)[:sampling.max_new_tokens]
                length = len(ids) >= sampling.max_new_tokens
                if not length:
                    ids.append(self.tok.eos_token_id)
                out.append(Rollout(prompt_index=i, prompt_ids=list(p), response_ids=ids,
                                   rollout_log_probs=[-0.5] * len(ids), finish_reason="length" if length else "stop",
                                   weight_version="step-0"))
        return out


def test_generate_step_flags_truncation_penalises_and_counts(tmp_path):
    tok = build_char_tokenizer()
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"copy:{d}{d}=", "answer": f"{d}{d}"}) + "\n" for d in range(6)))
    (tmp_path / "rw.py").write_text(REWARD)
    d = DataConfig(task="file", path=str(data), reward_fn=f"{tmp_path / 'rw.py'}:check", prompts_per_step=2,
                   reward_workers=1, reward_timeout_s=10.0, max_prompt_length=3, overlong_prompts="truncate",
                   overlong_buffer_len=4, overlong_penalty_factor=0.5)
    r = RolloutConfig(max_new_tokens=6, n_samples_per_prompt=4)
    cfg = SimpleNamespace(data=d, rollout=r, trainer=SimpleNamespace(seed=0), algorithm=AlgorithmConfig())
    task = build_task("file", tok, path=d.path, reward_fn=d.reward_fn)   # built with default options, as the loop does
    assert len(task.prompts[0].prompt_ids) == 5                       # copy : 0 0 =
    # responses: right answer (3 tokens incl. EOS), 5 tokens + EOS, 6 tokens (hits max_new_tokens), raises
    engine = FixedEngine(tok, ["@@", "12345", "123456", "99"])
    try:
        out = generate_step(task, engine, cfg, step=0, expected_version="step-0", replay=NoReplay())
    finally:
        task.close()
    # options applied: prompts truncated to their last 3 tokens (counted)
    assert all(len(p) == 3 for p in out.prompt_ids) and out.metrics["data/prompts_truncated"] == 6
    assert out.metrics["data/rows"] == 6 and out.metrics["data/malformed_rows"] == 0
    lengths = [len(x) for x in out.response_ids]
    assert lengths == [3, 6, 6, 3] * 2
    assert out.truncated == [False, False, True, False] * 2
    assert out.metrics["response/truncated_frac"] == pytest.approx(2 / 8)
    assert out.metrics["response/truncated_count"] == 2
    # raw rewards: "@@" is not the answer -> 0 (the char tokenizer has no '@': '<unk>' dropped), "99" raises -> 0
    assert out.metrics["reward/failed"] == 2 and out.metrics["reward/timed_out"] == 0
    # DAPO soft overlong penalty by hand: expected length 6 - 4 = 2; penalty = min(0, -(L - 2) / 4 * 0.5)
    hand = [min(0.0, -(n - 2) / 4 * 0.5) for n in lengths]
    assert hand[:4] == [-0.125, -0.5, -0.5, -0.125]
    assert out.rewards == pytest.approx(hand)
    assert out.metrics["response/overlong_penalty_mean"] == pytest.approx(sum(hand) / 8)
    assert out.metrics["reward/raw_mean"] == 0.0


def test_correct_answers_score_through_the_step(tmp_path):
    tok = build_char_tokenizer()
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": "copy:7=", "answer": "7"}) + "\n" for _ in range(2)))
    d = DataConfig(task="file", path=str(data), prompts_per_step=2, reward_workers=1)
    cfg = SimpleNamespace(data=d, rollout=RolloutConfig(max_new_tokens=4, n_samples_per_prompt=2),
                          trainer=SimpleNamespace(seed=0), algorithm=AlgorithmConfig())
    task = build_task("file", tok, path=d.path)
    try:
        out = generate_step(task, FixedEngine(tok, ["7", "8"]), cfg, step=3, expected_version="step-0",
                            replay=NoReplay())
    finally:
        task.close()
    assert out.rewards == [1.0, 0.0, 1.0, 0.0] and out.truncated == [False] * 4
    assert out.metrics["reward/failed"] == 0 and out.metrics["response/truncated_frac"] == 0.0


def test_overlong_penalty_off_and_bounds():
    assert overlong_penalty([1, 10, 16], 16, 0, 1.0) == [0.0, 0.0, 0.0]
    assert overlong_penalty([12, 14, 16], 16, 4, 1.0) == [0.0, -0.5, -1.0]


@pytest.mark.parametrize("kwargs,needle", [
    (dict(reward_fn="mathh"), "data.reward_fn: expected 'math', 'exact' or 'module:function', got 'mathh'"),
    (dict(reward_fn="mod:"), "data.reward_fn"),
    (dict(reward_workers=-1), "data.reward_workers: must be >= 0"),
    (dict(reward_timeout_s=0.0), "data.reward_timeout_s: must be > 0"),
    (dict(max_prompt_length=0), "data.max_prompt_length: must be >= 1"),
    (dict(overlong_prompts="cut"), "data.overlong_prompts: 'cut' is not one of filter, truncate"),
    (dict(overlong_buffer_len=-2), "data.overlong_buffer_len: must be >= 0"),
    (dict(overlong_penalty_factor=-1.0), "data.overlong_penalty_factor: must be >= 0"),
])
def test_data_config_errors_name_the_key(kwargs, needle):
    errs = DataConfig(**kwargs).errors()
    assert len(errs) == 1 and needle in errs[0]
    assert DataConfig(reward_fn="math").errors() == [] and DataConfig(reward_fn="pkg.mod:fn").errors() == []
