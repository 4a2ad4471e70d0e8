"""What ``megatron-rl check`` verifies of ``reward.model`` before a job starts: the RM's config is a one-label
sequence classifier, its tokenizer's chat template renders one data row (with the row's answer as a stand-in
response), and each SGLang RM server that answers is a reward / embedding server that scores that row.

Rule: a server that cannot be reached now is reported, not a problem (it may start with the job); a server that
answers wrongly is a problem naming its URL.
"""
from __future__ import annotations

import json
import os
import random
import urllib.error
from typing import List, Optional, Tuple

from safetensors import safe_open

from megatron_rl.tasks import build_task
from megatron_rl.tasks.base import Prompt
from megatron_rl.tasks.options import DataOptions
from megatron_rl.tasks.rm_backends import RMError, SGLangRM
from megatron_rl.tasks.rm_render import render_rm_input, rm_tokenizer
from megatron_rl.tokenizer import load_tokenizer


#: Heads SGLang 0.5.23 builds as ``nn.Linear(hidden, num_labels)`` WITH a bias, where HF's have none: a checkpoint
#: without ``score.bias`` leaves the server's bias at its random init (a constant per server start and seed).
SGLANG_BIASED_HEADS = ("Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification")


def checkpoint_keys(path: str) -> Optional[set]:
    """The tensor names of the safetensors checkpoint at ``path`` (headers only); None when there is none."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            return set(json.load(fh).get("weight_map", {}))
    files = [f for f in sorted(os.listdir(path)) if f.endswith(".safetensors")] if os.path.isdir(path) else []
    if not files:
        return None
    keys: set = set()
    for f in files:
        with safe_open(os.path.join(path, f), framework="pt") as fh:
            keys.update(fh.keys())
    return keys


def score_bias_finding(rm) -> Tuple[List[str], List[str]]:
    """``(problems, lines)``: an SGLang-served Qwen2 / Qwen3 RM whose checkpoint has no ``score.bias`` gets each
    server's random bias added to every score -- a problem with several servers (one group's rows, scored on
    different servers, differ by it), a note with one."""
    try:   # a local checkpoint (a hub name is not inspected)
        with open(os.path.join(rm.path, "config.json")) as fh:
            archs = set(json.load(fh).get("architectures") or [])
    except (OSError, ValueError):
        return [], []
    keys = checkpoint_keys(rm.path) if rm.backend == "sglang" and archs & set(SGLANG_BIASED_HEADS) else None
    if keys is None or "score.bias" in keys:
        return [], []
    what = (f"{rm.path!r} ({', '.join(sorted(archs))}) has no score.bias; SGLang builds that head with a bias, so "
            "each server adds its own random constant to every score (it changes with the server's --random-seed "
            "and restarts): write a zero score.bias into the checkpoint (docs/reward_models.md)")
    if len(rm.urls) > 1:
        return [f"reward.model.urls: {len(rm.urls)} servers on {what}; rows of one group scored on different servers "
                "would differ by their biases"], []
    return [], [f"reward model: note: {what}"]


def _config_problem(path: str) -> Optional[str]:
    from transformers import AutoConfig  # heavy: only a check with a reward model reads it

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001
        return f"reward.model.path: {path!r} has no readable HF config.json ({type(e).__name__}: {e})"
    archs = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith(("ForSequenceClassification", "ForRewardModel")) for a in archs):
        return f"reward.model.path: {path!r}: architectures {archs} is not a *ForSequenceClassification reward model"
    if getattr(config, "num_labels", 1) != 1:
        return f"reward.model.path: {path!r}: num_labels={config.num_labels}; a scalar reward model has one label"
    return None


def check_reward_model(rm, prompt: Optional[Prompt]) -> Tuple[List[str], List[str]]:
    """``(problems, report lines)`` for the ``reward.model`` section ``rm`` and one data row ``prompt`` (None: no
    row could be built; the data's own problems say why)."""
    problems: List[str] = []
    lines = [f"reward model: {rm.describe()}"]
    cfg_problem = _config_problem(rm.path)
    if cfg_problem:
        return [cfg_problem], lines
    problems, notes = score_bias_finding(rm)
    lines += notes
    try:
        tok = rm_tokenizer(rm.path, rm.chat_template)
    except ValueError as e:
        return [str(e).replace("reward.model.path=", "reward.model.path: ", 1)], lines
    if prompt is None:
        lines.append("reward model: no data row to render its template on (the problems of data.* / actor.load_hf "
                     "say why)")
        return problems, lines
    try:
        ids = render_rm_input(tok, prompt.text, prompt.messages, str(prompt.answer))
    except Exception as e:  # noqa: BLE001
        key = "reward.model.chat_template" if rm.chat_template else "reward.model.path"
        return [f"{key}: the RM's chat template fails on {prompt.row or 'the first data row'}: "
                f"{type(e).__name__}: {e}"], lines
    shown = tok.decode(ids)
    lines.append(f"reward model: the RM template renders {prompt.row or 'the first data row'} (its answer as the "
                 f"response) to {len(ids)} tokens: {shown[:160]!r}{' ...' if len(shown) > 160 else ''}")
    if rm.backend != "sglang":
        return problems, lines
    for url in rm.urls:
        client = SGLangRM([url], rm.timeout_s, retries=0)
        try:
            info = client.model_info(url)
        except (urllib.error.URLError, OSError, ValueError) as e:
            lines.append(f"reward model: {url} not reachable now ({e}); not checked")
            continue
        if isinstance(info, dict) and info.get("is_generation"):
            problems.append(f"reward.model.urls: {url} serves a generation model ({info.get('model_path')}); start "
                            "the RM server with --is-embedding")
            continue
        try:
            score = client.scores([ids])[0]
        except RMError as e:
            problems.append(f"reward.model.urls: {url} does not score the row: {e}")
            continue
        lines.append(f"reward model: {url} ({info.get('model_path') if isinstance(info, dict) else '?'}) scores "
                     f"the row {score:.4g}")
    return problems, lines


def first_prompt(data, load_hf: Optional[str]) -> Optional[Prompt]:
    """The first prompt the ``data`` section gives with the policy's tokenizer (``actor.load_hf``): a data file's
    first usable row, a generated task's first draw (seed 0); None when it cannot be built (the data's and
    ``actor.load_hf``'s own checks name why)."""
    if not load_hf:
        return None
    try:
        task = build_task(data.task, load_tokenizer(load_hf), path=data.path, prompt_key=data.prompt_key,
                          answer_key=data.answer_key, reward_fn=data.reward_fn, task_kwargs=data.task_kwargs)
        try:
            task.configure(DataOptions.from_config(data))
            rows = task.finite_prompts()
            return rows[0] if rows else task.sample(1, random.Random(0))[0]
        finally:
            close = getattr(task, "close", None)
            if close is not None:
                close()
    except Exception:  # noqa: BLE001 - the data's own checks report it
        return None
