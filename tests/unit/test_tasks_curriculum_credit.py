"""The quickstart's task options: ``eos_credit: false`` (partial credit for answer characters only),
``prefix_credit`` (partial credit up to the first wrong position), ``length_alpha`` (operand lengths drawn in
proportion to their string counts to a power) and ``curriculum_steps`` (the longest operand grows with the
training step, set by the loop's rollout phase)."""
from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest

from megatron_rl.config.sections import ActorConfig, AlgorithmConfig, DataConfig, RolloutConfig
from megatron_rl.rollout.base import Rollout
from megatron_rl.tasks import build_char_tokenizer, build_task
from megatron_rl.tasks.synthetic import operand_count
from megatron_rl.trainer.rollout_phase import generate_step
from megatron_rl.actor.replay_modes import NoReplay


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _ids(tok, text, eos=True):
    return tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])


@pytest.mark.parametrize("answer,response,eos,with_eos_credit,without", [
    ("8", "8", True, 1.0, 1.0),
    ("8", "4", True, 1 / 2, 0.0),        # right length, wrong digit: paid only with EOS credit
    ("8", "84", True, 1 / 3, 1 / 2),
    ("8", "8", False, 1 / 2, 1 / 2),     # missing EOS costs one position either way
    ("12", "13", True, 2 / 3, 1 / 2),
    ("123", "444", True, 1 / 4, 0.0),
    ("123", "1", True, 1 / 4, 1 / 3),
    ("12", "", True, 0.0, 0.0),          # EOS in the wrong place is no match
])
def test_eos_credit_scores(tok, answer, response, eos, with_eos_credit, without):
    p = build_task("copy", tok).make_prompt(answer)
    ids = _ids(tok, response, eos)
    assert build_task("copy", tok).reward(p, ids) == pytest.approx(with_eos_credit)
    assert build_task("copy", tok, task_kwargs={"eos_credit": False}).reward(p, ids) == pytest.approx(without)


def test_eos_credit_must_be_bool(tok):
    with pytest.raises(ValueError, match="data.task_kwargs.eos_credit"):
        build_task("copy", tok, task_kwargs={"eos_credit": "no"})


# prefix credit: the positions before the first wrong one, over max(len(target), len(got)) as before
@pytest.mark.parametrize("answer,response,eos,prefix,prefix_without_eos", [
    ("254", "254", True, 1.0, 1.0),
    ("254", "244", True, 1 / 4, 1 / 3),   # the middle digit wrong: 3/4 with per-position credit
    ("254", "253", True, 2 / 4, 2 / 3),
    ("254", "154", True, 0.0, 0.0),       # first digit wrong: nothing after it counts
    ("254", "25", True, 2 / 4, 2 / 3),    # EOS one position early
    ("254", "2545", True, 3 / 5, 3 / 4),  # EOS one position late: all answer characters, EOS missed
    ("254", "254", False, 3 / 4, 3 / 4),  # no EOS at all
    ("8", "4", True, 0.0, 0.0),
])
def test_prefix_credit_scores(tok, answer, response, eos, prefix, prefix_without_eos):
    p = build_task("copy", tok).make_prompt(answer)
    ids = _ids(tok, response, eos)
    kw = {"prefix_credit": True}
    assert build_task("copy", tok, task_kwargs=kw).reward(p, ids) == pytest.approx(prefix)
    assert build_task("copy", tok, task_kwargs={**kw, "eos_credit": False}).reward(p, ids) \
        == pytest.approx(prefix_without_eos)


def test_prefix_credit_never_exceeds_position_credit(tok):
    """Every response of up to 4 characters over a small alphabet, with and without EOS: prefix credit is
    never above per-position credit."""
    task, pre = build_task("copy", tok), build_task("copy", tok, task_kwargs={"prefix_credit": True})
    p = task.make_prompt("254")
    for n in range(5):
        for chars in itertools.product("245", repeat=n):
            for eos in (True, False):
                ids = _ids(tok, "".join(chars), eos)
                assert pre.reward(p, ids) <= task.reward(p, ids) + 1e-12


