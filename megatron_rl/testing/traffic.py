"""Bytes that pass through this process's ``torch.distributed`` calls (tests of where weight-sync bytes go).

    with Traffic() as t:          # patches isend / irecv (send / recv use them), broadcast, all_gather
        publisher.publish("step-1")
    t.sent, t.received            # tensor bytes this rank sent / received (object messages included)

``all_gather`` counts the other ranks' parts as received and this rank's part as sent once per peer; a
broadcast counts as sent on its source, received elsewhere (``src`` read as a rank of ``group``: true of the
default group and of weight-sync update groups, where the sender is rank 0).
"""
from __future__ import annotations

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_NAMES = ("isend", "irecv", "broadcast", "all_gather")  # send / recv call isend / irecv


def _nbytes(t) -> int:
    return int(t.numel() * t.element_size())


class Traffic:
    """See the module doc."""

    def __init__(self):
        self.sent = 0
        self.received = 0
        self._saved = {}

    def __enter__(self) -> "Traffic":
        for name in _NAMES:
            self._saved[name] = (getattr(dist, name), getattr(c10d, name))
        real = {name: self._saved[name][1] for name in _NAMES}

        def isend(tensor, *a, **k):
            self.sent += _nbytes(tensor)
            return real["isend"](tensor, *a, **k)

        def irecv(tensor, *a, **k):
            self.received += _nbytes(tensor)
            return real["irecv"](tensor, *a, **k)

        def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
            root = src if src is not None else group_src  # a group rank in the groups used here
            mine = dist.get_rank() if group is None else group.rank()
            if mine == root:
                self.sent += _nbytes(tensor)
            else:
                self.received += _nbytes(tensor)
            return real["broadcast"](tensor, src=src, group=group, async_op=async_op, group_src=group_src)

        def all_gather(tensor_list, tensor, group=None, *a, **k):
            peers = len(tensor_list) - 1
            self.sent += _nbytes(tensor) * peers
            self.received += _nbytes(tensor) * peers
            return real["all_gather"](tensor_list, tensor, group, *a, **k)

        for name, fn in (("isend", isend), ("irecv", irecv),
                         ("broadcast", broadcast), ("all_gather", all_gather)):
            setattr(dist, name, fn)
            setattr(c10d, name, fn)
        return self

    def __exit__(self, *exc) -> None:
        for name, (a, b) in self._saved.items():
            setattr(dist, name, a)
            setattr(c10d, name, b)
