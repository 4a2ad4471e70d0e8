"""Rollout engines behind one interface (``base.RolloutEngine``).

* ``base``: ``SamplingParams``, ``Rollout``, ``RolloutEngine`` and the error types.
* ``sglang_engine``: ``SGLangEngine`` — SGLang servers over HTTP (round-robin, retries, weight sync).
* ``sglang_server``: ``launch_sglang_server`` — start/stop a local SGLang server (CPU stand-ins included).
* the embedded in-process engine lives in its own module of this package.
"""
from megatron_rl.rollout.base import (
    EngineUnavailableError,
    MalformedResponseError,
    Rollout,
    RolloutEngine,
    RolloutError,
    SamplingParams,
    StaleRolloutError,
    WeightSyncError,
)

__all__ = [
    "EngineUnavailableError",
    "MalformedResponseError",
    "Rollout",
    "RolloutEngine",
    "RolloutError",
    "SamplingParams",
    "StaleRolloutError",
    "WeightSyncError",
]
