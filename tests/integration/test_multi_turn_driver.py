"""The multi-turn driver (``rollout/multi_turn.py``), the ``MultiTurn`` step generator and the ``multi_turn:``
config section.

* token in, token out: with a tokenizer where decode-then-encode does NOT round trip (the char tokenizer plus an
  added token "12": the model may sample "1", "2", re-encoding gives the one id of "12"), every model segment the
  trainer sees holds exactly the ids the engine sampled, and every engine call continues from exactly the ids
  so far; a re-tokenizing driver written here gets them wrong;
* limits: max_turns, max_total_tokens (truncation counted), max_tokens_per_turn, a stop token exactly at a
  limit (an engine that says "length" for it, as older ones do);
* async: through ``SegmentedEngine`` in interrupt mode a trajectory spans two weight versions and every model
  token carries the version that sampled it (its log-prob, which encodes the version, is the proof);
* environment failures (raise, garbage, hang past the timeout) end only their trajectory, named and counted;
* ``MultiTurn`` draws the prompts ``generate_step`` draws, its ``StepBatch`` masks environment tokens out of
  ``RolloutBatch.response_mask`` and ``build_step_generator`` picks it from ``multi_turn.env``;
* r3 over multi-turn trajectories (tiny Qwen3-MoE, embedded engine fp32, routers changed between turns): the
  joined routing of every position equals HF transformers' own routing under the weights of the call that fed
  it; the actor replaying it (r3) gives HF's log-probs with that routing forced, at every model token;
* a real SGLang server (CPU) runs a multi-turn training loop end to end (slow).

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_multi_turn_driver.py -q``
"""
import json
import os
import textwrap

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.config import ConfigError
from megatron_rl.envs.pool import EnvPool
from megatron_rl.rollout.base import Rollout, SamplingParams
from megatron_rl.rollout.finish import stop_ids
from megatron_rl.rollout.multi_turn import ObservationEncoder, TurnLimits, run_trajectories
from megatron_rl.tasks.base import response_text
from megatron_rl.rollout.versions import parse_version, version_tag
from megatron_rl.trainer.async_rollout import SegmentedEngine, check_staleness
from megatron_rl.trainer.rollout_phase import MultiTurn, SingleTurn, build_step_generator, generate_step
from megatron_rl.plan import budget_of, dynamic_sampling_of, replay_of

EOS, MARK, OBS = 1, 20, 21

ENVS = textwrap.dedent('''
    import time
    from megatron_rl.envs.base import Environment, EnvStep

    class Echo(Environment):
        """Answers a turn with its own text; done (reward 1) at step ``turns``."""
        def __init__(self, turns=3):
            self.turns = turns
        def reset(self, sample):
            self.k = 0
        def step(self, action):
            self.k += 1
            if self.k >= self.turns:
                return EnvStep("", reward=1.0, done=True)
            return EnvStep(action, info={"tool_calls": 1.0})

    class Never(Environment):
        """Never done; answers ``obs`` (a string of that many characters)."""
        def __init__(self, obs=2):
            self.obs = obs
        def reset(self, sample):
            pass
        def step(self, action):
            return EnvStep("x" * self.obs, info={"tool_calls": 1.0})

    class Flaky(Environment):
        """By the prompt row: "reset" raises in reset, "raise" raises, "garbage" returns no EnvStep, "hang" sleeps,
        else done (reward 1)."""
        def reset(self, sample):
            self.what = sample["prompt"]
            if self.what == "reset":
                raise ValueError("no such episode")
        def step(self, action):
            if self.what == "raise":
                raise RuntimeError("tool backend down")
            if self.what == "garbage":
                return {"observation": 42}
            if self.what == "hang":
                time.sleep(60)
            return EnvStep("", reward=1.0, done=True)
''')


@pytest.fixture(scope="module")
def envs(tmp_path_factory):
    """``name -> "file.py:Class"`` spec of the test environments."""
    path = tmp_path_factory.mktemp("envs") / "mt_envs.py"
    path.write_text(ENVS)
    return lambda name: f"{path}:{name}"


