"""Load a job config, plainly: YAML file -> dotted ``key.sub=value`` overrides -> typed sections.

    cfg, errors = read_job_config("configs/tiny_cpu.yaml", ["actor.lr=3e-4"])   # never raises ConfigError

Values of overrides are parsed as YAML (``true``, ``1e-4``, ``[a, b]``, ``null``). Path-valued keys
(``path_field``, :mod:`megatron_rl.config.paths`) resolve here, once: the file's against its directory, the
overrides' against the current directory. Every value is checked against its dataclass field's type
(:mod:`megatron_rl.config.types`) and every unknown key is reported with a hint (:mod:`megatron_rl.config.hints`).
The one rule: nothing here validates across keys -- the validating loader (``load_job_config``,
``collect_job_config``) is ``megatron_rl.plan.load``, one layer up, which adds what fails to build of the job plan.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import yaml

from megatron_rl.config.algorithm_spellings import merge_verl_spellings
from megatron_rl.config.epochs import apply_epochs
from megatron_rl.config.hints import unknown_key_message
from megatron_rl.config.critic import CriticConfig
from megatron_rl.config.job import SECTIONS, ConfigError, JobConfig
from megatron_rl.config.paths import moved_path_errors, path_kind, resolve_path, resolve_tree_paths
from megatron_rl.config.sections import (
    ActorConfig, AlgorithmConfig, ClusterConfig, DataConfig, FilterGroupsConfig, MultiTurnConfig, RolloutConfig,
    TrainerConfig, ValKwargsConfig,
)
from megatron_rl.config.types import check_value, field_types
from megatron_rl.config.verl_keys import is_verl_config
from megatron_rl.convert import CheckpointMismatchError, check_model_config_matches, model_config_for_checkpoint
from megatron_rl.convert.storage import hf_assets_dir, read_hf_config
from megatron_rl.correction import RolloutCorrectionConfig
from megatron_rl.algo.kl_reward import KLControlConfig
from megatron_rl.correction.migration import IGNORED_VERL_KEYS, LEGACY_KEYS
from megatron_rl.losses import PolicyLossConfig
from megatron_rl.lora.config import LoraConfig
from megatron_rl.losses.registry import loss_type_for_loss_mode
from megatron_rl.config.reward_section import RewardConfig, RewardModelConfig
from megatron_rl.models.config import ModelConfig
from megatron_rl.parallel.config import ParallelConfig
from megatron_rl.tasks.judge_config import JudgeConfig

__all__ = ["ConfigError", "JobConfig", "apply_overrides", "job_config_from_dict", "launch_world_size",
           "read_config_file", "read_job_config", "format_errors", "yaml_load"]

#: section (dotted) -> its dataclass
SECTION_CLASSES = {"cluster": ClusterConfig, "model": ModelConfig, "parallel": ParallelConfig,
                   "rollout": RolloutConfig, "rollout.val_kwargs": ValKwargsConfig,
                   "data": DataConfig, "multi_turn": MultiTurnConfig,
                   "algorithm": AlgorithmConfig,
                   "algorithm.rollout_correction": RolloutCorrectionConfig,
                   "algorithm.filter_groups": FilterGroupsConfig, "algorithm.kl_ctrl": KLControlConfig,
                   "actor": ActorConfig,
                   "actor.policy_loss": PolicyLossConfig, "trainer": TrainerConfig,
                   "reward": RewardConfig, "reward.judge": JudgeConfig, "reward.model": RewardModelConfig,
                   "actor.lora": LoraConfig, "critic": CriticConfig}
#: extra keys the nested sections' from_dict accepts besides their fields
_EXTRA_KEYS = {"actor.policy_loss": ("clip_ratio", "use_kl_loss"),
               "algorithm.rollout_correction": tuple(LEGACY_KEYS) + tuple(IGNORED_VERL_KEYS) + ("preset",)}


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


def _all_fields() -> Dict[str, List[str]]:
    return {s: list(field_types(c)) for s, c in SECTION_CLASSES.items()}


def _near(key: str, options: Sequence[str]) -> str:
    m = difflib.get_close_matches(key, list(options), n=1)
    return f" (did you mean {m[0]!r}?)" if m else ""


def _unknown_section(key: str) -> str:
    homes = [s for s, names in _all_fields().items() if key in names]
    hint = f" (it is a key of {' / '.join(f'{s}.{key}' for s in homes)})" if homes else _near(key, SECTIONS)
    return f"{key}: unknown section{hint}; sections: {', '.join(SECTIONS)}"


def apply_overrides(tree: Dict[str, Any], overrides: Sequence[str]) -> Dict[str, Any]:
    """Apply ``a.b.c=value`` strings to a nested dict (values parsed as YAML); raises one ConfigError
    naming every bad override."""
    tree, errors = _apply_overrides(tree, overrides)
    if errors:
        raise ConfigError(format_errors(errors))
    return tree


def _apply_overrides(tree: Dict[str, Any], overrides: Sequence[str]) -> Tuple[Dict[str, Any], List[str]]:
    tree = dict(tree)
    errors: List[str] = []
    for ov in overrides:
        if "=" not in ov:
            errors.append(f"override {ov!r}: expected key.sub=value")
            continue
        key, raw = ov.split("=", 1)
        parts = key.strip().split(".")
        if parts[0] not in SECTIONS:
            errors.append(f"override {key!r}: unknown section {parts[0]!r}{_near(parts[0], SECTIONS)}; "
                          f"sections: {', '.join(SECTIONS)}")
            continue
        try:
            value = yaml_load(raw)
        except yaml.YAMLError as exc:
            errors.append(f"override {key!r}: cannot parse value {raw!r}: {exc}")
            continue
        value = _override_path(parts, value)
        node = tree
        for i, p in enumerate(parts[:-1]):
            if node.get(p) is None:
                node[p] = {}
            elif not isinstance(node[p], dict):
                errors.append(f"override {key!r}: {'.'.join(parts[:i + 1])!r} is not a section")
                break
            node[p] = dict(node[p])
            node = node[p]
        else:
            node[parts[-1]] = value
    return tree, errors


def _override_path(parts: Sequence[str], value: Any) -> Any:
    """An override's value, resolved against the current directory when its key is path-valued."""
    cls = SECTION_CLASSES.get(".".join(parts[:-1]))
    f = next((f for f in dataclasses.fields(cls) if f.name == parts[-1]), None) if cls else None
    kind = path_kind(f) if f is not None else None
    if kind is None:
        return value
    base = os.getcwd()
    return [resolve_path(v, kind, base) for v in value] if isinstance(value, list) else resolve_path(value, kind, base)


