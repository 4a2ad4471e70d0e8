"""Which megatron-core patches a machine needs, keyed on what is missing, not on the device:

* no Transformer Engine (CPU, or CUDA without TE) -> ``"local_layers"`` (:mod:`megatron_rl.platform.local_layers`:
  packed attention, sequence-parallel torch norm, MLA's attention arguments in megatron's local spec);
* no CUDA -> ``"cpu"`` as well (:mod:`megatron_rl.platform.cpu_compat`: CUDA API stand-ins for CPU tensors and
  gloo).

Apex plays no part: the builder uses megatron's torch norm for RMSNorm in the local spec with or without apex
(apex's fused norm is LayerNorm only).

Usage::

    select_patches(has_cuda=True, has_te=False)     # ("local_layers",)
    select_patches(has_cuda=False, has_te=False)    # ("cpu", "local_layers")
    apply_platform_patches()                        # detects this machine (Platform.detect) and applies
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from megatron_rl.platform.cpu_compat import apply_cpu_stand_ins
from megatron_rl.platform.local_layers import apply_local_layer_patches

__all__ = ["Platform", "select_patches", "apply_platform_patches", "apply_cpu_patches", "applied_patch_sets",
           "te_installed", "PATCH_SETS"]

#: patch set name -> what it supplies
PATCH_SETS = {"local_layers": "what megatron's local (non-TE) layer spec lacks",
              "cpu": "CUDA API stand-ins for CPU tensors and gloo"}

_applied = set()


def te_installed() -> bool:
    """True when the ``transformer_engine`` package is installed (found, not imported: importing it needs CUDA)."""
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class Platform:
    """What the machine offers megatron-core."""

    has_cuda: bool
    """A CUDA device is available to torch."""
    has_te: bool
    """Transformer Engine is usable (installed, and CUDA is there to run it)."""

    @classmethod
    def detect(cls) -> "Platform":
        """This machine."""
        cuda = torch.cuda.is_available()
        return cls(has_cuda=cuda, has_te=cuda and te_installed())


def select_patches(has_cuda: bool, has_te: bool) -> Tuple[str, ...]:
    """The patch sets (names of ``PATCH_SETS``) a machine with / without CUDA and TE needs."""
    sets = []
    if not has_cuda:  # first: megatron modules the other set imports then load with the CPU view
        sets.append("cpu")
    if not has_te or not has_cuda:  # TE needs CUDA: without CUDA the local spec is built
        sets.append("local_layers")
    return tuple(sets)


def apply_platform_patches(platform: Optional[Platform] = None) -> Tuple[str, ...]:
    """Apply the patch sets ``platform`` (default: this machine) needs; idempotent. Returns their names."""
    p = platform or Platform.detect()
    chosen = select_patches(p.has_cuda, p.has_te)
    for name in chosen:
        {"local_layers": apply_local_layer_patches, "cpu": apply_cpu_stand_ins}[name]()
        _applied.add(name)
    return chosen


def apply_cpu_patches(force: bool = False) -> bool:
    """Everything a machine without CUDA needs: the local-layer patches (no TE without CUDA) and the CPU
    stand-ins. A no-op returning False when CUDA is available (unless ``force``); True otherwise. Idempotent."""
    if torch.cuda.is_available() and not force:
        return False
    apply_platform_patches(Platform(has_cuda=False, has_te=False))
    return True


def applied_patch_sets() -> Tuple[str, ...]:
    """The patch sets applied in this process so far."""
    return tuple(n for n in PATCH_SETS if n in _applied)
