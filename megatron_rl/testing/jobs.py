"""The table of named jobs the tests build: each row is a list of dotted ``key=value`` overrides (the
``--config`` command line's), optionally on a YAML of ``configs/``, and every test, fixture and forked rank
builds its job from a row by name, adding its own overrides last (they win).

* ``JOBS``: the rows (``NamedJob``), by name;
* ``named_job(name, *overrides, hf=..., run_dir=..., world_size=...)``: the row's ``JobConfig`` (validated for
  ``world_size`` like ``load_job_config``; without it built with no world checks, as the actor tests that fork
  their own ranks need);
* ``job_problems``: the row's config and every problem ``collect_job_config`` finds (``megatron-rl check``'s view);
* ``job_tree``: the row's nested dict; ``write_job`` writes it as the job YAML a launcher reads;
* ``setting(key, value)`` / ``settings(section, **values)`` / ``layout(tp=..., pp=...)`` / ``knobs(tp=...,
  mbs=..., **actor)``: override strings of Python values, of a parallel layout by its short names, and of both
  with actor keys (the actor tests' parametrizations).

Beside the table: ``train_or_error`` is the body of a forked rank that runs the RL loop and reports how it
ended; ``wait_for_steps`` waits until a running job has logged some steps.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

from megatron_rl.testing.actor_reference import CLIP_GRAD, LR, PPO_LOSS, TOKEN_IS, hf_model_section

#: the repository root (``configs/`` lives there)
ROOT = Path(__file__).resolve().parents[2]

#: an override: a ``key=value`` string, or a function returning one when the job is built (a free port)
Override = Union[str, Callable[[], str]]


def setting(key: str, value: Any) -> str:
    """The override ``key=value`` of a Python value (JSON, which the config's YAML reads back as the same value;
    a dict or list replaces the key's whole value)."""
    return f"{key}={json.dumps(value)}"


def settings(section: str, **values: Any) -> list[str]:
    """The overrides ``section.key=value`` of ``values`` (see ``setting``)."""
    return [setting(f"{section}.{k}", v) for k, v in values.items()]


#: ``layout``'s short names -> megatron's ``parallel.*`` keys
_LAYOUT = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
           "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size", "sp": "sequence_parallel",
           "vpp": "virtual_pipeline_model_parallel_size", "cp": "context_parallel_size",
           "first": "num_layers_in_first_pipeline_stage", "last": "num_layers_in_last_pipeline_stage"}


def layout(**short: Any) -> list[str]:
    """The ``parallel.*`` overrides of a layout given by its short names (tp, pp, ep, etp, sp, vpp, cp, first,
    last; None is the key's default)."""
    unknown = sorted(set(short) - set(_LAYOUT))
    if unknown:
        raise TypeError(f"layout: unknown short name(s) {unknown}; known: {sorted(_LAYOUT)}")
    return [setting(f"parallel.{_LAYOUT[k]}", v) for k, v in short.items()]


def knobs(**values: Any) -> list[str]:
    """The overrides of the actor tests' parametrizations: layout short names (see ``layout``), ``mbs``
    (``actor.micro_batch_size``), ``extra`` (``model.extra``, megatron TransformerConfig fields) and any other
    ``actor.*`` key."""
    short = {k: values.pop(k) for k in list(values) if k in _LAYOUT}
    model = settings("model", extra=values.pop("extra")) if "extra" in values else []
    if "mbs" in values:
        values["micro_batch_size"] = values.pop("mbs")
    return layout(**short) + model + settings("actor", **values)


@dataclasses.dataclass(frozen=True)
class NamedJob:
    """One row of the table."""

    #: the name tests build it by
    name: str
    #: what the job is, and who runs it
    doc: str
    #: dotted ``key=value`` overrides (or functions returning one), applied in order
    overrides: tuple[Override, ...] = ()
    #: a YAML under ``configs/`` the overrides apply to (None: every key at its default)
    base: Optional[str] = None
    #: the model section is the HF directory's ``config.json`` (``hf_model_section``, vocabulary unpadded)
    #: rather than the loader's reading of ``actor.load_hf``; needs ``hf``
    hf_model: bool = False


def _rows(*rows: NamedJob) -> dict[str, NamedJob]:
    return {r.name: r for r in rows}


def _free_port() -> str:
    from megatron_rl.rollout.sglang_server import find_free_port

    return f"rollout.sglang_port={find_free_port()}"


