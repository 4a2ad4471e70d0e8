"""File prompts are drawn without replacement, epoch by epoch (``tasks/epoch_order.py``, the job's
``trainer.prompt_draw.PromptDraw``), through the step generator the job builds (``build_step_generator``) with
dynamic sampling's rounds:

* over several steps of 1-3 rounds each, the draws split into epochs of N in which every prompt appears exactly
  once, no step draws a prompt twice, and each epoch follows the permutation of (trainer.seed, epoch) computed
  here with numpy (the prompts a step straddling an epoch boundary already holds come later in the new epoch);
* a resume from a checkpoint's state (sync: at a step boundary; async: after drained steps the producer does not
  regenerate) continues the uninterrupted sequence exactly;
* the epoch boundary when a round needs more prompts than the file holds, and a saved order that does not fit
  the data set any more (it starts over, saying so);
* the generated tasks (digit tasks) keep their seeded draw of (trainer.seed, step, round).

Run: ``OMP_NUM_THREADS=1 pytest tests/unit/test_prompt_order.py -q``
"""
from __future__ import annotations

import io
import json
import warnings

import numpy as np
import pytest
import torch

from megatron_rl.rollout.base import Rollout
from megatron_rl.tasks import build_task
from megatron_rl.tasks.char_tokenizer import build_char_tokenizer
from megatron_rl.testing.jobs import named_job
from megatron_rl.trainer.rollout_phase import build_step_generator
from megatron_rl.plan import budget_of, dynamic_sampling_of, replay_of

pytestmark = pytest.mark.timeout(300)

N, PER_STEP, SAMPLES, ROUNDS, STEPS = 13, 4, 2, 3, 12


class AnswerEngine:
    """Per prompt ``n`` responses: the answer every time for an even prompt (its group is alike: dropped by
    dynamic sampling), the answer then a wrong one for an odd one (signal). Records each call's prompts."""

    def __init__(self, tok, index_of):
        self.tok, self.index_of, self.calls = tok, index_of, []

    def generate(self, prompt_ids, sampling, n=1, seed=None):
        idx = [self.index_of[tuple(p)] for p in prompt_ids]
        self.calls.append(idx)
        out = []
        for b, (i, p) in enumerate(zip(idx, prompt_ids)):
            for s in range(n):
                text = str(i) if i % 2 == 0 or s == 0 else str(i) + "0"
                ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
                out.append(Rollout(prompt_index=b, prompt_ids=list(p), response_ids=ids,
                                   rollout_log_probs=[-0.5] * len(ids), finish_reason="stop", weight_version="step-0"))
        return out


def _cfg(tmp_path, n=N, *extra):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"copy:{i}=", "answer": str(i)}) + "\n" for i in range(n)))
    return named_job("dynamic_sampling", "data.task=file", f"data.path={path}", "data.task_kwargs={}",
                     "data.reward_fn=exact", "data.reward_workers=0", f"data.prompts_per_step={PER_STEP}",
                     f"rollout.n_samples_per_prompt={SAMPLES}",
                     f"algorithm.filter_groups.max_num_gen_batches={ROUNDS}", *extra)


def _job_parts(cfg, draw=None):
    """The task, the step generator (built as the job builds it) and the recording engine."""
    tok = build_char_tokenizer()
    task = build_task("file", tok, path=cfg.data.path, reward_fn=cfg.data.reward_fn)
    gen = build_step_generator(cfg, task, None if draw is None else draw(task, cfg), replay_of(cfg),
                               budget=budget_of(cfg), dynamic=dynamic_sampling_of(cfg))
    index_of = {tuple(p.prompt_ids): int(p.answer) for p in task.prompts}
    return task, gen, AnswerEngine(tok, index_of)


def _run(gen, engine, steps):
    """Each step's draws (one list per round)."""
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")            # exhausted steps (on_exhausted: train) warn
        for step in steps:
            first = len(engine.calls)
            gen.generate(engine, step, "step-0")
            out.append(engine.calls[first:])
    return out


