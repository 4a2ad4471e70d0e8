"""Disk exports (``rollout.weight_sync: disk``): what an export moves, and deleting the ones no engine needs."""
from __future__ import annotations

import os
from typing import List

from megatron_rl.weight_sync.versions import parse_version
from megatron_rl.weight_sync.report import SyncReport

__all__ = ["export_report", "prune_exports"]


def export_report(path: str) -> SyncReport:
    """What an HF export moves: the bytes of its safetensors files."""
    return SyncReport(bytes=sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                                if f.endswith(".safetensors")))


def prune_exports(out_dir: str, keep_versions: set) -> List[str]:
    """Rank 0, disk mode: delete the ``step-N`` exports in ``out_dir`` whose N is not in ``keep_versions`` (what
    an engine may still load or holds); other entries are left alone. Returns the deleted paths."""
    import shutil

    gone = []
    for entry in sorted(os.listdir(out_dir)):
        try:
            v = parse_version(entry)
        except ValueError:
            continue
        if v not in keep_versions and os.path.isdir(os.path.join(out_dir, entry)):
            shutil.rmtree(os.path.join(out_dir, entry))
            gone.append(os.path.join(out_dir, entry))
    return gone