def _checked_kwargs(where: str, d: Any, errors: List[str]) -> Dict[str, Any]:
    """The keys of mapping ``d`` that are fields of section ``where`` with values of the right type;
    every unknown key and wrong type is appended to ``errors``."""
    if d is None:
        return {}
    if not isinstance(d, dict):
        errors.append(f"{where}: expected a mapping, got {d!r} ({type(d).__name__})")
        return {}
    types = field_types(SECTION_CLASSES[where])
    extra = _EXTRA_KEYS.get(where, ())
    out: Dict[str, Any] = {}
    for k, v in d.items():
        if k in extra:
            out[k] = v
        elif k not in types:
            if where == "algorithm.rollout_correction" and "preset" in d:
                out[k] = v  # a preset's own arguments (threshold, ...): checked by the preset
            else:
                errors.append(unknown_key_message(where, str(k), list(types), _all_fields()))
        elif f"{where}.{k}" in SECTION_CLASSES:
            out[k] = v  # nested section: built by its own from_dict
        else:
            v, err = check_value(v, types[k], f"{where}.{k}")
            if err:
                errors.append(err)
            else:
                out[k] = v
    return out


def _nested(where: str, d: Any, errors: List[str]):
    """algorithm.rollout_correction / actor.policy_loss through their own from_dict (presets, verl's keys)."""
    cls = SECTION_CLASSES[where]
    if d is None and where == "algorithm.rollout_correction":
        kwargs = None
    else:
        kwargs = _checked_kwargs(where, d if d is not None else {}, errors)
    try:
        return cls.from_dict(kwargs)
    except (TypeError, ValueError) as exc:
        errors.append(f"{where}: {exc}")
        return None


def _section(where: str, d: Any, errors: List[str]):
    """Section dataclass from mapping ``d``; keys with problems fall back to their defaults (so that the
    rest of the file is still validated) and the problems go to ``errors``."""
    cls = SECTION_CLASSES[where]
    kwargs = _checked_kwargs(where, d, errors)
    for f in dataclasses.fields(cls):
        if f"{where}.{f.name}" in SECTION_CLASSES and f.name in kwargs:
            built = _nested(f"{where}.{f.name}", kwargs.pop(f.name), errors)
            if built is not None:
                kwargs[f.name] = built
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        errors.append(f"{where}: {exc}")
        return cls()


