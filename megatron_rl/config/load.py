"""Load a job config: YAML file -> dotted ``key.sub=value`` overrides -> typed sections -> validation.

    cfg = load_job_config("configs/tiny_cpu.yaml", ["actor.lr=3e-4", "parallel.tensor_model_parallel_size=1"],
                          world_size=4)

Values of overrides are parsed as YAML (``true``, ``1e-4``, ``[a, b]``, ``null``). Unknown keys at
any depth raise :class:`ConfigError` naming the dotted key and the nearest valid one — before any
process group exists.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence

import yaml

from megatron_rl.config.sections import (
    ActorConfig, AlgorithmConfig, DataConfig, RolloutConfig, TrainerConfig,
)
from megatron_rl.correction import RolloutCorrectionConfig
from megatron_rl.losses import PolicyLossConfig
from megatron_rl.models.config import ModelConfig, model_config_from_dict
from megatron_rl.parallel.config import ParallelConfig, parallel_config_from_dict


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-4`` as a string; accept exponent floats without a dot, like YAML 1.2."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def yaml_load(text_or_stream):
    """Parse YAML with exponent floats (``1e-4``) read as floats."""
    return yaml.load(text_or_stream, Loader=_Loader)


class ConfigError(ValueError):
    """A config problem, naming the dotted key."""


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

    def to_dict(self) -> Dict[str, Any]:
        """Plain nested dict (YAML-dumpable; the checkpoint stores it)."""
        out = {}
        for f in dataclasses.fields(self):
            out[f.name] = _plain(getattr(self, f.name))
        return out


SECTIONS = ("model", "parallel", "rollout", "data", "algorithm", "actor", "trainer")


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


def _near(key: str, options: Sequence[str]) -> str:
    m = difflib.get_close_matches(key, list(options), n=1)
    return f" (did you mean {m[0]!r}?)" if m else ""


def apply_overrides(tree: Dict[str, Any], overrides: Sequence[str]) -> Dict[str, Any]:
    """Apply ``a.b.c=value`` strings to a nested dict (values parsed as YAML)."""
    tree = dict(tree)
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r}: expected key.sub=value")
        key, raw = ov.split("=", 1)
        parts = key.strip().split(".")
        if parts[0] not in SECTIONS:
            raise ConfigError(f"override {key!r}: unknown section {parts[0]!r}{_near(parts[0], SECTIONS)}; "
                              f"sections: {', '.join(SECTIONS)}")
        node = tree
        for p in parts[:-1]:
            if node.get(p) is None:
                node[p] = {}
            elif not isinstance(node[p], dict):
                raise ConfigError(f"override {key!r}: {p!r} is not a section")
            node[p] = dict(node[p])
            node = node[p]
        try:
            node[parts[-1]] = yaml_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {key!r}: cannot parse value {raw!r}: {exc}") from None
    return tree


def _build(cls, d: Any, where: str):
    """Instantiate dataclass ``cls`` from dict ``d``; unknown keys named with their dotted path."""
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(d).__name__}")
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for k in d:
        if k not in names:
            raise ConfigError(f"{where}.{k}: unknown key{_near(k, names)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            continue
        v = d[f.name]
        try:
            if f.name == "rollout_correction":
                v = RolloutCorrectionConfig.from_dict(v)
            elif f.name == "policy_loss":
                v = PolicyLossConfig.from_dict(v or {})
        except ValueError as exc:
            raise ConfigError(f"{where}.{f.name}: {exc}") from None
        kwargs[f.name] = v
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _model_from_hf(path: str) -> ModelConfig:
    """ModelConfig of an HF directory or a ``megatron-rl convert hf-to-mcore`` directory (its hf_assets).

    The vocabulary is not padded: a size that TP does not divide is rejected by validation, because
    padded logit columns would change the softmax the rollout engine computes."""
    from megatron_rl.convert import model_config_for_checkpoint

    if not os.path.isdir(path):
        raise ConfigError(f"actor.load_hf: {path!r} is not a directory")
    try:
        return model_config_for_checkpoint(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"actor.load_hf: cannot read a model config from {path!r}: {exc}") from None


def job_config_from_dict(tree: Dict[str, Any]) -> JobConfig:
    """Typed JobConfig from a nested dict (no world-size checks; see validate_job)."""
    if not isinstance(tree, dict):
        raise ConfigError(f"config: expected a mapping at the top level, got {type(tree).__name__}")
    for k in tree:
        if k not in SECTIONS:
            raise ConfigError(f"{k}: unknown section{_near(k, SECTIONS)}; sections: {', '.join(SECTIONS)}")
    actor = _build(ActorConfig, tree.get("actor"), "actor")
    model = None
    if tree.get("model"):
        try:
            model = model_config_from_dict(dict(tree["model"]))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"model: {exc}") from None
    elif actor.load_hf:
        model = _model_from_hf(actor.load_hf)
    try:
        parallel = parallel_config_from_dict(dict(tree.get("parallel") or {}))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"parallel: {exc}") from None
    return JobConfig(model=model, parallel=parallel,
                     rollout=_build(RolloutConfig, tree.get("rollout"), "rollout"),
                     data=_build(DataConfig, tree.get("data"), "data"),
                     algorithm=_build(AlgorithmConfig, tree.get("algorithm"), "algorithm"),
                     actor=actor, trainer=_build(TrainerConfig, tree.get("trainer"), "trainer"))


def load_job_config(path: Optional[str], overrides: Sequence[str] = (), world_size: Optional[int] = None) -> JobConfig:
    """Read YAML ``path`` (None: all defaults), apply overrides, build and validate.

    ``world_size`` (default: $WORLD_SIZE, else 1) is checked against the parallel layout.
    """
    tree: Dict[str, Any] = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist")
        with open(path) as fh:
            try:
                tree = yaml_load(fh) or {}
            except yaml.YAMLError as exc:
                raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    tree = apply_overrides(tree, list(overrides))
    cfg = job_config_from_dict(tree)
    from megatron_rl.config.validate import validate_job

    ws = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    validate_job(cfg, ws)
    return cfg
