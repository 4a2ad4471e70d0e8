"""The whole-job config type and its error type, shared by loading (``load``) and validation
(``validate``) so neither imports the other.

    cfg: JobConfig = load_job_config("configs/tiny_cpu.yaml")
    cfg.to_dict()          # plain nested dict (the checkpoint stores it)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from megatron_rl.config.sections import (
    ActorConfig, AlgorithmConfig, ClusterConfig, DataConfig, MultiTurnConfig, RolloutConfig, TrainerConfig,
)
from megatron_rl.config.critic import CriticConfig
from megatron_rl.config.reward_section import RewardConfig
from megatron_rl.models.config import ModelConfig
from megatron_rl.parallel.config import ParallelConfig

#: YAML sections in file order.
SECTIONS = ("cluster", "model", "parallel", "rollout", "data", "multi_turn", "algorithm", "actor", "trainer",
            "reward", "critic")


class ConfigError(ValueError):
    """A config problem; the message names each dotted key (``actor.lr: ...``)."""


@dataclass
class JobConfig:
    """A whole megatron-rl job (see :mod:`megatron_rl.config.sections`)."""

    model: Optional[ModelConfig]
    parallel: ParallelConfig
    rollout: RolloutConfig
    data: DataConfig
    algorithm: AlgorithmConfig
    actor: ActorConfig
    trainer: TrainerConfig
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)

    def to_dict(self) -> Dict[str, Any]:
        """Plain nested dict (YAML-dumpable; the checkpoint stores it)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _plain(obj):
    if obj is None or isinstance(obj, (int, float, str, bool)):
        return obj
    if isinstance(obj, (list, tuple)):
        return [_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if hasattr(obj, "to_dict"):
        return _plain(obj.to_dict())
    if dataclasses.is_dataclass(obj):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    return obj
