"""The ``data_source`` dispatch scores as verl does: ``megatron_rl.tasks.rewards.default_compute_score`` (and the
ports in ``tasks/verl_scores.py``) against verl 0.9.1's own ``default_compute_score`` and scorer modules, vendored
unchanged under ``tests/data/verl/reward_score/`` and loaded here by path, on the same responses: right, wrong,
boxed, ``Answer:`` lines, ``####``, malformed and truncated boxes, number formats, long responses (verl reads
their tail only). Equal means equal: the same float, or the same dict (``score``, ``acc``, ``pred``).

Run: ``OMP_NUM_THREADS=1 pytest tests/unit/test_verl_scores.py -q``
"""
from __future__ import annotations

import importlib.util
import io
import itertools
import json
import sys
import types
from pathlib import Path

import pytest

from megatron_rl.tasks.char_tokenizer import build_char_tokenizer
from megatron_rl.tasks.datasets import FileTask
from megatron_rl.tasks.options import DataOptions
from megatron_rl.tasks.reward_fn import compute_reward_value
from megatron_rl.tasks.rewards import default_compute_score, reward_name_for_source
from megatron_rl.tasks.verl_scores import gsm8k_score, math_dapo_score

VENDORED = Path(__file__).resolve().parents[1] / "data" / "verl" / "reward_score"


