"""The installed megatron-core release, the supported range, and what differs between the releases we test.

The project runs on megatron-core 0.16.1 through 0.19.x (CI tests both ends: 0.16.1 and 0.19.2). Code that
behaves differently across that range asks here instead of comparing version strings itself::

    from megatron_rl.platform.mcore_version import MCORE, check_supported_mcore
    check_supported_mcore()                      # clear error outside 0.16.1 <= v < 0.20
    if MCORE.counts_expert_grads_at_etp_ne_tp:   # Megatron-LM #5916 (0.19.0)
        ...

Differences that need a patch of megatron itself (CPU only) live in ``platform/cpu_compat``; this module
only reads the version and states each difference once, with its reason.
"""
from __future__ import annotations

import dataclasses
import os
from importlib.metadata import PackageNotFoundError, version
from typing import Tuple

__all__ = ["MIN_SUPPORTED", "MAX_EXCLUSIVE", "McoreRelease", "MCORE", "parse_release", "installed_release",
           "check_supported_mcore", "UnsupportedMegatronCore", "write_legacy_common_state", "megatron_cp_batch"]

#: oldest supported megatron-core release (setup.py's lower bound)
MIN_SUPPORTED: Tuple[int, int, int] = (0, 16, 1)
#: first release not supported (setup.py's upper bound)
MAX_EXCLUSIVE: Tuple[int, int, int] = (0, 20, 0)


class UnsupportedMegatronCore(RuntimeError):
    """The installed megatron-core is outside the supported range."""


def parse_release(text: str) -> Tuple[int, int, int]:
    """``'0.19.2'``, ``'0.19.2+79b1ed7'``, ``'0.20.0rc1'`` -> ``(0, 19, 2)`` / ... (major, minor, patch)."""
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            raise ValueError(f"megatron-core version {text!r}: cannot read major.minor.patch")
        parts.append(int(digits))
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class McoreRelease:
    """One megatron-core release and the behaviour differences the project depends on."""

    release: Tuple[int, int, int]

    @property
    def text(self) -> str:
        """``'0.19.2'``."""
        return ".".join(map(str, self.release))

    @property
    def supported(self) -> bool:
        """``MIN_SUPPORTED <= release < MAX_EXCLUSIVE``."""
        return MIN_SUPPORTED <= self.release < MAX_EXCLUSIVE

    @property
    def counts_expert_grads_at_etp_ne_tp(self) -> bool:
        """The gradient norm (and so clipping) counts every expert gradient when expert TP != TP: fixed in 0.19.0
        (Megatron-LM #5916); before, expert params were deduplicated with the dense TP group."""
        return self.release >= (0, 19, 0)

    @property
    def moe_permute_saves_sort_index(self) -> bool:
        """The MoE token permutation saves for backward an int64 sort index over 2 x (token, expert) pairs
        instead of the ``[experts, tokens]`` bool routing map and its fp32 probabilities (0.19.0; measured)."""
        return self.release >= (0, 19, 0)

    @property
    def cp_batch_needs_hybrid_flag(self) -> bool:
        """``get_batch_on_this_cp_rank(batch, is_hybrid_cp, cp_group=...)``: 0.19.0 added the required
        ``is_hybrid_cp`` argument (and reads the group's size and rank through ``torch.distributed``)."""
        return self.release >= (0, 19, 0)


def installed_release() -> McoreRelease:
    """The installed megatron-core (from its distribution metadata; ``megatron.core.__version__`` appends the
    git hash of the current directory's repository)."""
    try:
        return McoreRelease(parse_release(version("megatron-core")))
    except PackageNotFoundError:
        import megatron.core

        return McoreRelease(parse_release(getattr(megatron.core, "__version__", "0.0.0")))


def check_supported_mcore(release: "McoreRelease | None" = None) -> McoreRelease:
    """Raise ``UnsupportedMegatronCore`` (naming the installed and the supported versions) outside the range."""
    rel = release if release is not None else MCORE
    if not rel.supported:
        lo, hi = ".".join(map(str, MIN_SUPPORTED)), ".".join(map(str, MAX_EXCLUSIVE))
        raise UnsupportedMegatronCore(
            f"megatron-core {rel.text} is installed; megatron-rl supports {lo} <= megatron-core < {hi} "
            f"(tested: 0.16.1 and 0.19.2; see docs/megatron_versions.md)")
    return rel


def write_legacy_common_state(checkpoint_dir: str) -> bool:
    """Make a torch_dist checkpoint readable by megatron-core 0.16-0.18; call on one rank after the save.

    0.19 keeps the common (non-sharded) state inside the shards (a ``common_state`` object) and writes no
    ``common.pt``; 0.16 reads the common state from ``common.pt`` only and fails without it. This copies the
    stored common state into ``common.pt`` (0.19 itself reads ``common.pt`` first when it exists: same content).
    Returns True when the file was written (False: already there, as every release before 0.19 writes it)."""
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

    path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
    if os.path.exists(path):
        return False
    import torch
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    common = load_common_state_dict(checkpoint_dir)
    tmp = path + ".tmp"
    torch.save(common, tmp)
    os.replace(tmp, path)
    return True


def megatron_cp_batch(batch: dict, cp_group) -> dict:
    """megatron-core's own context-parallel split of ``batch`` (``megatron.core.utils.get_batch_on_this_cp_rank``:
    each sequence in ``2 x cp`` chunks, chunks ``r`` and ``2cp-1-r`` to rank ``r``) for this process's rank of
    ``cp_group`` (a registered process group), whatever the installed release's signature."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    if MCORE.cp_batch_needs_hybrid_flag:
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group)
    return get_batch_on_this_cp_rank(batch, cp_group=cp_group)


#: the installed release (read once at import)
MCORE: McoreRelease = installed_release()
