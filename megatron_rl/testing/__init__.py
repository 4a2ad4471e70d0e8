"""Test utilities shipped with the package (used by ``tests/`` and by users' own tests)."""
from megatron_rl.testing.distributed import run_ranks

__all__ = ["run_ranks"]