#: the model overrides of the MoE actor tests: no load-balancing loss (nothing but the policy loss moves the router)
NO_LOAD_BALANCING = ("model.moe_router_load_balancing_type=none", "model.moe_aux_loss_coeff=0.0")

#: the model of the checkpoint tests' row: sizes alone, random init (4 layers, hidden 64, GQA 4/2, vocabulary 256)
CHECKPOINT_MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=256,
                        ffn_hidden_size=96, untie_embeddings_and_output_weights=True, max_position_embeddings=64)

#: the copy task in the short loop runs: digits 1..1, 3 new tokens, 4 prompts, micro-batch 8, one rank of TP
_COPY_SHORT = ("parallel.tensor_model_parallel_size=1", "rollout.max_new_tokens=3", "data.prompts_per_step=4",
               "data.task=copy", "data.task_kwargs={min_digits: 1, max_digits: 1}", "actor.micro_batch_size=8",
               "trainer.progress=false")

JOBS: dict[str, NamedJob] = _rows(
    NamedJob("actor", "An actor on an HF directory, micro-batch 2: the forward / export / weight-sync tests add a "
             "layout and knobs.", ("actor.micro_batch_size=2",), hf_model=True),
    NamedJob("sglang_actor", "An actor on an HF directory, micro-batch 2, whose rollout engine is an SGLang server "
             "the test serves (it adds ``rollout.sglang_urls``): the weight-sync and server-check tests.",
             ("actor.micro_batch_size=2", "rollout.engine=sglang"), hf_model=True),
    NamedJob("actor_ppo", "The actor reference train step (``actor_reference``): AdamW at LR, gradient clipping "
             "CLIP_GRAD, the PPO-clip loss PPO_LOSS, token-level IS (TOKEN_IS), micro-batch 3.",
             ("actor.micro_batch_size=3", setting("actor.lr", LR), setting("actor.clip_grad", CLIP_GRAD),
              setting("actor.policy_loss", PPO_LOSS), setting("algorithm.rollout_correction", TOKEN_IS)),
             hf_model=True),
    NamedJob("sized_model", "A model given by its sizes alone, no HF directory (2 layers, hidden 32, 4 heads, "
             "vocabulary 64): the schedule and config tests.",
             ("model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.vocab_size=64")),
    NamedJob("async_groups", "An async job's step of 2 prompts x 2 samples (staleness 1, partial rollouts finished): "
             "the tests of drained rollouts resumed from a checkpoint.",
             ("rollout.mode=async", "rollout.max_staleness=1", "rollout.partial_rollout=finish",
              "rollout.n_samples_per_prompt=2", "data.prompts_per_step=2")),
    NamedJob("checkpoint_actor", "An actor from random init of a model given by its sizes (4 layers, hidden 64, "
             "GQA 4/2, vocabulary 256), micro-batch 2, token-level IS: the checkpoint save / resume tests.",
             (setting("model", CHECKPOINT_MODEL),
              "actor.micro_batch_size=2", "actor.lr=1e-3", "actor.clip_grad=1.0", "actor.weight_decay=0.01",
              "algorithm.rollout_correction={rollout_is: token, rollout_is_threshold: 2.0}")),
    NamedJob("copy_loop", "The RL loop on the copy task (digits 1-2, 5 new tokens, 4 prompts x 4 samples, "
             "micro-batch 4, 2 steps, rollouts dumped) with token IS and token-k3 rejection: the loop tests.",
             ("parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
              "rollout.max_new_tokens=5", "rollout.n_samples_per_prompt=4", "data.prompts_per_step=4",
              "data.task=copy", "data.task_kwargs={min_digits: 1, max_digits: 2}",
              "algorithm.rollout_correction={rollout_is: token, rollout_is_threshold: 2.0, rollout_rs: token_k3, "
              "rollout_rs_threshold: 0.5}",
              "actor.lr=1e-3", "actor.micro_batch_size=4", "trainer.steps=2", "trainer.dump_rollouts=true",
              "trainer.progress=false")),
    NamedJob("async_copy", "The async loop on the one-digit copy task (4 prompts x 4 samples, 4 steps, token IS, "
             "rollouts dumped): the async training tests add the staleness and partial-rollout keys.",
             (*_COPY_SHORT, "rollout.n_samples_per_prompt=4",
              "algorithm.rollout_correction={rollout_is: token, rollout_is_threshold: 2.0}", "actor.lr=3e-3",
              "trainer.steps=4", "trainer.dump_rollouts=true")),
    NamedJob("async_drain", "The async loop on the one-digit copy task (4 prompts x 2 samples, staleness 1, 4 steps, "
             "a checkpoint every 2, collectives and phases bounded at 120 s): the drain tests.",
             (*_COPY_SHORT, "rollout.n_samples_per_prompt=2", "trainer.steps=4", "trainer.save_interval=2",
              "rollout.mode=async", "rollout.max_staleness=1", "trainer.collective_timeout_s=120",
              "trainer.phase_timeout_s=120")),
    NamedJob("dynamic_sampling", "The loop with dynamic sampling (``algorithm.filter_groups``) on the copy task "
             "(digits 1-2, 3 new tokens, 4 prompts x 4 samples, fp32 rollouts, 2 steps, rollouts dumped): the test "
             "adds its ``data.reward_fn``.",
             ("parallel.tensor_model_parallel_size=1", "rollout.max_new_tokens=3", "rollout.n_samples_per_prompt=4",
              "rollout.dtype=float32", "data.prompts_per_step=4", "data.task=copy",
              "data.task_kwargs={min_digits: 1, max_digits: 2}", "algorithm.filter_groups.enable=true",
              "actor.lr=1e-3", "actor.micro_batch_size=8", "trainer.steps=2", "trainer.dump_rollouts=true",
              "trainer.progress=false")),
    NamedJob("moe_routing_loop", "``configs/tiny_moe_cpu.yaml`` cut to 2 steps of 4 one-digit prompts on one-rank "
             "layouts (no TP / EP, no checkpoint): the routing-replay loop tests add ``actor.routing_replay``, the "
             "samples per prompt and ``cluster.gpus_per_node``.",
             ("parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false",
              "parallel.expert_model_parallel_size=1", "trainer.steps=2", "trainer.save_interval=0",
              "trainer.progress=false", "data.prompts_per_step=4", "actor.micro_batch_size=8",
              "data.task_kwargs={min_digits: 1, max_digits: 1}",
              # the example's learning recipe (dynamic sampling, 2 mini-batches, a KL reference) is not what these
              # tests measure: one round, one optimizer step, no reference model per step
              "algorithm.filter_groups.enable=false", "actor.ppo_mini_batches=1", "actor.policy_loss.kl_loss_coef=0.0"),
             base="tiny_moe_cpu.yaml"),
    NamedJob("sglang_loop", "A short loop on a real SGLang server the job launches (a tiny task model; 2 steps, 4 "
             "samples per prompt, micro-batch 8, rollouts dumped, a free port): the real-SGLang loop tests.",
             ("rollout.engine=sglang", "rollout.sglang_launch=true", _free_port, "rollout.n_samples_per_prompt=4",
              "trainer.steps=2", "trainer.dump_rollouts=true", "trainer.progress=false", "actor.micro_batch_size=8",
              "actor.lr=1e-3")),
    NamedJob("copy_tp2", "The small 2-rank job (TP2) on the copy task (digits 1-2, 4 prompts x 2 samples of 4 new "
             "tokens, micro-batch 4) that runs until stopped (100000 steps; collectives and phases bounded at "
             "120 s): the launcher tests start it with ``launch/torchrun.sh``.",
             ("parallel.tensor_model_parallel_size=2", "rollout.max_new_tokens=4", "rollout.n_samples_per_prompt=2",
              "data.task=copy", "data.prompts_per_step=4", "data.task_kwargs={min_digits: 1, max_digits: 2}",
              "actor.lr=1.0e-3", "actor.micro_batch_size=4", "trainer.steps=100000", "trainer.progress=false",
              "trainer.collective_timeout_s=120", "trainer.phase_timeout_s=120")),
    NamedJob("tiny_cpu", "``configs/tiny_cpu.yaml`` as shipped, with one generation round per step (no dynamic "
             "sampling: the tests count the rows, rounds and engine calls of a step; those of dynamic sampling "
             "enable it): the ``tiny_job`` fixture's row (it adds the HF directory, the run directory and the "
             "test's overrides).", ("algorithm.filter_groups.enable=false",), base="tiny_cpu.yaml"),
    NamedJob("packing_loop", "``configs/tiny_cpu.yaml`` cut to 2 steps of 4 prompts x 4 samples of up to 8 new "
             "tokens (copy digits 1-6), micro-batch 4, one PPO mini-batch, one generation round, no checkpoint, "
             "rollouts dumped: the tests of the loop with and without a token budget and packing.",
             ("parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
              "rollout.max_new_tokens=8", "rollout.n_samples_per_prompt=4",
              "data.task_kwargs={min_digits: 1, max_digits: 6}", "data.prompts_per_step=4",
              "actor.micro_batch_size=4", "actor.ppo_mini_batches=1", "trainer.steps=2",
              "trainer.dump_rollouts=true", "trainer.progress=false", "trainer.save_interval=0",
              "algorithm.filter_groups.enable=false"),
             base="tiny_cpu.yaml"),
    NamedJob("qwen2.5_7b_1x8", "``configs/qwen2.5_7b_1x8.yaml`` as shipped: the config-check tests.",
             base="qwen2.5_7b_1x8.yaml"),
)