class ScriptedEngine:
    """A deterministic stand-in policy: every turn samples ``turn`` (cut at ``max_new_tokens``); the tokens after
    the last ``MARK`` of its prompt say how far into the turn it is (so a continued segment goes on). The log-prob
    of a token encodes the weight version that sampled it. Like older engines it says "length" when the
    response reaches ``max_new_tokens``, even if its last token is a stop token. Records every call."""

    eos_token_ids = (EOS,)
    seeded_sampling = True

    def __init__(self, turn, version=0, mark=MARK):
        self.turn, self.version, self.mark, self.calls = list(turn), version, mark, []

    @property
    def weight_version(self):
        return version_tag(self.version)

    @staticmethod
    def log_prob(token, version):
        return -0.25 * (version + 1) - 0.001 * token

    def generate(self, prompt_ids, sampling, n=1, seed=None):
        stops = stop_ids(sampling, self.eos_token_ids)
        out = []
        for i, p in enumerate(prompt_ids):
            pos = len(p) - 1 - max(j for j, t in enumerate(p) if t == self.mark)
            ids = []
            for t in self.turn[pos:pos + sampling.max_new_tokens]:
                ids.append(t)
                if t in stops:
                    break
            finish = "length" if len(ids) == sampling.max_new_tokens else "stop"
            for _ in range(n):
                out.append(Rollout(i, list(p), list(ids), [self.log_prob(t, self.version) for t in ids], finish,
                                   self.weight_version))
        self.calls.append({"prompts": [list(p) for p in prompt_ids], "n": n, "seed": seed,
                           "max_new_tokens": sampling.max_new_tokens, "out": [list(r.response_ids) for r in out]})
        return out


def _int_codec():
    """(encode_observation, decode_action) over bare ids: an observation of k characters -> k-1 OBS ids + MARK."""
    return (lambda obs: [OBS] * (len(obs) - 1) + [MARK]), (lambda ids: " ".join(map(str, ids)))


def _run(engine, env, limits, prompts=((5, MARK),), n=1, samples=None, sampling=None, **kw):
    enc, dec = _int_codec()
    pool = EnvPool(env, {}, workers=0, step_timeout_s=5.0) if isinstance(env, str) else env
    samples = samples or [{"prompt": "ok"} for _ in prompts]
    try:
        return run_trajectories(engine, pool, [list(p) for p in prompts], samples, n,
                                sampling or SamplingParams(max_new_tokens=8), limits, enc, dec, seed=7, **kw)
    finally:
        pool.close()


def _kinds(traj):
    return [(s.kind, len(s.ids)) for s in traj.segments]


# ------------------------------------------------------------------------------------- token in, token out
@pytest.fixture(scope="module")
def merge_tokenizer():
    """The char tokenizer plus an added token "12": "1" "2" and "12" decode to the same text, and encoding that
    text gives the one id of "12" (decode-then-encode does not round trip)."""
    from megatron_rl.tasks.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.add_tokens(["12"])
    one, two, twelve = tok.convert_tokens_to_ids(["1", "2", "12"])
    assert tok.decode([one, two]) == "12" and tok.encode("12", add_special_tokens=False) == [twelve]
    return tok


def _retokenizing_driver(tok, prompt_text, engine, env_reply, turns, template):
    """What a text-level agent loop does: keep the conversation as text, re-encode it for every call and for the
    trainer. Returns the trainer's response ids and, per model turn, the ids it believes the model produced."""
    text, model_ids = prompt_text, []
    for _ in range(turns):
        ids = tok.encode(text, add_special_tokens=False)
        r = engine.generate([ids], SamplingParams(max_new_tokens=8), n=1)[0]
        turn_text = tok.decode(r.response_ids, skip_special_tokens=False)
        model_ids.append(tok.encode(turn_text, add_special_tokens=False))  # re-tokenized
        text += turn_text + template.replace("{observation}", env_reply(turn_text))
    prompt = tok.encode(prompt_text, add_special_tokens=False)
    return tok.encode(text, add_special_tokens=False)[len(prompt):], model_ids


def test_token_in_token_out_with_a_tokenizer_that_does_not_round_trip(envs, merge_tokenizer):
    tok = merge_tokenizer
    one, two, eq, twelve = tok.convert_tokens_to_ids(["1", "2", "=", "12"])
    engine = ScriptedEngine([one, two, one, EOS], mark=eq)   # the model samples "1" "2" "1" <eos> each turn
    template = ">{observation}="
    prompt = tok.encode("copy:7=", add_special_tokens=False)
    pool = EnvPool(envs("Echo"), {"turns": 3}, workers=0, step_timeout_s=5.0)
    try:
        trajs = run_trajectories(engine, pool, [prompt], [{"prompt": "copy:7="}], 2, SamplingParams(max_new_tokens=8),
                                 TurnLimits(4, 64, 8), ObservationEncoder(tok, template),
                                 lambda ids: response_text(tok, ids)[0], seed=3)
    finally:
        pool.close()
    # the independent record: what the engine returned, call by call
    sampled = [ids for call in engine.calls for ids in call["out"]]
    assert len(engine.calls) == 3 and all(ids == [one, two, one, EOS] for ids in sampled)
    for b, t in enumerate(trajs):
        assert t.finish == "answer" and t.reward == 1.0 and t.turns == 3
        model = [s.ids for s in t.segments if s.kind == "model"]
        assert model == [[one, two, one, EOS]] * 3                      # exactly the sampled ids
        env = [s.ids for s in t.segments if s.kind == "env"]
        assert env == [tok.encode(">121=", add_special_tokens=False)] * 2   # observation encoded once
        assert twelve in env[0]                                        # (the tokenizer merges "12" there)
        mask = t.loss_mask
        assert [x for x, m in zip(t.response_ids, mask) if m] == [i for ids in model for i in ids]
    # token in: every call continued from exactly the ids so far
    for k, call in enumerate(engine.calls[1:], start=1):
        for p, t in zip(call["prompts"], trajs):
            assert p == prompt + [i for s in t.segments[: 2 * k] for i in s.ids]
    # a re-tokenizing driver gets the model's ids wrong
    engine2 = ScriptedEngine([one, two, one, EOS], mark=eq)
    _, seen = _retokenizing_driver(tok, "copy:7=", engine2, lambda text: text, 3, template)
    assert seen[0] != [one, two, one, EOS] and seen[0] == [twelve, one, EOS]


