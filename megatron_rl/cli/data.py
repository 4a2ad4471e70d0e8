"""``megatron-rl data inspect PATH --tokenizer DIR [-n 3]``: check a prompt file before a cluster job.

    megatron-rl data inspect gsm8k/train.parquet --tokenizer /ckpt/Qwen3-8B -n 3 \\
        --chat-template-kwargs '{"enable_thinking": false}' --max-prompt-length 1024

Reads the file as training would (``FileTask``: verl's RL format or prompt/answer rows), then prints the
counts (usable rows, malformed rows with their row numbers and reasons, prompts filtered or truncated by
``--max-prompt-length``) and the first ``-n`` prompts exactly as the engine will receive them — the text
after the tokenizer's chat template, its token count — with their ground truth, data_source and the
reward that will score them. Exit status 0; 2 when the file cannot be used (the error names why).
"""
from __future__ import annotations

import argparse
import json
import sys

from megatron_rl.tasks.datasets import FileTask
from megatron_rl.tasks.options import DataOptions
from megatron_rl.tasks.reward_fn import SOURCE
from megatron_rl.tasks.rewards import reward_name_for_source
from megatron_rl.tokenizer import load_tokenizer


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    return value


def inspect_file(args: argparse.Namespace, out=sys.stdout) -> int:
    """Print the summary and the first ``args.n`` rendered prompts; the exit code."""
    try:
        tok = load_tokenizer(args.tokenizer)
    except Exception as e:  # noqa: BLE001 - reported with the path
        print(f"error: --tokenizer {args.tokenizer!r}: cannot load a tokenizer: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    try:
        options = DataOptions(chat_template_kwargs=args.chat_template_kwargs, max_prompt_length=args.max_prompt_length,
                              overlong_prompts=args.overlong_prompts, reward_workers=0)
        task = FileTask(args.path, tok, prompt_key=args.prompt_key, answer_key=args.answer_key,
                        reward_fn=args.reward_fn, options=options, report=None)
    except (ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stats = task.stats()
    print(f"{args.path}: {int(stats['data/rows'])} prompt(s); {int(stats['data/malformed_rows'])} malformed row(s); "
          f"{int(stats['data/prompts_filtered'])} filtered and {int(stats['data/prompts_truncated'])} truncated by "
          f"max_prompt_length={args.max_prompt_length}", file=out)
    for label, why in task.malformed[:20]:
        print(f"  malformed {label}: {why}", file=out)
    if len(task.malformed) > 20:
        print(f"  ... and {len(task.malformed) - 20} more malformed rows", file=out)
    lengths = [len(p.prompt_ids) for p in task.prompts]
    print(f"prompt tokens: min {min(lengths)}, mean {sum(lengths) / len(lengths):.1f}, max {max(lengths)}", file=out)
    for k, p in enumerate(task.prompts[:args.n]):
        spec = task.spec_for(p)
        reward = f"{reward_name_for_source(p.data_source)} (by data_source)" if spec == SOURCE else spec
        print(f"\n--- prompt {k} ({len(p.prompt_ids)} tokens, data_source={p.data_source!r}, reward: {reward}) ---",
              file=out)
        print(p.text, file=out)
        print(f"--- ground truth: {json.dumps(p.answer, ensure_ascii=False)}", file=out)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``data inspect``."""
    p.add_argument("path", help="a .jsonl or .parquet prompt file")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory (e.g. the HF checkpoint of actor.load_hf)")
    p.add_argument("-n", type=int, default=3, help="prompts to print (default 3)")
    p.add_argument("--prompt-key", default="prompt", help="data.prompt_key (default prompt)")
    p.add_argument("--answer-key", default="answer", help="data.answer_key (default answer)")
    p.add_argument("--reward-fn", default=None, help="data.reward_fn: math, exact or module:function")
    p.add_argument("--chat-template-kwargs", type=_json_object, default={},
                   help="data.chat_template_kwargs as JSON, e.g. '{\"enable_thinking\": false}'")
    p.add_argument("--max-prompt-length", type=int, default=None, help="data.max_prompt_length")
    p.add_argument("--overlong-prompts", choices=("filter", "truncate"), default="filter",
                   help="data.overlong_prompts (default filter)")


def add_parser(subparsers) -> None:
    """Register ``data`` (with its ``inspect`` subcommand) on the top-level subparsers."""
    p = subparsers.add_parser("data", help="inspect a prompt dataset (rendered prompts, ground truths)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="data_command", metavar="DATA_COMMAND")
    sub.required = True
    ins = sub.add_parser("inspect", help="print a few rendered prompts and their ground truths",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ins)
    ins.set_defaults(func=inspect_file)
