"""The weight-sync mode of a job (``rollout.weight_sync``) as one object, built once by ``resolve_mode``.

    mode = resolve_mode(cfg.rollout, engine_class(cfg.rollout.engine))   # "auto" resolved here, nowhere else
    receiver = mode.open(engine, "step-3", 600)   # streamed modes: the engine's WeightReceiver
    mode.load(engine, source, "step-3", 600)      # a whole payload: an HF directory (disk) or rank 0's buckets

The mode decides how the bytes reach the engine; the engine only receives (``endpoint.WeightEndpoint``). The engine
class is handed in (its declared ``sync_capabilities``): this package never imports an engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_rl.weight_sync.transport import UpdateGroups

__all__ = ["WeightSyncMode", "DiskMode", "TensorMode", "DistributedMode", "resolve_mode"]


class WeightSyncMode:
    """How a version's weights reach the engine (one subclass per ``rollout.weight_sync`` value)."""

    #: The ``rollout.weight_sync`` value.
    name: str = ""
    #: True: every sender streams its own buckets at sync time (``stream.stream_sync``); False: a disk export.
    streamed: bool = True

    def open(self, engine, version: str, timeout_s: float):
        """An in-memory update of ``engine`` to ``version`` (its ``WeightReceiver``)."""
        raise NotImplementedError

    def load(self, engine, source, version: str, timeout_s: float) -> None:
        """Load a whole payload (rank 0's buckets) and tag it ``version``, all-or-nothing: a failure aborts the
        update (the engine then refuses to generate until a later sync succeeds) and is raised."""
        receiver = self.open(engine, version, timeout_s)
        try:
            for bucket in source:
                receiver.load(bucket)
            receiver.commit()
        except BaseException as exc:
            receiver.abort(f"{type(exc).__name__}: {exc}")
            raise

    def __str__(self) -> str:
        return self.name


class DiskMode(WeightSyncMode):
    """``disk``: rank 0 writes an HF export and the engine loads the directory (``engine.update_weights``)."""

    name = "disk"
    streamed = False

    def open(self, engine, version, timeout_s):
        raise TypeError("rollout.weight_sync: disk has no in-memory update (load the export directory)")

    def load(self, engine, source, version, timeout_s) -> None:
        engine.update_weights(source, version)


class TensorMode(WeightSyncMode):
    """``tensor``: buckets reach the engine on this host (the embedded engine's process; SGLang servers through
    shared memory)."""

    name = "tensor"

    def open(self, engine, version, timeout_s):
        return engine.begin_weight_sync(version, timeout_s)


@dataclass
class DistributedMode(WeightSyncMode):
    """``distributed``: each sender broadcasts its buckets in its own update group with every server rank."""

    master_address: Optional[str] = None
    """``rollout.weight_sync_master_address``: where the servers reach trainer rank 0 (None: found by route)."""
    backend: str = field(default_factory=lambda: "nccl" if torch.cuda.is_available() else "gloo")
    """The update groups' backend: NCCL when the trainer has a GPU, gloo on CPU."""

    name = "distributed"

    def open(self, engine, version, timeout_s):
        return engine.begin_weight_sync(version, timeout_s, UpdateGroups(self.backend, self.master_address))


def resolve_mode(rollout, engine) -> WeightSyncMode:
    """The mode object of a ``rollout`` config section: ``rollout.weight_sync``, or for "auto" the ``engine``
    class's default for sync or async rollouts (embedded: tensor; SGLang: distributed, disk with async rollouts).
    ``rollout`` is validated (the engine accepts the mode)."""
    name = rollout.weight_sync
    if name == "auto":
        name = engine.sync_capabilities.default(async_rollouts=rollout.mode == "async")
    if name == "disk":
        return DiskMode()
    if name == "tensor":
        return TensorMode()
    return DistributedMode(rollout.weight_sync_master_address)