# ------------------------------------------------------------------------------------------------ limits
def test_max_turns_ends_without_the_last_observation(envs):
    engine = ScriptedEngine([5, 6, EOS])
    [t] = _run(engine, envs("Never"), TurnLimits(max_turns=3, max_total_tokens=100, max_tokens_per_turn=10))
    assert t.finish == "max_turns" and t.turns == 3
    assert _kinds(t) == [("model", 3), ("env", 2), ("model", 3), ("env", 2), ("model", 3)]
    assert t.counts["tool_calls"] == 3 and t.reward == 0.0
    assert [c["max_new_tokens"] for c in engine.calls] == [10, 10, 10]
    assert [c["seed"] for c in engine.calls] == [7, 7 + 7919, 7 + 2 * 7919]


def test_max_total_tokens_cuts_the_turn_and_is_counted(envs):
    engine = ScriptedEngine([5, 6, 7, EOS])
    [t] = _run(engine, envs("Never"), TurnLimits(max_turns=10, max_total_tokens=9, max_tokens_per_turn=4))
    assert [c["max_new_tokens"] for c in engine.calls] == [4, 3]    # min(per turn, budget left)
    assert _kinds(t) == [("model", 4), ("env", 2), ("model", 3)]
    assert t.finish == "max_tokens" and len(t.response_ids) == 9
    assert t.segments[-1].finish_reason == "length"


def test_observation_longer_than_the_budget_is_not_appended_and_counted(envs):
    engine = ScriptedEngine([5, 6, 7, EOS])
    pool = EnvPool(envs("Never"), {"obs": 6}, workers=0, step_timeout_s=5.0)
    [t] = _run(engine, pool, TurnLimits(max_turns=10, max_total_tokens=8, max_tokens_per_turn=4))
    assert _kinds(t) == [("model", 4)] and t.finish == "max_tokens"
    assert t.counts["truncated_observation"] == 1


def test_per_turn_limit_without_stop_ends_with_length(envs):
    engine = ScriptedEngine([5, 6, 7, 8, 9, EOS])
    [t] = _run(engine, envs("Never"), TurnLimits(max_turns=4, max_total_tokens=100, max_tokens_per_turn=3))
    assert _kinds(t) == [("model", 3)] and t.finish == "length"


def test_stop_token_exactly_at_a_limit_is_a_finished_turn(envs):
    # per-turn limit 3 and the turn is 3 tokens ending in EOS: the engine says "length", the turn is finished
    engine = ScriptedEngine([5, 6, EOS])
    [t] = _run(engine, envs("Never"), TurnLimits(max_turns=2, max_total_tokens=100, max_tokens_per_turn=3))
    assert t.finish == "max_turns" and [s.finish_reason for s in t.segments if s.kind == "model"] == ["stop"] * 2
    # the total budget ends exactly at the EOS: the environment still reads the turn and may answer
    pool = EnvPool(envs("Echo"), {"turns": 1}, workers=0, step_timeout_s=5.0)
    [t] = _run(ScriptedEngine([5, 6, EOS]), pool, TurnLimits(max_turns=4, max_total_tokens=3, max_tokens_per_turn=8))
    assert t.finish == "answer" and t.reward == 1.0 and t.response_ids == [5, 6, EOS]


def test_n_trajectories_per_prompt_first_turn_as_single_turn(envs):
    engine = ScriptedEngine([5, EOS])
    trajs = _run(engine, envs("Echo"), TurnLimits(3, 50, 8), prompts=[(3, MARK), (4, 4, MARK)], n=3,
                 samples=[{"prompt": "a"}, {"prompt": "b"}])
    first = engine.calls[0]
    assert first["n"] == 3 and first["prompts"] == [[3, MARK], [4, 4, MARK]] and first["seed"] == 7
    assert [t.prompt_ids for t in trajs] == [[3, MARK]] * 3 + [[4, 4, MARK]] * 3
    assert all(c["n"] == 1 and len(c["prompts"]) == 6 for c in engine.calls[1:])