@pytest.mark.parametrize("key,bad", [("prefix_credit", "yes"), ("length_alpha", "by_count"),
                                     ("length_alpha", 1.5), ("length_alpha", -0.1), ("length_alpha", True),
                                     ("length_alpha", float("nan")), ("length_alpha", float("inf")),
                                     ("length_floor", 1.5), ("length_floor", -0.1), ("length_floor", True),
                                     ("length_floor", "0.5"), ("length_floor", float("nan"))])
def test_credit_and_length_options_are_checked(tok, key, bad):
    with pytest.raises(ValueError, match=f"data.task_kwargs.{key}"):
        build_task("copy", tok, task_kwargs={key: bad})


@pytest.mark.parametrize("alpha,expected", [
    (1.0, [10 / 1110, 100 / 1110, 1000 / 1110]),          # every string equally likely
    (0.5, [10 ** 0.5 / (10 ** 0.5 + 10 + 1000 ** 0.5), 10 / (10 ** 0.5 + 10 + 1000 ** 0.5),
           1000 ** 0.5 / (10 ** 0.5 + 10 + 1000 ** 0.5)]),
    (0.0, [1 / 3] * 3),                                     # every length equally likely
])
def test_length_alpha_draw_frequencies(tok, alpha, expected, floor=0.0):
    """Lengths 1-3 drawn in proportion to (10, 100, 1000) ** alpha, on 30000 draws within 5 standard
    deviations. The draws are the operand strings ``sample`` makes its prompts of (the same random stream, checked
    on its first 300), without building 30000 prompts."""
    n = 30000
    task = build_task("copy", tok, task_kwargs={"length_alpha": alpha, "length_floor": floor})
    rng = random.Random(0)
    operands = [task._operands(rng) for _ in range(n)]
    assert [p.answer for p in task.sample(300, random.Random(0))] == operands[:300]
    lengths = [len(o) for o in operands]
    for k, q in zip((1, 2, 3), expected):
        sd = (n * q * (1 - q)) ** 0.5
        assert abs(lengths.count(k) - n * q) < 5 * sd, (alpha, k, lengths.count(k), n * q)


@pytest.mark.parametrize("alpha,floor", [(1.0, 0.5), (0.5, 0.3), (1.0, 1.0)])
def test_length_floor_mixes_uniform_lengths_in(tok, alpha, floor):
    """A share ``floor`` of the draws has uniform lengths: P(k) = floor / 3 + (1 - floor) * count(k) ** alpha
    / sum, written out independently."""
    w = [c ** alpha for c in (10, 100, 1000)]
    test_length_alpha_draw_frequencies(tok, alpha, [floor / 3 + (1 - floor) * x / sum(w) for x in w], floor)


def test_length_alpha_zero_keeps_the_original_draws(tok):
    """The default draws exactly what the task drew before the option existed (uniform randint lengths), so
    earlier runs' prompts are reproduced."""
    rng, ref = random.Random(3), random.Random(3)
    got = [p.answer for p in build_task("copy", tok).sample(200, rng)]
    want = []
    for _ in range(200):
        k = ref.randint(1, 3)
        want.append("".join(str(ref.randint(0, 9)) for _ in range(k)))
    assert got == want


def test_length_alpha_handles_long_operands(tok):
    """Weights are computed relative to the largest in log space: 1000 ** alpha * ... would overflow a float
    for operands of hundreds of digits."""
    task = build_task("copy", tok, task_kwargs={"min_digits": 300, "max_digits": 400, "length_alpha": 0.5})
    lengths = [len(p.answer) for p in task.sample(50, random.Random(0))]
    assert min(lengths) >= 380  # 10 ** (0.5 * k): the longest lengths dominate


def test_length_alpha_respects_curriculum_and_heldout(tok):
    task = build_task("copy", tok, task_kwargs={"length_alpha": 1.0, "curriculum_steps": 60,
                                                "heldout_frac": 0.1})
    heldout = {p.text for p in task.heldout_prompts()}
    task.begin_step(25)  # 1-2 digits: 10 and 100 strings
    prompts = task.sample(5000, random.Random(1))
    assert {len(p.answer) for p in prompts} == {1, 2}
    assert not heldout & {p.text for p in prompts}
    assert sum(len(p.answer) == 1 for p in prompts) < 0.2 * 5000


def test_operand_counts():
    """The string counts length_alpha weighs: digit strings 10**k; add operands are integers without leading
    zeros (10 of one digit, 9 * 10**(k-1) of k > 1)."""
    assert [operand_count("copy", k) for k in (1, 2, 3)] == [10, 100, 1000]
    assert [operand_count("add", k) for k in (1, 2, 3)] == [10, 90, 900]