def job_overrides(name: str, *overrides: str, hf: Optional[str] = None,
                  run_dir: Optional[Union[str, os.PathLike]] = None) -> list[str]:
    """Row ``name``'s overrides, then ``actor.load_hf=hf`` (with the row's HF model section) and
    ``trainer.run_dir=run_dir`` where given, then ``overrides``."""
    row = JOBS[name]
    if row.hf_model and hf is None:
        raise ValueError(f"job {name!r}: its model section is an HF directory's; pass hf=")
    out = [setting("model", hf_model_section(str(hf)))] if row.hf_model else []
    out += [o() if callable(o) else o for o in row.overrides]
    if hf is not None:
        out.append(f"actor.load_hf={hf}")
    if run_dir is not None:
        out.append(f"trainer.run_dir={run_dir}")
    return out + list(overrides)


def _base(name: str) -> Optional[str]:
    base = JOBS[name].base
    return None if base is None else str(ROOT / "configs" / base)


def job_tree(name: str, *overrides: str, hf: Optional[str] = None,
             run_dir: Optional[Union[str, os.PathLike]] = None) -> dict:
    """Row ``name`` as the nested dict of a job YAML (see ``job_overrides``)."""
    from megatron_rl.config.load import apply_overrides, read_config_file

    return apply_overrides(read_config_file(_base(name)), job_overrides(name, *overrides, hf=hf, run_dir=run_dir))


