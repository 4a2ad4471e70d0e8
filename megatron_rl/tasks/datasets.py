"""Prompt datasets from JSONL or Parquet files, as a ``Task``: verl's RL format or the simple form.

``load_records(path)`` reads ``.jsonl`` or ``.parquet``; ``FileTask`` turns records into prompts
(``rows.parse_row``) and scores responses in reward worker processes. The rule to keep: a row that cannot become a
prompt is skipped, counted and reported once with its row number, never silently used, and a file without one
usable row is an error; ``usable_rows`` does that parsing alone, without a tokenizer, so ``check`` and the
trainer's first step run it before any model is built. Rendering, rewards and drawing: docs/datasets.md.

    task = FileTask("gsm8k/train.parquet", tokenizer, reward_fn="math",
                    options=DataOptions(max_prompt_length=512, chat_template_kwargs={"enable_thinking": False}))
"""
from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_rl.jsonl import read_json_objects
from megatron_rl.tasks.base import Prompt, Task, check_rng, response_text
from megatron_rl.tasks.options import DataOptions
from megatron_rl.tasks.render import fit_length, has_chat_template, render_prompt
from megatron_rl.tasks.reward_fn import SOURCE, RewardFunction, check_reward_spec, compute_reward
from megatron_rl.tasks.reward_pool import RewardJob, RewardPool, RewardResult
from megatron_rl.tasks.rewards import UNPORTED_VERL_SOURCES, kwargs_refusal, reward_name_for_source
from megatron_rl.tasks.rows import CHAT, MalformedRow, Row, parse_row

#: How many malformed rows the load-time report lists.
REPORT_ROWS = 20


def read_records(path: str | os.PathLike, key: str = "data.path") -> List[Tuple[Optional[int], Dict[str, Any]]]:
    """``(line number or None, record)`` of every record of a JSONL or Parquet file (see module docstring); errors
    name the config ``key`` that gave the file."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{key}={str(path)!r} does not exist or is not a file")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return list(read_json_objects(p, where=f"{key}={str(path)!r}"))
    if suffix in (".parquet", ".pq"):
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ValueError(f"{key}={str(path)!r}: reading Parquet needs the 'pyarrow' package, which is "
                             "not installed (pip install pyarrow), or convert the file to JSONL") from e
        try:
            return [(None, rec) for rec in pq.read_table(str(p)).to_pylist()]
        except Exception as e:
            raise ValueError(f"{key}={str(path)!r}: cannot read Parquet: {type(e).__name__}: {e}") from e
    raise ValueError(f"{key}={str(path)!r}: unsupported extension {suffix!r}; use .jsonl or .parquet")


def load_records(path: str | os.PathLike) -> List[Dict[str, Any]]:
    """All records of a ``.jsonl`` / ``.json`` (JSON lines) or ``.parquet`` file, as dicts."""
    return [rec for _, rec in read_records(path)]


def row_label(index: int, line: Optional[int]) -> str:
    """``"row 3"`` or ``"row 3 (line 5)"`` for JSONL files."""
    return f"row {index}" + (f" (line {line})" if line is not None else "")


@dataclass
class FileRows:
    """The rows of a data file that can become prompts, and why the others cannot."""

    rows: List[Row]
    lines: Dict[int, Optional[int]]
    """Row index -> JSONL line number (None for Parquet)."""
    malformed: List[Tuple[str, str]]
    """``(row label, reason)`` of every row that cannot become a prompt."""


def usable_rows(path: str | os.PathLike, prompt_key: str = "prompt", answer_key: str = "answer",
                vocab_size: Optional[int] = None, answer_required: bool = True, key: str = "data.path") -> FileRows:
    """Parse every record of ``path`` (no tokenizer needed: ``vocab_size`` None skips the token-id range
    check). Raises ``ValueError`` naming the file, the keys and the first malformed rows when no row can
    become a prompt -- what ``megatron-rl check`` and the trainer run before any model is built."""
    records = read_records(path, key)
    if not records:
        raise ValueError(f"{key}={str(path)!r} has no records")
    out = FileRows(rows=[], lines={}, malformed=[])
    for i, (line, rec) in enumerate(records):
        try:
            row = parse_row(rec, i, prompt_key, answer_key, vocab_size, answer_required)
        except MalformedRow as e:
            out.malformed.append((row_label(i, line), str(e)))
            continue
        out.rows.append(row)
        out.lines[i] = line
    if not out.rows:
        listed = "; ".join(f"{lab}: {why}" for lab, why in out.malformed[:3])
        raise ValueError(f"{key}={str(path)!r}: no usable rows ({len(out.malformed)} malformed: {listed}"
                         f"{'; ...' if len(out.malformed) > 3 else ''})")
    return out


def check_sources_rewarded(path: str | os.PathLike, rows: FileRows, key: str = "data.path") -> None:
    """With ``data.reward_fn`` unset the reward is chosen by each row's ``data_source``: raise ``ValueError``
    naming the file, the row and the key when a row's ``data_source`` has no built-in reward (no tokenizer
    needed: what ``megatron-rl check`` and the trainer's start run, as ``FileTask`` does)."""
    for r in rows.rows:
        if r.data_source is not None and reward_name_for_source(r.data_source) is None:
            raise ValueError(f"{key}={str(path)!r} {row_label(r.index, rows.lines[r.index])}: "
                             f"data_source={r.data_source!r} has no built-in reward; set "
                             "data.reward_fn to 'math', 'exact' or 'module:function'")


