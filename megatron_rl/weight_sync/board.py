"""The end of a sync with several senders: every sender posts its outcome, rank 0 reads them all and posts the
decision, each wait bounded by a deadline.

The posts go to the default process group's key-value store (not a collective), so a sender that died or hangs
is named by rank when the deadline passes instead of blocking the others in a collective forever::

    board = Board(seq)                       # seq: the same per-process sync counter on every rank
    board.post(rank, outcome)                # each sender
    outcomes, missing = board.collect(senders, timeout_s)      # rank 0: {rank: outcome}, ranks never heard of
    board.decide(error_or_none)              # rank 0
    error = board.decision(timeout_s)        # every other rank (a WeightSyncError when rank 0 never decided)
"""
from __future__ import annotations

import pickle
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

from megatron_rl.weight_sync.endpoint import WeightSyncError

__all__ = ["Board"]


class Board:
    """One sync's outcomes in the default group's store (keys ``weight_sync/<seq>/...``)."""

    def __init__(self, seq: int):
        from torch.distributed.distributed_c10d import _get_default_store

        self.store = _get_default_store()
        self.prefix = f"weight_sync/{seq}/"

    def post(self, rank: int, outcome: Any) -> None:
        self.store.set(self.prefix + str(rank), pickle.dumps(outcome))

    def _wait(self, key: str, deadline: float) -> bool:
        try:
            self.store.wait([self.prefix + key], timedelta(seconds=max(0.01, deadline - time.monotonic())))
            return True
        except Exception:  # noqa: BLE001 - timed out (the poster is dead or late)
            return False

    def collect(self, ranks: List[int], timeout_s: float) -> Tuple[Dict[int, Any], List[int]]:
        """Every ``ranks`` outcome posted within ``timeout_s``; the ranks that posted none."""
        deadline = time.monotonic() + timeout_s
        got, missing = {}, []
        for r in ranks:
            if self._wait(str(r), deadline):
                got[r] = pickle.loads(self.store.get(self.prefix + str(r)))
                try:
                    self.store.delete_key(self.prefix + str(r))
                except Exception:  # noqa: BLE001 - a store without deletion keeps the key
                    pass
            else:
                missing.append(r)
        return got, missing

    def decide(self, error: Optional[BaseException]) -> None:
        self.store.set(self.prefix + "decision", pickle.dumps(error))

    def decision(self, timeout_s: float) -> Optional[BaseException]:
        if not self._wait("decision", time.monotonic() + timeout_s):
            return WeightSyncError(f"global rank 0 posted no outcome of the weight sync within {timeout_s:g} s "
                                   "(it died or hangs)")
        return pickle.loads(self.store.get(self.prefix + "decision"))


def world() -> Tuple[int, int]:
    """(rank, world size) of the default group ((0, 1) without one)."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()