def named_job(name: str, *overrides: str, hf: Optional[str] = None, run_dir: Optional[Union[str, os.PathLike]] = None,
        world_size: Optional[int] = None):
    """The ``JobConfig`` of row ``name`` (see ``job_overrides``): validated for ``world_size`` as
    ``load_job_config`` does; None: built without the world checks (``job_config_from_dict``)."""
    from megatron_rl.config import job_config_from_dict
    from megatron_rl.plan import load_job_config

    if world_size is None:
        return job_config_from_dict(job_tree(name, *overrides, hf=hf, run_dir=run_dir))
    return load_job_config(_base(name), job_overrides(name, *overrides, hf=hf, run_dir=run_dir),
                           world_size=world_size)


def job_problems(name: str, *overrides: str, hf: Optional[str] = None,
                 world_size: Union[int, str, None] = "cluster"):
    """(config, every problem) of row ``name`` as ``collect_job_config`` finds them (default world: the
    ``cluster:`` section's)."""
    from megatron_rl.plan import collect_job_config

    return collect_job_config(_base(name), job_overrides(name, *overrides, hf=hf), world_size=world_size)


def write_job(path: Union[str, os.PathLike], name: str, *overrides: str, hf: Optional[str] = None,
              run_dir: Optional[Union[str, os.PathLike]] = None) -> Path:
    """Write row ``name`` (``job_tree``) as the job YAML a launcher's ``--config`` reads to ``path``; returns it."""
    import yaml

    path = Path(path)
    path.write_text(yaml.safe_dump(job_tree(name, *overrides, hf=hf, run_dir=run_dir), sort_keys=False))
    return path


def train_or_error(cfg) -> Optional[str]:
    """Run ``trainer.loop.train(cfg)`` on this rank: None when it completes, else ``"ExcType: message"`` (the
    tests check every rank's error)."""
    from megatron_rl.trainer.loop import train

    try:
        train(cfg)
    except Exception as exc:  # noqa: BLE001 - the test checks every rank's error
        return f"{type(exc).__name__}: {exc}"
    return None


def wait_for_steps(proc: subprocess.Popen, metrics: Path, steps: int, timeout: float, poll: float) -> None:
    """Poll until ``metrics`` (a run's metrics.jsonl) holds ``steps`` records; ``AssertionError`` with the tail
    of the job's output if ``proc`` exits first, or when ``timeout`` s pass."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        time.sleep(poll)
    raise AssertionError(f"the job did not log {steps} steps in {timeout} s")