def _model_section(d: Any, errors: List[str]) -> Optional[ModelConfig]:
    before = len(errors)
    kwargs = _checked_kwargs("model", d, errors)
    for name in _required_model_fields():
        if name not in kwargs and not any(e.startswith(f"model.{name}:") for e in errors[before:]):
            errors.append(f"model.{name}: required (no default)")
    if len(errors) > before:
        return None
    return ModelConfig(**kwargs)


def _required_model_fields() -> List[str]:
    return [f.name for f in dataclasses.fields(ModelConfig)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def _partial_model(d: Any) -> bool:
    """Whether a ``model:`` section lacks shapes (then, with ``actor.load_hf``, it overrides the HF config's)."""
    return isinstance(d, dict) and any(name not in d for name in _required_model_fields())


def _model_over_hf(path: str, d: Dict[str, Any], errors: List[str]) -> Optional[ModelConfig]:
    """The HF config's ModelConfig with the keys of a ``model:`` section without shapes put over it (verl's
    ``override_config`` / ``override_transformer_config``); ``model.extra`` is merged key by key. A key that would
    change a tensor shape of the checkpoint is an error naming it (the loader refuses such a model when it builds)."""
    base = _model_from_hf(path, errors)
    kwargs = _checked_kwargs("model", d, errors)
    if base is None or any(e.startswith("model.") for e in errors):
        return None
    extra = {**base.extra, **(kwargs.pop("extra", None) or {})}
    hf_cfg = read_hf_config(hf_assets_dir(path))
    for key, value in kwargs.items():
        try:
            check_model_config_matches(hf_cfg, dataclasses.replace(base, **{key: value}))
        except CheckpointMismatchError as exc:
            errors.append(f"model.{key}: {value!r} over actor.load_hf ({path}, {key} {getattr(base, key)!r}) changes "
                          f"the shape of its weights ({exc}); a model: section over actor.load_hf may set only "
                          f"what keeps them")
    if any(e.startswith("model.") for e in errors):
        return None
    return dataclasses.replace(base, **kwargs, extra=extra)


def _model_from_hf(path: str, errors: List[str]) -> Optional[ModelConfig]:
    """ModelConfig of an HF directory or a ``megatron-rl convert hf-to-mcore`` directory (its hf_assets).

    The vocabulary is not padded: a size that TP does not divide is rejected by validation, because
    padded logit columns would change the softmax the rollout engine computes."""
    if not os.path.isdir(path):
        errors.append(f"actor.load_hf: {path!r} is not a directory")
        return None
    try:
        return model_config_for_checkpoint(path)
    except (OSError, ValueError) as exc:
        errors.append(f"actor.load_hf: cannot read a model config from {path!r}: {exc}")
        return None


def _move_loss_mode(tree: Dict[str, Any], errors: List[str]) -> Dict[str, Any]:
    """verl's ``actor.policy_loss.loss_mode`` -> ``algorithm.rollout_correction.loss_type`` (its one owner
    here). verl runs loss_mode only in decoupled mode (bypass mode replaces it), so with bypass_mode true a
    loss_mode other than vanilla is an error; a loss_type already set to a different objective is too."""
    loss = ((tree.get("actor") or {}).get("policy_loss") if isinstance(tree.get("actor"), dict) else None)
    if not isinstance(loss, dict) or "loss_mode" not in loss:
        return tree
    tree = copy.deepcopy(tree)
    mode = tree["actor"]["policy_loss"].pop("loss_mode")
    try:
        loss_type = loss_type_for_loss_mode(mode)
    except ValueError as exc:
        errors.append(str(exc))
        return tree
    algo = tree.get("algorithm")
    algo = tree.setdefault("algorithm", {}) if algo is None else algo
    if not isinstance(algo, dict):
        return tree
    corr = algo.get("rollout_correction")
    corr = {} if corr is None else corr
    if not isinstance(corr, dict):
        return tree
    corr = dict(corr)
    current = corr.get("loss_type")
    if corr.get("bypass_mode"):
        if loss_type not in ("vanilla", "ppo_clip"):
            errors.append(f"actor.policy_loss.loss_mode: {mode!r} with algorithm.rollout_correction.bypass_mode: "
                          f"true (verl runs its bypass_mode loss there, ppo_clip or reinforce by loss_type, and "
                          f"ignores loss_mode); set bypass_mode: false to train with {mode!r}")
        return tree
    if current not in (None, "ppo_clip", "vanilla", loss_type):
        errors.append(f"actor.policy_loss.loss_mode: {mode!r} conflicts with algorithm.rollout_correction."
                      f"loss_type: {current!r} (the loss type has one owner; keep one of them)")
        return tree
    corr["loss_type"] = loss_type
    algo["rollout_correction"] = corr
    return tree


_BUILT = ("cluster", "parallel", "rollout", "data", "multi_turn", "algorithm", "actor", "trainer", "reward",
          "critic")
#: The one problem reported for a verl config (its keys are not this project's).
VERL_FILE_MESSAGE = ("actor_rollout_ref: this is a verl config (its actor_rollout_ref: section), not a megatron-rl "
                     "one; convert it with `megatron-rl migrate verl FILE -o JOB.yaml`, which maps every key to "
                     "this project's and lists those it cannot map with the reason")


def build_job_config(tree: Any) -> Tuple[JobConfig, List[str]]:
    """(JobConfig, problems): the typed config of nested dict ``tree`` with every key that has a problem
    left at its default, and the list of those problems (dotted keys). No world-size checks. A verl config
    (``actor_rollout_ref:``) is one problem pointing to ``megatron-rl migrate verl``, with every section at its
    defaults."""
    errors: List[str] = []
    if not isinstance(tree, dict):
        errors.append(f"config: expected a mapping at the top level, got {type(tree).__name__}")
        tree = {}
    if is_verl_config(tree):
        errors.append(VERL_FILE_MESSAGE)
        return JobConfig(model=None, **{s: _section(s, None, []) for s in _BUILT}), errors
    for k in tree:
        if k not in SECTIONS:
            errors.append(_unknown_section(str(k)))
    tree = _move_loss_mode(tree, errors)
    tree = merge_verl_spellings(tree, errors)
    built = {s: _section(s, tree.get(s), errors) for s in _BUILT}
    model = None
    if tree.get("model") and built["actor"].load_hf and _partial_model(tree["model"]):
        model = _model_over_hf(built["actor"].load_hf, tree["model"], errors)
    elif tree.get("model"):
        model = _model_section(tree["model"], errors)
    elif built["actor"].load_hf:
        model = _model_from_hf(built["actor"].load_hf, errors)
    cfg = JobConfig(model=model, **built)
    trainer_tree = tree.get("trainer")
    errors += apply_epochs(cfg, trainer_tree if isinstance(trainer_tree, dict) else {})
    return cfg, errors


def job_config_from_dict(tree: Dict[str, Any]) -> JobConfig:
    """Typed JobConfig from a nested dict (no world-size checks; see ``megatron_rl.plan.validate_job``); raises one
    ConfigError listing every problem."""
    cfg, errors = build_job_config(tree)
    if errors:
        raise ConfigError(format_errors(errors))
    return cfg


def launch_world_size(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The world size torchrun ($WORLD_SIZE) or srun ($SLURM_NTASKS) launched this process with, or
    None when it was not started by a launcher."""
    env = os.environ if env is None else env
    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        if env.get(var, "").strip().isdigit():
            return int(env[var])
    return None


def _read_yaml(path: Optional[str]) -> Dict[str, Any]:
    """The nested dict of YAML config ``path`` as written (None: empty); ConfigError when it cannot be read."""
    if path is None:
        return {}
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    with open(path) as fh:
        try:
            return yaml_load(fh) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None


def read_config_file(path: Optional[str]) -> Dict[str, Any]:
    """The nested dict of YAML config ``path`` (None: empty) with its path-valued keys resolved against the
    file's directory (``~`` expanded); raises ConfigError when the file cannot be read."""
    tree = _read_yaml(path)
    return resolve_tree_paths(tree, SECTION_CLASSES, os.path.dirname(os.path.abspath(path))) if path else tree


def read_job_config(path: Optional[str], overrides: Sequence[str] = ()) -> Tuple[JobConfig, List[str]]:
    """(config, problems) of YAML ``path`` (None: all defaults) with ``overrides`` applied: each key's own type and
    value, no checks across keys or against the world size (``megatron_rl.plan.collect_job_config`` adds those).
    Raises ConfigError only when the file itself cannot be read."""
    raw = _read_yaml(path)
    base = os.path.dirname(os.path.abspath(path)) if path else os.getcwd()
    overridden = [o.split("=", 1)[0].strip() for o in overrides]
    moved = moved_path_errors(raw, SECTION_CLASSES, base, os.getcwd(), skip=overridden)
    tree, errors = _apply_overrides(resolve_tree_paths(raw, SECTION_CLASSES, base), list(overrides))
    errors = moved + errors
    cfg, build_errors = build_job_config(tree)
    return cfg, errors + build_errors


def format_errors(errors: Sequence[str]) -> str:
    """The one ``ConfigError`` message listing ``errors``."""
    return "invalid config:\n  - " + "\n  - ".join(errors)
