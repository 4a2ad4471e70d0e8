"""Weight-version tags of the engines: ``weight_sync.versions`` (their one home), named here for the rollout side."""
from __future__ import annotations

from megatron_rl.weight_sync.versions import parse_version, version_tag

__all__ = ["version_tag", "parse_version"]