def scorable_rows(path: str | os.PathLike, data, key: str = "data.path") -> FileRows:
    """``usable_rows`` of ``path`` with the ``data:`` section's keys, and, when ``data.reward_fn`` is unset, every
    row's ``data_source`` rewarded (``check_sources_rewarded``): the file check of ``megatron-rl check`` and of the
    trainer's start."""
    rows = usable_rows(path, data.prompt_key, data.answer_key, key=key)
    if data.reward_fn is None:
        check_sources_rewarded(path, rows, key)
        check_dispatch_kwargs(path, rows, dict(getattr(data, "reward_kwargs", None) or {}), key)
    return rows


def check_dispatch_kwargs(path: str | os.PathLike, rows: FileRows, kwargs: Dict[str, Any],
                          key: str = "data.path") -> None:
    """With ``data.reward_fn`` unset, ``data.reward_kwargs`` reach the scorer of every row's ``data_source`` (exact
    match for rows without one): raise ``ValueError`` naming the key, the source and what its scorer takes when one
    of them does not take them (every such sample would fail at run time)."""
    for source in sorted({r.data_source for r in rows.rows}, key=lambda s: (s is not None, s or "")):
        why = kwargs_refusal(source, kwargs)
        if why:
            where = "rows without a data_source (scored by exact match)" if source is None else \
                f"data_source {source!r}"
            raise ValueError(f"data.reward_kwargs: {why}, for the {where} of {key}={str(path)!r}: with data.reward_fn "
                             f"unset every row's scorer gets data.reward_kwargs (verl passes none to its "
                             f"default_compute_score); drop them, or set data.reward_fn")


def exact_match_reward(prompt_text: str, response_text: str, answer: Any) -> float:
    """Exact match: 1.0 if the stripped response equals ``str(answer).strip()``, else 0.0."""
    return 1.0 if response_text.strip() == str(answer).strip() else 0.0


