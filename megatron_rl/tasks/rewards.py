"""Verifiable rewards for reasoning datasets: the ``math`` reward (checked with math-verify) and the
dispatch by ``data_source`` that verl's ``default_compute_score`` does.

``math_reward(response_text, ground_truth)`` extracts the final answer (``extract``: boxed, ``####``, last number)
and compares it with math-verify: 1.0 when equivalent, else 0.0. math-verify is an optional extra; without it the
call raises an ``ImportError`` that says so, and its own signal-based timeouts are off (the reward pool bounds
every call). ``default_compute_score`` (verl's signature) scores by ``data_source`` with verl's own rules; an
unknown source is a ``ValueError`` naming it. The extractors, sources and scales: docs/datasets.md.

    default_compute_score("openai/gsm8k", "... #### 72", "72")                # -> 1.0 (verl's gsm8k rule)
"""
from __future__ import annotations

import logging
import re
from typing import Any, Dict, Optional, Sequence, Union

from megatron_rl.braces import closing_brace
from megatron_rl.tasks.verl_scores import gsm8k_score, math_dapo_score, math_reward_score

#: The answer extractors ``math_reward`` knows, in their default order.
EXTRACTORS = ("boxed", "hash", "last_number")

#: ``data_source`` -> the scorer ``default_compute_score`` uses (a key of ``SOURCE_SCORERS``): verl 0.9.1's
#: ``verl/utils/reward_score/__init__.py`` dispatch for the names it knows; the others are this project's aliases
#: (``gsm8k``, ``BytedTsinghua-SIA/DAPO-Math-17k``, ``AI-MO/aimo-validation-aime``) and sources. Sources that start
#: with one of ``SOURCE_PREFIXES``' keys (case-insensitive) map to its value.
SOURCE_REWARDS = {
    "openai/gsm8k": "verl:gsm8k",
    "gsm8k": "verl:gsm8k",
    "lighteval/MATH": "verl:math_reward",
    "DigitalLearningGmbH/MATH-lighteval": "verl:math_reward",
    "HuggingFaceH4/MATH-500": "verl:math_reward",
    "math": "verl:math_dapo",
    "math_dapo": "verl:math_dapo",
    "math_dapo_reasoning": "verl:math_dapo",
    "BytedTsinghua-SIA/DAPO-Math-17k": "verl:math_dapo",
    "AI-MO/aimo-validation-aime": "verl:math_dapo",
    # verl scores these with prime_math (sympy-based, not ported): here math-verify, on the same 0 / 1 scale
    "numina_aops_forum": "math",
    "numina_synthetic_math": "math",
    "numina_amc_aime": "math",
    "numina_synthetic_amc": "math",
    "numina_olympiads": "math",
    "numina_cn_k12": "math",
    "megatron_rl/arith_tiny": "math",
}
#: The sources verl scores with a scorer not ported here (verl's prime_math): ``SOURCE_REWARDS`` gives them the
#: math reward, and a data file with such rows says so when it loads (``FileTask``).
UNPORTED_VERL_SOURCES = ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                         "numina_olympiads", "numina_cn_k12")
#: Prefix rules of the dispatch (checked after the exact names, case-insensitive: verl's ``aime`` rule is
#: case-sensitive and has no ``numina_`` / ``math`` prefix rules; these are a superset of its names).
SOURCE_PREFIXES = {"aime": "verl:math_dapo", "numina_": "math", "math": "math"}

_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*-?\d+(?:\.\d+)?)?")
_HASH_NUMBER = re.compile(r"\s*(?:\\?\$)?\s*(" + _NUMBER.pattern + r")(?![\w^{}\\])")
_THOUSANDS = re.compile(r"(?<![\d.])(\d{1,3}(?:,\d{3})+)(?![\d,])")


def _last_braced(text: str, command: str) -> Optional[str]:
    """The content of the last ``\\command{...}`` in ``text`` (balanced braces), or None."""
    start = text.rfind("\\" + command)
    while start >= 0:
        i = start + len(command) + 1
        while i < len(text) and text[i] == " ":
            i += 1
        j = closing_brace(text, i) if i < len(text) and text[i] == "{" else -1
        if j >= 0:
            return text[i + 1:j]
        start = text.rfind("\\" + command, 0, start)
    return None


def extract_answer(text: str, extract: Sequence[str] = EXTRACTORS) -> Optional[str]:
    """The final answer of ``text`` by the first extractor of ``extract`` that finds one (see the module
    docstring), stripped; None when none does. Unknown extractor names raise ``ValueError``."""
    if isinstance(extract, str):
        extract = (extract,)
    for name in extract:
        if name not in EXTRACTORS:
            raise ValueError(f"math reward: extract={list(extract)!r}: unknown extractor {name!r}; "
                             f"use some of {list(EXTRACTORS)}")
    for name in extract:
        if name == "boxed":
            found = _last_braced(text, "boxed")
            if found is None:
                found = _last_braced(text, "fbox")
        elif name == "hash":
            k = text.rfind("####")
            found = text[k + 4:].split("\n", 1)[0] if k >= 0 else None
            lead = _HASH_NUMBER.match(found) if found is not None else None
            if lead:  # "#### $18 dollars" -> "18", as verl's GSM8K scorer reads it
                found = lead.group(1)
        else:
            numbers = _NUMBER.findall(text)
            found = numbers[-1] if numbers else None
        if found is not None and found.strip():
            return found.strip()
    return None


