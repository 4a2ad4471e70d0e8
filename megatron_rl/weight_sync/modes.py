"""The weight-sync mode of a job (``rollout.weight_sync``) as one object, built once by ``resolve_mode``.

    mode = resolve_mode(rollout, {k: engine_class(k) for k in ENGINE_KINDS})  # "auto" resolved here, nowhere else
    receiver = mode.open(engine, "step-3", 600)   # streamed modes: the engine's WeightReceiver
    mode.load(engine, source, "step-3", 600)      # a whole payload: an HF directory (disk) or rank 0's buckets

The mode decides how the bytes reach the engine; the engine only receives (``endpoint.WeightEndpoint``). The engine
classes are handed in (their declared ``sync_capabilities``): this package never imports an engine. Rule: this is
the one module that reads ``rollout.weight_sync``; everything else asks the mode object.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch

from megatron_rl.weight_sync.endpoint import WEIGHT_SYNC_MODES
from megatron_rl.weight_sync.transport import UpdateGroups

__all__ = ["WeightSyncMode", "DiskMode", "TensorMode", "DistributedMode", "resolve_mode"]


class WeightSyncMode:
    """How a version's weights reach the engine (one subclass per ``rollout.weight_sync`` value)."""

    #: The ``rollout.weight_sync`` value.
    name: str = ""
    #: True: every sender streams its own buckets at sync time (``stream.stream_sync``); False: a disk export.
    streamed: bool = True
    #: Whether ``rollout.weight_sync_delta`` can ride on this mode (only the changed elements sent).
    delta_ok: bool = False

    def __init__(self, auto: bool = False):
        self.auto = auto
        """True: ``rollout.weight_sync: auto`` chose this mode (the engine class's default)."""

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
    delta_ok = True

    def open(self, engine, version, timeout_s):
        return engine.begin_weight_sync(version, timeout_s)


@dataclass
class DistributedMode(WeightSyncMode):
    """``distributed``: each sender broadcasts its buckets in its own update group with every server rank."""

    master_address: Optional[str] = None
    """``rollout.weight_sync_master_address``: where the servers reach trainer rank 0 (None: found by route)."""
    backend: str = field(default_factory=lambda: "nccl" if torch.cuda.is_available() else "gloo")
    """The update groups' backend: NCCL when the trainer has a GPU, gloo on CPU."""
    auto: bool = False
    """True: ``rollout.weight_sync: auto`` chose this mode (the engine class's default)."""

    name = "distributed"

    def open(self, engine, version, timeout_s):
        return engine.begin_weight_sync(version, timeout_s, UpdateGroups(self.backend, self.master_address))


def resolve_mode(rollout, engines: Mapping[str, type]) -> Optional[WeightSyncMode]:
    """The mode object of a ``rollout`` config section: ``rollout.weight_sync``, or for "auto" the engine class's
    default for sync or async rollouts (embedded: tensor; SGLang: distributed, disk with async rollouts).
    ``engines``: every ``rollout.engine`` value's class (an error names those that take the mode). ``ValueError``
    naming ``rollout.weight_sync`` when it is not a mode, its engine does not take it, or async rollouts cannot
    apply it later; None when ``rollout.engine`` is not one of ``engines`` (that key's own check names it)."""
    name, auto = rollout.weight_sync, rollout.weight_sync == "auto"
    known = ("auto",) + WEIGHT_SYNC_MODES
    if name not in known:
        raise ValueError(f"rollout.weight_sync: {name!r} is not one of {', '.join(known)}")
    engine = engines.get(rollout.engine) if isinstance(rollout.engine, str) else None
    if engine is None:
        return None
    caps = engine.sync_capabilities
    if auto:
        name = caps.default(async_rollouts=rollout.mode == "async")
    elif name not in caps.modes:
        able = [k for k, cls in engines.items() if name in cls.sync_capabilities.modes]
        raise ValueError(f"rollout.weight_sync: {name!r} needs rollout.engine "
                         f"{' or '.join(repr(k) for k in able)} (the {rollout.engine} engine takes "
                         f"{' or '.join(caps.modes)})")
    elif rollout.mode == "async" and name not in caps.deferred:
        raise ValueError(f"rollout.weight_sync: {name!r} streams the weights from every trainer rank at sync time, "
                         f"but rollout.mode 'async' applies them later in rank 0's producer thread alone — use "
                         f"rollout.weight_sync: {' or '.join(caps.deferred)} (or auto) with rollout.mode: async")
    if name == "disk":
        return DiskMode(auto=auto)
    if name == "tensor":
        return TensorMode(auto=auto)
    return DistributedMode(rollout.weight_sync_master_address, auto=auto)