class FileTask(Task):
    """Prompts from a JSONL / Parquet file (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, tokenizer, prompt_key: str = "prompt", answer_key: str = "answer",
                 reward_fn: str | RewardFunction | None = None, answer_required: bool = True,
                 options: Optional[DataOptions] = None, report=sys.stderr, key: str = "data.path"):
        """Load and check every record now; malformed rows are skipped and reported to ``report`` (a text
        stream, or None) with their row numbers. Configuration errors (no usable row, a chat prompt with a
        tokenizer without a chat template, a data_source without a reward) raise ``ValueError`` naming the
        file, the row and the key (``key``: the config key that gave the file)."""
        self.name = Path(path).name
        self.key = key
        super().__init__(tokenizer)
        self.path = str(path)
        self.report = report
        spec = reward_fn.spec if isinstance(reward_fn, RewardFunction) else reward_fn
        self.reward_spec = check_reward_spec(spec)
        rows = usable_rows(path, prompt_key, answer_key, len(tokenizer), answer_required, key)
        self.rows: List[Row] = rows.rows
        self.row_lines: Dict[int, Optional[int]] = rows.lines
        #: ``(row label, reason)`` of every malformed row (load time and rendering).
        self.malformed: List[Tuple[str, str]] = rows.malformed
        chat = [r for r in self.rows if r.kind == CHAT]
        if chat and not has_chat_template(tokenizer):
            raise ValueError(f"{self.key}={self.path!r} {row_label(chat[0].index, self.row_lines[chat[0].index])}: "
                             "the prompt is a list of chat messages but the tokenizer (actor.load_hf) has no "
                             "chat_template. Use the tokenizer of a chat (instruct) model, whose tokenizer_config.json "
                             "carries one, or build the tiny chat model (python -m megatron_rl.tasks.chat_model DIR), "
                             "or give the prompts as plain strings (docs/datasets.md)")
        if self.reward_spec is None:
            check_sources_rewarded(self.path, rows, key)
            self._report_unported_sources()
        self.options: Optional[DataOptions] = None
        self.pool: Optional[RewardPool] = None
        self.prompts: List[Prompt] = []
        self.filtered = self.truncated = 0
        self.configure(options or DataOptions())
        self._report_malformed()

    def configure(self, options: DataOptions) -> None:
        """Render the prompts with ``options`` (chat template arguments, length limit) and set up the
        reward workers; nothing happens when the options did not change."""
        if options == self.options:
            return
        old = self.options
        if old is None or (old.chat_template_kwargs, old.max_prompt_length, old.overlong_prompts) != \
                (options.chat_template_kwargs, options.max_prompt_length, options.overlong_prompts):
            self._render(options)
        if old is None or (old.reward_workers, old.reward_timeout_s) != (options.reward_workers,
                                                                          options.reward_timeout_s):
            if self.pool is not None:
                self.pool.close()
            self.pool = RewardPool(options.reward_workers, options.reward_timeout_s)
        self.options = options

    def _render(self, options: DataOptions) -> None:
        prompts, filtered, truncated = [], 0, 0
        self.malformed = [m for m in self.malformed if not m[1].startswith("chat template failed")]
        for row in self.rows:
            label = row_label(row.index, self.row_lines[row.index])
            try:
                ids, text = render_prompt(self.tokenizer, row, options.chat_template_kwargs)
            except Exception as e:  # noqa: BLE001 - a row the template rejects is malformed, not fatal
                self.malformed.append((label, f"chat template failed: {type(e).__name__}: {e}"))
                continue
            ids, cut = fit_length(ids, options.max_prompt_length, options.overlong_prompts)
            if ids is None:
                filtered += 1
                continue
            truncated += int(cut)
            if not ids:
                self.malformed.append((label, "the prompt renders to no tokens"))
                continue
            prompts.append(Prompt(prompt_ids=ids, answer=row.ground_truth, text=text, data_source=row.data_source,
                                  extra_info=row.extra_info, row=f"{self.key}={self.path!r} {label}",
                                  messages=list(row.prompt) if row.kind == CHAT else None))
        if not prompts:
            raise ValueError(f"{self.key}={self.path!r}: no prompt left after data.max_prompt_length="
                             f"{options.max_prompt_length} ({filtered} filtered, {len(self.malformed)} malformed)")
        self.prompts, self.filtered, self.truncated = prompts, filtered, truncated

    def _report_unported_sources(self) -> None:
        """Say once that rows whose ``data_source`` verl scores with prime_math get the math reward here."""
        found = sorted({r.data_source for r in self.rows if r.data_source in UNPORTED_VERL_SOURCES})
        if found and self.report is not None:
            print(f"[megatron-rl] {self.key}={self.path!r}: data_source {', '.join(found)}: verl scores these with "
                  f"its prime_math scorer, which is not ported; they are scored by the math reward (math-verify, "
                  f"0 / 1 like prime_math), whose equivalence rules differ (docs/datasets.md)",
                  file=self.report, flush=True)

    def _report_malformed(self) -> None:
        if not self.malformed or self.report is None:
            return
        listed = "\n".join(f"  {lab}: {why}" for lab, why in self.malformed[:REPORT_ROWS])
        more = len(self.malformed) - REPORT_ROWS
        print(f"[megatron-rl] {self.key}={self.path!r}: skipped {len(self.malformed)} malformed row(s) of "
              f"{len(self.rows) + len(self.malformed)}:\n{listed}" + (f"\n  ... and {more} more" if more > 0 else ""),
              file=self.report, flush=True)

    def stats(self) -> Dict[str, float]:
        """``data/rows`` (usable prompts), ``data/malformed_rows``, ``data/prompts_filtered``,
        ``data/prompts_truncated``."""
        return {"data/rows": float(len(self.prompts)), "data/malformed_rows": float(len(self.malformed)),
                "data/prompts_filtered": float(self.filtered), "data/prompts_truncated": float(self.truncated)}

    def __len__(self) -> int:
        return len(self.prompts)

    def finite_prompts(self) -> List[Prompt]:
        """The rendered prompts (training draws them epoch by epoch: ``trainer.prompt_draw``)."""
        return self.prompts

    def sample(self, n: int, rng: random.Random) -> list[Prompt]:
        """``n`` prompts: distinct while ``n <= len(self)``, then with replacement (a one-off draw: training draws
        through ``finite_prompts``)."""
        check_rng(rng, f"FileTask({self.path!r}).sample")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"FileTask.sample: n={n!r} must be an int >= 1")
        idx = rng.sample(range(len(self.prompts)), min(n, len(self.prompts)))
        idx += [rng.randrange(len(self.prompts)) for _ in range(n - len(idx))]
        return [self.prompts[i] for i in idx]

    def spec_for(self, prompt: Prompt) -> str:
        """The reward spec of ``prompt``: ``reward_fn``, else the data_source dispatch, else exact match."""
        if self.reward_spec is not None:
            return self.reward_spec
        return SOURCE if prompt.data_source is not None else "exact"

    def job(self, prompt: Prompt, response_ids: Sequence[int]) -> RewardJob:
        """The ``RewardJob`` of one response (decoded up to EOS, special tokens skipped)."""
        text, _ = response_text(self.tokenizer, response_ids)
        kwargs = dict(self.options.reward_kwargs) if self.options is not None else {}
        return RewardJob(self.spec_for(prompt), prompt.text, text, prompt.answer, prompt.data_source,
                         prompt.extra_info, kwargs, prompt.row)

    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> float:
        """One response's reward, in this process (no timeout; ``score`` is the step's path)."""
        j = self.job(prompt, response_ids)
        return compute_reward(j.spec, j.prompt_text, j.response_text, j.ground_truth, j.data_source,
                              j.extra_info, j.kwargs)

    def score(self, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]]) -> RewardResult:
        """The step's rewards in the worker pool (per-sample timeout; failures 0.0 and counted)."""
        if len(prompts) != len(responses):
            raise ValueError(f"task {self.name!r}: {len(prompts)} prompts but {len(responses)} responses")
        return self.pool.score([self.job(p, r) for p, r in zip(prompts, responses)])

    def close(self) -> None:
        """Stop the reward workers."""
        if self.pool is not None:
            self.pool.close()
