"""ReMax in the trainer: the rollout phase asks the engine for one greedy response per prompt (temperature 0, n=1,
the round's weights) and scores it with the same reward; every row carries its prompt's greedy reward through the
DP split and dynamic sampling's regrouping to the estimator, whose advantages equal verl 0.9.1's
``compute_remax_outcome_advantage`` (its own function) on the same rows.

Run: ``OMP_NUM_THREADS=1 pytest tests/unit/test_remax_baseline.py -q``
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.algo.estimator import AlgoParams, Estimator
from megatron_rl.config.sections import AlgorithmConfig, DataConfig, RolloutConfig
from megatron_rl.rollout.base import Rollout, StaleRolloutError
from megatron_rl.tasks import build_task
from megatron_rl.tasks.char_tokenizer import build_char_tokenizer
from megatron_rl.trainer.dynamic_sampling import take_groups
from megatron_rl.trainer.rollout_phase import generate_step
from megatron_rl.actor.replay_modes import NoReplay
from tests.verl_core_algos import AlgoCfg, verl_core_algos

pytestmark = pytest.mark.timeout(300)
N = 3


class Engine:
    """Sampled responses "1", "2", "3" per prompt; the greedy response is the prompt's answer (``copy:A=`` -> A)
    for even positions of the call, "0" for odd ones. Records each call's sampling."""

    def __init__(self, tok, greedy_version="step-0"):
        self.tok, self.greedy_version, self.calls = tok, greedy_version, []

    def generate(self, prompt_ids, sampling, n=1, seed=None):
        self.calls.append((sampling, n))
        out = []
        for i, p in enumerate(prompt_ids):
            answer = self.tok.decode(list(p)).split(":")[-1].rstrip("=")
            texts = ([answer if i % 2 == 0 else "0"] if sampling.temperature == 0
                     else ["1", "2", "3"][:n])
            for t in texts:
                ids = self.tok.encode(t, add_special_tokens=False) + [self.tok.eos_token_id]
                out.append(Rollout(prompt_index=i, prompt_ids=list(p), response_ids=ids,
                                   rollout_log_probs=[-0.5] * len(ids), finish_reason="stop",
                                   weight_version=self.greedy_version if sampling.temperature == 0 else "step-0"))
        return out


def _job(tmp_path, answers):
    tok = build_char_tokenizer()
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"copy:{a}=", "answer": a}) + "\n" for a in answers))
    d = DataConfig(task="file", path=str(data), prompts_per_step=len(answers), reward_workers=1)
    cfg = SimpleNamespace(data=d, rollout=RolloutConfig(max_new_tokens=4, n_samples_per_prompt=N, temperature=0.7),
                          trainer=SimpleNamespace(seed=0), algorithm=AlgorithmConfig())
    return tok, cfg, build_task("file", tok, path=d.path)


def test_rows_carry_their_prompts_greedy_reward(tmp_path):
    answers = ["1", "2", "5", "3"]
    tok, cfg, task = _job(tmp_path, answers)
    engine = Engine(tok)
    try:
        out = generate_step(task, engine, cfg, step=0, expected_version="step-0", greedy_baseline=True,
                            replay=NoReplay())
        plain = generate_step(task, Engine(tok), cfg, step=0, expected_version="step-0", replay=NoReplay())
    finally:
        task.close()
    (sampled, n_sampled), (greedy, n_greedy) = engine.calls
    assert (sampled.temperature, n_sampled) == (0.7, N)
    assert (greedy.temperature, greedy.top_p, greedy.top_k, n_greedy) == (0.0, 1.0, -1, 1)
    prompts = [p for p in out.prompt_ids[::N]]
    # the greedy response of an even prompt (in draw order) is its answer (reward 1), of an odd one "0" (reward 0)
    want = [1.0 if i % 2 == 0 else 0.0 for i in range(len(prompts))]
    assert out.reward_baselines == [w for w in want for _ in range(N)]
    assert out.metrics["reward/greedy_baseline_mean"] == pytest.approx(sum(want) / len(want))
    assert plain.reward_baselines == [] and "reward/greedy_baseline_mean" not in plain.metrics