def test_add_length_alpha_weights_operand_lengths(tok):
    """add: 10 one-digit operands, 90 two-digit ones (no leading zeros)."""
    task = build_task("add", tok, task_kwargs={"min_digits": 1, "max_digits": 2, "length_alpha": 1})
    ops = [o for p in task.sample(4000, random.Random(2)) for o in p.text[4:-1].split("+")]
    share = sum(len(o) == 2 for o in ops) / len(ops)
    assert abs(share - 0.9) < 0.02, share


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_curriculum_steps_must_be_int(tok, bad):
    with pytest.raises(ValueError, match="data.task_kwargs.curriculum_steps"):
        build_task("copy", tok, task_kwargs={"curriculum_steps": bad})


def test_curriculum_caps_the_length_by_step(tok):
    task = build_task("copy", tok, task_kwargs={"min_digits": 1, "max_digits": 3, "curriculum_steps": 60})
    for step, allowed in ((0, {1}), (19, {1}), (20, {1, 2}), (39, {1, 2}), (40, {1, 2, 3}), (500, {1, 2, 3})):
        task.begin_step(step)
        lengths = {len(p.answer) for p in task.sample(300, random.Random(step))}
        assert lengths == allowed, (step, lengths)


class _EchoEngine:
    """Answers every prompt with its own digits (a perfect copier), n times."""

    def __init__(self, tok):
        self.tok = tok

    def generate(self, prompt_ids, sampling, n=1, seed=None):
        out = []
        for i, p in enumerate(prompt_ids):
            digits = self.tok.decode(p).split(":")[1].rstrip("=")
            ids = _ids(self.tok, digits)
            out += [Rollout(prompt_index=i, prompt_ids=list(p), response_ids=ids, rollout_log_probs=[-0.1] * len(ids),
                            finish_reason="stop", weight_version="step-0") for _ in range(n)]
        return out


def test_rollout_phase_drives_the_curriculum(tok):
    """The loop's rollout phase tells the task its step: step 0 draws 1-digit prompts only, step 45 all lengths
    (without the call, every step would draw 1-3 digits)."""
    kw = {"min_digits": 1, "max_digits": 3, "curriculum_steps": 60}
    cfg = SimpleNamespace(data=DataConfig(task="copy", prompts_per_step=64, task_kwargs=kw),
                          rollout=RolloutConfig(max_new_tokens=4, n_samples_per_prompt=1), trainer=SimpleNamespace(seed=0),
                          actor=ActorConfig(), algorithm=AlgorithmConfig())
    task = build_task("copy", tok, task_kwargs=kw)
    lengths = {}
    for step in (0, 45):
        out = generate_step(task, _EchoEngine(tok), cfg, step=step, expected_version="step-0", replay=NoReplay())
        lengths[step] = {len(r) - 1 for r in out.response_ids}
        assert out.rewards == [1.0] * 64
    assert lengths == {0: {1}, 45: {1, 2, 3}}


def test_stats_report_the_last_batch_mean_reward_per_length(tok):
    """``reward/digits_<k>``: mean reward of the scored samples whose operand has k digits, from the rewards
    computed one by one."""
    task = build_task("copy", tok, task_kwargs={"prefix_credit": True})
    assert task.stats() == {}
    prompts = [task.make_prompt(o) for o in ("7", "7", "12", "345")]
    eos = tok.eos_token_id
    responses = [tok.encode("7", add_special_tokens=False) + [eos], tok.encode("77", add_special_tokens=False) + [eos],
                 tok.encode("13", add_special_tokens=False) + [eos], tok.encode("345", add_special_tokens=False) + [eos]]
    want = [task.reward(p, r) for p, r in zip(prompts, responses)]
    assert want == [1.0, 1 / 3, 1 / 3, 1.0]
    task.score(prompts, responses)
    assert task.stats() == pytest.approx({"reward/digits_1": (want[0] + want[1]) / 2, "reward/digits_2": want[2],
                                          "reward/digits_3": want[3]})
    task.score(prompts[2:3], responses[2:3])  # the last batch only
    assert task.stats() == pytest.approx({"reward/digits_2": want[2]})
