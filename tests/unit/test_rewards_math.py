"""The math reward: answer extraction (boxed / #### / last number, configurable) and math-verify equivalence,
a hand-written table of answer / ground-truth pairs with their expected rewards, math-verify's own verdict
as an independent reference, verl's data_source dispatch and verl-style ``module:function`` rewards.

Run: ``OMP_NUM_THREADS=1 pytest tests/unit/test_rewards_math.py -q``
"""
from __future__ import annotations

import sys

import pytest

from megatron_rl.tasks.reward_fn import compute_reward, load_reward_fn
from megatron_rl.tasks.rewards import default_compute_score, extract_answer, math_reward

mv = pytest.importorskip("math_verify")

# (response text, ground truth, expected reward) — equivalent forms score 1, wrong answers 0
TABLE = [
    ("So the answer is \\boxed{0.5}.", "1/2", 1.0),
    ("So the answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("Half of it: \\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("4 / 8 = 1/2\n#### 1/2", "0.5", 1.0),
    ("Each person gets 0.5 of a pizza.", "\\frac{1}{2}", 1.0),           # last number
    ("The rope is \\boxed{5\\text{ cm}} long.", "5", 1.0),               # units in LaTeX
    ("The rope is 5 cm long.", "5", 1.0),                               # units in text
    ("She pays $18 in total.\n#### 18 dollars", "18", 1.0),
    ("They have \\boxed{1,000} stamps.", "1000", 1.0),
    ("In total 1,250 apples.", "1250", 1.0),
    ("12 + 60 = 72\n#### 72", "72", 1.0),
    ("\\boxed{18.0}", "18", 1.0),
    ("\\boxed{x + 1}", "1 + x", 1.0),
    ("\\boxed{50\\%}", "0.5", 1.0),
    ("First I got 3, then \\boxed{4}. Check: 3", "4", 1.0),             # boxed beats the last number
    ("12 + 61 = 73\n#### 73", "72", 0.0),                               # wrong
    ("\\boxed{2}", "\\frac{1}{2}", 0.0),                                # wrong
    ("The answer is 0.49", "1/2", 0.0),                                 # close is wrong
    ("I do not know.", "3", 0.0),                                       # no answer
    ("", "3", 0.0),
    ("\\boxed{}", "3", 0.0),                                            # empty box, no number
]


@pytest.mark.parametrize("response,truth,expected", TABLE)
def test_math_reward_table(response, truth, expected):
    assert math_reward(response, truth) == expected


@pytest.mark.parametrize("response,truth,expected", [r for r in TABLE if "\\boxed{" in r[0] and r[0] != "\\boxed{}"])
def test_boxed_rows_agree_with_math_verify_itself(response, truth, expected):
    """Independent reference: math-verify's own parse of the whole response (its boxed extraction) and
    of the ground truth in $...$."""
    gold = mv.parse(f"${truth}$")
    pred = mv.parse(response)
    assert float(mv.verify(gold, pred)) == expected == math_reward(response, truth)


def test_extractors_are_configurable():
    text = "Step: 40 + 32 = 72\n#### 72 apples, \\boxed{71} and finally 70"
    assert extract_answer(text) == "71"                                 # boxed, hash, last_number
    assert extract_answer(text, ("hash",)) == "72"                      # the number #### starts with
    assert extract_answer("#### 2^{10}", ("hash",)) == "2^{10}"          # else the rest of the line
    assert extract_answer("#### x^2 + 1\nmore", ("hash",)) == "x^2 + 1"
    assert extract_answer("#### \\$3.5 per hour", ("hash",)) == "3.5"
    assert extract_answer(text, ("last_number",)) == "70"
    assert extract_answer("a \\boxed{\\frac{1}{\\sqrt{2}}} b", ("boxed",)) == "\\frac{1}{\\sqrt{2}}"  # nested braces
    assert extract_answer("no box here 5", ("boxed",)) is None
    assert math_reward("#### 72", "72", extract=("boxed",)) == 0.0       # only boxed: nothing found
    assert math_reward("#### 72", "72", extract=("hash",)) == 1.0
    assert math_reward("\\boxed{72} then 5", "5", extract=("last_number",)) == 1.0
    assert math_reward("\\boxed{72}", "72", correct=2.0) == 2.0
    assert math_reward("\\boxed{7}", ["72", "7"]) == 1.0                 # a list of acceptable answers
    with pytest.raises(ValueError, match="unknown extractor 'final'"):
        extract_answer("x", ("final",))


def test_missing_math_verify_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ImportError, match=r"pip install 'megatron-rl\[math\]'"):
        math_reward("\\boxed{1}", "1")


def test_data_source_dispatch_like_verl():
    assert default_compute_score("openai/gsm8k", "... #### 72", "72") == 1.0
    assert default_compute_score("lighteval/MATH", "\\boxed{\\frac12}", "0.5") == 1.0
    assert default_compute_score("numina_olympiads", "\\boxed{3}", "4") == 0.0
    with pytest.raises(ValueError, match="data_source='my/unknown' has no built-in reward"):
        default_compute_score("my/unknown", "1", "1")
    # through the spec layer: "source" dispatches, "math" / "exact" are the built-ins
    assert compute_reward("source", "q", "#### 72", "72", data_source="openai/gsm8k") == 1.0
    assert compute_reward("math", "q", "#### 72.0", "72") == 1.0
    assert compute_reward("exact", "q", " 72 ", "72") == 1.0 and compute_reward("exact", "q", "72.0", "72") == 0.0
    assert compute_reward("math", "q", "\\boxed{7}", "7", kwargs={"extract": ["hash"]}) == 0.0


VERL_STYLE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if (data_source, solution_str, ground_truth, extra_info["k"]) == ("src", "resp", "gt", 7) else 0.5

def ours(prompt_text, response_text, answer, bonus=0.0):
    return (1.0 if response_text == answer else 0.0) + bonus
'''


def test_verl_style_and_own_style_module_functions(tmp_path):
    f = tmp_path / "verl_style_rewards.py"
    f.write_text(VERL_STYLE)
    verl = load_reward_fn(f"{f}:compute_score")
    assert verl.verl_style
    assert verl("prompt", "resp", "gt", data_source="src", extra_info={"k": 7}) == 1.0
    assert compute_reward(f"{f}:compute_score", "p", "resp", "gt", "src", {"k": 7}) == 1.0
    assert compute_reward(f"{f}:compute_score", "p", "resp", "gt", "other", {"k": 7}) == 0.5
    ours = load_reward_fn(f"{f}:ours")
    assert not ours.verl_style
    assert compute_reward(f"{f}:ours", "p", "a", "a", kwargs={"bonus": 0.5}) == 1.5
