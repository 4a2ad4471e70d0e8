"""One job module, two entry points: ``megatron-rl <name>`` and ``python -m megatron_rl.<name>``.

A job module (``megatron_rl.train``, ``megatron_rl.score``) defines ``add_arguments(parser)`` and
``run(args) -> exit code``; these helpers build both parsers the same way from its docstring.
"""
from __future__ import annotations

import argparse
from typing import Callable, List, Optional


def register(subparsers, name: str, help: str, doc: str, add_arguments: Callable, run: Callable) -> None:
    """Register ``megatron-rl <name>`` (its --help shows ``doc``)."""
    p = subparsers.add_parser(name, help=help, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def module_main(prog: str, doc: str, add_arguments: Callable, run: Callable,
                argv: Optional[List[str]] = None) -> int:
    """Parse ``argv`` for ``python -m <prog>`` and return ``run``'s exit code."""
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))