@pytest.fixture(scope="module")
def verl_scores():
    """verl's ``verl.utils.reward_score`` package from the vendored files (its one verl import,
    ``verl.utils.import_utils.deprecated``, stood in by a no-op decorator); the modules are removed afterwards."""
    names = ["verl", "verl.utils", "verl.utils.import_utils", "verl.utils.reward_score"]
    saved = {n: sys.modules.get(n) for n in names}
    for n in names[:2]:
        sys.modules[n] = types.ModuleType(n)
    iu = types.ModuleType("verl.utils.import_utils")
    iu.deprecated = lambda *a, **k: (lambda fn: fn)
    sys.modules["verl.utils.import_utils"] = iu
    spec = importlib.util.spec_from_file_location("verl.utils.reward_score", VENDORED / "__init__.py",
                                                  submodule_search_locations=[str(VENDORED)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["verl.utils.reward_score"] = pkg
    spec.loader.exec_module(pkg)
    from verl.utils.reward_score import gsm8k, math_dapo, math_reward  # noqa: E402  (the vendored files)
    yield types.SimpleNamespace(default_compute_score=pkg.default_compute_score, gsm8k=gsm8k, math_dapo=math_dapo,
                                math_reward=math_reward)
    for n in list(sys.modules):
        if n == "verl" or n.startswith("verl."):
            del sys.modules[n]
    sys.modules.update({n: m for n, m in saved.items() if m is not None})


FILLER = "Let me think about this carefully. " * 12   # > 300 characters: verl scores the tail only

RESPONSES = [
    "So she sold 48 + 24 = 72 clips.\n#### 72",
    "#### 72.0", "#### 1,234", "#### -5", "#### $18", "#### 72 dollars", "The answer is 72.", "####72",
    "#### ", "72", "", "...", "#### 7 2",
    "\\boxed{72}", "The answer is \\boxed{\\frac{1}{2}}.", "\\boxed{\\dfrac{1}{2}}", "\\boxed{0.5}", "\\boxed{1/2}",
    "\\boxed{\\frac12}", "\\boxed 72$", "\\fbox{72}", "\\boxed{72", "so \\boxed{\\frac{3}{4}", "\\boxed{}",
    "\\boxed{1,234}", "\\boxed{1234}", "\\boxed{5\\%}", "\\boxed{x = 72}", "\\boxed{\\text{(A)}}", "\\boxed{-5}",
    "Answer: 72", "answer : 72", "Answer: $72$", "Answer: 72 dollars", "Answer: x = 72", "Answer: \\frac{1}{2}",
    "Answer: 1,234", "Answer: 1/2", "Answer: \\boxed{72}", "Answer: 71\nAnswer: 72", "Answer: 72\n\\boxed{71}",
    "Answer:", "Answer: (A)", "Answer: -5 degrees", "Answer: \\text{18 cm}",
    FILLER + "#### 72", "#### 72\n" + FILLER, FILLER + "Answer: 72", "Answer: 72\n" + FILLER, FILLER + "\\boxed{72}",
    "\\boxed{72}" + "x" * 95, "\\boxed{72}" + "x" * 120,
]
TRUTHS = ["72", "1234", "-5", "18", "\\frac{1}{2}", "0.5", "1/2", "\\frac{3}{4}", "(A)", "5"]
VERL_SOURCES = ["openai/gsm8k", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500",
                "math_dapo", "math", "math_dapo_reasoning", "aime2024", "aime25"]


def _same(ours, theirs):
    """Equal values of the same kind (a float for a float, a dict with equal items and value types)."""
    if isinstance(theirs, dict):
        return isinstance(ours, dict) and ours == theirs and all(type(ours[k]) is type(v) for k, v in theirs.items())
    return type(ours) is float and type(theirs) is float and ours == theirs


def test_dispatch_matches_verls_default_compute_score(verl_scores):
    diffs = []
    for source, resp, gt in itertools.product(VERL_SOURCES, RESPONSES, TRUTHS):
        ours, theirs = default_compute_score(source, resp, gt), verl_scores.default_compute_score(source, resp, gt)
        if not _same(ours, theirs):
            diffs.append((source, resp[-60:], gt, ours, theirs))
    assert not diffs, f"{len(diffs)} differences, first: {diffs[:3]}"
    # the set exercises both outcomes of every scorer (not a set that only ever scores 0)
    for source in ("openai/gsm8k", "lighteval/MATH", "math_dapo"):
        values = {str(verl_scores.default_compute_score(source, r, g)) for r, g in itertools.product(RESPONSES, TRUTHS)}
        assert len(values) > 1, source


def test_verl_scales_and_dict(verl_scores):
    """math_dapo is +-1 with acc and pred (the overlong penalty then sits on a span of 2), gsm8k / MATH are 0 / 1."""
    assert default_compute_score("math_dapo", "Answer: 72", "72") == {"score": 1.0, "acc": True, "pred": "72"}
    assert default_compute_score("aime2024", "Answer: 71", "72") == {"score": -1.0, "acc": False, "pred": "71"}
    assert default_compute_score("openai/gsm8k", "#### 71", "72") == 0.0
    assert default_compute_score("lighteval/MATH", "\\boxed{71}", "72") == 0.0
    # through the reward path: the dict's score is the reward, acc an extra (1.0 / 0.0), pred (a string) dropped
    v = compute_reward_value("source", "q", "Answer: 71", "72", data_source="math_dapo")
    assert (v.score, v.extras, v.other_keys) == (-1.0, {"acc": 0.0}, ("pred",))


@pytest.mark.parametrize("alias, verl_name", [("gsm8k", "openai/gsm8k"),
                                              ("BytedTsinghua-SIA/DAPO-Math-17k", "math_dapo"),
                                              ("AI-MO/aimo-validation-aime", "math_dapo"), ("AIME2024", "aime2024")])
def test_project_aliases_score_with_the_verl_rule_of_their_source(verl_scores, alias, verl_name):
    for resp, gt in itertools.product(RESPONSES, TRUTHS):
        assert _same(default_compute_score(alias, resp, gt), verl_scores.default_compute_score(verl_name, resp, gt))


def test_scorer_options_match_verls_functions(verl_scores):
    """Options verl's scorer functions take (``data.reward_kwargs`` reaches them here): gsm8k's flexible extraction
    and its format / correct scores, math_dapo's strict box check."""
    for resp, gt in itertools.product(RESPONSES, TRUTHS):
        for kw in ({"method": "flexible"}, {"method": "strict", "format_score": 0.1, "score": 2.0}):
            assert gsm8k_score(resp, gt, **kw) == float(verl_scores.gsm8k.compute_score(resp, gt, **kw))
        assert math_dapo_score(resp, gt, strict_box_verify=True) == verl_scores.math_dapo.compute_score(
            resp, gt, strict_box_verify=True)


def test_numina_sources_are_not_verls_scorer():
    """verl scores numina_* with prime_math (not ported: sympy + pylatexenc); here math-verify, named as such."""
    assert reward_name_for_source("numina_olympiads") == "math"
    assert reward_name_for_source("openai/gsm8k") == "verl:gsm8k"
    assert reward_name_for_source("math") == "verl:math_dapo"


def test_a_file_with_numina_rows_says_they_are_not_verls_scorer(tmp_path):
    path = tmp_path / "n.jsonl"
    path.write_text("".join(json.dumps({"prompt": "copy:1=", "answer": "1", "data_source": s}) + "\n"
                            for s in ("numina_olympiads", "math_dapo")))
    out = io.StringIO()
    FileTask(path, build_char_tokenizer(), options=DataOptions(reward_workers=0), report=out)
    said = out.getvalue()
    assert "data_source numina_olympiads: verl scores these with its prime_math scorer, which is not ported" in said
    assert "math_dapo" not in said


def test_reward_kwargs_that_a_rows_scorer_does_not_take_are_refused_at_load(tmp_path):
    """With data.reward_fn unset each row's data_source picks its scorer, and data.reward_kwargs reach every one of
    them: kwargs one of them does not take (math's ``extract`` on a gsm8k row, anything on a row without a
    data_source: exact match) would fail every such sample at run time; the file check names the key, the source
    and what that scorer takes. Kwargs every scorer takes pass."""
    from types import SimpleNamespace

    from megatron_rl.tasks.datasets import scorable_rows

    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (
        {"prompt": "q1", "answer": "1", "data_source": "openai/gsm8k"},
        {"prompt": "q2", "answer": "2", "data_source": "numina_olympiads"})))
    data = SimpleNamespace(prompt_key="prompt", answer_key="answer", reward_fn=None,
                           reward_kwargs={"extract": ["hash"]})
    with pytest.raises(ValueError, match=r"data.reward_kwargs: 'extract' is not an argument of its scorer gsm8k_score "
                                         r"\(it takes method, .*the data_source 'openai/gsm8k'"):
        scorable_rows(path, data)
    data.reward_kwargs = {}
    assert len(scorable_rows(path, data).rows) == 2
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"prompt": "q", "answer": "1", "data_source": "openai/gsm8k"}) + "\n")
    data.reward_kwargs = {"method": "flexible"}
    assert len(scorable_rows(gsm, data).rows) == 1
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"prompt": "q", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match="rows without a data_source .* exact match"):
        scorable_rows(plain, data)


