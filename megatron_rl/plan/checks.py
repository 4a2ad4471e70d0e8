"""The checks of a job's keys that build no object of their own, each returning its problems (dotted key first).

``JobPlan.collect`` runs them between the builders of the plan's objects, in the order the problems are listed.
Rule: a check reads config sections and plain values, never the whole job config, except where it compares keys
of several sections (named ``*_of_job``).
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
from typing import List, Optional

from megatron_rl.envs.base import env_import_error
from megatron_rl.errors import Unbuilt
from megatron_rl.models.builder import EXTRA_OWNED, EXTRA_SHAPES, transformer_config_fields
from megatron_rl.models.config import ModelConfig, ModelConfigError
from megatron_rl.parallel.config import ParallelConfig, ParallelConfigError
from megatron_rl.parallel.dims import ParallelDims, data_parallel_size
from megatron_rl.rollout.factory import ENGINE_KINDS, engine_class
from megatron_rl.rollout.sglang_lora_flags import adapter_lora, sglang_lora_targets

__all__ = ["TASKS", "ADV", "DTYPES", "DEVICES", "Unbuilt", "build_dims", "cluster_errors", "rollout_errors",
           "data_errors", "actor_size_errors", "trainer_errors", "rollout_mode_errors", "staleness_errors",
           "ENGINES", "lora_target_errors", "validation_errors_of_job", "multi_turn_errors_of_job", "dp_errors",
           "model_extra_errors"]

TASKS = ("copy", "reverse", "sort", "add", "lookup", "file")
ADV = ("grpo", "rloo")
DTYPES = ("bfloat16", "float16", "float32")
DEVICES = ("cuda", "cpu")

_PARALLEL_KEYS = [f.name for f in dataclasses.fields(ParallelConfig) if f.init]
_MODEL_KEYS = [f.name for f in dataclasses.fields(ModelConfig) if f.init]


#: Every ``rollout.engine`` value's class (``WeightSyncSettings.checked`` asks them which modes they take).
ENGINES = {kind: engine_class(kind) for kind in ENGINE_KINDS}


def _dotted(violation: str) -> str:
    """A layout / shape violation with its keys dotted (``parallel.tensor_model_parallel_size``,
    ``model.num_layers``), prefixed by the key to change: the first parallel key it names, else the first
    model key, else ``world size``."""
    def sub(m):
        name = m.group(0)
        if name in _PARALLEL_KEYS:
            return f"parallel.{name}"
        return f"model.{name}" if name in _MODEL_KEYS else name

    text = re.sub(r"(?<![\w.])[a-z_]+(?![\w.])", sub, violation)
    keys = re.findall(r"\b(?:parallel|model)\.[a-z_]+", text)
    if violation.startswith("world_size="):
        return "world size: " + re.sub(r"^world_size=(\d+) is", r"\1 ranks are", text)
    par = [k for k in keys if k.startswith("parallel.")]
    return f"{(par or keys or ['parallel'])[0]}: {text}"


def build_dims(parallel, model, world_size: int) -> ParallelDims:
    """The layout (``ParallelDims``) of ``parallel`` at ``world_size`` ranks for ``model``; ``Unbuilt`` with the
    model shape's and the layout's violations, each naming its dotted key. The expert layout (world = ETP x EP x
    PP x expert-DP) is only checked for MoE models."""
    errs: List[str] = []
    if model is not None:
        try:
            model.validate()
        except ModelConfigError as exc:
            errs += [_dotted(v) for v in str(exc).split("\n  - ")[1:]]
    dims = None
    try:
        dims = ParallelDims.build(parallel, world_size, model)
    except ParallelConfigError as exc:
        moe = model is not None and model.is_moe
        errs += [_dotted(v) for v in exc.violations if moe or "expert layout" not in v]
    except ValueError as exc:
        errs.append(f"parallel: {exc}")
    if errs or dims is None:
        raise Unbuilt(errs)
    return dims


def cluster_errors(c) -> List[str]:
    """The ``cluster:`` section."""
    errs: List[str] = []
    if c.device not in DEVICES:
        errs.append(f"cluster.device: {c.device!r} is not one of {', '.join(DEVICES)}")
    for k in ("nodes", "gpus_per_node"):
        if getattr(c, k) < 1:
            errs.append(f"cluster.{k}: must be >= 1, got {getattr(c, k)}")
    if c.gpu_memory_gb is not None and not c.gpu_memory_gb > 0:
        errs.append(f"cluster.gpu_memory_gb: must be > 0 (or null), got {c.gpu_memory_gb}")
    return errs


def rollout_errors(r, advantage_estimator: str) -> List[str]:
    """The sampling keys of the ``rollout:`` section and what its engine needs (SGLang: a server)."""
    errs: List[str] = []
    if r.engine not in ENGINE_KINDS:
        errs.append(f"rollout.engine: {r.engine!r} is not one of {', '.join(ENGINE_KINDS)}")
    if not r.temperature > 0:
        errs.append(f"rollout.temperature: must be > 0, got {r.temperature}")
    if not 0 < r.top_p <= 1:
        errs.append(f"rollout.top_p: must be in (0, 1], got {r.top_p}")
    if r.max_new_tokens < 1:
        errs.append(f"rollout.max_new_tokens: must be >= 1, got {r.max_new_tokens}")
    if r.n_samples_per_prompt < 1:
        errs.append(f"rollout.n_samples_per_prompt: must be >= 1, got {r.n_samples_per_prompt}")
    if r.dtype not in DTYPES:
        errs.append(f"rollout.dtype: {r.dtype!r} is not one of {', '.join(DTYPES)}")
    if r.engine in ENGINE_KINDS:
        errs += engine_class(r.engine).config_errors(r)
    return errs


def data_errors(d, advantage_estimator: str) -> List[str]:
    """The ``data:`` section (its own ``DataConfig.errors`` too); the estimator's checks: ``plan/advantage.py``."""
    errs: List[str] = []
    if d.task not in TASKS and not (isinstance(d.task, str) and ":" in d.task):
        errs.append(f"data.task: {d.task!r} is not one of {', '.join(TASKS)} or 'module:factory' (your own task: "
                    f"docs/extending.md)")
    if d.task == "file":
        if not d.path:
            errs.append("data.path: required when data.task is 'file'")
        elif not os.path.isfile(d.path):
            errs.append(f"data.path: {d.path!r} does not exist")
    errs += d.errors()  # reward, prompt-length and overlong settings (DataConfig.errors)
    if d.prompts_per_step < 1:
        errs.append(f"data.prompts_per_step: must be >= 1, got {d.prompts_per_step}")
    return errs


