"""Known, harmless megatron-core messages: shown once, on rank 0, each on one line with why it is harmless.

    install_known_message_filter()      # first thing in an entry point (train, score, check)

A run on CPU otherwise prints ~36 of them (8 per rank plus megatron's rerun-machine notice): Transformer
Engine / Apex are not installed, a deprecated cuda-graph scope default, the CUDA_DEVICE_MAX_CONNECTIONS
hint, "Implicit initialization of Rerun State Machine!". Every other warning is shown as Python would.
``MEGATRON_RL_SHOW_KNOWN_WARNINGS=1`` turns the filter off (megatron's messages verbatim, every rank).
"""
from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from typing import List, Optional, Set, Tuple

#: (regex matched against the message, why it is harmless)
KNOWN: List[Tuple[str, str]] = [
    (r"Transformer Engine and Apex are not installed",
     "TE / Apex are optional CUDA kernels; megatron uses its torch implementations"),
    (r"Apex is not installed\. Falling back to Torch Norm", "torch's RMSNorm is used; same math"),
    (r"full scope is deprecated", "megatron-core's own cuda_graph_scope default; CUDA graphs are not used"),
    (r"CUDA_DEVICE_MAX_CONNECTIONS", "a GPU overlap tuning hint; gradients are reduced after the backward pass"),
    (r"Implicit initialization of Rerun State Machine",
     "megatron's fault-reproduction machinery, created on first use and disabled"),
    (r"RerunStateMachine initialized in mode RerunMode\.DISABLED",
     "megatron's fault-reproduction machinery, created on first use and disabled"),
]
_PATTERNS = [(re.compile(p), why) for p, why in KNOWN]
_shown: Set[str] = set()
_installed = False


def _rank() -> int:
    for var in ("RANK", "SLURM_PROCID"):
        v = os.environ.get(var, "")
        if v.strip().isdigit():
            return int(v)
    return 0


def known_reason(message: str) -> Optional[str]:
    """Why ``message`` is harmless, or None when it is not a known message."""
    for pat, why in _PATTERNS:
        if pat.search(message):
            return why
    return None


def _show_once(message: str, why: str) -> None:
    first_line = message.strip().splitlines()[0] if message.strip() else message
    if _rank() != 0 or first_line in _shown:
        return
    _shown.add(first_line)
    print(f"[megatron-rl] known, harmless: {first_line} -- {why}", file=sys.stderr, flush=True)


class _KnownLogFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        why = known_reason(message)
        if why is None:
            return True
        _show_once(message, why)
        return False


def install_known_message_filter() -> None:
    """Route known megatron-core warnings and log messages through :func:`known_reason` (idempotent)."""
    global _installed
    if _installed or os.environ.get("MEGATRON_RL_SHOW_KNOWN_WARNINGS") == "1":
        return
    _installed = True
    previous = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        why = known_reason(str(message))
        if why is None:
            return previous(message, category, filename, lineno, file, line)
        _show_once(str(message), why)

    warnings.showwarning = showwarning
    logging.getLogger("megatron.core.rerun_state_machine").addFilter(_KnownLogFilter())