# ------------------------------------------------------------------------------------------ env failures
def test_env_failures_end_only_their_trajectory(envs):
    engine = ScriptedEngine([5, EOS])
    failures = []
    rows = ["ok", "raise", "garbage", "ok", "reset"]
    trajs = _run(engine, envs("Flaky"), TurnLimits(3, 50, 8), prompts=[(3, MARK)] * 5,
                 samples=[{"prompt": w} for w in rows], failures=failures)
    assert [t.finish for t in trajs] == ["answer", "env_error", "env_error", "answer", "env_error"]
    assert [t.reward for t in trajs] == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert trajs[1].counts == {"env_exception": 1.0} and trajs[2].counts == {"env_garbage": 1.0}
    assert trajs[4].counts == {"env_exception": 1.0}
    assert all(t.response_ids == [5, EOS] for t in trajs)     # every row has its first turn, nothing more
    assert sorted(k for k, _ in failures) == [1, 2, 4]
    assert "tool backend down" in dict(failures)[1].message and "no such episode" in dict(failures)[4].message


@pytest.mark.timeout(120)
def test_hanging_env_times_out_alone(envs):
    engine = ScriptedEngine([5, EOS])
    pool = EnvPool(envs("Flaky"), {}, workers=2, step_timeout_s=2.0)
    trajs = _run(engine, pool, TurnLimits(3, 50, 8), prompts=[(3, MARK)] * 2,
                 samples=[{"prompt": "hang"}, {"prompt": "ok"}])
    assert [t.finish for t in trajs] == ["env_error", "answer"]
    assert trajs[0].counts == {"env_timeout": 1.0} and trajs[1].reward == 1.0


# ----------------------------------------------------------------------------------------------- async
def test_async_interrupted_trajectory_spans_two_versions(envs):
    engine = ScriptedEngine([5, 6, 7, 8, 9, EOS])
    bumped = []

    def before_segment():          # the producer loads the newest published weights between segments
        if not bumped:
            engine.version += 1
            bumped.append(True)

    view = SegmentedEngine(engine, 2, before_segment)
    pool = EnvPool(envs("Echo"), {"turns": 2}, workers=0, step_timeout_s=5.0)
    trajs = _run(view, pool, TurnLimits(4, 64, 6), n=2, expected_version="step-0")
    for t in trajs:
        assert t.finish == "answer" and t.turns == 2
        model = [s for s in t.segments if s.kind == "model"]
        versions = [v for s in model for v in s.versions]
        assert set(versions) == {0, 1} and versions[:2] == [0, 0]
        for s in model:  # the log-prob the engine sampled each token with names its version
            assert s.log_probs == [ScriptedEngine.log_prob(x, v) for x, v in zip(s.ids, s.versions)]
        env_at = [i for i, m in enumerate(t.loss_mask) if not m]
        assert all(t.token_versions[i] == t.token_versions[env_at[0] - 1] for i in env_at)
        check_staleness([t.token_versions], 1, 1, 1)


# ------------------------------------------------------------------------------- the MultiTurn generator
def _one_rank(tiny_job, *overrides):
    return tiny_job("parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1", *overrides)


def _mt_cfg(tiny_job, envs, *extra):
    return _one_rank(tiny_job, f"multi_turn.env={envs('Echo')}", "multi_turn.env_kwargs={turns: 2}",
                     "multi_turn.env_workers=0", "multi_turn.observation_template='{observation}='",
                     "multi_turn.max_turns=3", *extra)


