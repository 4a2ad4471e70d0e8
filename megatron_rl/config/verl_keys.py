"""Every verl config key and what it is here: the one owner of verl-name knowledge.

``VERL_KEYS`` lists rules in order; the first whose pattern matches a verl key (dotted, after Hydra
interpolations are resolved) decides it. A pattern is dotted; ``*`` matches one level, a trailing ``**`` any number
of levels (a whole sub-tree), a leading ``**`` any key ending in the rest. Each rule is one of

* ``MAPPED``: the key has a home here -- ``target`` (this project's dotted key, Megatron's parameter names), or
  ``convert``, a function of (value, the verl config) returning ``{our key: value}`` (e.g. verl's
  ``ppo_mini_batch_size`` in prompts becomes ``actor.ppo_mini_batches``, a count);
* ``UNSUPPORTED``: a feature this project does not have yet;
* ``NO_MEANING``: a setting of verl's own machinery (Ray, FSDP, Hydra, its profiler, its critic) that has no
  counterpart here;
* ``SERVER``: a setting of the SGLang server (memory fraction, its own tensor parallelism, ...), given where
  the servers start, not in the trainer's config.

A non-mapped rule may name ``neutral`` values (what this project does anyway: ``param_offload: false``) and an
``inactive`` test (the key has no effect in that verl config, e.g. ``kl_ctrl.*`` while ``use_kl_in_reward`` is
false); such keys are reported as changing nothing. :mod:`megatron_rl.config.migrate_verl` applies the table;
:mod:`megatron_rl.config.hints` derives its hints for verl names users put in this project's sections from it
(:func:`hint_entries`).

Features that are being added (entropy bonus, dynamic sampling) are in
``PENDING``: each verl key names the key it will map to, and the rule maps as soon as that key exists in this
project's config dataclasses (until then the key is reported as not supported yet).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import os
import typing
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

from megatron_rl.algo.estimator import NOT_IN_TRAINER, STD_ALWAYS, TRAINER_ESTIMATORS
from megatron_rl.config.interpolation import lookup
from megatron_rl.config.sections import ActorConfig, AlgorithmConfig, DataConfig, RolloutConfig, TrainerConfig
from megatron_rl.config.verl_tools import read_verl_tools
from megatron_rl.config.verl_versions import NEWEST, after
from megatron_rl.losses.registry import MODE_PARAMETERS, loss_type_for_loss_mode

MAPPED = "mapped"
UNSUPPORTED = "not supported yet"
NO_MEANING = "no meaning here"
SERVER = "the SGLang server's setting"

#: The top-level sections only a verl config has (``data`` / ``trainer`` / ``algorithm`` are both's).
VERL_ONLY_SECTIONS = ("actor_rollout_ref", "critic", "reward_model", "custom_reward_function", "reward_manager",
                      "global_profiler", "transfer_queue", "ray_kwargs")


NOTE = "#note"
"""A converter's result may carry this key: a remark on the value written (e.g. "x context_parallel_size 2"),
reported with the key; it is not one of this project's keys."""


