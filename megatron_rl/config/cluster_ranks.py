"""``python -m megatron_rl.config.cluster_ranks CONFIG [key.sub=value ...]``: the ranks per node a job is written for.

launch/torchrun.sh's default for ``--nproc-per-node``: the config's ``cluster.gpus_per_node`` with the command
line's overrides applied, so a config's README line runs the job the config describes. Reads keys only (no
megatron-core import); prints nothing and exits 1 when the config cannot be read -- the launcher's check then
names the problem.
"""
import sys
from typing import List, Optional

from megatron_rl.config.job import ConfigError
from megatron_rl.config.load import read_job_config


def ranks_per_node(path: str, overrides: List[str]) -> Optional[int]:
    """``cluster.gpus_per_node`` of the job (overrides applied); None when the file or that key cannot be read."""
    try:
        cfg, errors = read_job_config(path, overrides)
    except ConfigError:
        return None
    if any(e.startswith("cluster.gpus_per_node") for e in errors):
        return None
    return cfg.cluster.gpus_per_node


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m megatron_rl.config.cluster_ranks CONFIG [key.sub=value ...]", file=sys.stderr)
        return 2
    n = ranks_per_node(argv[0], [a for a in argv[1:] if not a.startswith("--resume")])
    if n is None:
        return 1
    print(n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