def actor_size_errors(ac) -> List[str]:
    """``actor.clip_grad`` and the PPO sizes."""
    errs: List[str] = []
    if ac.clip_grad < 0:
        errs.append(f"actor.clip_grad: must be >= 0, got {ac.clip_grad}")
    for k in ("micro_batch_size", "ppo_mini_batches", "ppo_epochs"):
        if getattr(ac, k) < 1:
            errs.append(f"actor.{k}: must be >= 1, got {getattr(ac, k)}")
    return errs


def trainer_errors(t, max_reward_failure_frac: float) -> List[str]:
    """Resume / overwrite, the step counts and intervals of the ``trainer:`` section, and
    ``data.max_reward_failure_frac``."""
    errs: List[str] = []
    if isinstance(t.resume, str) and t.resume != "required":
        errs.append(f"trainer.resume: expected true, false or 'required', got {t.resume!r}")
    if t.resume and t.overwrite:
        errs.append("trainer.overwrite: true together with trainer.resume (--resume): choose one (resume continues "
                    "the run in trainer.run_dir, overwrite removes it)")
    if not 0 <= max_reward_failure_frac <= 1:
        errs.append(f"data.max_reward_failure_frac: must be in [0, 1] (1: never), got {max_reward_failure_frac}")
    if t.steps < 1:
        errs.append(f"trainer.steps: must be >= 1, got {t.steps}")
    if t.save_interval < 0:
        errs.append(f"trainer.save_interval: must be >= 0, got {t.save_interval}")
    if t.console_table_interval < 0:
        errs.append(f"trainer.console_table_interval: must be >= 0 (0: no table), got {t.console_table_interval}")
    return errs


def rollout_mode_errors(r) -> List[str]:
    """``rollout.mode``."""
    if r.mode not in ("sync", "async"):
        return [f"rollout.mode: {r.mode!r} is not one of sync, async"]
    return []