def _math_verify():
    try:
        import math_verify
    except ImportError as e:
        raise ImportError("the math reward (data.reward_fn: math, or a math data_source) needs the "
                          "'math-verify' package: pip install 'megatron-rl[math]' (or pip install "
                          "math-verify)") from e
    # its "timeout is disabled" warning: intended here (the reward pool bounds each call)
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return math_verify


def math_verify_error() -> Optional[str]:
    """Why the math reward cannot run here (math-verify missing or failing to import), or None."""
    try:
        _math_verify()
    except ImportError as e:
        cause = e.__cause__ if e.__cause__ is not None else e
        return f"{e} ({type(cause).__name__}: {cause})"
    return None


def _parse(mv, answer: str):
    """math-verify's parse of one answer string, read as the content of a ``\\boxed{}``."""
    answer = _THOUSANDS.sub(lambda m: m.group(1).replace(",", ""), answer.strip())
    if "\\boxed" not in answer:
        answer = "\\boxed{" + answer + "}"
    configs = [mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig()]
    return mv.parse(answer, configs, parsing_timeout=None)


def math_reward(response_text: str, ground_truth: Any, extract: Sequence[str] = EXTRACTORS,
                correct: float = 1.0, incorrect: float = 0.0) -> float:
    """``correct`` if the final answer of ``response_text`` (see ``extract_answer``) is mathematically
    equivalent to ``ground_truth`` by math-verify, else ``incorrect``. ``ground_truth`` may be a string, a
    number, or a list of acceptable answers (any match counts)."""
    mv = _math_verify()
    answer = extract_answer(str(response_text), extract)
    if answer is None:
        return float(incorrect)
    golds = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    pred = _parse(mv, answer)
    if not pred:
        return float(incorrect)
    for gold in golds:
        g = _parse(mv, str(gold))
        if g and mv.verify(g, pred, timeout_seconds=None):
            return float(correct)
    return float(incorrect)


def exact_match(response_text: str, ground_truth: Any) -> float:
    """1.0 if the stripped response equals ``str(ground_truth).strip()``, else 0.0."""
    return 1.0 if str(response_text).strip() == str(ground_truth).strip() else 0.0


#: Built-in reward names (``data.reward_fn``) -> functions of ``(response_text, ground_truth, **kwargs)``.
BUILTIN_REWARDS = {"math": math_reward, "exact": exact_match}

#: The scorers of the ``data_source`` dispatch -> functions of ``(solution_str, ground_truth, **kwargs)``.
SOURCE_SCORERS = {"math": math_reward, "verl:gsm8k": gsm8k_score, "verl:math_reward": math_reward_score,
                  "verl:math_dapo": math_dapo_score}


def reward_name_for_source(data_source: Optional[str]) -> Optional[str]:
    """The built-in reward name for ``data_source`` (``SOURCE_REWARDS`` then ``SOURCE_PREFIXES``), or None."""
    if not data_source:
        return None
    if data_source in SOURCE_REWARDS:
        return SOURCE_REWARDS[data_source]
    low = data_source.lower()
    for prefix, name in SOURCE_PREFIXES.items():
        if low.startswith(prefix):
            return name
    return None


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None,
                          **kwargs) -> Union[float, Dict[str, Any]]:
    """verl's ``default_compute_score``: the scorer for ``data_source`` (``reward_name_for_source``) applied to
    ``solution_str``, a float or -- ``math_dapo`` -- verl's dict; ``kwargs`` go to that scorer (e.g.
    ``method="flexible"`` for gsm8k, ``extract=("hash",)`` for the math reward). Unknown sources raise
    ``ValueError``."""
    name = reward_name_for_source(data_source)
    if name is None:
        raise ValueError(f"data_source={data_source!r} has no built-in reward (known: {sorted(SOURCE_REWARDS)} "
                         f"and prefixes {sorted(SOURCE_PREFIXES)}); set data.reward_fn to 'math' or "
                         "'module:function'")
    res = SOURCE_SCORERS[name](solution_str, ground_truth, **kwargs)
    return res if isinstance(res, dict) else float(res)


def warmup() -> None:
    """Import math-verify and parse one expression (its LaTeX parser builds lazily; reward workers call
    this before their first timed job). Does nothing when math-verify is not installed."""
    try:
        mv = _math_verify()
    except ImportError:
        return
    mv.verify(_parse(mv, "\\frac{1}{2}"), _parse(mv, "0.5"), timeout_seconds=None)
