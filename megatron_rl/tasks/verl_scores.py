# Ported from verl (Apache License 2.0; Copyright 2024 Bytedance Ltd. and/or its affiliates; the MATH
# normalisation: Copyright 2022 EleutherAI and the HuggingFace Inc. team), verl 0.9.1,
# verl/utils/reward_score/{gsm8k,math_dapo,math_reward}.py. The rules are kept as verl has them, quirks included.
"""verl's rule-based scorers for its data sources, ported so a ``data_source`` row scores what verl scores.

Each function cites the verl file it reproduces; ``tests/unit/test_verl_scores.py`` compares them with verl's
own files (``tests/data/verl/reward_score/``) on the same responses. The one rule to keep: these are ports,
not improvements -- a difference from verl is a bug, even where verl's rule looks wrong (``gsm8k`` compares
strings, ``math_dapo`` reads the last 300 characters only). Scales: ``gsm8k`` and ``math_reward`` 0 / 1,
``math_dapo`` a dict ``{"score": +1 / -1, "acc": bool, "pred": str}`` (docs/datasets.md).
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["gsm8k_score", "math_dapo_score", "math_reward_score"]


# ---- gsm8k ---------------------------------------------------------------------------------------------------

_GSM8K_CLIP_CHARS = 300


def gsm8k_extract(solution_str: str, method: str = "strict") -> Optional[str]:
    """verl 0.9.1 ``verl/utils/reward_score/gsm8k.py`` ``extract_solution``: the last ``#### <number>`` of the
    last 300 characters (commas and ``$`` removed) for ``"strict"``; the last number-like token that is not
    ``""`` / ``"."`` for ``"flexible"`` (verl keeps the last token it looked at when all are invalid)."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k scorer: method={method!r} is not 'strict' or 'flexible'")
    if len(solution_str) > _GSM8K_CLIP_CHARS:
        solution_str = solution_str[-_GSM8K_CLIP_CHARS:]
    if method == "strict":
        solutions = re.findall("#### (\\-?[0-9\\.\\,]+)", solution_str)
        return solutions[-1].replace(",", "").replace("$", "") if solutions else None
    answer = re.findall("(\\-?[0-9\\.\\,]+)", solution_str)
    final_answer = None
    for final_answer in reversed(answer):
        if final_answer not in ("", "."):
            break
    return final_answer


def gsm8k_score(solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0,
                score: float = 1.0) -> float:
    """verl 0.9.1 ``verl/utils/reward_score/gsm8k.py`` ``compute_score`` (through ``default_compute_score``,
    which makes it a float): ``score`` when the extracted answer equals ``ground_truth`` as a string,
    ``format_score`` when an answer was found but differs, 0 when none was found."""
    answer = gsm8k_extract(solution_str, method)
    if answer is None:
        return 0.0
    return float(score if answer == ground_truth else format_score)


# ---- math_reward (MATH: lighteval/MATH, MATH-500) -------------------------------------------------------------

def _math_remove_boxed(s: str) -> str:
    """verl's ``math_reward.remove_boxed`` (its asserts raise ``AssertionError``, which ``compute_score`` catches)."""
    if "\\boxed " in s:
        left = "\\boxed "
        assert s[:len(left)] == left
        return s[len(left):]
    left = "\\boxed{"
    assert s[:len(left)] == left
    assert s[-1] == "}"
    return s[len(left):-1]


def _math_last_boxed_only_string(string: str) -> Optional[str]:
    """verl's ``math_reward.last_boxed_only_string``: ``\\boxed <x>`` up to the next ``$``, else the last
    ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else None."""
    idx = string.rfind("\\boxed")
    if "\\boxed " in string:
        return "\\boxed " + string.split("\\boxed ")[-1].split("$")[0]
    if idx < 0:
        idx = string.rfind("\\fbox")
        if idx < 0:
            return None
    end = _closing_brace(string, idx)
    return None if end is None else string[idx:end + 1]