FUZZ_TOKENS = ["\\boxed{", "\\boxed ", "}", "{", "$", "\\$", "Answer:", "answer :", "####", "#### ", "1", "72", ",",
               ".", " ", "\n", "-", "\\frac", "\\dfrac", "12", "/", "\\sqrt", "3", "=", "x", "\\text{ ", "cm",
               "\\text{", "\\left(", "\\right)", "^\\circ", "\\%", "a ", "an ", "\\fbox{", "0.5", "(A)", "\\!", "\\\\",
               "dollars", "[INVALID]", "\\overline{", "\\textbf{"]


def test_seeded_random_responses_score_as_verls_files(verl_scores):
    """Responses and ground truths drawn (seeded) from the tokens verl's rules react to -- boxes (balanced or not),
    ``Answer:`` lines, ``####``, fractions, units, ``$``, long tails, an answer or a box near the edge of the 300- /
    100-character windows: the dispatch equals verl's on every one, exceptions included (same type), for every
    ported source."""
    import contextlib
    import random

    rnd = random.Random(46)
    truths = ["72", "1/2", "\\frac{1}{2}", "0.5", "12", "-1", "(A)", "3", "x=3", "1,2", "\\sqrt{3}", "1.", "{", "$1$",
              ""]
    diffs = []
    for _ in range(4000):
        resp = "".join(rnd.choice(FUZZ_TOKENS) for _ in range(rnd.randint(0, 14)))
        if rnd.random() < 0.05:
            resp = "y" * rnd.randint(250, 320) + resp
        if rnd.random() < 0.15:   # a tail around the strict box's 100-character window
            resp = resp + "\\boxed{72}" + "z" * rnd.randint(80, 100)
        elif rnd.random() < 0.15:   # an answer around the 300-character tail verl's gsm8k / math_dapo read
            resp = resp + rnd.choice(["#### 72", "Answer: 72"]) + "\n" + "z" * rnd.randint(280, 300)
        gt = rnd.choice(truths) if rnd.random() < 0.7 else "".join(rnd.choice(FUZZ_TOKENS) for _ in range(4))
        if resp.endswith("z") and rnd.random() < 0.5:
            gt = "72"   # the tail's answer: found or not decides the score
        source = rnd.choice(["openai/gsm8k", "lighteval/MATH", "math_dapo", "aime24"])
        outcome = []
        for fn in (default_compute_score, verl_scores.default_compute_score):
            try:
                with contextlib.redirect_stdout(io.StringIO()):   # verl's math_reward prints its errors
                    outcome.append(("ok", fn(source, resp, gt)))
            except Exception as e:  # noqa: BLE001 - the same failure is part of the same behaviour
                outcome.append(("raised", type(e).__name__))
        ours, theirs = outcome
        same = ours[0] == theirs[0] and (_same(ours[1], theirs[1]) if ours[0] == "ok" else ours[1] == theirs[1])
        if not same:
            diffs.append((source, resp, gt, ours, theirs))
    assert not diffs, f"{len(diffs)} differences, first: {diffs[:3]}"