def test_multi_turn_generator_batch(tiny_job, envs, copy_model):
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.trainer.job import build_task

    # 12 tokens a turn: a random model ends some turns with EOS (then the environment answers)
    cfg = _mt_cfg(tiny_job, envs, "rollout.max_new_tokens=12", "data.prompts_per_step=4",
                  "actor.ppo_mini_batches=1", "rollout.n_samples_per_prompt=4")
    task, tok = build_task(cfg)
    gen = build_step_generator(cfg, task, None, replay_of(cfg), budget=budget_of(cfg), dynamic=dynamic_sampling_of(cfg))
    assert isinstance(gen, MultiTurn)
    engine = EmbeddedEngine(copy_model, dtype="float32", seed=1, weight_version="step-2")
    calls = []
    inner = engine.generate
    engine.generate = lambda p, s, n=1, seed=None: calls.append((p, s, n, seed)) or inner(p, s, n=n, seed=seed)
    try:
        batch = gen.generate(engine, 2, "step-2")
    finally:
        gen.close()
    # the prompts generate_step draws for that step (same rng, same task calls)
    task2, _ = build_task(cfg)
    single = generate_step(task2, engine, cfg, 2, "step-2", replay=replay_of(cfg))
    assert batch.prompt_ids == single.prompt_ids
    n = cfg.rollout.n_samples_per_prompt
    assert calls[0][2] == n and calls[0][3] == cfg.trainer.seed * 7919 + 2
    assert len(batch.loss_masks) == batch.num_rows == len(batch.response_ids)
    two_turn = [b for b, m in enumerate(batch.loss_masks) if 0 in m]
    for b, (mask, ids) in enumerate(zip(batch.loss_masks, batch.response_ids)):
        assert len(mask) == len(ids) == len(batch.rollout_log_probs[b])
        assert all(lp == 0.0 for lp, m in zip(batch.rollout_log_probs[b], mask) if not m)
    m = batch.metrics
    for key in ("multi_turn/turns_mean", "multi_turn/env_token_frac", "multi_turn/finish_answer_frac",
                "multi_turn/finish_length_frac", "multi_turn/tool_calls_per_traj", "data/prompt_length_mean",
                "reward/failed", "reward/timed_out", "response/truncated_frac"):
        assert key in m, key
    # Echo(turns=2) answers the second finished turn: a row with two model runs that ends in EOS
    runs = [sum(1 for j, x in enumerate(mask) if x and (j == 0 or not mask[j - 1])) for mask in batch.loss_masks]
    answered = [b for b in range(batch.num_rows) if runs[b] == 2 and batch.response_ids[b][-1] == tok.eos_token_id]
    assert m["multi_turn/finish_answer_frac"] == pytest.approx(len(answered) / batch.num_rows)
    assert batch.rewards == [1.0 if b in answered else 0.0 for b in range(batch.num_rows)]
    assert m["multi_turn/turns_mean"] == pytest.approx(sum(runs) / batch.num_rows)
    assert batch.token_versions == [[2] * len(ids) for ids in batch.response_ids]   # every token: the step's version
    # env tokens are in the forward pass but out of the response mask
    shard = batch.shard(2, n, 0, 0, 1, torch.device("cpu"))
    rb = shard.batch
    for b in range(batch.num_rows):
        p, r = len(batch.prompt_ids[b]), len(batch.response_ids[b])
        assert rb.tokens[b, p:p + r].tolist() == batch.response_ids[b]
        assert rb.response_mask[b, p - 1:p - 1 + r].tolist() == [float(x) for x in batch.loss_masks[b]]
    assert two_turn, "some trajectory must have had an environment turn"
    one = _one_rank(tiny_job)
    assert isinstance(build_step_generator(one, task, None, replay_of(one), budget=budget_of(one), dynamic=dynamic_sampling_of(one)), SingleTurn)


def test_multi_turn_generator_through_the_async_view_tags_every_token(tiny_job, envs):
    from megatron_rl.trainer.job import build_task

    cfg = _mt_cfg(tiny_job, envs, "rollout.max_new_tokens=6", "data.prompts_per_step=2",
                  "actor.ppo_mini_batches=1", "rollout.n_samples_per_prompt=2")
    task, tok = build_task(cfg)
    one, two, eq = tok.convert_tokens_to_ids(["1", "2", "="])
    engine = ScriptedEngine([one, two, one, two, EOS], version=2, mark=eq)
    view = SegmentedEngine(engine, 2, lambda: setattr(engine, "version", 3))   # newer weights after a segment
    gen = build_step_generator(cfg, task, None, replay_of(cfg), budget=budget_of(cfg), dynamic=dynamic_sampling_of(cfg))
    try:
        batch = gen.generate(view, 3, "step-2")
    finally:
        gen.close()
    assert len(batch.token_versions) == batch.num_rows
    for versions, mask, ids, lps in zip(batch.token_versions, batch.loss_masks, batch.response_ids,
                                        batch.rollout_log_probs):
        assert versions[:2] == [2, 2] and set(versions) == {2, 3} and 0 in mask
        for v, m, x, lp in zip(versions, mask, ids, lps):
            if m:   # the version each model token carries is the one that sampled it
                assert lp == ScriptedEngine.log_prob(x, v)
    check_staleness(batch.token_versions, 3, 1, 4)
    assert batch.rewards == [1.0] * batch.num_rows