def _closing_brace(string: str, start: int) -> Optional[int]:
    """Index of the brace that closes the first ``{`` at or after ``start`` (verl's scan: braces counted from
    ``start``, the first return to depth 0 after an opening), or None."""
    depth = 0
    for i in range(start, len(string)):
        if string[i] == "{":
            depth += 1
        if string[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def _fix_fracs(string: str) -> str:
    substrs = string.split("\\frac")
    new_str = substrs[0]
    for substr in substrs[1:]:
        new_str += "\\frac"
        if substr[0] == "{":
            new_str += substr
        else:
            if len(substr) < 2:
                return string
            a, b = substr[0], substr[1]
            if b != "{":
                new_str += "{" + a + "}{" + b + "}" + substr[2:]
            else:
                new_str += "{" + a + "}" + b + substr[2:]
    return new_str


def _fix_a_slash_b(string: str) -> str:
    if len(string.split("/")) != 2:
        return string
    a, b = string.split("/")
    try:
        a, b = int(a), int(b)
        assert string == "{}/{}".format(a, b)
        return "\\frac{" + str(a) + "}{" + str(b) + "}"
    except Exception:  # noqa: BLE001 - verl's rule: anything else stays as it is
        return string


def _remove_right_units(string: str) -> str:
    if "\\text{ " in string:
        splits = string.split("\\text{ ")
        assert len(splits) == 2
        return splits[0]
    return string


def _fix_sqrt(string: str) -> str:
    if "\\sqrt" not in string:
        return string
    splits = string.split("\\sqrt")
    new_string = splits[0]
    for split in splits[1:]:
        if split[0] != "{":
            new_string += "\\sqrt{" + split[0] + "}" + split[1:]
        else:
            new_string += "\\sqrt" + split
    return new_string


def _strip_string(string: str) -> str:
    """verl's ``math_reward.strip_string`` (the hendrycks MATH normalisation), step for step."""
    string = string.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    string = string.replace("tfrac", "frac").replace("dfrac", "frac")
    string = string.replace("\\left", "").replace("\\right", "")
    string = string.replace("^{\\circ}", "").replace("^\\circ", "")
    string = string.replace("\\$", "")
    string = _remove_right_units(string)
    string = string.replace("\\\\%", "").replace("\\%", "")
    string = string.replace(" .", " 0.").replace("{.", "{0.")
    if len(string) == 0:
        return string
    if string[0] == ".":
        string = "0" + string
    if len(string.split("=")) == 2 and len(string.split("=")[0]) <= 2:
        string = string.split("=")[1]
    string = _fix_sqrt(string)
    string = string.replace(" ", "")
    string = _fix_fracs(string)
    if string == "0.5":
        string = "\\frac{1}{2}"
    return _fix_a_slash_b(string)


def _math_is_equiv(str1: Optional[str], str2: Optional[str]) -> bool:
    """verl's ``math_reward.is_equiv``: equal after ``_strip_string`` (raw equality if that raises)."""
    if str1 is None and str2 is None:
        return True
    if str1 is None or str2 is None:
        return False
    try:
        return _strip_string(str1) == _strip_string(str2)
    except Exception:  # noqa: BLE001 - verl's fallback
        return str1 == str2


def math_reward_score(solution_str: str, ground_truth: Any) -> float:
    """verl 0.9.1 ``verl/utils/reward_score/math_reward.py`` ``compute_score`` (the ``lighteval/MATH``,
    ``DigitalLearningGmbH/MATH-lighteval`` and ``HuggingFaceH4/MATH-500`` sources): 1.0 when the last boxed
    answer equals ``ground_truth`` after the hendrycks MATH normalisation, else 0.0 (an error while reading the
    box -- verl prints it -- scores 0.0)."""
    try:
        boxed = _math_last_boxed_only_string(solution_str)
        if boxed is not None and _math_is_equiv(_math_remove_boxed(boxed), ground_truth):
            return 1.0
    except Exception:  # noqa: BLE001 - verl catches everything here and scores 0
        pass
    return 0.0


# ---- math_dapo (math_dapo, math, math_dapo_reasoning, aime*) ---------------------------------------------------

def _dapo_last_boxed_only_string(string: str) -> Optional[str]:
    """verl's ``math_dapo.last_boxed_only_string``: the last ``\\boxed{...}`` with balanced braces, or None."""
    idx = string.rfind("\\boxed{")
    if idx < 0:
        return None
    end = _closing_brace(string, idx)
    return None if end is None else string[idx:end + 1]


def _dapo_remove_boxed(s: str) -> str:
    left = "\\boxed{"
    assert s[:len(left)] == left, f"box error: {s}"
    assert s[-1] == "}", f"box error: {s}"
    return s[len(left):-1]


_DAPO_SUBSTITUTIONS: List[Tuple[str, str]] = [
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
]
_DAPO_REMOVED = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots",
]


