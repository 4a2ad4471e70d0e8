"""What a job config really runs, as ``megatron-rl check`` plans it: device, parameter dtype, optimizer
sharding, and the task's real prompt length.

    prof = run_profile(precision, cfg.actor, cfg.data, cfg.cluster.device)   # precision: the job plan's

Rule: the dtype and optimizer come from the actor's own objects (the plan's ``Precision``,
``actor.optimizer.optimizer_config``), so the plan follows the actor when it changes. The prompt length is the
longest prompt of a built-in or custom task, or of ``data.path`` rendered as the trainer renders it (the
checkpoint's tokenizer and chat template; without the tokenizer: the prompt's UTF-8 bytes, an upper bound for
byte-level BPE); None when neither can be read (the caller falls back to a flag).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional, Tuple

from megatron_rl.actor.optimizer import optimizer_config
from megatron_rl.actor.precision import Precision
from megatron_rl.tokenizer import load_tokenizer
from megatron_rl.tasks import FileTask, build_char_tokenizer, build_task, is_custom_task, load_records
from megatron_rl.tasks.options import DataOptions


@dataclass
class RunProfile:
    """The run settings the memory plan needs that follow from the config and the actor's code."""

    device: str
    """"cuda" or "cpu" (``cluster.device``)."""
    params_bytes: int
    """Bytes per model parameter of the actor (4: fp32)."""
    distributed_optimizer: bool
    """Whether the actor shards the Adam state over data-parallel ranks."""
    prompt_length: Optional[int]
    """Longest prompt in tokens (None: unknown)."""
    prompt_source: str
    """Where ``prompt_length`` comes from (printed by ``check``)."""


def actor_precision(precision: Precision, actor) -> Tuple[int, bool]:
    """(bytes per parameter, distributed optimizer) of the actor ``train`` builds with ``precision`` (the job plan's)
    and the ``actor:`` section ``actor``."""
    ocfg = optimizer_config(actor, precision)
    return precision.params_bytes, bool(ocfg.use_distributed_optimizer)


def _tokenizer(path: Optional[str]):
    """(tokenizer, description) of ``actor.load_hf`` ``path``, or (None, why not)."""
    if not path or not os.path.isdir(path):
        return None, f"actor.load_hf {path!r} is not there yet" if path else "no actor.load_hf"
    for d in (path, os.path.join(path, "hf_assets")):  # an HF dir, or a converted (hf-to-mcore) dir
        try:
            return load_tokenizer(d), f"tokenizer of {d}"
        except (OSError, ValueError):
            continue
    return None, f"no tokenizer in {path}"


def task_prompt_length(data, load_hf: Optional[str]) -> Tuple[Optional[int], str]:
    """(longest prompt in tokens, where it comes from) of the ``data:`` section ``data`` (``load_hf``:
    ``actor.load_hf``, whose tokenizer encodes the prompts)."""
    d = data
    tok, tok_src = _tokenizer(load_hf)
    if is_custom_task(d.task):  # your own task: its longest_prompt(), when it knows one
        if tok is None:
            return None, f"data.task {d.task!r}: needs its tokenizer ({tok_src})"
        try:
            longest = build_task(d.task, tok, task_kwargs=d.task_kwargs).longest_prompt()
        except ValueError as exc:
            return None, str(exc)
        if longest is None:
            return None, f"data.task {d.task!r}: its longest_prompt() is not known up front"
        return len(longest.prompt_ids), f"longest {d.task!r} prompt ({tok_src})"
    if d.task != "file":  # a built-in task: its longest prompt
        if tok is None:
            tok, tok_src = build_char_tokenizer(task=d.task), f"char tokenizer ({tok_src})"
        try:
            task = build_task(d.task, tok, task_kwargs=d.task_kwargs)
            longest = task.longest_prompt()
        except ValueError as exc:
            return None, f"data.task {d.task!r}: {exc}"
        if longest is None:
            return None, f"data.task {d.task!r}: prompts not readable"
        limits = {k: v for k, v in vars(task).items() if k.startswith("max_") and k.endswith("digits")}
        return len(longest.prompt_ids), f"longest {d.task!r} prompt ({_kv(limits)}), {tok_src}"
    if d.task == "file" and d.path and os.path.isfile(d.path):
        if tok is None:
            return _utf8_bound(d.path, d.prompt_key, tok_src)
        # rendered as the trainer renders them: chat template arguments, length limit (filter / truncate)
        try:
            options = replace(DataOptions.from_config(d), reward_workers=0)
            task = FileTask(d.path, tok, prompt_key=d.prompt_key, answer_key=d.answer_key, answer_required=False,
                            reward_fn="exact", options=options, report=None)  # the reward plays no part here
        except ValueError:
            return _utf8_bound(d.path, d.prompt_key, f"{tok_src} could not read it")
        task.close()
        kwargs = f", chat_template_kwargs {options.chat_template_kwargs}" if options.chat_template_kwargs else ""
        return max(len(p.prompt_ids) for p in task.prompts), f"longest prompt of {d.path} ({tok_src}{kwargs})"
    return None, f"data.task {d.task!r}: prompts not readable"


def _kv(d) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items()))


def _utf8_bound(path: str, key: str, tok_src: str) -> Tuple[Optional[int], str]:
    """Without the model's tokenizer: the UTF-8 bytes of the longest prompt of ``path``, an upper bound of
    its tokens under a byte-level BPE tokenizer (each token covers at least one byte)."""
    try:
        records = load_records(path)
    except (OSError, ValueError) as exc:
        return None, str(exc)
    sizes = [_prompt_bytes(r.get(key)) for r in records]
    sizes = [n for n in sizes if n is not None]
    if not sizes:
        return None, f"no {key!r} prompts in {path}"
    return max(sizes), (f"UTF-8 bytes of the longest prompt of {path} (+{CHAT_TEMPLATE_TOKENS} per chat message), "
                        f"about an upper bound of its tokens ({tok_src})")


#: Tokens a chat template adds around one message (role markers, separators) -- an allowance, not exact.
CHAT_TEMPLATE_TOKENS = 8


def _prompt_bytes(prompt) -> Optional[int]:
    """UTF-8 bytes of a prompt: text, token ids (their count), or chat messages (contents + template)."""
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8"))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        return sum(len(str(m.get("content", "")).encode("utf-8")) + CHAT_TEMPLATE_TOKENS for m in prompt)
    return None


def run_profile(precision: Precision, actor, data, device: str) -> RunProfile:
    """The :class:`RunProfile` of a (possibly invalid) job: ``precision`` the one its plan builds (or plans with),
    ``actor`` / ``data`` its sections, ``device`` its ``cluster.device``."""
    params_bytes, dist_opt = actor_precision(precision, actor)
    n, src = task_prompt_length(data, actor.load_hf)
    return RunProfile(device=device, params_bytes=params_bytes, distributed_optimizer=dist_opt,
                      prompt_length=n, prompt_source=src)