def test_dynamic_sampling_over_multi_turn_through_the_async_view(tiny_job, envs):
    """The scripted policy answers alike on every sample (reward 1): every group is alike, so dynamic sampling
    draws ``max_num_gen_batches`` rounds of fresh prompts (fresh environment seeds and keys), warns, and trains a
    full batch. Round 0 loaded newer weights between its segments (interrupt mode): round 1 starts from them
    instead of failing as stale (the first turn's version check expects the round's start version)."""
    from megatron_rl.trainer.dynamic_sampling import DynamicSampling, FilterGroupsExhaustedWarning
    from megatron_rl.trainer.job import build_task
    from megatron_rl.trainer.rollout_phase import sample_prompts

    cfg = _mt_cfg(tiny_job, envs, "rollout.max_new_tokens=6", "data.prompts_per_step=2",
                  "actor.ppo_mini_batches=1", "rollout.n_samples_per_prompt=2", "algorithm.filter_groups.enable=true",
                  "algorithm.filter_groups.max_num_gen_batches=2")
    task, tok = build_task(cfg)
    one, two, eq = tok.convert_tokens_to_ids(["1", "2", "="])
    engine = ScriptedEngine([one, two, one, two, EOS], version=2, mark=eq)
    view = SegmentedEngine(engine, 2, lambda: setattr(engine, "version", 3))   # newer weights after a segment
    gen = build_step_generator(cfg, task, None, replay_of(cfg), budget=budget_of(cfg), dynamic=dynamic_sampling_of(cfg))
    assert isinstance(gen, DynamicSampling) and isinstance(gen.inner, MultiTurn)
    try:
        with pytest.warns(FilterGroupsExhaustedWarning, match="found 0 of the 2 prompt groups"):
            batch = gen.generate(view, 3, "step-2")
    finally:
        gen.close()
    first_turns = [c for c in engine.calls if c["n"] == 2]    # each round's first turn: n samples per prompt
    assert [c["prompts"] for c in first_turns] == [[p.prompt_ids for p in sample_prompts(task, cfg, 3, r)]
                                                   for r in (0, 1)]
    assert first_turns[0]["seed"] != first_turns[1]["seed"]
    m = batch.metrics
    assert (m["filter_groups/rounds"], m["filter_groups/groups_drawn"], m["filter_groups/groups_filled"]) == (2, 4, 2)
    assert batch.num_rows == 4 and batch.rows_generated == 8 and batch.rewards == [1.0] * 4
    assert batch.weight_version == "step-2" and batch.token_versions[0][:2] == [2, 2]
    assert len(batch.loss_masks) == 4 and all(0 in mask for mask in batch.loss_masks)
    check_staleness(batch.token_versions, 3, 1, 4)


def test_config_section_errors_name_keys(tiny_job, envs):
    with pytest.raises(ConfigError) as e:
        _one_rank(tiny_job, "multi_turn.env=no_such_module_xyz:Env", "multi_turn.max_turns=0",
                  "multi_turn.env_workers=-1", "multi_turn.env_step_timeout_s=0", "multi_turn.observation_template=abc",
                  "multi_turn.max_total_tokens=-1")
    msg = str(e.value)
    for key in ("multi_turn.env:", "multi_turn.max_turns:", "multi_turn.env_workers:",
                "multi_turn.env_step_timeout_s:", "multi_turn.observation_template:", "multi_turn.max_total_tokens:"):
        assert key in msg, (key, msg)
    assert "no_such_module_xyz" in msg
    with pytest.raises(ConfigError, match="data.overlong_buffer_len: .*multi-turn") as e:
        _one_rank(tiny_job, f"multi_turn.env={envs('Echo')}", "data.overlong_buffer_len=2", "data.reward_fn=exact")
    assert "data.reward_fn: multi-turn rewards come from the environment" in str(e.value)
    cfg = _one_rank(tiny_job, f"multi_turn.env={envs('Echo')}", "rollout.max_new_tokens=5", "multi_turn.max_turns=3")
    limits = TurnLimits.from_config(cfg.multi_turn, cfg.rollout.max_new_tokens)
    assert limits == TurnLimits(max_turns=3, max_total_tokens=15, max_tokens_per_turn=5)
    assert _one_rank(tiny_job).multi_turn.env is None


def test_multi_turn_generator_enforces_the_plans_limits(tiny_job, envs):
    """The job plan builds the turn limits once (its response budget carries them) and the multi-turn generator
    receives that object; the limits are the ``multi_turn`` section's, its zeros meaning ``rollout.max_new_tokens``
    per turn and ``max_turns`` times that in all (the keys' documented meaning)."""
    from megatron_rl.plan import JobPlan
    from megatron_rl.trainer.job import build_task

    cfg = _mt_cfg(tiny_job, envs, "rollout.max_new_tokens=5")
    plan = JobPlan.build(cfg, 1)
    assert plan.budget.limits == TurnLimits(max_turns=3, max_total_tokens=15, max_tokens_per_turn=5)
    assert plan.budget.tokens == 15
    task, _ = build_task(cfg)
    for budget in (plan.budget, budget_of(cfg)):  # budget_of: the config alone (tools) reads the same limits
        gen = build_step_generator(cfg, task, None, plan.replay, budget=budget, dynamic=plan.dynamic_sampling)
        try:
            assert isinstance(gen, MultiTurn) and gen.limits == plan.budget.limits
            if budget is plan.budget:  # the plan's object itself, not a copy
                assert gen.limits is plan.budget.limits
        finally:
            gen.close()
    assert JobPlan.build(_one_rank(tiny_job), 1).budget.limits is None  # single-turn: no turn limits


