"""``megatron-rl`` command line: one subcommand per job.

    megatron-rl train   --config X.yaml [--resume] [key.sub=value ...]     (under torchrun / srun)
    megatron-rl score   --config X.yaml --rollouts R.jsonl --out S.jsonl    (under torchrun / srun)
    megatron-rl check   X.yaml --nodes N --gpus-per-node G --gpu-memory-gb M
    megatron-rl report  RUN_DIR
    megatron-rl data inspect PATH --tokenizer DIR [-n 3]
    megatron-rl convert hf-to-mcore --hf-dir D --out O --tensor-model-parallel-size T ...
    megatron-rl convert mcore-to-hf --mcore-dir O --out D2
    megatron-rl migrate verl VERL.yaml -o JOB.yaml

Each subcommand lives in its own module exposing ``add_parser(subparsers)`` (registers its arguments
and sets ``func``); ``_SUBCOMMANDS`` lists them.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

# subcommand name -> module implementing add_parser(subparsers)
_SUBCOMMANDS = {
    "convert": "megatron_rl.cli.convert",
    "train": "megatron_rl.train",
    "score": "megatron_rl.score",
    "check": "megatron_rl.cli.check",
    "report": "megatron_rl.cli.report",
    "data": "megatron_rl.cli.data",
    "migrate": "megatron_rl.cli.migrate",
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every available subcommand."""
    p = argparse.ArgumentParser(prog="megatron-rl", description="RL post-training on Megatron-Core.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module in _SUBCOMMANDS.items():
        importlib.import_module(module).add_parser(sub)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``megatron-rl`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
