"""The held-out split of the digit tasks (``data.task_kwargs.heldout_frac``): training never draws a held-out
operand string, ``heldout_prompts`` enumerates exactly the held-out strings, bad fractions are config errors."""
from __future__ import annotations

import itertools
import random
import zlib

import pytest

from megatron_rl.tasks import build_char_tokenizer, build_task


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _reference_heldout(task: str, digits: range, frac: float) -> set:
    """Brute force over every operand string: the crc32 rule written out independently."""
    out = set()
    for k in digits:
        for t in itertools.product("0123456789", repeat=k):
            s = "".join(t)
            if zlib.crc32(f"{task}:{s}".encode()) % 10_000 < round(frac * 10_000):
                out.add(f"{task}:{s}=")
    return out


def test_heldout_prompts_are_exactly_the_split_and_never_sampled(tok):
    task = build_task("copy", tok, task_kwargs={"min_digits": 1, "max_digits": 3, "heldout_frac": 0.1})
    held = {p.text for p in task.heldout_prompts()}
    assert held == _reference_heldout("copy", range(1, 4), 0.1)
    assert 0.07 * 1110 < len(held) < 0.13 * 1110  # about the fraction of the 1110 strings
    drawn = task.sample(20_000, random.Random(0))
    assert not held & {p.text for p in drawn}
    # without the split the same strings are drawn (the split, not chance, keeps them out)
    plain = build_task("copy", tok, task_kwargs={"min_digits": 1, "max_digits": 3})
    assert held & {p.text for p in plain.sample(20_000, random.Random(0))}
    # answers of held-out prompts are the task's
    for p in task.heldout_prompts()[:5]:
        assert p.answer == p.text.split(":")[1].rstrip("=")


def test_heldout_add_enumerates_operand_pairs(tok):
    task = build_task("add", tok, task_kwargs={"min_digits": 1, "max_digits": 1, "heldout_frac": 0.2})
    held = task.heldout_prompts()
    ref = {f"add:{a}+{b}=" for a in range(10) for b in range(10)
           if zlib.crc32(f"add:{a}+{b}".encode()) % 10_000 < 2000}
    assert {p.text for p in held} == ref
    assert all(p.answer == str(sum(map(int, p.text[4:-1].split("+")))) for p in held)


@pytest.mark.parametrize("bad", [-0.1, 0.6, True, "0.1"])
def test_bad_heldout_frac_names_the_key(tok, bad):
    with pytest.raises(ValueError, match="data.task_kwargs.heldout_frac"):
        build_task("copy", tok, task_kwargs={"heldout_frac": bad})


def test_no_split_and_oversized_space_are_errors(tok):
    with pytest.raises(ValueError, match="heldout_frac is 0"):
        build_task("copy", tok).heldout_prompts()
    with pytest.raises(ValueError, match="too many to enumerate"):
        build_task("copy", tok, task_kwargs={"max_digits": 7, "heldout_frac": 0.1}).heldout_prompts()


def test_every_prompt_covers_each_string_once_and_marks_the_split(tok):
    task = build_task("copy", tok, task_kwargs={"min_digits": 1, "max_digits": 3, "heldout_frac": 0.1})
    every = task.every_prompt()
    ref = {f"copy:{''.join(t)}=" for k in range(1, 4) for t in itertools.product("0123456789", repeat=k)}
    assert len(every) == 1110 and {p.text for p in every} == ref
    assert {p.text for p in every if task.is_heldout(p)} == _reference_heldout("copy", range(1, 4), 0.1)
    assert [task.operand_digits(p) for p in every].count(2) == 100
    assert task.operand_digits(build_task("add", tok).make_prompt("7+345")) == 3
    plain = build_task("copy", tok)  # no split: nothing is held out, every string is still enumerated
    assert len(plain.every_prompt()) == 1110 and not any(plain.is_heldout(p) for p in plain.every_prompt())
    with pytest.raises(ValueError, match="too many to enumerate"):
        build_task("copy", tok, task_kwargs={"max_digits": 7}).every_prompt()