def reference_permutation(seed, epoch, n=N):
    """The order of ``epoch``: numpy's permutation seeded by (trainer.seed, epoch) (docs/datasets.md)."""
    return [int(i) for i in np.random.default_rng([seed % 2 ** 64, epoch]).permutation(n)]


def test_no_prompt_repeats_within_an_epoch_over_rounds_and_steps(tmp_path):
    cfg = _cfg(tmp_path)
    task, gen, engine = _job_parts(cfg)
    try:
        steps = _run(gen, engine, range(STEPS))
    finally:
        gen.close()
        task.close()
    assert max(len(s) for s in steps) > 1                          # dynamic sampling drew several rounds
    per_step = [[i for rnd in s for i in rnd] for s in steps]
    flat = [i for s in per_step for i in s]
    assert len(flat) >= 3 * N
    for s in per_step:                                             # a step never trains a prompt twice
        assert len(set(s)) == len(s), s
    epochs = [flat[e * N:(e + 1) * N] for e in range(len(flat) // N)]
    for e, block in enumerate(epochs):                             # every prompt exactly once per epoch
        assert sorted(block) == list(range(N)), (e, block)
    # each epoch follows the (seed, epoch) permutation; what the straddling step already held comes later
    for e, block in enumerate(epochs):
        ref = reference_permutation(cfg.trainer.seed, e)
        first_step = next(k for k in range(len(per_step)) if sum(map(len, per_step[:k + 1])) > e * N)
        before = sum(map(len, per_step[:first_step]))
        held = set(flat[before:e * N])                             # the straddling step's draws of epoch e - 1
        assert [i for i in block if i not in held] == [i for i in ref if i not in held], e
        mine = flat[e * N:before + len(per_step[first_step])]      # epoch e's part of the straddling step
        assert not held & set(mine)
    assert any(sum(map(len, per_step[:k])) % N for k in range(len(per_step)))   # some step straddled


def _draw_class():
    from megatron_rl.trainer.prompt_draw import PromptDraw
    return PromptDraw


def _saved(state):
    """Through torch.save / torch.load as a checkpoint's extra state (plain data)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("drained", [0, 2])
def test_resume_continues_the_uninterrupted_sequence(tmp_path, drained):
    """``drained``: steps the async checkpoint holds (the resumed producer does not regenerate them)."""
    PromptDraw = _draw_class()
    cfg = _cfg(tmp_path)
    stop = 5
    task, gen, engine = _job_parts(cfg, PromptDraw)
    draw = gen.inner.draw
    try:
        straight = _run(gen, engine, range(STEPS))
    finally:
        gen.close()
        task.close()
    # the run that stops after step `stop`: its checkpoint holds the order's positions at steps stop..stop+drained
    task, gen, engine = _job_parts(cfg, PromptDraw)
    draw = gen.inner.draw
    try:
        assert _run(gen, engine, range(stop + drained)) == straight[:stop + drained]
        state = _saved(draw.state(stop, stop + drained))
    finally:
        gen.close()
        task.close()
    assert state["prompt_order"]["size"] == N
    task, gen, engine = _job_parts(cfg, PromptDraw)
    try:
        gen.inner.draw.restore(state, stop)
        resumed = _run(gen, engine, range(stop + drained, STEPS))
    finally:
        gen.close()
        task.close()
    assert resumed == straight[stop + drained:]


def test_state_after_resume_and_a_second_checkpoint(tmp_path):
    """A resumed run's own checkpoint (including positions it restored but never drew) resumes exactly too."""
    PromptDraw = _draw_class()
    cfg = _cfg(tmp_path)
    task, gen, engine = _job_parts(cfg, PromptDraw)
    try:
        straight = _run(gen, engine, range(STEPS))
        first = _saved(gen.inner.draw.state(0, 0))
    finally:
        gen.close()
        task.close()
    task, gen, engine = _job_parts(cfg, PromptDraw)
    try:
        assert _run(gen, engine, range(5)) == straight[:5]         # 3 trained, 2 generated ahead (async)
        saved = _saved(gen.inner.draw.state(3, 5))
    finally:
        gen.close()
        task.close()
    task, gen, engine = _job_parts(cfg, PromptDraw)
    try:
        gen.inner.draw.restore(saved, 3)                           # steps 3, 4 preloaded: it draws from 5 on
        assert _run(gen, engine, range(5, 7)) == straight[5:7]
        again = _saved(gen.inner.draw.state(4, 7))                 # 4 restored, 5..6 drawn, 7 not begun
    finally:
        gen.close()
        task.close()
    task, gen, engine = _job_parts(cfg, PromptDraw)
    try:
        gen.inner.draw.restore(again, 4)
        assert _run(gen, engine, range(4, STEPS)) == straight[4:]
    finally:
        gen.close()
        task.close()
    assert first["prompt_order"]["positions"] == {0: [0, 0, []]}


def test_epoch_order_when_a_round_needs_more_than_the_file():
    from megatron_rl.tasks.epoch_order import EpochOrder

    order = EpochOrder(3, seed=7)
    draws = [order.take(5, step) for step in range(6)]
    flat = [i for d in draws for i in d]
    for e in range(len(flat) // 3):                                # still a whole permutation per epoch
        assert sorted(flat[3 * e:3 * e + 3]) == [0, 1, 2]
    assert [sorted(set(d)) for d in draws] == [[0, 1, 2]] * 6      # every prompt in every step


def test_the_epoch_order_stream_without_straddles_is_the_permutations():
    from megatron_rl.tasks.epoch_order import EpochOrder

    order = EpochOrder(12, seed=-3)
    flat = [i for step in range(9) for i in order.take(4, step)]
    assert flat == [i for e in range(3) for i in reference_permutation(-3, e, 12)]
    assert order.position() == (2, 12, ())                         # the next epoch starts at the next draw


def test_a_saved_order_that_does_not_fit_starts_over(tmp_path, capsys):
    PromptDraw = _draw_class()
    cfg = _cfg(tmp_path)
    task, gen, engine = _job_parts(cfg, PromptDraw)
    try:
        _run(gen, engine, range(3))
        state = gen.inner.draw.state(3, 3)
    finally:
        gen.close()
        task.close()
    state["prompt_order"]["size"] = N + 1
    task, gen, engine = _job_parts(cfg, PromptDraw)
    try:
        gen.inner.draw.restore(state, 3)
        got = _run(gen, engine, [3])
    finally:
        gen.close()
        task.close()
    assert "the prompt order starts over" in capsys.readouterr().out
    assert [i for rnd in got[0] for i in rnd][:PER_STEP] == reference_permutation(cfg.trainer.seed, 0)[:PER_STEP]


def test_generated_tasks_keep_the_step_seeded_draw(tiny_job):
    """Digit tasks generate prompts (no finite set to permute): their draw is the seeded one of (trainer.seed,
    step, round) it always was (docs/results.md's numbers stand)."""
    from megatron_rl.trainer.job import build_task as job_task
    from megatron_rl.trainer.rollout_phase import sample_prompts

    PromptDraw = _draw_class()
    cfg = tiny_job("parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
                   "data.prompts_per_step=8")
    task, _ = job_task(cfg)
    draw = PromptDraw(task, cfg)
    got = [[p.prompt_ids for p in draw(step, rnd)] for step in (0, 3) for rnd in (0, 1)]
    assert got == [[p.prompt_ids for p in sample_prompts(task, cfg, step, rnd)] for step in (0, 3) for rnd in (0, 1)]
    assert draw.state(2, 3) == {}


def test_one_off_generate_step_calls_draw_per_step_not_the_same_prompts(tmp_path):
    """``generate_step`` without the job's draw (a one-off call) draws each step's own seeded sample of the file, as
    ``random.Random(trainer.seed * 1_000_003 + step).sample(range(N), prompts_per_step)`` does -- not a fresh
    epoch order per call (which gave every step epoch 0's first prompts)."""
    import random

    from megatron_rl.trainer.rollout_phase import generate_step

    cfg = _cfg(tmp_path)
    task, gen, engine = _job_parts(cfg)
    gen.close()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = [generate_step(task, engine, cfg, step, "step-0", replay=replay_of(cfg)).prompt_ids[::SAMPLES]
                   for step in (0, 1, 2)]
    finally:
        task.close()
    by_index = {i: list(p.prompt_ids) for i, p in ((int(p.answer), p) for p in task.prompts)}
    ref = [[by_index[i] for i in random.Random(cfg.trainer.seed * 1_000_003 + step).sample(range(N), PER_STEP)]
           for step in (0, 1, 2)]
    assert got == ref
    assert got[0] != got[1]


def test_a_saved_order_of_another_file_of_the_same_size_starts_over(tmp_path, capsys):
    """A checkpoint's order is for the prompts it was drawn from: another data file with as many prompts (here the
    same prompts in another row order) starts over at epoch 0, saying why; the same file continues."""
    PromptDraw = _draw_class()
    cfg = _cfg(tmp_path)
    task, gen, engine = _job_parts(cfg, PromptDraw)
    try:
        straight = _run(gen, engine, range(5))
        state = _saved(gen.inner.draw.state(3, 3))
    finally:
        gen.close()
        task.close()
    other = tmp_path / "other"
    other.mkdir()
    moved = _cfg(other)
    rows = (other / "prompts.jsonl").read_text().splitlines(keepends=True)
    (other / "prompts.jsonl").write_text("".join(rows[1:] + rows[:1]))          # same size, other rows
    for c, expect in ((cfg, straight[3]), (moved, None)):
        task, gen, engine = _job_parts(c, PromptDraw)
        try:
            gen.inner.draw.restore(state, 3)
            got = _run(gen, engine, [3])[0]
        finally:
            gen.close()
            task.close()
        out = capsys.readouterr().out
        if expect is not None:                                                   # the same file: continued
            assert got == expect and "starts over" not in out
        else:
            assert "the prompt order starts over at epoch 0" in out and "other prompts" in out, out
            # file row r holds prompt (r + 1) % N: epoch 0 of the new file's rows, as prompt numbers
            ref = [(r + 1) % N for r in reference_permutation(cfg.trainer.seed, 0)]
            assert [i for rnd in got for i in rnd][:PER_STEP] == ref[:PER_STEP]


def test_a_fresh_order_after_an_async_resume_checkpoints_the_held_steps(tmp_path, capsys):
    """Resumed at step 3 from a checkpoint without a prompt order that holds the async rollouts of steps 3 and 4:
    the order starts over and the producer draws step 5 first. The next checkpoints (after steps 4 and 5) record
    where steps 4.. start -- the held ones, never drawn here, at the fresh order's start -- instead of raising, and
    a run resumed from them continues the first resumed run's prompts."""
    PromptDraw = _draw_class()
    cfg = _cfg(tmp_path)
    task, gen, engine = _job_parts(cfg, PromptDraw)
    try:
        gen.inner.draw.restore({"async_rollouts": {3: "...", 4: "..."}}, 3)   # no prompt_order; 2 steps held
        assert "starts over" in capsys.readouterr().out
        resumed = _run(gen, engine, range(5, 9))
        at4 = _saved(gen.inner.draw.state(4, 6))            # a checkpoint after step 4 would have raised
        at6 = _saved(gen.inner.draw.state(6, 8))
    finally:
        gen.close()
        task.close()
    flat = [i for s in resumed for rnd in s for i in rnd]
    assert flat[:N] == reference_permutation(cfg.trainer.seed, 0)   # step 5 starts epoch 0
    assert at4["prompt_order"]["positions"][4] == [0, 0, []] == at4["prompt_order"]["positions"][5]
    for state, start, held in ((at4, 4, 1), (at6, 6, 2)):  # resumed again, keeping the held rollouts
        task, gen, engine = _job_parts(cfg, PromptDraw)
        try:
            gen.inner.draw.restore({**state, "async_rollouts": dict.fromkeys(range(start, start + held))}, start)
            assert _run(gen, engine, range(start + held, 9)) == resumed[start + held - 5:]
        finally:
            gen.close()
            task.close()
