"""Prompt datasets from JSONL or Parquet files, as a ``Task``.

``load_records(path)`` reads a ``.jsonl`` file (one JSON object per line; blank lines skipped) or a
``.parquet`` file (needs ``pyarrow``; a clear ImportError-style ``ValueError`` names the package otherwise).
``FileTask`` turns records into prompts: ``record[prompt_key]`` is the prompt — text (encoded with the task's
tokenizer, ``add_special_tokens=True``) or a list of token ids (decoded for ``Prompt.text``) —
``record[answer_key]`` the reference answer (any JSON value; ``None`` if the key is absent in a record and
``answer_required`` is False). Rewards: a ``module:function`` reward (see ``reward_fn``) or, by default, exact
match of the stripped decoded response with ``str(answer).strip()`` (1.0 / 0.0).

Sampling: each ``sample(n, rng)`` call draws ``min(n, N)`` distinct records (``rng.sample``), then, if
``n > N``, the rest with replacement — deterministic given ``rng``'s state.

Usage::

    task = FileTask("prompts.jsonl", tokenizer, prompt_key="question", answer_key="answer",
                    reward_fn="my_rewards:exact")
"""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any, Sequence

from megatron_rl.tasks.base import Prompt, Task, check_rng, response_text
from megatron_rl.jsonl import read_json_objects
from megatron_rl.tasks.reward_fn import RewardFunction, load_reward_fn


def load_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a ``.jsonl`` / ``.json`` (JSON lines) or ``.parquet`` file, as dicts."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"data.path={str(path)!r} does not exist or is not a file")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        records = [rec for _, rec in read_json_objects(p, where=f"data.path={str(path)!r}")]
        return records
    if suffix in (".parquet", ".pq"):
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ValueError(f"data.path={str(path)!r}: reading Parquet needs the 'pyarrow' package, which is "
                             "not installed (pip install pyarrow), or convert the file to JSONL") from e
        try:
            return pq.read_table(str(p)).to_pylist()
        except Exception as e:
            raise ValueError(f"data.path={str(path)!r}: cannot read Parquet: {type(e).__name__}: {e}") from e
    raise ValueError(f"data.path={str(path)!r}: unsupported extension {suffix!r}; use .jsonl or .parquet")


def exact_match_reward(prompt_text: str, response_text: str, answer: Any) -> float:
    """Default file-task reward: 1.0 if the stripped response equals ``str(answer).strip()``, else 0.0."""
    return 1.0 if response_text.strip() == str(answer).strip() else 0.0


class FileTask(Task):
    """Prompts from a JSONL / Parquet file (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, tokenizer, prompt_key: str = "prompt", answer_key: str = "answer",
                 reward_fn: str | RewardFunction | None = None, answer_required: bool = True):
        """Load and validate every record now (errors name the file, the record index and the key)."""
        self.name = Path(path).name
        super().__init__(tokenizer)
        self.path = str(path)
        if isinstance(reward_fn, str):
            reward_fn = load_reward_fn(reward_fn)
        self.reward_fn = reward_fn
        records = load_records(path)
        if not records:
            raise ValueError(f"data.path={self.path!r} has no records")
        vocab = len(tokenizer)
        self.prompts: list[Prompt] = []
        for i, rec in enumerate(records):
            if prompt_key not in rec:
                raise ValueError(f"data.path={self.path!r} record {i}: no data.prompt_key={prompt_key!r} "
                                 f"(keys: {sorted(rec)[:10]})")
            if answer_required and answer_key not in rec:
                raise ValueError(f"data.path={self.path!r} record {i}: no data.answer_key={answer_key!r} "
                                 f"(keys: {sorted(rec)[:10]})")
            raw = rec[prompt_key]
            if isinstance(raw, str):
                if not raw:
                    raise ValueError(f"data.path={self.path!r} record {i}: {prompt_key!r} is empty")
                ids = list(tokenizer.encode(raw, add_special_tokens=True))
                text = raw
            elif isinstance(raw, (list, tuple)) and raw and all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in raw):
                ids = [int(t) for t in raw]
                text = tokenizer.decode(ids)
            else:
                raise ValueError(f"data.path={self.path!r} record {i}: {prompt_key!r} must be a non-empty string "
                                 f"or a non-empty list of token ids < {vocab}, got {str(raw)[:60]!r}")
            self.prompts.append(Prompt(prompt_ids=ids, answer=rec.get(answer_key), text=text))

    def __len__(self) -> int:
        return len(self.prompts)

    def sample(self, n: int, rng: random.Random) -> list[Prompt]:
        """``n`` prompts: distinct while ``n <= len(self)``, then with replacement."""
        check_rng(rng, f"FileTask({self.path!r}).sample")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"FileTask.sample: n={n!r} must be an int >= 1")
        idx = rng.sample(range(len(self.prompts)), min(n, len(self.prompts)))
        idx += [rng.randrange(len(self.prompts)) for _ in range(n - len(idx))]
        return [self.prompts[i] for i in idx]

    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> float:
        """The configured reward function (or exact match) of the decoded response."""
        text, _ = response_text(self.tokenizer, response_ids)
        fn = self.reward_fn or exact_match_reward
        return float(fn(prompt.text, text, prompt.answer))