# ---------------------------------------------------------------------------------------------- routing
E, K, NL = 8, 2, 2


@pytest.fixture(scope="module")
def moe_dir(tiny_hf_model):
    return tiny_hf_model("qwen3_moe", seed=41, num_hidden_layers=NL, num_experts=E, num_experts_per_tok=K)


class RouterShiftingEngine:
    """An embedded engine whose MoE routers change after every call (new weights per turn), recording the router
    weights each call ran with."""

    def __init__(self, engine):
        self.engine, self.gates = engine, []
        self.eos_token_ids = engine.eos_token_ids
        self._g = torch.Generator().manual_seed(0)

    @property
    def weight_version(self):
        return self.engine.weight_version

    def _routers(self):
        return [layer.mlp.gate for layer in self.engine.model.model.layers]

    def generate(self, prompt_ids, sampling, n=1, seed=None):
        self.gates.append([g.weight.detach().clone() for g in self._routers()])
        out = self.engine.generate(prompt_ids, sampling, n=n, seed=seed)
        with torch.no_grad():
            for g in self._routers():
                g.weight.add_(torch.randn(g.weight.shape, generator=self._g) * g.weight.std() * 2)
        return out


def _multi_turn_moe_trajectories(moe_dir, envs):
    from megatron_rl.rollout.embedded import EmbeddedEngine

    engine = RouterShiftingEngine(EmbeddedEngine(moe_dir, dtype="float32", seed=3, weight_version="step-0"))
    vocab = engine.engine.vocab_size
    # half the vocabulary stops a turn, so turns are short and several fit
    sampling = SamplingParams(temperature=1.0, max_new_tokens=5, stop_token_ids=tuple(range(3, vocab, 2)))
    pool = EnvPool(envs("Never"), {"obs": 3}, workers=0, step_timeout_s=5.0)
    try:
        trajs = run_trajectories(engine, pool, [[11, 12, 13], [40, 41]], [{"prompt": "a"}, {"prompt": "b"}], 2,
                                 sampling, TurnLimits(3, 40, 5), lambda obs: [7, 8, 9][: len(obs)],
                                 lambda ids: "x", seed=5)
    finally:
        pool.close()
    return engine, trajs


@pytest.mark.timeout(300)
def test_joined_routing_is_the_routing_each_token_was_sampled_with(moe_dir, envs):
    from megatron_rl.testing.actor_reference import load_hf_reference
    from megatron_rl.testing.routing_reference import hf_own_routing

    engine, trajs = _multi_turn_moe_trajectories(moe_dir, envs)
    model = load_hf_reference(moe_dir).eval()
    gates = [layer.mlp.gate for layer in model.model.layers]
    assert any(t.turns >= 2 for t in trajs)
    agree = total = agree_last = 0
    for b, t in enumerate(trajs):
        seq = t.prompt_ids + t.response_ids
        assert tuple(t.routing.shape) == (len(seq) - 1, NL, K)
        # the call that fed each position: call k fed [end of turn k-1's routing, end of turn k's)
        start, call_of_turn, pos = 0, [], len(t.prompt_ids)
        for s in t.segments:
            pos += len(s.ids)
            if s.kind == "model":
                call_of_turn.append(pos - 1)
        for k, end in enumerate(call_of_turn):
            # which engine call made turn k: turn 0 is call 0; turn k of every trajectory is call k (one budget)
            with torch.no_grad():
                for g, w in zip(gates, engine.gates[k]):
                    g.weight.copy_(w)
            ref = hf_own_routing(model, seq[:end])
            same = (t.routing[start:end].long().sort(-1).values == ref[start:end].sort(-1).values).all(-1)
            agree += int(same.sum())
            total += same.numel()
            with torch.no_grad():
                for g, w in zip(gates, engine.gates[-1]):
                    g.weight.copy_(w)
            last = hf_own_routing(model, seq[:end])
            agree_last += int((t.routing[start:end].long().sort(-1).values ==
                               last[start:end].sort(-1).values).all(-1).sum())
            start = end
    assert agree / total > 0.995, f"joined routing agrees with each call's HF routing on {agree}/{total}"
    assert agree_last / total < 0.9, "the routers changed between turns: one call's routing cannot explain all"


def _rank_r3_multi_turn(rank, world, job, batch, temperature):
    from megatron_rl.actor import MegatronActor
    from megatron_rl.plan import actor_spec
    from megatron_rl.parallel import initialize_model_parallel

    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    actor = MegatronActor(actor_spec(job))
    lp, _ = actor.compute_log_probs(batch, temperature, compute_entropy=False)
    return {"lp": lp, "metrics": dict(actor.routing_metrics)}