class Skip(Exception):
    """Raised by a converter: the key is not mapped for the reason given (``kind``, ``reason``)."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind, self.reason = kind, reason


class Verl:
    """A verl config (interpolations resolved) as the rules read it, and the verl version it is read as."""

    def __init__(self, tree: Mapping[str, Any], version: str = NEWEST):
        self.tree, self.version = tree, version

    def get(self, dotted: str, default: Any = None) -> Any:
        """The value at ``dotted`` (``default`` when absent)."""
        return lookup(self.tree, dotted, default)

    def has(self, dotted: str) -> bool:
        """Whether the file sets ``dotted``."""
        return lookup(self.tree, dotted, _ABSENT) is not _ABSENT

    @property
    def strategy(self) -> Optional[str]:
        """verl's actor backend: ``actor.strategy``, else the Hydra choice ``model_engine`` (verl main's run
        scripts: ``megatron``, or ``dp`` for FSDP), else "megatron" when the file has an ``actor.megatron``
        block, "fsdp" when it has an ``actor.fsdp_config`` block, else None (unknown)."""
        s = self.get("actor_rollout_ref.actor.strategy")
        if s is None and self.get("model_engine") in _MODEL_ENGINES:
            s = _MODEL_ENGINES[self.get("model_engine")]
        if s is not None:
            return "megatron" if s == "megatron" else "fsdp"
        if self.has("actor_rollout_ref.actor.megatron"):
            return "megatron"
        if self.has("actor_rollout_ref.actor.fsdp_config"):
            return "fsdp"
        return None

    @property
    def objective(self) -> str:
        """The policy loss verl runs: ``rollout_correction.loss_type`` in bypass mode, else
        ``actor.policy_loss.loss_mode`` (verl's default "vanilla")."""
        if self.get("algorithm.rollout_correction.bypass_mode"):
            return str(self.get("algorithm.rollout_correction.loss_type") or "ppo_clip")
        return str(self.get("actor_rollout_ref.actor.policy_loss.loss_mode") or "vanilla")


_ABSENT = object()
#: verl's ``model_engine`` Hydra choices (its ppo_trainer.yaml defaults list) whose generated config is bundled.
_MODEL_ENGINES = {"megatron": "megatron", "dp": "fsdp"}


@dataclass(frozen=True)
class Rule:
    """What one verl key (or sub-tree) is here; see the module docstring."""

    pattern: str
    """Dotted verl key; ``*`` one level, trailing ``**`` a sub-tree, leading ``**`` any prefix."""
    kind: str
    """MAPPED, UNSUPPORTED, NO_MEANING or SERVER."""
    target: Optional[str] = None
    """MAPPED: this project's dotted key (the value is copied); otherwise the key that covers it, if any."""
    note: str = ""
    """Why / what to know: the reason of a key that is not mapped, a remark on a mapped one."""
    convert: Optional[Callable[[Any, Verl], Dict[str, Any]]] = None
    """MAPPED with a computed value: (value, verl config) -> {our dotted key: value}; may raise Skip."""
    neutral: Tuple[Any, ...] = ()
    """Values that are this project's behaviour anyway (nothing to set)."""
    inactive: Optional[Callable[[Verl], Optional[str]]] = None
    """Verl config -> why the key has no effect in it (None: it has)."""
    hint: bool = True
    """Whether the key's last name is distinctive enough to hint on when found in this project's sections."""

    def matches(self, key: str) -> bool:
        """Whether verl key ``key`` (dotted) falls under this rule."""
        pat, parts = self.pattern.split("."), key.split(".")
        if pat[0] == "**":  # any key ending in the rest
            return len(parts) >= len(pat) - 1 and all(
                fnmatch.fnmatchcase(k, p) for k, p in zip(parts[len(parts) - len(pat) + 1:], pat[1:]))
        if pat[-1] == "**":
            return len(parts) >= len(pat) and all(fnmatch.fnmatchcase(k, p) for k, p in zip(parts, pat[:-1]))
        return len(parts) == len(pat) and all(fnmatch.fnmatchcase(k, p) for k, p in zip(parts, pat))

    def reason(self) -> str:
        """``"<kind>: <note>"`` of a key that is not mapped."""
        return f"{self.kind}: {self.note}" if self.note else self.kind


def _m(pattern: str, target: Optional[str] = None, note: str = "", convert=None, hint: bool = True) -> Rule:
    return Rule(pattern, MAPPED, target=target, note=note, convert=convert, hint=hint)


def _u(pattern: str, note: str, neutral: Tuple[Any, ...] = (), inactive=None, target: Optional[str] = None,
       hint: bool = True) -> Rule:
    return Rule(pattern, UNSUPPORTED, target=target, note=note, neutral=neutral, inactive=inactive, hint=hint)


def _n(pattern: str, note: str, neutral: Tuple[Any, ...] = (), inactive=None, target: Optional[str] = None,
       hint: bool = False) -> Rule:
    return Rule(pattern, NO_MEANING, target=target, note=note, neutral=neutral, inactive=inactive, hint=hint)


def _s(pattern: str, note: str, hint: bool = True) -> Rule:
    return Rule(pattern, SERVER, note=note, hint=hint)


# ------------------------------------------------------------------------------------------------ conditions
def _unless(key: str, on: Callable[[Any], bool], what: str) -> Callable[[Verl], Optional[str]]:
    """inactive unless ``on(value of key)``: "no effect in verl while <key> is <value>"."""
    def test(v: Verl) -> Optional[str]:
        value = v.get(key)
        return None if on(value) else f"no effect in verl while {key} is {_show(value)}{what}"
    return test


def _show(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _strategy_is(strategy: str) -> Callable[[Verl], Optional[str]]:
    def test(v: Verl) -> Optional[str]:
        s = v.strategy
        return None if s in (None, strategy) else f"a setting of verl's {strategy} actor; this file's actor is {s}"
    return test


_RM = "actor_rollout_ref"
_A, _R, _REF, _MODEL = f"{_RM}.actor", f"{_RM}.rollout", f"{_RM}.ref", f"{_RM}.model"
_DYN = _unless(f"{_A}.use_dynamic_bsz", bool, " (fixed micro-batches of ppo_micro_batch_size_per_gpu rows)")
_OFFLOAD_KEY = f"{_A}.optim.override_optimizer_config.optimizer_cpu_offload"
_OFFLOAD_OFF = _unless(_OFFLOAD_KEY, bool, "")
#: verl's between-phase offloads: what they free is used by verl's colocated engine, which wakes into it
_PHASE_OFFLOAD = ("verl parks the actor's {what} on the CPU while its colocated engine generates and loads them "
                  "back for the train step; here a colocated SGLang server keeps the memory fraction it was "
                  "launched with, so parking would free memory nothing takes: the train step's peak is the same "
                  "(docs/memory.md); plan cluster.gpu_memory_gb as the GPU memory the trainer gets")


def _cpu_offload(value: Any, v: Verl) -> Dict[str, Any]:
    """On only where megatron offloads something: its ``optimizer_offload_fraction`` defaults to 0."""
    return {"actor.optimizer_cpu_offload": bool(value and v.get(_OFFLOAD_KEY.replace("optimizer_cpu_offload",
                                                                                     "optimizer_offload_fraction")))}


def _set_with_offload(v: Verl) -> Optional[str]:
    """megatron's precision-aware optimizer is what its CPU offload runs through: set with it."""
    return "set here by actor.optimizer_cpu_offload, which runs through it" if v.get(_OFFLOAD_KEY) else None


# ------------------------------------------------------------------------------------------------ converters
def _mini_batches(value: Any, v: Verl) -> Dict[str, Any]:
    """verl's ppo_mini_batch_size counts prompts per optimizer step (verl multiplies it by rollout.n)."""
    total = v.get("data.train_batch_size")
    if not isinstance(value, int) or value < 1 or not isinstance(total, int):
        raise Skip(UNSUPPORTED, f"needs integer data.train_batch_size and ppo_mini_batch_size (got {total!r}, "
                                f"{value!r}) to count mini-batches")
    if total % value:
        raise Skip(UNSUPPORTED, f"{value} prompts per mini-batch do not divide data.train_batch_size {total}; "
                                f"here a step is split into actor.ppo_mini_batches equal mini-batches")
    return {"actor.ppo_mini_batches": total // value}


def _dynamic_bsz(value: Any, v: Verl) -> Dict[str, Any]:
    if not value:
        raise Skip(NO_MEANING, "false: micro-batches of a fixed number of rows, this project's default too "
                               "(actor.max_tokens_per_micro_batch: null)")
    return {}


def _optimizer_steps(target: str) -> Callable[[Any, Verl], Dict[str, Any]]:
    """verl steps its learning-rate scheduler once per training step; this project once per optimizer step
    (ppo_epochs x mini-batches of each training step)."""
    def convert(value: Any, v: Verl) -> Dict[str, Any]:
        if target == "actor.lr_warmup_steps" and _ratio_decides_warmup(value, v):
            raise Skip(NO_MEANING, f"{_show(value)}: verl then warms up for lr_warmup_steps_ratio of the run")
        total, mini = v.get("data.train_batch_size", 1024), v.get(f"{_A}.ppo_mini_batch_size", 256)
        epochs = v.get(f"{_A}.ppo_epochs", 1)
        if not all(isinstance(x, int) and x > 0 for x in (total, mini, epochs)) or total % mini:
            raise Skip(UNSUPPORTED, f"cannot count optimizer steps per training step from data.train_batch_size "
                                    f"{total!r}, ppo_mini_batch_size {mini!r}, ppo_epochs {epochs!r}")
        return {target: value * epochs * (total // mini)}
    return convert


def _ratio_decides_warmup(steps: Any, v: Verl) -> bool:
    """Whether verl warms up for ``lr_warmup_steps_ratio`` of the run rather than ``lr_warmup_steps``: its Megatron
    actor when lr_warmup_steps is null or <= 0, its FSDP actor when it is < 0 (0 there: no warm-up)."""
    if not isinstance(steps, (int, float)) or isinstance(steps, bool):
        return True
    return steps < 0 if v.strategy == "fsdp" else steps <= 0


def _warmup_steps_set(v: Verl) -> Optional[str]:
    steps = v.get(f"{_A}.optim.lr_warmup_steps")
    if _ratio_decides_warmup(steps, v):
        return None
    return (f"no effect in verl while {_A}.optim.lr_warmup_steps is {_show(steps)} (verl then warms up for that "
            f"many steps, not this ratio)")


def _warmup_ratio(value: Any, v: Verl) -> Dict[str, Any]:
    if not value:
        raise Skip(NO_MEANING, f"{_show(value)}: no warm-up, this project's default too")
    return {"actor.lr_warmup_fraction": value}




def _betas(value: Any, v: Verl) -> Dict[str, Any]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise Skip(UNSUPPORTED, f"expected [beta1, beta2], got {value!r}")
    return {"actor.adam_beta1": float(value[0]), "actor.adam_beta2": float(value[1])}


def _token_budget(value: Any, v: Verl) -> Dict[str, Any]:
    """verl's Megatron engine packs ``ppo_max_token_len_per_gpu x context_parallel_size`` tokens per micro-batch
    (its engine hands CP as ``sp_size`` to ``prepare_micro_batches``); the budget here counts the whole sequence
    before the CP split too."""
    cp = (v.get(f"{_A}.megatron.context_parallel_size") or 1) if v.strategy == "megatron" else 1
    if not isinstance(value, int) or isinstance(value, bool):
        raise Skip(UNSUPPORTED, f"expected an integer token budget, got {value!r}")
    out: Dict[str, Any] = {"actor.max_tokens_per_micro_batch": value * cp}
    if cp > 1:
        out[NOTE] = f"x context_parallel_size {cp}, as verl's Megatron engine counts it"
    return out


def _remove_padding(value: Any, v: Verl) -> Dict[str, Any]:
    return {"actor.sequence_packing": bool(value)}


def _dtype(value: Any, v: Verl) -> Dict[str, Any]:
    if value not in ("bfloat16", "bf16", "float32", "fp32"):
        raise Skip(UNSUPPORTED, f"the actor trains in bf16 (with fp32 main weights) or fp32, not {value!r}")
    return {"actor.bf16": value in ("bfloat16", "bf16")}


def _kl_loss_coef(value: Any, v: Verl) -> Dict[str, Any]:
    if not v.get(f"{_A}.use_kl_loss", False):
        raise Skip(NO_MEANING, f"no effect in verl while {_A}.use_kl_loss is {_show(v.get(f'{_A}.use_kl_loss'))} "
                               f"(actor.policy_loss.kl_loss_coef stays 0)")
    return {"actor.policy_loss.kl_loss_coef": value}


VERL_KL_LOSS_COEF = 0.001
"""verl's default ``actor.kl_loss_coef`` (its trainer configs), what ``use_kl_loss: true`` alone turns on."""


def _use_kl_loss(value: Any, v: Verl) -> Dict[str, Any]:
    if value and not v.has(f"{_A}.kl_loss_coef"):  # verl then applies its default coefficient
        return {"actor.policy_loss.kl_loss_coef": VERL_KL_LOSS_COEF}
    return {}


def _clip_ratio(value: Any, v: Verl) -> Dict[str, Any]:
    if v.get(f"{_A}.clip_ratio_low") is not None and v.get(f"{_A}.clip_ratio_high") is not None:
        raise Skip(NO_MEANING, "verl uses clip_ratio_low / clip_ratio_high when they are set (both are)")
    return {"actor.policy_loss.clip_ratio": value}


#: Objectives whose policy-gradient term verl main (after 0.9.1) aggregates "seq-mean-token-mean" whatever
#: loss_agg_mode says (its core_algos.py compute_policy_loss_gspo; the KL loss keeps loss_agg_mode).
_SEQ_MEAN_AFTER_091 = ("gspo",)


def _loss_mode(value: Any, v: Verl) -> Dict[str, Any]:
    """verl runs actor.policy_loss.loss_mode in decoupled mode; bypass_mode replaces it by its own loss."""
    if v.get("algorithm.rollout_correction.bypass_mode"):
        raise Skip(NO_MEANING, "verl ignores loss_mode when algorithm.rollout_correction.bypass_mode is true "
                               "(its loss_type decides)")
    try:
        out: Dict[str, Any] = {"algorithm.rollout_correction.loss_type": loss_type_for_loss_mode(value)}
    except ValueError as exc:
        raise Skip(UNSUPPORTED, str(exc)) from None
    if value in _SEQ_MEAN_AFTER_091 and after(v.version, "0.9.1"):
        out["actor.policy_loss.pg_loss_agg_mode"] = "seq-mean-token-mean"
        out[NOTE] = (f"verl {v.version}'s {value} aggregates its policy loss seq-mean-token-mean whatever "
                     f"loss_agg_mode says (0.9.1 read loss_agg_mode): actor.policy_loss.pg_loss_agg_mode")
    return out


def _loss_key(name: str) -> Callable[[Any, Verl], Dict[str, Any]]:
    """An objective parameter verl keeps on the actor (clip_ratio_low, clip_ratio_c, tau_pos, ...): copied to
    actor.policy_loss when verl's objective reads it, else without effect in verl (reported, not written)."""
    def convert(value: Any, v: Verl) -> Dict[str, Any]:
        readers = MODE_PARAMETERS.get(name)
        if readers is not None and v.objective not in readers:
            raise Skip(NO_MEANING, f"{_show(value)}: ignored by verl's {v.objective} objective (read by "
                                   f"{', '.join(m for m in readers if m != 'ppo_clip')})")
        return {f"actor.policy_loss.{name}": value}
    return convert


def _correction_loss_type(value: Any, v: Verl) -> Dict[str, Any]:
    if not v.get("algorithm.rollout_correction.bypass_mode"):
        raise Skip(NO_MEANING, "verl reads rollout_correction.loss_type only in bypass_mode; the objective is "
                               f"{_A}.policy_loss.loss_mode")
    return {"algorithm.rollout_correction.loss_type": value}


def _adv_estimator(value: Any, v: Verl) -> Dict[str, Any]:
    if value in NOT_IN_TRAINER:
        raise Skip(UNSUPPORTED, f"advantage estimator {value!r} {NOT_IN_TRAINER[value]}")
    if value not in TRAINER_ESTIMATORS:
        raise Skip(UNSUPPORTED, f"advantage estimator {value!r}: algorithm.adv_estimator is one of "
                                f"{', '.join(TRAINER_ESTIMATORS)}")
    return {"algorithm.advantage_estimator": value}


def _norm_adv(value: Any, v: Verl) -> Dict[str, Any]:
    if not value and v.get("algorithm.adv_estimator") in STD_ALWAYS:
        raise Skip(NO_MEANING, f"false: verl's trainer does not pass it to {v.get('algorithm.adv_estimator')!r}, "
                               f"which always divides by the std")
    return {"algorithm.norm_adv_by_std": value}


_KL_IN_REWARD_OFF = _unless("algorithm.use_kl_in_reward", bool, "")


def _use_kl_in_reward(value: Any, v: Verl) -> Dict[str, Any]:
    if not value:
        raise Skip(NO_MEANING, "false is this project's default too (no KL in the reward)")
    if v.get("algorithm.filter_groups.enable"):
        raise Skip(UNSUPPORTED, "KL in the reward with algorithm.filter_groups.enable (dynamic sampling) is not "
                                "built: groups are filtered on rank 0 before the log-probs the penalty needs exist")
    if v.get("algorithm.adv_estimator") == "gdpo":
        raise Skip(NO_MEANING, "true has no effect on adv_estimator gdpo in verl (its gdpo reads the reward "
                               "components, never the penalised token_level_rewards): not carried")
    return {"algorithm.use_kl_in_reward": True}


def _kl_penalty_in_reward(value: Any, v: Verl) -> Dict[str, Any]:
    if value == "full":
        raise Skip(UNSUPPORTED, "kl_penalty 'full' (the KL over the whole vocabulary): verl 0.9.1 raises "
                                "NotImplementedError for it too")
    return {"algorithm.kl_penalty": value}


def _engine(value: Any, v: Verl) -> Dict[str, Any]:
    if value not in ("sglang", "vllm"):
        raise Skip(UNSUPPORTED, f"rollout engine {value!r}: rollouts come from SGLang servers (rollout.engine: "
                                f"sglang) or the embedded engine")
    return {"rollout.engine": "sglang", "rollout.sglang_urls": ["http://127.0.0.1:30000"]}


def _routing_replay(value: Any, v: Verl) -> Dict[str, Any]:
    mode = str(value).lower()
    if mode not in ("disabled", "r2", "r3"):
        raise Skip(UNSUPPORTED, f"router_replay.mode {value!r}: actor.routing_replay is none, r2 or r3")
    return {"actor.routing_replay": "none" if mode == "disabled" else mode}


def _train_files(value: Any, v: Verl) -> Dict[str, Any]:
    files = [value] if isinstance(value, str) else list(value or [])
    if len(files) != 1:
        raise Skip(UNSUPPORTED, f"{len(files)} training files: data.path reads one file (concatenate them)")
    return {"data.task": "file", "data.path": _local_path(files[0])}


def _local_path(path: Any) -> str:
    """A data file path as verl opens it: ``~`` expanded (verl's default paths are ``~/data/...``; this project reads
    a path as written)."""
    return os.path.expanduser(str(path))


def _val_paths(v: Verl) -> List[str]:
    """verl's ``data.val_files`` as a list of the non-empty paths (a launch script's unset variable gives '')."""
    value = v.get("data.val_files")
    files = [value] if isinstance(value, str) else list(value or [])
    return [_local_path(f) for f in files if f is not None and str(f).strip()]


def _val_files(value: Any, v: Verl) -> Dict[str, Any]:
    files = _val_paths(v)
    if not files:
        raise Skip(NO_MEANING, f"{_show(value)}: no validation file (nothing is validated)")
    return {"data.val_files": files[0] if len(files) == 1 else files}


def _val_max_samples(value: Any, v: Verl) -> Dict[str, Any]:
    if value is None or (isinstance(value, int) and value < 0):
        raise Skip(NO_MEANING, f"{_show(value)}: every validation row, this project's default too")
    return {"data.val_max_samples": value}


def _with_val_set(target: str, off: Tuple[Any, ...]) -> Callable[[Any, Verl], Dict[str, Any]]:
    """A validation schedule key: copied when verl's config has validation files and the value is not verl's off."""
    def convert(value: Any, v: Verl) -> Dict[str, Any]:
        if any(same_value(value, o) for o in off):
            raise Skip(NO_MEANING, f"{_show(value)}: verl's off (nothing to set)")
        if not _val_paths(v):
            raise Skip(NO_MEANING, "no effect in verl without data.val_files")
        return {target: value}
    return convert


def _val_greedy(v: Verl) -> bool:
    """verl's validation decodes greedily: ``val_kwargs.do_sample`` false, or sampling at temperature 0 (its
    default), which the engine turns into argmax."""
    return not v.get(f"{_R}.val_kwargs.do_sample") or not v.get(f"{_R}.val_kwargs.temperature", 0)


def _val_do_sample(value: Any, v: Verl) -> Dict[str, Any]:
    if value and _val_greedy(v):
        raise Skip(NO_MEANING, f"{_show(value)} at val_kwargs.temperature 0: verl's engine decodes greedily, "
                               f"do_sample: false here")
    return {"rollout.val_kwargs.do_sample": value}


def _val_n(value: Any, v: Verl) -> Dict[str, Any]:
    if isinstance(value, int) and value > 1 and _val_greedy(v):
        raise Skip(NO_MEANING, f"{_show(value)} with greedy decoding (do_sample false or temperature 0): verl's "
                               f"{value} responses per prompt are one response repeated; n: 1 here gives the same "
                               f"val/* metrics")
    return {"rollout.val_kwargs.n": value}


def _overlong_prompts(value: Any, v: Verl) -> Dict[str, Any]:
    if value:
        return {"data.overlong_prompts": "filter"}
    raise Skip(NO_MEANING, "false: data.truncation decides what happens to an overlong prompt")


def _truncation(value: Any, v: Verl) -> Dict[str, Any]:
    if v.get("data.filter_overlong_prompts"):
        raise Skip(NO_MEANING, "data.filter_overlong_prompts is true: overlong prompts are dropped first")
    if value == "left":
        return {"data.overlong_prompts": "truncate"}
    if value == "error":  # a file verl trains to the end holds no overlong prompt: filtering drops none of it
        return {"data.overlong_prompts": "filter", NOTE: "verl stops at an overlong prompt; here one is dropped and "
                                                         "counted (a job verl completes has none: the same prompts)"}
    raise Skip(UNSUPPORTED, f"with truncation {value!r} verl {'stops on' if value == 'error' else 'cuts'} an "
                            f"overlong prompt; here data.overlong_prompts is filter (drop it, the default) or "
                            f"truncate (keep its last tokens: verl's truncation left)")


def _reward_fn_at(block: str) -> Callable[[Any, Verl], Dict[str, Any]]:
    """``<block>.path`` (and ``<block>.name``) -> data.reward_fn (verl 0.9.1 moved the block under reward:)."""
    def convert(value: Any, v: Verl) -> Dict[str, Any]:
        if value is None:
            raise Skip(NO_MEANING, "no custom reward file: verl's default_compute_score dispatch on data_source, "
                                   "which is this project's default too")
        return {"data.reward_fn": f"{value}:{v.get(block + '.name') or 'compute_score'}"}
    return convert


_reward_fn = _reward_fn_at("custom_reward_function")


def _dapo_manager_off(manager: Optional[str], v: Verl) -> Optional[str]:
    """Why the DAPO overlong settings have no effect: verl's reward manager ``manager`` (a key) is not dapo (its
    naive manager reads no overlong_buffer_cfg); None when it is, or when ``manager`` is None (not checked)."""
    if manager is None or v.get(manager) == "dapo":
        return None
    return f"no effect in verl while {manager} is {_show(v.get(manager))} (only its dapo reward manager applies it)"


def _overlong(prefix: str, target: str, manager: Optional[str] = None) -> Callable[[Any, Verl], Dict[str, Any]]:
    """DAPO's overlong buffer key -> ``target``, when ``<prefix>.enable`` is true (and the reward manager
    ``manager`` is dapo)."""
    def convert(value: Any, v: Verl) -> Dict[str, Any]:
        off = _dapo_manager_off(manager, v)
        if off:
            raise Skip(NO_MEANING, off)
        if not v.get(f"{prefix}.enable"):
            raise Skip(NO_MEANING, f"no effect in verl while {prefix}.enable is {_show(v.get(f'{prefix}.enable'))}")
        return {target: value}
    return convert


def _overlong_rules(prefix: str, manager: Optional[str] = None) -> List[Rule]:
    """DAPO's overlong buffer (``reward_model.overlong_buffer`` of the DAPO recipe, or the reward manager's
    ``overlong_buffer_cfg``) -> ``data.overlong_buffer_len`` / ``data.overlong_penalty_factor`` (``manager``: the
    reward-manager key that must be dapo for verl to apply it; None: not checked)."""
    return [_m(f"{prefix}.len", convert=_overlong(prefix, "data.overlong_buffer_len", manager), hint=False),
            _m(f"{prefix}.penalty_factor", convert=_overlong(prefix, "data.overlong_penalty_factor", manager),
               hint=False),
            _m(f"{prefix}.enable", convert=lambda value, v: {}, hint=False,
               note="decides whether len / penalty_factor apply (data.overlong_buffer_len)"),
            _n(f"{prefix}.log", "the penalty is in the metrics (reward/*) always")]


def _max_resp_len(prefix: str, manager: Optional[str] = None) -> Callable[[Any, Verl], Dict[str, Any]]:
    """The DAPO reward manager's ``max_resp_len`` (``<prefix>`` is its ``overlong_buffer_cfg``): the length the
    penalty counts from, here always rollout.max_new_tokens (verl's data.max_response_length)."""
    def convert(value: Any, v: Verl) -> Dict[str, Any]:
        off = _dapo_manager_off(manager, v)
        if off:
            raise Skip(NO_MEANING, off)
        if not v.get(f"{prefix}.enable"):
            raise Skip(NO_MEANING, f"no effect in verl while {prefix}.enable is {_show(v.get(f'{prefix}.enable'))}")
        total = v.get("data.max_response_length")
        if value is None or same_value(value, total):
            raise Skip(NO_MEANING, f"{_show(value)}: the penalty counts from rollout.max_new_tokens "
                                   f"(data.max_response_length {total}), as here")
        raise Skip(UNSUPPORTED, f"{value}: verl's penalty counts from it, here from rollout.max_new_tokens "
                                f"(data.max_response_length {total}); set data.max_response_length to {value} or "
                                f"shift data.overlong_buffer_len by the difference")
    return convert


def _logger(value: Any, v: Verl) -> Dict[str, Any]:
    names = [value] if isinstance(value, str) else list(value or [])
    known = {"console", "wandb", "tensorboard"}
    other = [n for n in names if n not in known]
    if other:
        raise Skip(UNSUPPORTED, f"logger(s) {other}: metrics go to metrics.jsonl, the console (trainer.progress), "
                                f"W&B (trainer.wandb) and TensorBoard (trainer.tensorboard)")
    return {"trainer.progress": "console" in names, "trainer.wandb": "wandb" in names,
            "trainer.tensorboard": "tensorboard" in names}


def _save_freq(value: Any, v: Verl) -> Dict[str, Any]:
    return {"trainer.save_interval": max(int(value), 0)}


def _steps(value: Any, v: Verl) -> Dict[str, Any]:
    if value is None:
        raise Skip(NO_MEANING, "null: verl counts trainer.total_epochs over the data instead (see there)")
    return {"trainer.steps": value}


def _total_epochs(value: Any, v: Verl) -> Dict[str, Any]:
    """verl's length without total_training_steps: len(train dataloader) x total_epochs, the dataloader batching
    gen_batch_size (else train_batch_size) prompts with drop_last (ray_trainer._create_dataloader):
    trainer.epochs here counts the same from the training file's rows when the job is built."""
    if v.get("trainer.total_training_steps") is not None:
        raise Skip(NO_MEANING, "trainer.total_training_steps is set and wins in verl")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise Skip(UNSUPPORTED, f"total_epochs {value!r}: set trainer.steps (or trainer.epochs >= 1)")
    out: Dict[str, Any] = {"trainer.epochs": value}
    if v.get("data.filter_overlong_prompts"):
        out[NOTE] = ("steps = total_epochs x floor(rows / prompts per draw), rows counted before "
                     "data.overlong_prompts filtering (verl counts after its filter_overlong_prompts)")
    return out


def _resume_mode(value: Any, v: Verl) -> Dict[str, Any]:
    if value == "disable":
        return {"trainer.resume": False}
    if value == "auto":  # verl: resume from the newest checkpoint in default_local_dir when there is one
        return {"trainer.resume": True}
    raise Skip(UNSUPPORTED, f"resume_mode {value!r}: resuming is explicit here (trainer.resume: true, or --resume, "
                            f"continues the newest complete checkpoint in trainer.run_dir)")


def _rollout_dump(value: Any, v: Verl) -> Dict[str, Any]:
    if value is None:
        raise Skip(NO_MEANING, "null: rollouts are not dumped (trainer.dump_rollouts: false, the default)")
    return {"trainer.dump_rollouts": True}


def _pick_device(value: Any, v: Verl) -> Dict[str, Any]:
    if value not in ("cuda", "cpu"):
        raise Skip(UNSUPPORTED, f"device {value!r}: cluster.device is cuda or cpu")
    return {"cluster.device": value}


def _seed(value: Any, v: Verl) -> Dict[str, Any]:
    if value is None:
        raise Skip(NO_MEANING, "null: verl's default seed; trainer.seed seeds data, sampling and init here")
    return {"trainer.seed": value}


# ------------------------------------------------------------------------------------------------ pending
def _field(dotted: str) -> bool:
    """Whether ``dotted`` is a key of this project's config (section dataclass field)."""
    first, *rest = dotted.split(".")
    cls: Any = {"actor": ActorConfig, "algorithm": AlgorithmConfig, "data": DataConfig, "rollout": RolloutConfig,
                "trainer": TrainerConfig}.get(first)
    for name in rest:  # through nested sections (actor.policy_loss, algorithm.filter_groups, ...)
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            return False
        hints = typing.get_type_hints(cls)
        if name not in hints:
            return False
        cls = hints[name]
    return bool(rest) and cls is not None


@dataclass(frozen=True)
class Pending:
    """A verl key of a feature being added; see ``PENDING``."""

    targets: Tuple[str, ...]
    """The keys it will map to (the first that exists in the config dataclasses wins)."""
    why: str
    """Why it is not supported yet."""
    neutral: Tuple[Any, ...] = ()
    """Values that set nothing (verl's "off")."""
    inactive: Optional[Callable[[Verl], Optional[str]]] = None
    """Verl config -> why the key has no effect in it."""
    transform: Optional[Callable[[Any, Verl], Any]] = None
    """Value in verl's units -> value in the target's (None: the same)."""


_NO_DYN = "no dynamic sampling (DAPO's filter_groups: drop groups whose rewards are all equal, draw more prompts)"

_FG_OFF = _unless("algorithm.filter_groups.enable", bool, "")


def _filter_metric(value: Any) -> Any:
    """verl's filter_groups.metric -> this project's, unchanged: ``seq_reward`` / ``seq_final_reward`` / ``score``
    and a reward's extra keys (``acc``: verl's math_dapo scorer and DAPO-style reward files return it; a key the
    reward does not return stops the first generation round, naming the keys it did return)."""
    return value


def _v1(v: Verl) -> bool:
    """Whether verl runs the file with main_ppo's v1 trainer (``trainer.use_v1``, true in verl 0.9.1's and main's
    defaults): its DAPO filtering refills one prompt at a time without a round limit (v1/trainer_base.py
    ``_init_dataloader`` / ``_resolve_filter_groups_metric``), unlike verl-recipe's DAPO trainer."""
    return bool(v.get("trainer.use_v1"))


_RECIPE = ("or set trainer.use_v1: false in the verl file to read it as verl-recipe's DAPO trainer (main_dapo: "
           "gen_batch_size prompts per round, at most max_num_gen_batches rounds, then it raises)")


def _max_rounds(value: Any, v: Verl) -> Any:
    """verl's max_num_gen_batches (0: unlimited) -> this project's (at least 1: rounds are always bounded)."""
    if _v1(v):
        raise Skip(UNSUPPORTED, f"{_show(value)}: verl's v1 trainer (trainer.use_v1: true) ignores "
                                f"max_num_gen_batches (it warns) and refills filtered groups without limit; here "
                                f"rounds are bounded: set algorithm.filter_groups.max_num_gen_batches (>= 1) and "
                                f"on_exhausted yourself, {_RECIPE}")
    if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
        raise Skip(UNSUPPORTED, f"{value}: verl's unlimited rounds; here they are bounded (set "
                                f"algorithm.filter_groups.max_num_gen_batches >= 1, default 10)")
    return value


#: Features being added (entropy bonus, dynamic sampling): verl key pattern -> Pending. Each maps as soon as its key exists in the config
#: dataclasses (until then: not supported yet), so the mapping lands with the feature and nowhere else.
PENDING: Dict[str, Pending] = {
    f"{_A}.entropy_coeff": Pending(("actor.policy_loss.entropy_coeff", "algorithm.entropy_coeff",
                                    "actor.entropy_coeff"), "no entropy bonus is implemented", (0, 0.0)),
    "algorithm.filter_groups.metric": Pending(("algorithm.filter_groups.metric",), _NO_DYN, inactive=_FG_OFF,
                                              transform=lambda value, v: _filter_metric(value)),
    "algorithm.filter_groups.max_num_gen_batches": Pending(
        ("algorithm.filter_groups.max_num_gen_batches",), _NO_DYN, inactive=_FG_OFF,
        transform=_max_rounds),
}


def _filter_groups_enable(value: Any, v: Verl) -> Dict[str, Any]:
    """verl's DAPO trainer (verl-recipe dapo/dapo_ray_trainer.py) raises ValueError when max_num_gen_batches
    rounds did not fill the batch: on_exhausted "error" here."""
    if not value:
        raise Skip(NO_MEANING, f"{_show(value)}: no dynamic sampling, this project's default too")
    if _v1(v):  # max_num_gen_batches is refused then: the user decides the bound and on_exhausted
        return {"algorithm.filter_groups.enable": True,
                NOTE: "verl's v1 trainer (trainer.use_v1: true) refills filtered groups without a round limit; "
                      "here rounds are bounded (algorithm.filter_groups.max_num_gen_batches, on_exhausted)"}
    return {"algorithm.filter_groups.enable": True, "algorithm.filter_groups.on_exhausted": "error",
            NOTE: "on_exhausted: error -- verl-recipe's DAPO trainer raises when max_num_gen_batches rounds did "
                  "not fill the batch"}


def _gen_batch_size(value: Any, v: Verl) -> Dict[str, Any]:
    """verl's dataloader batches gen_batch_size prompts (else train_batch_size): with filter_groups one
    generation round; without, what a step trains."""
    total = v.get("data.train_batch_size")
    if value is None or same_value(value, total):
        raise Skip(NO_MEANING, f"{_show(value)}: each draw takes data.train_batch_size prompts, as here")
    if _v1(v) and not v.get("algorithm.filter_groups.enable"):
        raise Skip(NO_MEANING, f"{value}: verl's v1 trainer (trainer.use_v1: true) fetches prompts {value} at a time "
                               f"but trains data.train_batch_size {total} per step and counts rows // "
                               f"train_batch_size steps per epoch, as here")
    if _v1(v):
        raise Skip(UNSUPPORTED, f"{value}: verl's v1 trainer (trainer.use_v1: true) with filter_groups has it "
                                f"overridden to 1 (one prompt drawn per filtered group) and counts rows // "
                                f"data.train_batch_size {total} steps per epoch; here rounds draw "
                                f"algorithm.filter_groups.prompts_per_round (default data.prompts_per_step) "
                                f"prompts: drop data.gen_batch_size for that, {_RECIPE}")
    if not v.get("algorithm.filter_groups.enable"):
        raise Skip(UNSUPPORTED, f"{value}: without filter_groups verl's steps train gen_batch_size prompts, not "
                                f"data.train_batch_size {total}: set data.train_batch_size to {value}")
    return {"algorithm.filter_groups.prompts_per_round": value}


def _model_engine(value: Any, v: Verl) -> Dict[str, Any]:
    """verl's Hydra choice of the actor / ref / critic configs (``model_engine=megatron`` in its run scripts)."""
    if value in _MODEL_ENGINES:
        raise Skip(NO_MEANING, f"{value}: verl's {_MODEL_ENGINES[value]} actor configs (the file is read over "
                               f"them); the actor here is Megatron")
    raise Skip(UNSUPPORTED, f"verl's {value!r} engine: its defaults are not bundled (model_engine megatron or dp); "
                            f"give its generated config as --base")


def _strategy(value: Any, v: Verl) -> Dict[str, Any]:
    """The actor here is Megatron; verl's FSDP actor shards parameters, gradients and Adam state over its ranks."""
    if value == "megatron":
        raise Skip(NO_MEANING, "megatron: the actor here is Megatron too")
    return {"actor.use_distributed_optimizer": True,
            NOTE: f"verl's {value} actor shards the optimizer state; here Megatron's distributed optimizer shards "
                  f"the fp32 main weights and Adam state over the data-parallel ranks (ZeRO-1: bf16 weights and "
                  f"gradients are whole on each DP rank); the updates are the same"}


def _landed(target: str, p: Pending) -> Callable[[Any, Verl], Dict[str, Any]]:
    def convert(value: Any, v: Verl) -> Dict[str, Any]:
        if any(same_value(value, n) for n in p.neutral):
            raise Skip(NO_MEANING, f"{_show(value)}: verl's off (nothing to set)")
        return {target: p.transform(value, v) if p.transform else value}
    return convert


def same_value(a: Any, b: Any) -> bool:
    """Equal with booleans kept apart from numbers (``False`` is not ``0``)."""
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def _pending_rules() -> List[Rule]:
    rules = []
    for pattern, p in PENDING.items():
        landed = [t for t in p.targets if _field(t)]
        if landed and "**" not in pattern:
            rules.append(Rule(pattern, MAPPED, target=landed[0], convert=_landed(landed[0], p), inactive=p.inactive))
        else:
            rules.append(_u(pattern, p.why, neutral=p.neutral, inactive=p.inactive))
    return rules


# ---- LoRA: verl's FSDP keys (model.lora_rank / lora_alpha / target_modules) and its Megatron ones (model.lora.*)
_NO_LORA = "a verl LoRA option (FSDP spelling) without a counterpart here"


def _lora_rank(value: Any, v: Verl) -> Dict[str, Any]:
    if not value:
        raise Skip(NO_MEANING, f"{_show(value)}: no adapters, as here (actor.lora.rank 0)")
    return {"actor.lora.rank": value}


def _lora_targets(value: Any, v: Verl) -> Dict[str, Any]:
    """verl / PEFT write ``all-linear`` as a string; HF and megatron-core names pass as they are (actor.lora
    validates them)."""
    return {"actor.lora.target_modules": [value] if isinstance(value, str) else list(value)}


def _lora_merge(value: Any, v: Verl) -> Dict[str, Any]:
    return {"rollout.lora_sync": "merged" if value else "adapter"}


def _ref_param_offload(value: Any, v: Verl) -> Dict[str, Any]:
    """With LoRA the reference is the policy with its adapters off (no separate weights to offload)."""
    if v.get(f"{_MODEL}.lora_rank") or v.get(f"{_MODEL}.lora.rank"):
        raise Skip(NO_MEANING, f"{_show(value)}: with LoRA the KL reference is the policy with its adapters off "
                               f"(no separate reference weights to offload)")
    return {"actor.ref_param_offload": value}


def _lora_rules() -> List[Rule]:
    """verl's LoRA keys onto ``actor.lora`` / ``rollout.lora_sync``; each key counts only while its rank is on."""
    fsdp, mcore = _unless(f"{_MODEL}.lora_rank", bool, ""), _unless(f"{_MODEL}.lora.rank", bool, "")
    init = "A is initialised as PEFT does (actor.lora.init: kaiming, or gaussian)"
    return [
        _m(f"{_MODEL}.lora_rank", "actor.lora.rank", convert=_lora_rank),
        Rule(f"{_MODEL}.lora_alpha", MAPPED, target="actor.lora.alpha", inactive=fsdp),
        Rule(f"{_MODEL}.target_modules", MAPPED, convert=_lora_targets, inactive=fsdp),
        _u(f"{_MODEL}.exclude_modules", "no exclude list: name the targets in actor.lora.target_modules",
           neutral=(None, []), inactive=fsdp),
        _u(f"{_MODEL}.lora_adapter_path", "training cannot start from a saved adapter yet", neutral=(None,)),
        _u(f"{_MODEL}.target_parameters", "adapters on bare nn.Parameters (fused experts) are not built; "
           "linear_fc1 / linear_fc2 adapt every expert", neutral=(None, [])),
        _m(f"{_MODEL}.lora.rank", "actor.lora.rank", convert=_lora_rank),
        Rule(f"{_MODEL}.lora.alpha", MAPPED, target="actor.lora.alpha", inactive=mcore),
        Rule(f"{_MODEL}.lora.dropout", MAPPED, target="actor.lora.dropout", inactive=mcore),
        Rule(f"{_MODEL}.lora.target_modules", MAPPED, convert=_lora_targets, inactive=mcore),
        Rule(f"{_MODEL}.lora.merge", MAPPED, convert=_lora_merge, inactive=mcore,
             note="verl's merge: true syncs merged weights, false the adapters"),
        _u(f"{_MODEL}.lora.type", "only plain LoRA (no DoRA, canonical or VLM LoRA)", neutral=("lora",),
           inactive=mcore),
        _u(f"{_MODEL}.lora.dropout_position", "dropout is on the adapter's input (PEFT's)", neutral=("pre",),
           inactive=mcore),
        _u(f"{_MODEL}.lora.lora_A_init_method", init, neutral=("kaiming",), inactive=mcore),
        _u(f"{_MODEL}.lora.lora_B_init_method", "B starts at zero", neutral=("zero",), inactive=mcore),
        _u(f"{_MODEL}.lora.exclude_modules", "no exclude list: name the targets in actor.lora.target_modules",
           neutral=(None, []), inactive=mcore),
        _u(f"{_MODEL}.lora.adapter_path", "training cannot start from a saved adapter yet", neutral=(None,),
           inactive=mcore),
        _u(f"{_MODEL}.lora.dtype", "adapters are kept in the base's dtype with fp32 main params", neutral=(None,),
           inactive=mcore),
        _n(f"{_MODEL}.lora.a2a_experimental", "Megatron-Bridge's experimental expert all-to-all", inactive=mcore),
        _u(f"{_MODEL}.lora.freeze_language_model", "the base model is frozen: only the adapters train",
           neutral=(True,), inactive=mcore),
        _u(f"{_MODEL}.lora.freeze_vision_model", "vision-language models are not supported", neutral=(True,),
           inactive=mcore),
        _u(f"{_MODEL}.lora.freeze_vision_projection", "vision-language models are not supported", neutral=(True,),
           inactive=mcore),
        _u(f"{_MODEL}.lora.**", "a Megatron-Bridge LoRA option without a counterpart here", inactive=mcore),
        _u(f"{_MODEL}.lora_*", _NO_LORA, inactive=fsdp),
    ]


# ---- layout overrides of verl's Megatron actor (override_transformer_config: megatron TransformerConfig fields)
def _is_full(value: Any) -> bool:
    return value == "full"


def _layout_rules(prefix: str) -> List[Rule]:
    """Uneven pipeline stages and activation recomputation: megatron's names, which verl passes to megatron-core's
    TransformerConfig as they are; here parallel.* and actor.recompute_*. megatron ignores recompute_method /
    num_layers without full granularity and recompute_modules without selective (its default: core_attn)."""
    gran = f"{prefix}.recompute_granularity"
    return [
        *[_m(f"{prefix}.num_layers_in_{s}_pipeline_stage", f"parallel.num_layers_in_{s}_pipeline_stage")
          for s in ("first", "last")],
        _m(gran, "actor.recompute_granularity"),
        *[Rule(f"{prefix}.recompute_{k}", MAPPED, target=f"actor.recompute_{k}",
               inactive=_unless(gran, _is_full, " (megatron reads it with full recomputation only)"))
          for k in ("method", "num_layers")],
        Rule(f"{prefix}.recompute_modules", MAPPED, target="actor.recompute_modules",
             inactive=_unless(gran, lambda g: g == "selective", " (megatron reads it with selective recomputation "
                                                                 "only)")),
    ]


#: HF config names verl's model.override_config.model_config may set -> the ModelConfig key of the same meaning
_HF_MODEL_NAMES = {"max_position_embeddings": "max_position_embeddings", "rope_theta": "rotary_base",
                   "rms_norm_eps": "norm_epsilon"}


def _gradient_checkpointing(value: Any, v: Verl) -> Dict[str, Any]:
    if not value:
        raise Skip(NO_MEANING, "false: every activation is kept, this project's default too")
    return {"actor.recompute_granularity": "full", "actor.recompute_method": "uniform",
            "actor.recompute_num_layers": 1}


# ---- multi-turn (verl's tool agent loop, verl/experimental/agent_loop/tool_agent_loop.py)
_MT = f"{_R}.multi_turn"
_MT_ON = _unless(f"{_MT}.enable", bool, " (single-turn rollouts)")


def _multi_turn_enable(value: Any, v: Verl) -> Dict[str, Any]:
    """verl's multi-turn switch: a job here needs an Environment class (multi_turn.env) that does what verl's
    tools / interaction do, which migrate cannot write; the job is refused with what to do."""
    if not value:
        raise Skip(NO_MEANING, "false: single-turn rollouts, this project's default too (multi_turn.env: null)")
    tools_path, interaction = v.get(f"{_MT}.tool_config_path"), v.get(f"{_MT}.interaction_config_path")
    if tools_path:
        try:
            what = "its tools " + ", ".join(str(t) for t in read_verl_tools(tools_path))
        except (OSError, ValueError) as exc:
            what = f"the tools of {tools_path} (not readable here: {exc})"
    else:
        what = "no tools"
    if interaction:
        what += f" and the interaction of {interaction}"
    raise Skip(UNSUPPORTED, f"true: verl runs multi-turn rollouts with {what}, which do not run here; without "
                            f"multi_turn.env this file trains SINGLE-TURN. Write a megatron_rl.envs.tool_env."
                            f"ToolEnvironment subclass (Hermes tool calls) with those tools and your reward as its "
                            f"score(), and set multi_turn.env to it (docs/multi_turn.md); the turn and token limits "
                            f"are mapped below")


def _turn_limits(value: Any, v: Verl) -> Dict[str, Any]:
    """verl stops a trajectory after an assistant turn once max_assistant_turns assistant turns or max_user_turns
    tool / user turns happened (null: no limit), and when response_length response tokens (model and tool) are
    used; each turn may sample up to what is left. Here: max_turns model turns, max_total_tokens, and
    max_tokens_per_turn = response_length (a turn's budget is min(that, what is left)). Without a turn limit the
    token budget bounds it: response_length turns can never be reached first (each turn samples >= 1 token)."""
    assistant, user = v.get(f"{_MT}.max_assistant_turns"), v.get(f"{_MT}.max_user_turns")
    tokens = v.get(f"{_R}.response_length", v.get("data.max_response_length"))
    if not isinstance(tokens, int) or tokens < 1:
        raise Skip(UNSUPPORTED, f"needs the response budget actor_rollout_ref.rollout.response_length (or "
                                f"data.max_response_length) as an integer, got {tokens!r}")
    limits = [t for t in (assistant, user + 1 if isinstance(user, int) and user else None) if t]
    return {"multi_turn.max_turns": min(limits) if limits else tokens, "multi_turn.max_total_tokens": tokens,
            "multi_turn.max_tokens_per_turn": tokens}


def _multi_turn_rules() -> List[Rule]:
    """verl's ``rollout.multi_turn`` block and the agent-loop switch that also turns it on."""
    env = "a ToolEnvironment runs every call of a turn and returns its whole result; do as verl does in your " \
          "environment's step (multi_turn.env)"
    return [
        _m(f"{_MT}.enable", convert=_multi_turn_enable, hint=False),
        # no target: a null (no limit in verl) is converted too, not left at this project's default
        *[Rule(f"{_MT}.{k}", MAPPED, convert=_turn_limits, inactive=_MT_ON,
               note="multi_turn.max_turns, and multi_turn.max_total_tokens / max_tokens_per_turn = the response "
                    "budget (rollout.response_length), as verl bounds a trajectory")
          for k in ("max_assistant_turns", "max_user_turns")],
        _u(f"{_MT}.tool_config_path", "verl's tool classes: see multi_turn.enable", neutral=(None,),
           inactive=_MT_ON),
        _u(f"{_MT}.interaction_config_path", "verl's interaction (simulated user) classes: see multi_turn.enable",
           neutral=(None,), inactive=_MT_ON),
        _u(f"{_MT}.format", "tool calls are parsed in the Hermes format here (megatron_rl/envs/tool_calls.py)",
           neutral=("hermes",), inactive=_MT_ON),
        _u(f"{_MT}.max_parallel_calls", f"verl runs the first max_parallel_calls calls of a turn; {env}",
           inactive=_MT_ON),
        _u(f"{_MT}.max_tool_response_length", f"verl cuts a tool's response text to this many characters; {env}",
           inactive=_MT_ON),
        _u(f"{_MT}.tool_response_truncate_side", f"where verl cuts a long tool response; {env}", inactive=_MT_ON),
        _n(f"{_MT}.use_inference_chat_template", "the driver never re-renders the conversation: every turn "
           "continues from the exact token ids (docs/multi_turn.md)", inactive=_MT_ON),
        _n(f"{_MT}.tokenization_sanity_check_mode", "the driver never re-tokenizes the model's turns "
           "(docs/multi_turn.md)", inactive=_MT_ON),
        _u(f"{_MT}.**", "verl's multi-turn setting; multi-turn rollouts here run an Environment class "
           "(multi_turn.env, docs/multi_turn.md)", inactive=_MT_ON),
        _u(f"{_R}.agent.default_agent_loop", "verl's agent loop for rows without agent_name; a tool / multi-turn "
           "loop needs an Environment class here (multi_turn.env, docs/multi_turn.md)",
           neutral=("single_turn_agent",)),
    ]


# ------------------------------------------------------------------------------------------------ the table
_SGLANG = "give it where the servers start: launch/sglang_server.sh -- <sglang flag>, SGLANG_EXTRA_ARGS of " \
          "launch/slurm.sbatch"
_TRAINER_ONLY = "the actor's own layout is parallel.*"
_PROFILER = "verl's profiler; profile with your own tools (nsys, torch.profiler) around launch/torchrun.sh"
_NO_CRITIC = ("verl's critic worker settings: the critic here has the actor's model, layout, micro-batches and "
              "the other optimizer keys of critic: (docs/critic.md)")
def _critic_mini_batches(value: Any, v: Verl) -> Dict[str, Any]:
    """verl's critic.ppo_mini_batch_size (default: the actor's) counts prompts per critic optimizer step."""
    try:
        return {"critic.ppo_mini_batches": _mini_batches(value, v)["actor.ppo_mini_batches"]}
    except Skip as skip:
        raise Skip(skip.kind, skip.reason.replace("actor.ppo_mini_batches", "critic.ppo_mini_batches"))


def _critic_optimizer_steps(target: str) -> Callable[[Any, Verl], Dict[str, Any]]:
    """A critic schedule length in critic optimizer steps (verl: training steps)."""
    def convert(value: Any, v: Verl) -> Dict[str, Any]:
        if target == "critic.lr_warmup_steps" and _ratio_decides_warmup(value, v):
            raise Skip(NO_MEANING, f"{_show(value)}: verl then warms up for critic.optim.lr_warmup_steps_ratio")
        total, mini = v.get("data.train_batch_size", 1024), v.get("critic.ppo_mini_batch_size", 256)
        epochs = v.get("critic.ppo_epochs", 1)
        if not all(isinstance(x, int) and x > 0 for x in (total, mini, epochs)) or total % mini:
            raise Skip(UNSUPPORTED, f"cannot count critic optimizer steps per training step from "
                                    f"data.train_batch_size {total!r}, critic.ppo_mini_batch_size {mini!r}, "
                                    f"critic.ppo_epochs {epochs!r}")
        return {target: value * epochs * (total // mini)}
    return convert


def _critic_warmup_ratio(value: Any, v: Verl) -> Dict[str, Any]:
    if _ratio_decides_warmup(v.get("critic.optim.lr_warmup_steps"), v) is False:
        raise Skip(NO_MEANING, "no effect in verl while critic.optim.lr_warmup_steps is set (verl then warms up "
                               "for that many steps)")
    if not value:
        raise Skip(NO_MEANING, f"{_show(value)}: no warm-up, this project's default too")
    return {"critic.lr_warmup_fraction": value}


def _no_critic(v: Verl) -> Optional[str]:
    """Inactive unless verl trains a critic (its ``need_critic``: critic.enable, or null and gae)."""
    enable = v.get("critic.enable")
    if enable or (enable is None and v.get("algorithm.adv_estimator") == "gae"):
        return None
    return f"no effect in verl: it trains no critic (critic.enable {_show(enable)}, algorithm.adv_estimator " \
           f"{_show(v.get('algorithm.adv_estimator'))})"


def _critic_model_path(value: Any, v: Verl) -> Dict[str, Any]:
    """verl's critic.model.path is critic.load_hf here (null: the actor's, verl's default)."""
    if value == v.get("actor_rollout_ref.model.path"):
        raise Skip(NO_MEANING, "the actor's model: critic.load_hf null starts the critic from actor.load_hf too")
    return {"critic.load_hf": value}


_LOGPROB_MB = "one micro-batch setting serves the log-prob and the train pass here (actor.micro_batch_size / " \
              "actor.max_tokens_per_micro_batch)"
_REF_NOTE = "the reference model (KL loss) runs with the actor's layout and micro-batches here"
_RAY = "verl's Ray set-up; processes here are started by torchrun / srun"
_TARGET = "Hydra's class name of a verl config block"
_MULTI_TURN = "multi-turn rollouts here run an Environment class (multi_turn.env, docs/multi_turn.md); verl's " \
              "tool / interaction configs do not carry over"
_RM_OFF = _unless("reward_model.enable", bool, " (rewards come from functions: data.reward_fn)")
_RM_SERVER = "the reward model's SGLang server (--is-embedding): give it where that server starts; reward.model.urls " \
             "names it (docs/reward_models.md)"


def _rm_enable(value: Any, v: Verl) -> Dict[str, Any]:
    """verl's reward-model switch -> ``reward.model.enable`` with backend sglang (verl serves its RM on GPUs)."""
    if not value:
        raise Skip(NO_MEANING, "the reward model is off (rewards come from functions: data.reward_fn)")
    fn = next((k for k in ("custom_reward_function.path", "reward.custom_reward_function.path") if v.get(k)), None)
    if fn is not None:  # verl's reward loop scores with that function alone (it may call the RM itself)
        raise Skip(UNSUPPORTED, f"with {fn} set, verl's reward loop scores with that function alone (a GenRM or "
                                "hybrid reward calls the RM from it through reward_router_address), not with the RM's "
                                "score: choose here reward.model (rule_weight > 0 adds data.reward_fn) or "
                                "reward.judge (a generative RM) by hand (docs/reward_models.md)")
    return {"reward.model.enable": True, "reward.model.backend": "sglang",
            NOTE: "the RM is served by an SGLang server started with --is-embedding: set reward.model.urls "
                  "(backend local runs tiny RMs on CPU); its reward is the RM score alone (reward.model.rule_weight "
                  "0, as verl's reward manager adds no rule score when a reward model scores)"}


def _rm_mapped(pattern: str, target: str, enable: str, note: str = "", convert=None) -> Rule:
    """A reward-model key mapped to ``target``, with no effect while ``enable`` is off."""
    return Rule(pattern, MAPPED, target=target, note=note, convert=convert, hint=False,
                inactive=_unless(enable, bool, " (no reward model)"))


def _rm_token_budget(value: Any, v: Verl) -> Dict[str, Any]:
    if not v.get("reward_model.use_dynamic_bsz"):
        raise Skip(NO_MEANING, "no effect in verl while reward_model.use_dynamic_bsz is off")
    return {"reward.model.max_tokens_per_batch": value}


_PARALLEL_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                   "virtual_pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
                   "expert_tensor_parallel_size")
_LOSS_KEYS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "tau_pos", "tau_neg", "loss_agg_mode",
              "loss_scale_factor", "kl_loss_type")


def _rules() -> List[Rule]:
    return [
        _n("**._target_", _TARGET),
        _n("defaults", "Hydra's composition: the file builds on the verl configs it lists; give that config (verl's "
           "generated one, e.g. _generated_ppo_trainer.yaml) as --base so its keys are read too"),
        _n("hydra.**", "Hydra's own settings (config search path, output directory)"),
        *_pending_rules(),
        *_newer_verl_rules(),  # keys verl 0.9.1 / main added (before the sub-tree rows below that would take them)
        # ---- actor: optimizer
        _m(f"{_A}.optim.lr", "actor.lr"),
        _m(f"{_A}.optim.weight_decay", "actor.weight_decay"),
        _m(f"{_A}.optim.betas", "actor.adam_beta1", convert=_betas, note="and actor.adam_beta2"),
        _m(f"{_A}.optim.clip_grad", "actor.clip_grad"),
        _m(f"{_A}.grad_clip", "actor.clip_grad"),
        _u(f"{_A}.optim.optimizer", "the optimizer is Adam (megatron-core's, with decoupled weight decay)",
           neutral=("adam", "adamw", "AdamW")),
        _n(f"{_A}.optim.total_training_steps", "verl fills it from the trainer at run time (the schedule's length)",
           neutral=(-1, None)),
        # learning-rate schedule: megatron-core's OptimizerParamScheduler on both sides; verl steps it once per
        # training step, this project once per optimizer step
        _m(f"{_A}.optim.lr_warmup_steps", "actor.lr_warmup_steps", convert=_optimizer_steps("actor.lr_warmup_steps"),
           note="counted in optimizer steps: verl's training steps x actor.ppo_epochs x actor.ppo_mini_batches"),
        Rule(f"{_A}.optim.lr_warmup_steps_ratio", MAPPED, target="actor.lr_warmup_fraction",
             convert=_warmup_ratio, inactive=_warmup_steps_set,
             note="a fraction of the decay length (the whole run) on both sides"),
        _m(f"{_A}.optim.lr_warmup_init", "actor.lr_warmup_init"),
        _m(f"{_A}.optim.lr_decay_style", "actor.lr_decay_style", note="constant, linear, cosine or "
           "inverse-square-root"),
        _m(f"{_A}.optim.warmup_style", "actor.lr_decay_style", note="verl's warmup_style names the decay after "
           "the warm-up"),
        Rule(f"{_A}.optim.lr_scheduler_type", MAPPED, target="actor.lr_decay_style",
             inactive=_unless(f"{_A}.optim.warmup_style", lambda s: s is None,
                              " (verl's FSDP optimizer config then takes the decay style from warmup_style)"),
             note="constant, linear, cosine or inverse-square-root"),
        _m(f"{_A}.optim.lr_decay_steps", "actor.lr_decay_steps", convert=_optimizer_steps("actor.lr_decay_steps"),
           note="counted in optimizer steps"),
        _m(f"{_A}.optim.min_lr", "actor.min_lr"),
        _m(f"{_A}.optim.min_lr_ratio", "actor.min_lr", convert=lambda value, v: {
            "actor.min_lr": value * v.get(f"{_A}.optim.lr", 1e-6)}, note="an absolute learning rate: min_lr_ratio x "
           "actor.lr"),
        _u(f"{_A}.optim.num_cycles", "the cosine decays once, from actor.lr to actor.min_lr (verl's default "
           "num_cycles 0.5)", neutral=(0.5,)),
        _u(f"{_A}.optim.weight_decay_incr_style", "weight decay is constant (actor.weight_decay)",
           neutral=("constant",)),
        _u(f"{_A}.optim.lr_wsd_*", "no warmup-stable-decay schedule (lr_decay_style wsd)",
           inactive=_unless(f"{_A}.optim.lr_decay_style", lambda s: s == "wsd", "")),
        _n(f"{_A}.optim.use_checkpoint_opt_param_scheduler", "the optimizer state is always restored from the "
           "checkpoint on resume", neutral=(False,)),
        # megatron's optimizer CPU offload (HybridDeviceOptimizer): the same on both sides (docs/memory.md)
        _m(f"{_A}.optim.override_optimizer_config.optimizer_cpu_offload", "actor.optimizer_cpu_offload",
           convert=_cpu_offload, note="megatron's optimizer CPU offload (needs actor.use_distributed_optimizer and "
           "actor.bf16); without optimizer_offload_fraction megatron's default 0 offloads nothing: written as false"),
        Rule(f"{_A}.optim.override_optimizer_config.optimizer_offload_fraction", MAPPED,
             target="actor.optimizer_offload_fraction", inactive=_OFFLOAD_OFF),
        Rule(f"{_A}.optim.override_optimizer_config.use_precision_aware_optimizer", UNSUPPORTED,
             note="megatron's precision-aware optimizer alone (Transformer Engine's FusedAdam) is not exposed",
             neutral=(False,), inactive=_set_with_offload),
        _n(f"{_A}.optim.override_optimizer_config.overlap_cpu_optimizer_d2h_h2d", "a CUDA-stream overlap of "
           "megatron's optimizer offload: speed only, the same updates (megatron's default, off, here)"),
        _n(f"{_A}.optim.override_optimizer_config.pin_cpu_*", "pinned host buffers of megatron's optimizer "
           "offload: speed only (megatron's default, pinned, here)"),
        _u(f"{_A}.optim.override_optimizer_config.**", "Megatron optimizer overrides other than CPU offload "
           "are not exposed"),
        _n(f"{_A}.optim.override_optimizer_config", "no overrides given", neutral=({},)),
        _u(f"{_A}.optim.**", "an optimizer option the Adam optimizer here does not have"),
        # ---- actor: Megatron engine
        *[_m(f"{_A}.megatron.{k}", f"parallel.{k}") for k in _PARALLEL_SIZES],  # Megatron's names on both sides
        _m(f"{_A}.megatron.sequence_parallel", convert=lambda value, v: {"parallel.sequence_parallel": bool(
            value and (v.get(f"{_A}.megatron.tensor_model_parallel_size") or 1) > 1)},
           note="Megatron turns sequence parallelism off at TP 1; it is written as that"),
        _m(f"{_A}.megatron.use_distributed_optimizer", "actor.use_distributed_optimizer"),
        _m(f"{_A}.megatron.seed", "trainer.seed", convert=_seed,
           note="one seed (trainer.seed) drives data, sampling and init"),
        _m(f"{_A}.megatron.dtype", convert=_dtype),
        _m(f"{_A}.megatron.use_remove_padding", "actor.sequence_packing", convert=_remove_padding,
           note="true packs each micro-batch's rows into one sequence"),
        _n(f"{_A}.megatron.param_offload", _PHASE_OFFLOAD.format(what="parameters"), neutral=(False,)),
        _n(f"{_A}.megatron.grad_offload", _PHASE_OFFLOAD.format(what="gradients"), neutral=(False,)),
        _n(f"{_A}.megatron.optimizer_offload", _PHASE_OFFLOAD.format(what="optimizer state") + "; if the "
           "train step does not fit, actor.optimizer_cpu_offload keeps it on the host for the step too",
           neutral=(False,)),
        _n(f"{_A}.megatron.use_dist_checkpointing", "checkpoints are always megatron-core distributed "
           "checkpoints; the actor starts from actor.load_hf (or a `megatron-rl convert hf-to-mcore` output)",
           neutral=(False,)),
        _n(f"{_A}.megatron.dist_checkpointing_*", "the actor starts from actor.load_hf",
           neutral=(None, "")),
        _n(f"{_A}.megatron.use_mbridge", "HF weights are converted by this project's own converter "
           "(megatron_rl.convert)"),
        _n(f"{_A}.megatron.vanilla_mbridge", "HF weights are converted by this project's own converter"),
        _n(f"{_A}.megatron.forward_only", "a flag verl sets per role (the reference model)"),
        *_layout_rules(f"{_A}.megatron.override_transformer_config"),
        _u(f"{_A}.megatron.override_transformer_config.attention_backend", "the attention backend is chosen from "
           "the device and Transformer Engine (`megatron-rl check` prints it)", neutral=("flash", "auto")),
        _m(f"{_A}.megatron.override_transformer_config.**", note="verl passes it to megatron-core's "
           "TransformerConfig; model.extra does the same, over actor.load_hf's shapes (`check` refuses a name "
           "that is not a TransformerConfig field, or that a project key sets, naming that key)"),
        _n(f"{_A}.megatron.override_transformer_config", "no overrides given", neutral=({},)),
        _u(f"{_A}.megatron.override_ddp_config.**", "megatron DDP overrides are not exposed"),
        _n(f"{_A}.megatron.override_ddp_config", "no overrides given", neutral=({},)),
        _u(f"{_A}.megatron.override_mcore_model_config.**", "megatron model overrides go to a model: section"),
        _n(f"{_A}.megatron.override_mcore_model_config", "no overrides given", neutral=({},)),
        # ---- actor: FSDP engine (verl's other backend)
        Rule(f"{_A}.fsdp_config.dtype", MAPPED, convert=_dtype, inactive=_strategy_is("fsdp"), hint=False,
             note="verl's FSDP actor computes in this dtype over fp32 parameters: actor.bf16 (bf16 compute, fp32 "
                  "main weights)"),
        Rule(f"{_A}.fsdp_config.offload_policy", MAPPED, target="actor.optimizer_cpu_offload",
             inactive=_strategy_is("fsdp"), hint=False,
             note="FSDP2's CPUOffloadPolicy steps the optimizer on the CPU: megatron's optimizer CPU offload (the "
                  "parameters and gradients stay on the GPU here; needs actor.use_distributed_optimizer, actor.bf16)"),
        Rule(f"{_A}.fsdp_config.param_offload", NO_MEANING, inactive=_strategy_is("fsdp"), hint=False,
             neutral=(False,), note=_PHASE_OFFLOAD.format(what="parameters")),
        Rule(f"{_A}.fsdp_config.optimizer_offload", NO_MEANING, inactive=_strategy_is("fsdp"), hint=False,
             neutral=(False,), note=_PHASE_OFFLOAD.format(what="optimizer state")),
        _n(f"{_A}.fsdp_config.**", "verl's FSDP actor; the actor here is Megatron (parallel.*, "
           "actor.use_distributed_optimizer, actor.bf16)"),
        _n(f"{_A}.ulysses_sequence_parallel_size", "DeepSpeed-Ulysses sequence parallelism of verl's FSDP actor; "
           "the Megatron actor splits long sequences with parallel.context_parallel_size", neutral=(1,)),
        Rule(f"{_A}.use_remove_padding", MAPPED, convert=_remove_padding, inactive=_strategy_is("fsdp"),
             hint=False, note="verl's FSDP actor's packing switch"),
        _n(f"{_A}.entropy_from_logits_with_chunking", "a memory option of verl's FSDP entropy computation"),
        _n(f"{_A}.entropy_checkpointing", "a memory option of verl's FSDP entropy computation"),
        _n(f"{_A}.calculate_sum_pi_squared", "the log-prob pass computes sum pi^2 whenever algorithm.adv_estimator "
           "needs it (the optimal token baselines), never otherwise", neutral=(False,)),
        _n(f"{_A}.sum_pi_squared_checkpointing", "a memory option of calculate_sum_pi_squared"),
        _m(f"{_A}.strategy", convert=_strategy, hint=False),
        _m("model_engine", convert=_model_engine, hint=False),
        _n(f"{_A}.rollout_n", "verl's copy of actor_rollout_ref.rollout.n"),
        # ---- actor: batching
        _m(f"{_A}.ppo_mini_batch_size", "actor.ppo_mini_batches", convert=_mini_batches,
           note="verl counts prompts per mini-batch; here actor.ppo_mini_batches counts mini-batches per step"),
        _m(f"{_A}.ppo_micro_batch_size_per_gpu", "actor.micro_batch_size",
           note="sequences per micro-batch on each rank"),
        _u(f"{_A}.ppo_micro_batch_size", "verl's deprecated global micro-batch size; set "
           "ppo_micro_batch_size_per_gpu (actor.micro_batch_size, per rank)", neutral=(None,)),
        _m(f"{_A}.use_dynamic_bsz", "actor.max_tokens_per_micro_batch", convert=_dynamic_bsz,
           note="true: the token budget ppo_max_token_len_per_gpu is actor.max_tokens_per_micro_batch"),
        Rule(f"{_A}.ppo_max_token_len_per_gpu", MAPPED, target="actor.max_tokens_per_micro_batch",
             convert=_token_budget, inactive=_DYN,
             note="token budget of one micro-batch per rank (padded tokens unless actor.sequence_packing)"),
        _m(f"{_A}.ppo_epochs", "actor.ppo_epochs"),
        _u(f"{_A}.shuffle", "mini-batches are taken in order from the step's rows", neutral=(False,)),
        _n(f"{_A}.data_loader_seed", "one seed (trainer.seed) drives data, sampling and init"),
        # ---- actor: loss
        _m(f"{_A}.clip_ratio", "actor.policy_loss.clip_ratio", convert=_clip_ratio),
        *[_m(f"{_A}.{k}", f"actor.policy_loss.{k}", convert=_loss_key(k)) for k in _LOSS_KEYS],  # on actor in verl
        _m(f"{_A}.policy_loss.loss_mode", convert=_loss_mode, target="algorithm.rollout_correction.loss_type",
           note="verl's actor.policy_loss.loss_mode is moved there on load"),
        _m(f"{_A}.policy_loss.*", hint=False),  # clip_cov_ratio, kl_cov_ratio, ...: same names under actor.policy_loss
        _m(f"{_A}.use_kl_loss", "actor.policy_loss.kl_loss_coef", convert=_use_kl_loss,
           note=f"use_kl_loss decides whether kl_loss_coef applies (verl's default {VERL_KL_LOSS_COEF} when the "
                f"file does not set it)"),
        _m(f"{_A}.kl_loss_coef", convert=_kl_loss_coef, target="actor.policy_loss.kl_loss_coef"),
        _n(f"{_A}.calculate_entropy", "the train step always reports the entropy (actor/entropy)"),
        _u(f"{_A}.use_prefix_grouper", "no shared-prefix grouping of a group's rows", neutral=(False,)),
        _n(f"{_A}.use_torch_compile", "torch.compile of verl's FSDP log-prob function"),
        _n(f"{_A}.use_fused_kernels", "this project picks its log-prob kernel itself (docs/logprob_kernels.md)"),
        _u(f"{_A}.freeze_vision_tower", "vision-language models are not supported", neutral=(False,)),
        _n(f"{_A}.checkpoint.**", "a checkpoint holds the model, optimizer and loop state, always "
           "(trainer.save_interval, trainer.checkpoint_timeout_s)"),
        _n(f"{_A}.profiler.**", _PROFILER),
        _n(f"{_A}.router_replay.mode", "verl 0.9.1 / main decide routing replay from actor_rollout_ref.actor.megatron."
           "router_replay.mode alone (its engine workers; an FSDP actor: none); this key has no effect there",
           neutral=("disabled",), hint=False),
        _n(f"{_A}.router_replay.*", "routing is replayed in memory (actor.routing_replay), not through files",
           neutral=(None,)),
        _n(f"{_A}.load_weight", "the actor always starts from actor.load_hf", neutral=(True,)),
        # ---- reference model
        _m(f"{_REF}.megatron.param_offload", "actor.ref_param_offload", hint=False,  # not the actor's param_offload
           note="the reference's weights on the GPU only during its log-prob pass", convert=_ref_param_offload),
        Rule(f"{_REF}.fsdp_config.param_offload", MAPPED, target="actor.ref_param_offload",
             inactive=_strategy_is("fsdp"), hint=False, convert=_ref_param_offload,
             note="the reference's weights on the GPU only during its log-prob pass"),
        _n(f"{_REF}.log_prob_*", _LOGPROB_MB),
        _n(f"{_REF}.**", _REF_NOTE),
        # ---- rollout
        _m(f"{_R}.name", convert=_engine, note="rollout.sglang_urls is the local default; launch/slurm.sbatch "
           "replaces it"),
        _n(f"{_R}.mode", "verl's sync / async server mode of its rollout workers (rollout.mode here is async "
           "off-policy generation, a different thing)", hint=False),
        _m(f"{_R}.temperature", "rollout.temperature"),
        _m(f"{_R}.top_k", "rollout.top_k"),
        _m(f"{_R}.top_p", "rollout.top_p"),
        _m(f"{_R}.n", "rollout.n_samples_per_prompt", note="the group size"),
        _m(f"{_R}.prompt_length", "data.max_prompt_length",
           note="longer prompts are filtered or truncated: data.overlong_prompts"),
        _m(f"{_R}.response_length", "rollout.max_new_tokens"),
        _s(f"{_R}.tensor_model_parallel_size", "the SGLang servers' tensor parallelism is set where they start: "
           "launch/sglang_server.sh --tp, SGLANG_TP of launch/slurm.sbatch; parallel.tensor_model_parallel_size "
           "is the trainer's"),
        _s(f"{_R}.gpu_memory_utilization", "launch/sglang_server.sh --mem-fraction (SGLang's "
           "--mem-fraction-static), SGLANG_MEM_FRACTION of launch/slurm.sbatch"),
        _s(f"{_R}.dtype", "launch/sglang_server.sh --dtype, SGLANG_DTYPE (rollout.dtype here is the embedded "
           "engine's)", hint=False),
        _s(f"{_R}.data_parallel_size", _SGLANG + " (or more servers in rollout.sglang_urls)"),
        _s(f"{_R}.expert_parallel_size", _SGLANG),
        _s(f"{_R}.pipeline_model_parallel_size", _SGLANG),
        _s(f"{_R}.enforce_eager", _SGLANG + " (--disable-cuda-graph)"),
        _s(f"{_R}.cudagraph_capture_sizes", _SGLANG),
        _s(f"{_R}.free_cache_engine", _SGLANG),
        _s(f"{_R}.max_num_batched_tokens", _SGLANG + " (--chunked-prefill-size / --max-prefill-tokens)"),
        _s(f"{_R}.max_model_len", _SGLANG + " (--context-length)"),
        _s(f"{_R}.max_num_seqs", _SGLANG + " (--max-running-requests)"),
        _s(f"{_R}.enable_chunked_prefill", _SGLANG),
        _s(f"{_R}.enable_prefix_caching", _SGLANG),
        _s(f"{_R}.enable_sleep_mode", _SGLANG),
        _s(f"{_R}.scheduling_policy", _SGLANG + " (--schedule-policy)"),
        _s(f"{_R}.load_format", _SGLANG + " (--load-format)"),
        _s(f"{_R}.disable_log_stats", _SGLANG),
        _s(f"{_R}.engine_kwargs.**", _SGLANG),
        _s(f"{_R}.quantization*", _SGLANG),
        _s(f"{_R}.skip_tokenizer_init", _SGLANG),
        _s(f"{_R}.layer_name_map.**", "how verl names fused layers of its rollout engine; weight sync here "
           "reads SGLang's own names"),
        _s(f"{_R}.prometheus.**", _SGLANG + " (--enable-metrics)"),
        _s(f"{_R}.mtp.**", _SGLANG + " (speculative decoding)", hint=False),
        _n(f"{_R}.log_prob_*", _LOGPROB_MB),
        _u(f"{_R}.ignore_eos", "generation always stops at EOS", neutral=(False,)),
        _u(f"{_R}.logprobs_mode", "the engine's log-probs are of the processed (temperature-scaled) "
           "distribution, which the trainer scores too", neutral=("processed_logprobs",)),
        _u(f"{_R}.do_sample", "rollouts are sampled (rollout.temperature > 0)", neutral=(True,)),
        _u(f"{_R}.over_sample_rate", "no over-sampling of prompts", neutral=(0, 0.0)),
        _n(f"{_R}.layered_summon", "how verl's FSDP actor gathers weights for its engine; weight sync here is "
           "rollout.weight_sync"),
        _n(f"{_R}.multi_stage_wake_up", "verl's colocated engine memory management"),
        _n(f"{_R}.calculate_log_probs", "the engine always returns the sampled tokens' log-probs (the rollout "
           "correction needs them)"),
        *_multi_turn_rules(),
        _u(f"{_R}.agent.agent_loop_config_path", "verl's agent loops registered from this file run for the rows "
           "that name them (agent_name); here a row is generated single-turn, or by an Environment class "
           "(multi_turn.env, docs/multi_turn.md)", neutral=(None,)),
        _u(f"{_R}.agent.custom_async_server.*", "verl's own rollout server class; rollouts come from SGLang servers "
           "here", neutral=(None,)),
        _n(f"{_R}.agent.**", "verl's agent-loop workers; generation requests are sent from rank 0 here"),
        _m(f"{_R}.checkpoint_engine.update_weights_bucket_megabytes", "rollout.weight_sync_bucket_mb"),
        _n(f"{_R}.checkpoint_engine.**", "how weights reach the engine is rollout.weight_sync here"),
        _n(f"{_R}.trace.**", "verl's rollout tracing; trainer.dump_rollouts writes every rollout"),
        _u(f"{_R}.skip_rollout", "no replay of dumped rollouts in training", neutral=(False,)),
        _n(f"{_R}.skip_dump_dir", "used by skip_rollout only"),
        _n(f"{_R}.enable_rollout_routing_replay", "actor.routing_replay: r3 asks the engine for the routing "
           "(set from actor.router_replay.mode)"),
        _n(f"{_R}.profiler.**", _PROFILER),
        # ---- model
        _m(f"{_MODEL}.path", "actor.load_hf", note="the HF checkpoint directory the actor starts from (verl's "
           "model.path)"),
        _u(f"{_MODEL}.hf_config_path", "the model config is actor.load_hf's config.json (or a model: section)",
           neutral=(None,)),
        _u(f"{_MODEL}.tokenizer_path", "the tokenizer is read from actor.load_hf", neutral=(None,)),
        _u(f"{_MODEL}.custom_chat_template", "the tokenizer's own chat template is used", neutral=(None,)),
        _u(f"{_MODEL}.external_lib", "custom model code is not imported", neutral=(None,)),
        _n(f"{_MODEL}.use_shm", "verl's shared-memory model copy"),
        _n(f"{_MODEL}.trust_remote_code", "models are built by megatron-core from the config's shapes"),
        _u(f"{_MODEL}.override_config.moe_config.freeze_moe_router", "the router is trained", neutral=(False,)),
        *[_m(f"{_MODEL}.override_config.model_config.{hf}", f"model.{ours}", note="verl puts it over the HF "
             "config; a model: section without shapes puts it over actor.load_hf's") for hf, ours in _HF_MODEL_NAMES.items()],
        _u(f"{_MODEL}.override_config.**", "HF config overrides: write a model: section (the shapes, "
           "max_position_embeddings, ...) instead of relying on actor.load_hf's config.json"),
        _n(f"{_MODEL}.override_config", "no overrides given", neutral=({},)),
        Rule(f"{_MODEL}.enable_gradient_checkpointing", MAPPED, target="actor.recompute_granularity",
             convert=_gradient_checkpointing, inactive=_strategy_is("fsdp"), hint=False,
             note="HF gradient checkpointing recomputes every decoder layer in backward: megatron's full / "
                  "uniform / 1 layer"),
        _u(f"{_MODEL}.enable_activation_offload", "no activation offload", neutral=(False,)),
        Rule(f"{_MODEL}.use_remove_padding", MAPPED, convert=_remove_padding, inactive=_strategy_is("fsdp"),
             hint=False, note="verl's FSDP actor's packing switch (the Megatron actor's is "
                              "actor.megatron.use_remove_padding)"),
        *_lora_rules(),
        _n(f"{_MODEL}.use_liger", "Liger kernels of verl's FSDP actor"),
        _n(f"{_MODEL}.use_fused_kernels", "this project picks its log-prob kernel itself "
           "(docs/logprob_kernels.md)"),
        _n(f"{_MODEL}.fused_kernel_options.**", "this project picks its log-prob kernel itself"),
        _u(f"{_MODEL}.tiled_mlp.**", "no tiled MLP", inactive=_unless(f"{_MODEL}.tiled_mlp.enabled", bool, "")),
        _u(f"{_MODEL}.mtp.**", "multi-token prediction is not trained",
           inactive=_unless(f"{_MODEL}.mtp.enable", bool, "")),
        _n(f"{_RM}.hybrid_engine", "whether SGLang shares the trainer's GPUs is chosen at launch "
           "(launch/slurm.sbatch SGLANG_MODE=colocated / separate)"),
        _n(f"{_RM}.nccl_timeout", "verl's worker NCCL timeout; trainer.collective_timeout_s here must also cover "
           "the rollout phase (ranks wait in a collective while rank 0 generates)"),
        # ---- critic (megatron_rl/config/critic.py: the actor's layout, micro-batches and model)
        _m("critic.enable", "critic.enable"),
        _m("critic.optim.lr", "critic.lr"),
        _m("critic.optim.weight_decay", "critic.weight_decay"),
        _m("critic.optim.clip_grad", "critic.clip_grad"),
        _m("critic.ppo_epochs", "critic.ppo_epochs"),
        _m("critic.cliprange_value", "critic.cliprange_value"),
        _m("critic.loss_agg_mode", "critic.loss_agg_mode"),
        _m("critic.ppo_mini_batch_size", "critic.ppo_mini_batches", convert=_critic_mini_batches,
           note="verl counts prompts per critic mini-batch (default: the actor's); here a count per step"),
        _m("critic.optim.lr_warmup_steps_ratio", "critic.lr_warmup_fraction", convert=_critic_warmup_ratio),
        _m("critic.optim.lr_warmup_steps", "critic.lr_warmup_steps",
           convert=_critic_optimizer_steps("critic.lr_warmup_steps"), note="counted in critic optimizer steps"),
        _m("critic.optim.betas", "critic.adam_beta1", convert=lambda value, v: {
            k.replace("actor.", "critic."): x for k, x in _betas(value, v).items()}),
        _m("critic.optim.min_lr_ratio", "critic.min_lr", convert=lambda value, v: {
            "critic.min_lr": value * v.get("critic.optim.lr", 1e-5)}, note="min_lr_ratio x critic.lr"),
        Rule("critic.optim.lr_scheduler_type", MAPPED, target="critic.lr_decay_style",
             inactive=_unless("critic.optim.warmup_style", lambda s: s is None, " (verl then takes warmup_style)")),
        _m("critic.optim.warmup_style", "critic.lr_decay_style"),
        Rule("critic.model.path", MAPPED, target="critic.load_hf", convert=_critic_model_path, inactive=_no_critic,
             note="a value / reward model (*ForTokenClassification / *ForSequenceClassification, num_labels 1) gives "
                  "the body and the value head, a CausalLM the body (docs/critic.md)"),
        _u("critic.model.lora_rank", "a LoRA critic is not built (the critic trains all its weights)", neutral=(0,),
           inactive=_no_critic),
        _u("critic.model.lora.rank", "a LoRA critic is not built (the critic trains all its weights)",
           neutral=(0, None), inactive=_no_critic),
        _u("critic.shuffle", "critic mini-batches are taken in order from the step's rows", neutral=(False,),
           inactive=_no_critic),
        _n("critic.**", _NO_CRITIC),
        # ---- data
        _m("data.train_files", "data.path", convert=_train_files, note="with data.task: file; ~ expanded as verl does"),
        _m("data.prompt_key", "data.prompt_key"),
        _m("data.max_prompt_length", "data.max_prompt_length",
           note="longer prompts are filtered or truncated: data.overlong_prompts"),
        _m("data.max_response_length", "rollout.max_new_tokens"),
        _m("data.train_batch_size", "data.prompts_per_step", note="prompts per step over all ranks; sequences per "
           "step = data.prompts_per_step x rollout.n_samples_per_prompt"),
        _m("data.filter_overlong_prompts", convert=_overlong_prompts),
        _m("data.truncation", convert=_truncation),
        _m("data.apply_chat_template_kwargs", "data.chat_template_kwargs"),
        _m("data.seed", convert=_seed),
        _u("data.tokenizer", "the tokenizer is read from actor.load_hf", neutral=(None,)),
        _n("data.use_shm", "verl's shared-memory data copy"),
        _m("data.gen_batch_size", convert=_gen_batch_size, target="algorithm.filter_groups.prompts_per_round"),
        _m("algorithm.filter_groups.enable", convert=_filter_groups_enable, target="algorithm.filter_groups.enable",
           hint=False),
        _u("data.train_max_samples", "the whole file is used", neutral=(-1, None)),
        _n("data.reward_fn_key", "the reward is dispatched on each row's data_source (verl's default key)",
           neutral=("data_source",)),
        _n("data.tool_config_path", _MULTI_TURN, neutral=(None,)),
        _n("data.return_raw_input_ids", "how verl's dataset hands prompts to its workers"),
        _n("data.return_raw_chat", "how verl's dataset hands prompts to its workers"),
        _n("data.return_full_prompt", "how verl's dataset hands prompts to its workers"),
        _n("data.return_multi_modal_inputs", "text-only prompts"),
        _n("data.shuffle", "a data file's prompts are drawn without replacement in a shuffled order per epoch "
           "(seeded by trainer.seed; docs/datasets.md)", neutral=(True,)),
        _n("data.dataloader_num_workers", "prompts are read once at start-up"),
        _u("data.image_key", "vision-language data is not supported", neutral=("images",)),
        _u("data.video_key", "vision-language data is not supported", neutral=("videos",)),
        _n("data.image_patch_size", "vision-language data is not supported"),
        _n("data.filter_overlong_prompts_workers", "prompts are filtered once at start-up"),
        _n("data.trust_remote_code", "the tokenizer is read from actor.load_hf"),
        _u("data.custom_cls.**", "custom dataset classes are not supported; rows are verl's RL format or "
           "prompt_key / answer_key records", neutral=(None,)),
        _u("data.sampler.**", "custom samplers are not supported (curricula: data.task_kwargs of the built-in "
           "tasks)", neutral=(None,)),
        _u("data.datagen.**", "dynamic data generation is not supported", neutral=(None,)),
        # ---- rewards
        _m("custom_reward_function.path", convert=_reward_fn, note="data.reward_fn: path:name, verl's "
           "compute_score signature is recognised", hint=False),
        _m("custom_reward_function.name", convert=lambda value, v: {}, hint=False,
           note="part of data.reward_fn (custom_reward_function.path:name)"),
        _u("custom_reward_function.reward_kwargs.**", "write them under data.reward_kwargs"),
        _m("reward_model.enable", convert=_rm_enable, target="reward.model.enable", hint=False),
        _rm_mapped("reward_model.model.path", "reward.model.path", "reward_model.enable"),
        _rm_mapped("reward_model.micro_batch_size_per_gpu", "reward.model.max_rows_per_batch", "reward_model.enable",
                   note="rows per RM batch (one request / forward); reward.model.max_tokens_per_batch bounds its tokens"),
        _rm_mapped("reward_model.forward_max_token_len_per_gpu", "reward.model.max_tokens_per_batch",
                   "reward_model.enable", convert=_rm_token_budget),
        _n("reward_model.use_dynamic_bsz", "RM batches are always cut by tokens (reward.model.max_tokens_per_batch) "
           "and rows (reward.model.max_rows_per_batch)", inactive=_RM_OFF),
        _n("reward_model.model.input_tokenizer", "the RM always reads (prompt, response) rendered with its own "
           "tokenizer's chat template (reward.model.chat_template replaces it)", inactive=_RM_OFF),
        _n("reward_model.strategy", "the RM runs on an SGLang server (or on CPU), not in verl's FSDP / Megatron "
           "workers", inactive=_RM_OFF),
        _u("reward_model.model.trust_remote_code", "remote-code reward models are not supported", neutral=(False,),
           inactive=_RM_OFF),
        Rule("reward_model.rollout.**", SERVER, note=_RM_SERVER, inactive=_RM_OFF),
        Rule("reward_model.enable_resource_pool", SERVER, note=_RM_SERVER, inactive=_RM_OFF),
        Rule("reward_model.n_gpus_per_node", SERVER, note=_RM_SERVER, inactive=_RM_OFF),
        Rule("reward_model.nnodes", SERVER, note=_RM_SERVER, inactive=_RM_OFF),
        *_overlong_rules("reward_model.overlong_buffer"),
        *_overlong_rules("reward_model.reward_kwargs.overlong_buffer_cfg"),
        _m("reward_model.reward_kwargs.max_resp_len", hint=False,
           convert=_max_resp_len("reward_model.reward_kwargs.overlong_buffer_cfg")),
        _u("reward_model.reward_kwargs.**", "write the reward function's arguments under data.reward_kwargs"),
        _n("reward_model.reward_manager", "rewards are scored by data.reward_fn in worker processes "
           "(data.reward_workers); DAPO's overlong penalty is data.overlong_buffer_len",
           neutral=("naive", "dapo")),
        _u("reward_model.reward_manager", "reward managers other than naive / dapo are not supported"),
        _u("reward_model.sandbox_fusion.**", "no sandbox code execution for rewards",
           inactive=_unless("reward_model.sandbox_fusion.url", bool, "")),
        _n("reward_model.launch_reward_fn_async", "rewards are scored in worker processes (data.reward_workers)"),
        _n("reward_model.reward_loop_*", "verl's reward-loop workers; rewards are scored in worker processes here"),
        _n("reward_model.use_reward_loop", "verl's reward-loop workers; rewards are scored in worker processes here"),
        _n("reward_model.num_workers", "verl's reward-loop workers; data.reward_workers here", hint=False),
        _u("reward_model.**", "model-based rewards (a reward model) are not supported", inactive=_RM_OFF),
        _n("reward_manager.**", "rewards are scored by data.reward_fn in worker processes (data.reward_workers)"),
        # ---- algorithm
        _m("algorithm.rollout_correction.loss_type", "algorithm.rollout_correction.loss_type",
           convert=_correction_loss_type),
        _m("algorithm.rollout_correction.*", hint=False),  # verl's keys, pasted as they are
        _m("algorithm.adv_estimator", convert=_adv_estimator, target="algorithm.advantage_estimator"),
        _m("algorithm.norm_adv_by_std_in_grpo", convert=_norm_adv, target="algorithm.norm_adv_by_std"),
        _m("algorithm.gamma", "algorithm.gamma"),
        _m("algorithm.lam", "algorithm.lam"),
        _m("algorithm.gdpo_reward_keys", "algorithm.gdpo_reward_keys"),
        _m("algorithm.gdpo_reward_weights", "algorithm.gdpo_reward_weights"),
        _m("algorithm.use_kl_in_reward", convert=_use_kl_in_reward, target="algorithm.use_kl_in_reward"),
        Rule("algorithm.kl_penalty", MAPPED, target="algorithm.kl_penalty", convert=_kl_penalty_in_reward,
             inactive=_KL_IN_REWARD_OFF),
        *(Rule(f"algorithm.kl_ctrl.{k}", MAPPED, target=f"algorithm.kl_ctrl.{k}", inactive=_KL_IN_REWARD_OFF)
          for k in ("type", "kl_coef", "horizon", "target_kl")),
        _u("algorithm.kl_ctrl.**", "not a key of verl 0.9.1's KLControlConfig", inactive=_KL_IN_REWARD_OFF),
        _u("algorithm.use_pf_ppo", "no preference-feedback PPO reweighting", neutral=(False,)),
        _u("algorithm.pf_ppo.**", "no preference-feedback PPO reweighting",
           inactive=_unless("algorithm.use_pf_ppo", bool, "")),
        # ---- trainer
        _m("trainer.total_training_steps", convert=_steps, target="trainer.steps"),
        _m("trainer.total_epochs", convert=_total_epochs, target="trainer.epochs",
           note="trainer.steps = total_epochs x floor(rows / prompts per draw), counted from data.path when the job "
                "is built, as verl counts its dataloader"),
        _m("trainer.project_name", "trainer.wandb_project"),
        _n("trainer.experiment_name", "the run is named by its directory, trainer.run_dir"),
        _m("trainer.default_local_dir", "trainer.run_dir", note="checkpoints go to trainer.run_dir/checkpoints"),
        _m("trainer.logger", convert=_logger),
        _m("trainer.nnodes", "cluster.nodes", note="what `megatron-rl check` plans; the job runs at the "
           "launcher's world size"),
        _m("trainer.n_gpus_per_node", "cluster.gpus_per_node"),
        _m("trainer.device", convert=_pick_device),
        # ---- validation during training
        _m("data.val_files", "data.val_files", convert=_val_files, note="read as data.path is; ~ expanded as verl does"),
        _m("data.val_max_samples", "data.val_max_samples", convert=_val_max_samples),
        _n("data.val_batch_size", "validation sends as many rows per engine call as a training step generates",
           neutral=(None,)),
        _u("data.validation_shuffle", "validation prompts are taken in file order (data.val_max_samples keeps the "
           "first)", neutral=(False,)),
        _m("trainer.test_freq", "trainer.test_freq", convert=_with_val_set("trainer.test_freq", (-1, 0)),
           note="-1 -> 0 (never)"),
        _m("trainer.val_before_train", "trainer.val_before_train",
           convert=_with_val_set("trainer.val_before_train", ())),
        _u("trainer.validation_data_dir", "validation generations are not written; the val/* metrics are",
           neutral=(None,)),
        _u("trainer.val_only", "no validation-only run: validation runs during training (trainer.test_freq)",
           neutral=(False,)),
        _m("trainer.log_val_generations", "trainer.val_log_samples",
           note="run_dir/val_generations.jsonl, and a W&B table with trainer.wandb"),
        *[_m(f"{_R}.val_kwargs.{k}", f"rollout.val_kwargs.{k}") for k in ("temperature", "top_p", "top_k")],
        _m(f"{_R}.val_kwargs.do_sample", "rollout.val_kwargs.do_sample", convert=_val_do_sample),
        _m(f"{_R}.val_kwargs.n", "rollout.val_kwargs.n", convert=_val_n),
        _m("trainer.save_freq", convert=_save_freq, target="trainer.save_interval",
           note="-1 -> 0 (at the end and on SIGTERM / SIGINT only)"),
        _m("trainer.resume_mode", convert=_resume_mode),
        _u("trainer.resume_from_path", "trainer.resume continues from trainer.run_dir/checkpoints",
           neutral=(None,)),
        _m("trainer.rollout_data_dir", convert=_rollout_dump,
           note="trainer.dump_rollouts writes run_dir/rollouts.jsonl"),
        _n("trainer.balance_batch", "with actor.max_tokens_per_micro_batch the prompt groups of a step are spread "
           "over the DP ranks balancing their tokens"),
        _m("trainer.critic_warmup", "critic.critic_warmup"),
        _n("trainer.esi_redundant_time", "verl's elastic-server checkpoint timing; a SIGTERM checkpoints "
           "(trainer.stop_timeout_s)"),
        _n("trainer.del_local_ckpt_after_load", "verl's checkpoint housekeeping", neutral=(False,)),
        _n("trainer.default_hdfs_dir", "no HDFS upload", neutral=(None,)),
        _u("trainer.max_actor_ckpt_to_keep", "every checkpoint is kept", neutral=(None,)),
        _n("trainer.max_critic_ckpt_to_keep", _NO_CRITIC),
        _n("trainer.ray_wait_register_center_timeout", _RAY),
        _n("trainer.use_legacy_worker_impl", "verl's worker implementation choice"),
        # ---- verl's infrastructure
        _n("global_profiler.**", _PROFILER),
        _n("transfer_queue.**", "verl's data transfer queue between Ray workers"),
        _n("ray_kwargs.**", _RAY),
        _n("ray_init.**", _RAY),
    ]


def _off(*keys: str) -> Callable[[Verl], Optional[str]]:
    """inactive while every one of ``keys`` is false / unset (a feature block verl leaves off by default)."""
    def test(v: Verl) -> Optional[str]:
        on = [k for k in keys if v.get(k)]
        return None if on else f"no effect in verl while {' / '.join(keys)} {'is' if len(keys) == 1 else 'are'} off"
    return test


def _newer_verl_rules() -> List[Rule]:
    """Rows for the keys verl 0.9.1 and main added (their generated defaults list them all)."""
    opt, meg, qat = f"{_A}.optim", f"{_A}.megatron", "Quantization-aware training is not supported"
    return [
        _u(f"{opt}.muon_*", "the optimizer is Adam (no Muon)",
           inactive=_unless(f"{opt}.optimizer", lambda o: str(o).lower() == "muon", "")),
        _u(f"{opt}.use_precision_aware_optimizer", "fp32 main weights and Adam state (no precision-aware "
           "optimizer)", neutral=(False,)),
        _u(f"{opt}.main_grads_dtype", "gradients are accumulated in fp32", neutral=("fp32", "float32")),
        _u(f"{opt}.exp_avg_dtype", "Adam state is fp32", neutral=("fp32", "float32")),
        _u(f"{opt}.exp_avg_sq_dtype", "Adam state is fp32", neutral=("fp32", "float32")),
        _u(f"{opt}.use_layer_wise_distributed_optimizer", "Megatron's distributed optimizer "
           "(actor.use_distributed_optimizer) shards by buckets, not by layers", neutral=(False,)),
        _n(f"{opt}.optimizer_impl", "the module verl's FSDP actor imports its optimizer from; the optimizer is "
           "megatron-core's Adam here", neutral=("torch.optim",)),
        _n(f"{opt}.zero_indexed_step", "how torch's AdamW counts its first step for bias correction; megatron-core's "
           "Adam bias-corrects from step 1 as torch.optim.AdamW does", neutral=(True,)),
        _u(f"{meg}.dynamic_context_parallel", "context parallelism is parallel.context_parallel_size, fixed",
           neutral=(False,)),
        _u(f"{meg}.max_seqlen_per_dp_cp_rank", "context parallelism is parallel.context_parallel_size, fixed",
           neutral=(None,)),
        _n(f"{meg}.dist_ckpt_optim_fully_reshardable", "checkpoints are megatron-core distributed checkpoints"),
        _n(f"{meg}.distrib_optim_fully_reshardable_mem_efficient", "checkpoints are megatron-core distributed "
           "checkpoints"),
        _n(f"{meg}.entropy_from_logits_with_chunking", "a memory option of verl's entropy computation"),
        _n(f"{meg}.entropy_from_logits_chunk_size", "a memory option of verl's entropy computation"),
        _n(f"{_A}.entropy_from_logits_chunk_size", "a memory option of verl's entropy computation"),
        _n(f"{meg}.pad_bshd_to_minibatch_max", "padding of verl's micro-batches (the loss is the same)"),
        _n(f"{meg}.pad_to_length*", "padding of verl's micro-batches (the loss is the same)"),
        _n(f"{_A}.pad_to_length*", "padding of verl's micro-batches (the loss is the same)"),
        _u(f"{meg}.use_megatron_fsdp", "Megatron FSDP is not supported (actor.use_distributed_optimizer shards "
           "the optimizer state)", neutral=(False,)),
        _m(f"{meg}.router_replay.mode", convert=_routing_replay, hint=False),
        _n(f"{meg}.router_replay.*", "routing is replayed in memory (actor.routing_replay), not through files",
           neutral=(None,)),
        _u(f"{meg}.qat.**", qat, inactive=_off(f"{meg}.qat.enable")),
        _u(f"{_A}.qat.**", qat, inactive=_off(f"{_A}.qat.enable")),
        _s(f"{_R}.qat.**", _SGLANG, hint=False),
        _s(f"{_R}.nnodes", "the SGLang servers' nodes are chosen where they start (launch/slurm.sbatch)", hint=False),
        _s(f"{_R}.n_gpus_per_node", "the SGLang servers' GPUs are chosen where they start", hint=False),
        _s(f"{_R}.full_determinism", _SGLANG + " (--enable-deterministic-inference)", hint=False),
        _s(f"{_R}.router_config_path", _SGLANG, hint=False),
        _s(f"{_R}.disaggregation.**", _SGLANG + " (prefill / decode disaggregation)", hint=False),
        _n(f"{_R}.seed", "sampling is seeded from trainer.seed, per step and round", hint=False),
        _n(f"{_R}.moe_load_balance_metrics_interval", "a metric of verl's rollout engine"),
        _u("data.function_tool_path", _MULTI_TURN, neutral=(None,)),
        _u("data.audio_key", "audio data is not supported", neutral=("audios",)),
        _u("data.mm_processor_kwargs.**", "multi-modal data is not supported"),
        _n("data.mm_processor_kwargs", "no multi-modal processor options", neutral=({},)),
        _u("algorithm.filter_groups.max_inflight_gen_batches", "generation rounds run one after the other",
           neutral=(1,), inactive=_FG_OFF),
        # verl 0.9.1 / main keep the reward settings under reward: (custom_reward_function, reward_manager, ...)
        _m("reward.custom_reward_function.path", convert=_reward_fn_at("reward.custom_reward_function"), hint=False,
           note="data.reward_fn: path:name, verl's compute_score signature is recognised"),
        _m("reward.custom_reward_function.name", convert=lambda value, v: {}, hint=False,
           note="part of data.reward_fn (reward.custom_reward_function.path:name)"),
        _u("reward.custom_reward_function.reward_kwargs.**", "write them under data.reward_kwargs"),
        _n("reward.reward_manager.name", "rewards are scored by data.reward_fn in worker processes "
           "(data.reward_workers); DAPO's overlong penalty is data.overlong_buffer_len", neutral=("naive", "dapo")),
        _u("reward.reward_manager.name", "reward managers other than naive / dapo are not supported"),
        _n("reward.reward_manager.source", "verl's reward-manager registry", neutral=("register",)),
        _u("reward.reward_manager.source", "custom reward-manager classes are not supported"),
        _u("reward.reward_manager.module.**", "custom reward-manager classes are not supported",
           inactive=_unless("reward.reward_manager.source", lambda s: s == "importlib", "")),
        _n("reward.num_workers", "verl's reward-loop workers; data.reward_workers here"),
        # verl 0.9.1's reward-loop DAPO manager reads its penalty here (reward_loop/reward_manager/dapo.py)
        *_overlong_rules("reward.reward_kwargs.overlong_buffer_cfg", "reward.reward_manager.name"),
        _m("reward.reward_kwargs.max_resp_len", hint=False,
           convert=_max_resp_len("reward.reward_kwargs.overlong_buffer_cfg", "reward.reward_manager.name")),
        _m("reward.reward_model.enable", convert=_rm_enable, target="reward.model.enable", hint=False),
        _rm_mapped("reward.reward_model.model_path", "reward.model.path", "reward.reward_model.enable"),
        _u("reward.reward_model.rollout.name", "RM servers here are SGLang's (--is-embedding)", neutral=("sglang",),
           inactive=_off("reward.reward_model.enable")),
        Rule("reward.reward_model.rollout.**", SERVER, note=_RM_SERVER, inactive=_off("reward.reward_model.enable")),
        Rule("reward.reward_model.enable_resource_pool", SERVER, note=_RM_SERVER, inactive=_off("reward.reward_model.enable")),
        Rule("reward.reward_model.n_gpus_per_node", SERVER, note=_RM_SERVER, inactive=_off("reward.reward_model.enable")),
        Rule("reward.reward_model.nnodes", SERVER, note=_RM_SERVER, inactive=_off("reward.reward_model.enable")),
        _u("reward.reward_model.**", "model-based rewards are not supported", inactive=_off("reward.reward_model.enable")),
        _u("reward.sandbox_fusion.**", "no sandbox code execution for rewards", inactive=_off("reward.sandbox_fusion.url")),
        _u("sandbox_fusion.**", "no sandbox code execution", inactive=_off("sandbox_fusion.url")),
        _u("reward.**", "a reward setting this project does not have"),
        _u("distillation.enabled", "no on-policy distillation", neutral=(False,)),
        _u("distillation.**", "no on-policy distillation", inactive=_off("distillation.enabled")),
        _n("trainer.use_v1", "which of verl's trainer implementations runs"),
        _n("trainer.v1.trainer_mode", "rollouts come from rollout.mode here (sync: generate, then train)",
           neutral=("sync",)),
        _u("trainer.v1.trainer_mode", "verl's v1 asynchronous modes: rollout.mode async (rollout.max_staleness) "
           "is this project's off-policy generation"),
        _n("trainer.v1.**", "settings of verl's v1 trainer's asynchronous modes",
           inactive=_unless("trainer.v1.trainer_mode", lambda m: m not in (None, "sync"), "")),
        _n("trainer.checkpoint_callback_class", "no checkpoint callbacks", neutral=(None,)),
        _u("skip.*.enable", "no replay of dumped rollouts in training", neutral=(False,)),
        _n("skip.**", "used by verl's rollout skipping only",
           inactive=_off("skip.rollout.enable", "skip.rollout_tq.enable", "skip.async_rollout.enable")),
    ]


VERL_KEYS: List[Rule] = _rules()


def rule_for(key: str) -> Optional[Rule]:
    """The first rule of ``VERL_KEYS`` matching dotted verl ``key`` (None: a key the table does not know)."""
    for rule in VERL_KEYS:
        if rule.matches(key):
            return rule
    return None


def is_verl_config(tree: Any) -> bool:
    """Whether a loaded YAML tree is a verl config (it has verl's ``actor_rollout_ref:`` section)."""
    return isinstance(tree, dict) and "actor_rollout_ref" in tree


#: verl blocks whose direct keys users put in this project's section of that name.
_OUR_SECTION = {f"{_A}.": "actor", f"{_A}.optim.": "actor", f"{_A}.megatron.": "actor", f"{_MODEL}.": "actor",
                f"{_R}.": "rollout", "data.": "data", "trainer.": "trainer", "algorithm.": "algorithm"}


def hint_entries() -> Iterator[Tuple[str, Optional[str], str]]:
    """(hint key, this project's key or None, note) for :mod:`megatron_rl.config.hints`, from the table: the last
    name of every rule with a concrete last name. A mapped rule is keyed by the name alone; one that is not mapped
    by ``<our section>.<name>``, for a key of a verl block users put in that section (it is what the name means
    there only: verl's rollout TP is the server's)."""
    for rule in VERL_KEYS:
        leaf = rule.pattern.rsplit(".", 1)[-1]
        if not rule.hint or any(c in leaf for c in "*?["):
            continue
        if rule.kind == MAPPED:
            if rule.target is not None:
                yield leaf, rule.target, rule.note
            continue
        section = next((s for p, s in _OUR_SECTION.items() if rule.pattern == p + leaf), None)
        if section is not None:
            yield f"{section}.{leaf}", None, rule.reason()
