"""Known, harmless library messages: hidden; rank 0 says so once, on one line (``KNOWN`` below says why each is).

    install_known_message_filter()      # first thing in an entry point (train, score, check)

A run on CPU otherwise prints ~36 of them (8 per rank plus megatron's rerun-machine notice): Transformer
Engine / Apex are not installed, a deprecated cuda-graph scope default, the CUDA_DEVICE_MAX_CONNECTIONS
hint, "Implicit initialization of Rerun State Machine!", and library deprecation notices our dependencies
raise from their own code (checkpoint loading, the embedded engine's KV cache argument).

Other warnings: deprecation notices (``FutureWarning``, ``DeprecationWarning``, ``PendingDeprecationWarning``)
concern code, which is the same on every rank, so they are shown on rank 0 only; every other warning on the
rank that raised it. Each distinct message is shown once per process, on one line with its origin.
``MEGATRON_RL_SHOW_KNOWN_WARNINGS=1`` turns the filter off (messages verbatim, every rank);
``MEGATRON_RL_SHOW_KNOWN_WARNINGS=why`` shows each known one once on rank 0 with why it is harmless.
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
    (r"`load_state_dict` is deprecated and will be removed",
     "megatron-core's checkpoint loader calls torch's older load API; the checkpoint loads the same"),
    (r"Please use DTensor instead and we are deprecating ShardedTensor",
     "megatron-core's checkpoint format is built on ShardedTensor; a torch deprecation notice"),
    (r"`past_key_values`(/`cache_params`)? (is|are) deprecated",
     "transformers renamed the KV-cache argument the embedded engine passes; generation is unchanged"),
    (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
     "megatron-core's sequence-parallel collectives use torch's older names; same collectives"),
]
#: Deprecation notices: about code, identical on every rank -- shown on rank 0 only.
RANK0_ONLY = (FutureWarning, DeprecationWarning, PendingDeprecationWarning)
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
    if os.environ.get("MEGATRON_RL_SHOW_KNOWN_WARNINGS") == "why":
        print(f"[megatron-rl] known, harmless: {first_line} -- {why}", file=sys.stderr, flush=True)
    elif "known" not in _shown:
        _shown.add("known")
        print("[megatron-rl] known, harmless library notices are hidden (Transformer Engine / Apex missing on CPU, "
              "megatron's rerun machine, deprecation notices; MEGATRON_RL_SHOW_KNOWN_WARNINGS=why lists them with "
              "why)", file=sys.stderr, flush=True)


def _show_other(message, category, filename: str, lineno: int) -> None:
    """An unknown warning: once per distinct (category, first line), deprecation notices on rank 0 only."""
    text = str(message).strip()
    first_line = text.splitlines()[0] if text else text
    key = f"{category.__name__}: {first_line}"
    if key in _shown or (issubclass(category, RANK0_ONLY) and _rank() != 0):
        return
    _shown.add(key)
    where = f"{os.path.basename(filename)}:{lineno}"
    print(f"[megatron-rl] warning from {where}: {category.__name__}: {first_line}", file=sys.stderr, flush=True)


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
            if file is not None:  # an explicit stream (warnings.showwarning called directly): as Python would
                return previous(message, category, filename, lineno, file, line)
            return _show_other(message, category, filename, lineno)
        _show_once(str(message), why)

    warnings.showwarning = showwarning
    for name in ("megatron.core.rerun_state_machine", "transformers.utils.generic"):
        logging.getLogger(name).addFilter(_KnownLogFilter())