@pytest.mark.timeout(400)
def test_r3_over_multi_turn_equals_hf_forced_routing(moe_dir, envs):
    from megatron_rl.actor import RolloutBatch
    from megatron_rl.testing.actor_reference import hf_token_log_probs, load_hf_reference
    from megatron_rl.testing.distributed import run_ranks
    from megatron_rl.testing.routing_reference import replay_job

    _, trajs = _multi_turn_moe_trajectories(moe_dir, envs)
    batch = RolloutBatch.from_sequences([t.prompt_ids for t in trajs], [t.response_ids for t in trajs],
                                        [t.rollout_log_probs for t in trajs], routing=[t.routing for t in trajs],
                                        loss_masks=[t.loss_mask for t in trajs])
    res = run_ranks(_rank_r3_multi_turn, 1, replay_job(moe_dir, "r3"), batch, 1.0, timeout=350)[0]
    # HF (the checkpoint's weights) with every position routed as the joined routing says
    model = load_hf_reference(moe_dir).eval()
    with torch.no_grad():
        natural = hf_token_log_probs(model, batch.tokens, 1.0)
    B, S = batch.tokens.shape
    forced = torch.zeros(B, S, NL, K, dtype=torch.long)
    for b, t in enumerate(trajs):
        forced[b, : t.routing.shape[0]] = t.routing.long()
    for j, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate

        def fwd(hidden_states, gate=gate, j=j):
            h = hidden_states.reshape(-1, gate.hidden_dim)
            logits = F.linear(h, gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            idx = forced[:, : hidden_states.shape[0] // B, j].reshape(-1, gate.top_k)
            top = probs.gather(1, idx)
            if gate.norm_topk_prob:
                top = top / top.sum(-1, keepdim=True)
            return logits, top.to(logits.dtype), idx

        gate.forward = fwd
    with torch.no_grad():
        ref = hf_token_log_probs(model, batch.tokens, 1.0)
    mask = batch.response_mask.bool()
    W = res["lp"].shape[1]
    assert int(mask.sum()) == sum(t.num_model_tokens for t in trajs)
    assert (natural - ref)[mask].abs().max() > 1e-3, "the routing of later turns (other routers) must matter"
    torch.testing.assert_close(res["lp"][mask[:, :W]], ref[:, :W][mask[:, :W]], rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------ SGLang
def _train_body(rank, world, cfg):
    from megatron_rl.trainer.loop import train

    return train(cfg)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_multi_turn_loop_with_real_sglang_server(tmp_path, envs, copy_sglang_server):
    """The multi-turn loop on the copy model's server this pytest process shares (the loop publishes its initial
    weights as step-0 first)."""
    from megatron_rl.rollout.sglang_server import sglang_available
    from megatron_rl.testing.distributed import run_ranks
    from megatron_rl.testing.jobs import named_job

    ok, reason = sglang_available()
    if not ok:
        pytest.skip(reason)
    model = copy_sglang_server.model_dir
    run_dir = str(tmp_path / "run")
    cfg = named_job("sglang_loop", *copy_sglang_server.job_overrides(), "parallel.tensor_model_parallel_size=1",
                    "rollout.max_new_tokens=12",
                    "data.prompts_per_step=4", f"multi_turn.env={envs('Echo')}", "multi_turn.env_kwargs={turns: 2}",
                    "multi_turn.env_workers=1", "multi_turn.observation_template='{observation}='",
                    "multi_turn.max_turns=3", hf=model, run_dir=run_dir, world_size=1)
    run_ranks(_train_body, 1, cfg, timeout=840)
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        metrics = [json.loads(line) for line in fh]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all("multi_turn/turns_mean" in m for m in metrics)
    with open(os.path.join(run_dir, "rollouts.jsonl")) as fh:
        recs = [json.loads(line) for line in fh]
    assert {r["weight_version"] for r in recs if r["step"] == 2} == {"step-1"}
    multi = [r for r in recs if 0 in r["loss_mask"]]
    assert multi, "some trajectory must have had an environment turn"
    for r in multi:
        assert all(lp == 0.0 for lp, m in zip(r["rollout_log_probs"], r["loss_mask"]) if not m)
    # independent reference: the engine's log-probs of the model tokens of step 1 match HF fp32 over the whole
    # trajectory (bf16 server: loosely), environment tokens included in the context
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    diffs = []
    with torch.no_grad():
        for rec in (r for r in multi if r["step"] == 1):
            p, resp = rec["prompt_ids"], rec["response_ids"]
            lsm = torch.log_softmax(hf(torch.tensor([p + resp])).logits[0].double(), -1)
            diffs += [abs(float(lsm[len(p) - 1 + j, resp[j]]) - lp)
                      for j, (lp, m) in enumerate(zip(rec["rollout_log_probs"], rec["loss_mask"])) if m]
    assert diffs, "no trajectory of step 1 had an environment turn (the reference needs one)"
    assert sum(diffs) / len(diffs) < 0.05, sum(diffs) / len(diffs)
    assert max(parse_version(r["weight_version"]) for r in recs) == 1