def staleness_errors(r, t) -> List[str]:
    """Async staleness, partial rollouts and the ``trainer.*_timeout_s`` keys."""
    errs: List[str] = []
    if r.max_staleness < 0:
        errs.append(f"rollout.max_staleness: must be >= 0, got {r.max_staleness}")
    if r.partial_rollout not in ("finish", "interrupt"):
        errs.append(f"rollout.partial_rollout: {r.partial_rollout!r} is not one of finish, interrupt")
    if r.partial_rollout == "interrupt" and r.segment_tokens < 1:
        errs.append(f"rollout.segment_tokens: partial_rollout 'interrupt' needs segment_tokens >= 1, "
                    f"got {r.segment_tokens}")
    if r.segment_tokens < 0:
        errs.append(f"rollout.segment_tokens: must be >= 0, got {r.segment_tokens}")
    if not t.collective_timeout_s > 0:
        errs.append(f"trainer.collective_timeout_s: must be > 0, got {t.collective_timeout_s}")
    for key in ("phase_timeout_s", "checkpoint_timeout_s", "stop_timeout_s"):
        if not getattr(t, key) >= 0:
            errs.append(f"trainer.{key}: must be >= 0 (0: no limit), got {getattr(t, key)}")
    return errs


def lora_target_errors(r, lora) -> List[str]:
    """``actor.lora.target_modules`` against the SGLang servers' LoRA modules when the job syncs its adapters alone
    to them (``WeightSyncSettings.checked`` reports it when ``rollout.lora_sync`` has no other problem)."""
    if adapter_lora(lora, r) is not None:
        try:
            sglang_lora_targets(lora)  # the servers' --lora-target-modules
        except ValueError as exc:
            return [str(exc)]
    return []


def validation_errors_of_job(cfg, world_size: int) -> List[str]:
    """The validation keys (``trainer.test_freq``, ``trainer.val_timeout_s``, ``rollout.val_kwargs``) and what
    validation during training runs with (DataConfig.errors checks the validation set itself). With several ranks
    the others wait for rank 0's validation in one collective: a ``val_timeout_s`` above
    ``trainer.collective_timeout_s`` would end them with a collective timeout that names neither."""
    t, d = cfg.trainer, cfg.data
    errs = cfg.rollout.val_kwargs.errors() if cfg.rollout.val_kwargs is not None else []
    if t.test_freq < 0:
        errs.append(f"trainer.test_freq: must be >= 0 (0: never; verl's -1 is 0 here), got {t.test_freq}")
    if not t.val_timeout_s >= 0:
        errs.append(f"trainer.val_timeout_s: must be >= 0 (0: no limit), got {t.val_timeout_s}")
    if t.val_log_samples < 0:
        errs.append(f"trainer.val_log_samples: must be >= 0 (0: none), got {t.val_log_samples}")
    has_set = bool(d.val_paths) or d.val_heldout
    if t.test_freq > 0 and not has_set:
        errs.append(f"trainer.test_freq: {t.test_freq} but there is no validation set: give data.val_files or "
                    f"data.val_heldout: true (with data.task_kwargs.heldout_frac), or set test_freq: 0")
    if has_set and (t.test_freq > 0 or t.val_before_train):
        if world_size > 1 and t.val_timeout_s > t.collective_timeout_s > 0:
            errs.append(f"trainer.val_timeout_s: {t.val_timeout_s} exceeds trainer.collective_timeout_s "
                        f"{t.collective_timeout_s}: ranks other than 0 wait for the validation in one collective, "
                        f"which would time out first; raise collective_timeout_s or lower val_timeout_s")
        # the key that turns validation on: test_freq, else val_before_train (true by default, as in verl)
        key = "trainer.test_freq" if t.test_freq > 0 else "trainer.val_before_train"
        if cfg.rollout.mode != "sync":
            errs.append(f"{key}: validation during training runs with rollout.mode 'sync' only (the "
                        "async producer owns the engine); set test_freq: 0 and val_before_train: false, or "
                        "rollout.mode: sync")
        if cfg.multi_turn.env is not None:
            errs.append(f"{key}: validation during training evaluates single-turn prompts; with "
                        "multi_turn.env set, set test_freq: 0 and val_before_train: false")
    return errs