def dapo_normalize_final_answer(final_answer: str) -> str:
    """verl's ``math_dapo.normalize_final_answer`` (Minerva's normalisation): the text after the last ``=``,
    substitutions and removals, ``$...$`` / ``\\text{}`` / ``\\textbf{}`` / ``\\overline{}`` / ``\\boxed{}``
    unwrapped, shorthand ``\\frac`` / ``\\sqrt`` braced, ``$`` dropped, digit-only numbers without commas."""
    final_answer = final_answer.split("=")[-1]
    for before, after in _DAPO_SUBSTITUTIONS:
        final_answer = final_answer.replace(before, after)
    for expr in _DAPO_REMOVED:
        final_answer = final_answer.replace(expr, "")
    final_answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", final_answer)
    final_answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", final_answer)
    final_answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", final_answer)
    final_answer = final_answer.replace("$", "")
    if final_answer.replace(",", "").isdigit():
        final_answer = final_answer.replace(",", "")
    return final_answer.strip()


def _dapo_is_correct_minerva(solution_str: str, gt: str,
                             answer_pattern: str = r"(?i)Answer\s*:\s*([^\n]+)") -> Tuple[bool, str]:
    match = re.findall(answer_pattern, solution_str)
    pred = dapo_normalize_final_answer(match[-1] if match else "[INVALID]")
    return pred == dapo_normalize_final_answer(gt), pred


def _dapo_is_correct_strict_box(pred: str, gt: str,
                                pause_tokens_index: Optional[List[int]] = None) -> Tuple[int, Optional[str]]:
    if pause_tokens_index is not None:
        assert len(pause_tokens_index) == 4
        pred = pred[pause_tokens_index[-1] - 100:]
    else:
        pred = pred[-100:]
    boxed = _dapo_last_boxed_only_string(pred)
    extracted = _dapo_remove_boxed(boxed) if boxed is not None else None
    return (1 if extracted == gt else -1), extracted


def _dapo_verify(solution_str: str, answer: str, strict_box_verify: bool,
                 pause_tokens_index: Optional[List[int]]) -> Tuple[bool, Optional[str]]:
    """verl 0.9.1's ``math_dapo.verify``: Minerva (``Answer: ...``) first; when it finds no answer line, the
    strict ``\\boxed{}`` of the last 100 characters."""
    if strict_box_verify:
        correct, pred = _dapo_is_correct_strict_box(solution_str, answer, pause_tokens_index)
        return correct == 1, pred
    correct, pred = _dapo_is_correct_minerva(solution_str, answer)
    if pred != "[INVALID]":
        return correct, pred
    box_correct, box_pred = _dapo_is_correct_strict_box(solution_str, answer, pause_tokens_index)
    if box_pred is not None:
        return box_correct == 1, box_pred
    return correct, pred


def math_dapo_score(solution_str: str, ground_truth: str, strict_box_verify: bool = False,
                    pause_tokens_index: Optional[List[int]] = None) -> Dict[str, Any]:
    """verl 0.9.1 ``verl/utils/reward_score/math_dapo.py`` ``compute_score`` (the ``math_dapo``, ``math``,
    ``math_dapo_reasoning`` and ``aime*`` sources): on the last 300 characters, ``{"score": 1.0, "acc": True}``
    when the answer matches ``ground_truth`` after Minerva's normalisation (or, without an ``Answer:`` line,
    the last ``\\boxed{}`` equals it exactly), else ``{"score": -1.0, "acc": False}``; ``"pred"`` the extracted
    answer (``"[INVALID]"`` when none, or None)."""
    solution_str = solution_str[-300:]
    correct, pred = _dapo_verify(solution_str, ground_truth, strict_box_verify, pause_tokens_index)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