def test_greedy_responses_from_other_weights_are_refused(tmp_path):
    tok, cfg, task = _job(tmp_path, ["1", "2"])
    try:
        with pytest.raises(StaleRolloutError, match="greedy baseline responses from weight version 'step-1'"):
            generate_step(task, Engine(tok, greedy_version="step-1"), cfg, step=0,
                          expected_version="step-0", greedy_baseline=True, replay=NoReplay())
    finally:
        task.close()


def test_baselines_follow_the_rows_to_the_estimator_and_match_verl(tmp_path):
    answers = ["1", "2", "5", "3"]
    tok, cfg, task = _job(tmp_path, answers)
    try:
        batch = generate_step(task, Engine(tok), cfg, step=0, expected_version="step-0",
                              greedy_baseline=True, replay=NoReplay())
    finally:
        task.close()
    batch.rewards = [float(i % 4) * 0.5 for i in range(batch.num_rows)]   # distinct rewards per row
    regrouped = take_groups([batch], [(0, 2), (0, 0)], N)   # dynamic sampling's regrouping keeps them
    assert regrouped.reward_baselines == batch.reward_baselines[2 * N:3 * N] + batch.reward_baselines[:N]
    rows = [N, N + 1, N + 2, 3 * N, 3 * N + 1, 3 * N + 2]   # DP rank 1 of 2
    shard = batch.part(rows, 0.0).shard(0, N, 0, torch.device("cpu"))
    base = shard.estimator_inputs["reward_baselines"]
    assert base.tolist() == [batch.reward_baselines[r] for r in rows]
    mask = shard.batch.response_mask.float()
    got = Estimator("remax", AlgoParams()).advantages(shard.rewards, shard.group_index, mask,
                                                        **shard.estimator_inputs)
    tlr = torch.zeros_like(mask)   # verl: the score on the last response token
    for b in range(mask.shape[0]):
        tlr[b, torch.nonzero(mask[b]).flatten()[-1]] = shard.rewards[b]
    with verl_core_algos() as verl:
        want, _ = verl.get_adv_estimator_fn("remax")(token_level_rewards=tlr, reward_baselines=base,
                                                     response_mask=mask, config=AlgoCfg(gamma=1.0))
    torch.testing.assert_close(got, want * mask)
    assert (got != 0).any()


class _VersionedEngine:
    """Each response: "1" then EOS, one token per call, from the engine's current weight version."""

    def __init__(self, tok):
        self.tok, self.weight_version = tok, "step-0"
        self.eos_token_ids = [tok.eos_token_id]
        self.one = tok.encode("1", add_special_tokens=False)[0]

    def generate(self, prompt_ids, sampling, n=1, seed=None):
        out = []
        for i, p in enumerate(prompt_ids):
            cont = p[-1] == self.one   # a continuation segment
            for _ in range(n):
                out.append(Rollout(prompt_index=i, prompt_ids=list(p),
                                   response_ids=[self.tok.eos_token_id] if cont else [self.one],
                                   rollout_log_probs=[-0.5], finish_reason="stop" if cont else "length",
                                   weight_version=self.weight_version))
        return out


def test_interrupt_mode_refused_as_the_producer_loads_newer_weights_between_segments(tmp_path):
    """Async partial_rollout 'interrupt': the producer may load a newer version between the sampled responses'
    segments, so the greedy call that follows runs on other weights than the round's -- it is refused at config
    time, naming the keys."""
    from megatron_rl.config import ConfigError
    from megatron_rl.plan import load_job_config
    from megatron_rl.trainer.async_rollout import SegmentedEngine

    tok, cfg, task = _job(tmp_path, ["1", "2"])
    eng = _VersionedEngine(tok)

    def newer():   # what RolloutProducer._load_newest does between segments when a version was published
        eng.weight_version = "step-1"
    try:
        with pytest.raises(StaleRolloutError, match="greedy baseline responses from weight version 'step-1'"):
            generate_step(task, SegmentedEngine(eng, 1, newer), cfg, step=0, expected_version="step-0",
                          greedy_baseline=True, replay=NoReplay())
    finally:
        task.close()
    model = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.vocab_size=64"]
    with pytest.raises(ConfigError, match=r"algorithm\.adv_estimator: 'remax' with rollout\.partial_rollout "
                                          r"'interrupt'"):
        load_job_config(None, model + ["algorithm.adv_estimator=remax", "rollout.mode=async",
                                       "rollout.partial_rollout=interrupt", "rollout.segment_tokens=4"],
                        world_size=1)