def multi_turn_errors_of_job(cfg) -> List[str]:
    """The ``multi_turn`` section; its environment class is imported here (a bad ``module:Class`` fails in
    ``megatron-rl check`` and before any process group)."""
    m, errs = cfg.multi_turn, []
    env_error = env_import_error(m.env)
    if env_error:
        errs.append(f"multi_turn.env: {m.env!r}: " + env_error.removeprefix(f"multi_turn.env={m.env!r}: "))
    if m.max_turns < 1:
        errs.append(f"multi_turn.max_turns: must be >= 1, got {m.max_turns}")
    for key in ("max_total_tokens", "max_tokens_per_turn"):
        if getattr(m, key) < 0:
            errs.append(f"multi_turn.{key}: must be >= 0 (0: from rollout.max_new_tokens), got {getattr(m, key)}")
    if not m.env_step_timeout_s > 0:
        errs.append(f"multi_turn.env_step_timeout_s: must be > 0, got {m.env_step_timeout_s}")
    if m.env_workers < 0:
        errs.append(f"multi_turn.env_workers: must be >= 0 (0: in the trainer's process), got {m.env_workers}")
    if m.env is not None and cfg.data.overlong_buffer_len > 0:
        errs.append("data.overlong_buffer_len: DAPO's overlong penalty applies to single-turn responses; multi-turn "
                    "trajectories end at multi_turn.max_total_tokens (finish max_tokens): set it to 0")
    if m.env is not None and cfg.data.reward_fn is not None:
        errs.append("data.reward_fn: multi-turn rewards come from the environment (multi_turn.env), not a reward "
                    "function: leave data.reward_fn unset")
    if "{observation}" not in m.observation_template:
        errs.append(f"multi_turn.observation_template: must contain {{observation}}, got {m.observation_template!r}")
    return errs


def dp_errors(parallel, prompts_per_step: int, ppo_mini_batches: int, world_size: int) -> List[str]:
    """Batch sizes that the data-parallel size at ``world_size`` must divide."""
    errs: List[str] = []
    dp = data_parallel_size(parallel, world_size)  # None: the layout errors name the world size
    if dp is not None:
        tp_pp_cp = world_size // dp
        if prompts_per_step % dp:
            errs.append(f"data.prompts_per_step: {prompts_per_step} is not divisible by the data-parallel "
                        f"size {dp} (world {world_size} / TP x PP x CP {tp_pp_cp}); each DP rank takes whole groups")
        if ppo_mini_batches > 0 and (prompts_per_step // max(dp, 1)) % ppo_mini_batches:
            errs.append(f"actor.ppo_mini_batches: {ppo_mini_batches} does not divide the "
                        f"{prompts_per_step // max(dp, 1)} prompts per DP rank")
    return errs


def model_extra_errors(model: Optional[ModelConfig]) -> List[str]:
    """``model.extra`` keys that are not megatron-core TransformerConfig fields, or that a project key sets."""
    if model is None or not model.extra:
        return []
    errs: List[str] = []
    fields = transformer_config_fields()
    for key in model.extra:
        if key in EXTRA_OWNED:
            errs.append(f"model.extra.{key}: set from {EXTRA_OWNED[key]}; use that key instead")
        elif key in EXTRA_SHAPES:
            errs.append(f"model.extra.{key}: a tensor shape, set from model.{key} (what check plans and the "
                        f"checkpoint loader reads); use that key instead")
        elif key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=1)
            errs.append(f"model.extra.{key}: not a megatron-core TransformerConfig field"
                        + (f" (did you mean {close[0]!r}?)" if close else ""))
    return errs


def lora_adapter_expert_errors(cfg) -> List[str]:
    """Adapter-only sync of expert adapters: the embedded engine's transformers model fuses a MoE layer's experts
    (no per-expert linear to apply an adapter to) -- refused, naming the keys, before anything runs."""
    lora, model = cfg.actor.lora, cfg.model
    if not (lora.enabled and getattr(cfg.rollout, "lora_sync", "merged") == "adapter" and model is not None
            and model.num_moe_experts):
        return []
    experts = [entry for entry, name in lora.mcore_targets() if name in ("linear_fc1", "linear_fc2")]
    if not experts:
        return []
    return [f"rollout.lora_sync: 'adapter' with actor.lora.target_modules {sorted(set(experts))} on a MoE model: "
            f"the engine keeps the experts fused and cannot apply per-expert adapters; use rollout.lora_sync: merged "
            f"(or leave the MLP out of the targets)"]
