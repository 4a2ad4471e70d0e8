"""``megatron-rl check``: validate a job config on the cluster it is written for and print the per-rank memory plan.

    megatron-rl check configs/qwen2.5_7b_1x8.yaml                  # plans the file's cluster: section
    megatron-rl check configs/deepseek_v3_scale_64x8.yaml --nodes 32 --recompute full \\
        rollout.max_new_tokens=8192

The config is loaded as the trainer loads it, at the world size of its ``cluster:`` section (``--nodes`` /
``--gpus-per-node`` / ``--gpu-memory-gb`` / ``--device`` override it); every problem is listed at once, each
naming its dotted key. Rule: the memory and weight-sync plans are computed from the job plan's own objects
(``plan.job.plan_parts``, built once here and handed down), whenever the model shapes are known, even if other
keys are wrong. What it checks and prints, and its exit status (2: a problem; 3 with ``--strict``: the plan does
not fit): docs/check.md.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Tuple

from megatron_rl.cli.build_hint import build_command
from megatron_rl.config import ConfigError
from megatron_rl.plan import collect_job_config
from megatron_rl.config.epochs import epochs_line
from megatron_rl.config.load import VERL_FILE_MESSAGE
from megatron_rl.config.sections import DEFAULT_GPU_MEMORY_GB
from megatron_rl.config.timeouts import rollout_waits_line
from megatron_rl.models.attention import expected_te
from megatron_rl.ops.memory import (GiB, MemoryOptions, format_checkpoint_host, format_plan, longest_row, memory_plan,
                                    token_budget_error)
from megatron_rl.ops.run_profile import run_profile
from megatron_rl.plan import JobPlan, world_errors
from megatron_rl.plan.job import plan_parts
from megatron_rl.plan.sizing import job_sync_plan, memory_job
from megatron_rl.platform.warnings import install_known_message_filter
from megatron_rl.tasks.datasets import scorable_rows
from megatron_rl.tasks.val_set import val_file_problems
from megatron_rl.tasks.custom import task_import_error
from megatron_rl.tasks import build_task as build_task_for
from megatron_rl.tasks.judge_check import judge_check
from megatron_rl.tasks.reward_fn import reward_import_error
from megatron_rl.tasks.rm_check import check_reward_model, first_prompt
from megatron_rl.tokenizer import load_tokenizer


DEFAULT_PROMPT_LENGTH = 1024


def nodes_that_fit(cfg, gpus_per_node: int, limit: int = 4096) -> Optional[int]:
    """The smallest node count whose world size (x ``gpus_per_node``) fits the config's layout and batch."""
    for n in range(1, limit + 1):
        if not world_errors(cfg, n * gpus_per_node):
            return n
    return None


def data_problems(cfg, problems: List[str]) -> List[str]:
    """The data files read as the trainer reads them: a ``data.task: file`` file, or a ``data.val_files`` file,
    with no usable row is a problem (unless its key was already reported)."""
    d = cfg.data
    out = [] if any(p.startswith("data.val_files") for p in problems) else val_file_problems(d)
    if d.task != "file" or not d.path or any(p.startswith("data.path") for p in problems):
        return out
    try:
        scorable_rows(d.path, d)
    except ValueError as exc:
        return [f"data.path: {exc}"] + out
    return out


def _flag_overrides(args: argparse.Namespace) -> List[str]:
    out = []
    for flag, key in (("nodes", "nodes"), ("gpus_per_node", "gpus_per_node"), ("gpu_memory_gb", "gpu_memory_gb"),
                      ("device", "device")):
        if getattr(args, flag) is not None:
            out.append(f"cluster.{key}={getattr(args, flag)}")
    return out


#: the sections the objective line is read from: a problem in one leaves it at its defaults in the config read
_OBJECTIVE_SECTIONS = ("algorithm.rollout_correction", "actor.policy_loss")


def _blocks_plan(problem: str) -> bool:
    """Problems after which the plan's numbers would be wrong (shapes or layout)."""
    return problem.startswith(("world size", "parallel.", "model.", "model:", "actor.micro_batch_size",
                               "actor.max_tokens_per_micro_batch",
                               "rollout.max_new_tokens", "data.prompts_per_step", "rollout.n_samples_per_prompt",
                               "actor.ppo_mini_batches"))


def _run(args: argparse.Namespace) -> int:
    install_known_message_filter()  # megatron's known CPU notices: once, with why

    for name in ("nodes", "gpus_per_node"):
        v = getattr(args, name)
        if v is not None and v < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1, got {v}", file=sys.stderr)
            return 2
    try:
        cfg, problems = collect_job_config(args.config, list(args.overrides) + _flag_overrides(args),
                                           world_size="cluster", has_te=args.transformer_engine)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if VERL_FILE_MESSAGE in problems:
        print(f"error: {args.config}: {VERL_FILE_MESSAGE.replace('FILE', args.config)}", file=sys.stderr)
        return 2
    problems += data_problems(cfg, problems)
    reward_error = reward_import_error(cfg.data.reward_fn)  # e.g. the math reward without math-verify
    if reward_error and not any(p.startswith("data.reward_fn") for p in problems):
        problems.append(reward_error)
    task_error = task_import_error(cfg.data.task, cfg.data.task_kwargs)          # your own task (module:factory) that does not import
    if task_error and not any(p.startswith("data.task") for p in problems):
        problems.append(task_error)
    judge_lines = _judge_lines(cfg, problems)  # reward.judge: the template on one row, one request to the endpoint
    if cfg.reward.model.enable and not any(p.startswith("reward.") for p in problems):  # the RM, one row, servers
        rm_problems, rm_lines = check_reward_model(cfg.reward.model, first_prompt(cfg.data, cfg.actor.load_hf))
        problems += rm_problems
        judge_lines += rm_lines
    c = cfg.cluster
    world = c.world_size
    where = (f"{args.config} at world size {world} ({c.nodes} node(s) x {c.gpus_per_node} "
             f"{'GPU' if c.device == 'cuda' else 'CPU rank'}(s))")
    prof = prompt = prompt_src = None
    parts = plan_parts(cfg, world, has_te=args.transformer_engine)  # the plan's objects check sizes the job with
    sized = parts.dims is not None and parts.budget is not None and parts.batcher is not None
    if cfg.model is not None and not any(_blocks_plan(p) for p in problems):  # the longest row needs the layout
        prof, prompt, prompt_src = _prompt(args, cfg, parts)
        budget_problem = (token_budget_error(parts.batcher, longest_row(parts.dims, parts.budget, prompt), prompt_src)
                          if sized else None)
        if budget_problem is not None:
            problems.append(budget_problem)
    if problems:
        print(f"error: {where}: {len(problems)} problem(s):", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        layout = sorted({q.split(":", 1)[0] for q in problems if q.startswith("parallel.")})
        if world_errors(cfg, world) and layout:   # a node count cannot fix a size the model's shapes refuse
            print(f"hint: fix {', '.join(layout)} first (the problems above that no node count fixes); then "
                  f"`megatron-rl check` suggests a node count", file=sys.stderr)
        elif world_errors(cfg, world):
            n = nodes_that_fit(cfg, c.gpus_per_node)
            if n is not None:
                print(f"hint: --nodes {n} (world size {n * c.gpus_per_node}) fits this layout", file=sys.stderr)
            else:
                print(f"hint: no node count of {c.gpus_per_node} rank(s) fits this layout; change the "
                      f"parallel sizes or --gpus-per-node", file=sys.stderr)
    for line in judge_lines:
        print(line)
    ok_line = None if problems else f"config OK: {where}"  # printed once the plan's fit verdict is known
    job_plan = JobPlan.collect(cfg, world, has_te=args.transformer_engine)[0] if not problems else None
    for line in job_plan.describe() if job_plan is not None else ():  # what the trainer prints at start
        print(line)
    corr = cfg.algorithm.rollout_correction
    refused = any(p.startswith(_OBJECTIVE_SECTIONS) for p in problems)  # read at its defaults: not the job's
    if corr is not None and job_plan is None and not refused:  # the plan's lines hold it
        print(corr.objective.summary(corr.bypass_mode, cfg.actor.policy_loss))  # the row the section looked up
    if cfg.trainer.epochs is not None and not any(q.startswith("trainer.epochs") for q in problems):
        print(epochs_line(cfg))
    waits = rollout_waits_line(cfg)
    if waits is not None and world > 1:
        print(waits)
    build = build_command(args.config, cfg)
    if build is not None and any(p.startswith("actor.load_hf:") for p in problems):
        print(f"hint: build actor.load_hf first: {build}", file=sys.stderr)
    if cfg.model is None:
        if ok_line:
            print(ok_line)
        print("memory plan: skipped (no model shapes: give a model: section, or an actor.load_hf directory with "
              "a config.json)", file=sys.stderr)
        return 2
    blocking = [p for p in problems if _blocks_plan(p)]
    if blocking:
        if ok_line:
            print(ok_line)
        print("memory plan: skipped until the layout / batch problems above are fixed", file=sys.stderr)
        return 2
    job_recompute = parts.recompute  # what the trainer will do (actor.recompute_*; None: refused, planned as none)
    job_mode = job_recompute.plan_mode if job_recompute is not None else "none"
    recompute = args.recompute or job_mode
    same = recompute == job_mode == "full"
    params_bytes = args.params_bytes if args.params_bytes is not None else prof.params_bytes
    dist_opt = args.distributed_optimizer if args.distributed_optimizer is not None else prof.distributed_optimizer
    te_source = expected_te(c.device, args.transformer_engine)[1]
    precision, backend = parts.precision, parts.attention
    opts = MemoryOptions(prompt_length=prompt, params_bytes=params_bytes, grad_bytes=args.grad_bytes,
                         fp32_output_layer=precision.fp32_output_layer and params_bytes < 4,
                         distributed_optimizer=dist_opt, recompute=recompute, fused_logprobs=args.fused_logprobs,
                         recompute_method=job_recompute.method if same else "uniform",
                         recompute_num_layers=job_recompute.num_layers if same else 1,
                         attention=backend.name,
                         reference_offload=bool(cfg.actor.ref_param_offload),
                         optimizer_offload_fraction=(cfg.actor.optimizer_offload_fraction
                                                     if cfg.actor.optimizer_cpu_offload else 0.0))
    try:
        plan = memory_plan(memory_job(cfg, world, parts), opts)
    except ValueError as exc:  # PlanError too: a sizing object that did not build
        if ok_line:
            print(ok_line)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    params_src = "--params-bytes" if args.params_bytes is not None else f"the actor builds {_dtype(params_bytes)}"
    opt_src = "flag" if args.distributed_optimizer is not None else "the actor's optimizer"
    print(f"runs: device {c.device}; params {params_bytes} B ({params_src}); Adam state "
          f"{'sharded over DP' if dist_opt else 'on every DP rank'} ({opt_src}); prompt {prompt} tokens ({prompt_src})")
    print(f"attention: {backend.name}: {backend.description}; Transformer Engine: {te_source}")
    gpu_gb, gpu_src = gpu_memory(c)
    print(format_plan(plan, gpu_gb, device=c.device))
    sync = job_sync_plan(cfg, plan.total_params, world, parts)  # None: rollout.weight_sync* refused (named above)
    if sync is not None:
        print(sync.line())
    ckpt_line = format_checkpoint_host(plan, min(c.gpus_per_node, world))
    if ckpt_line:
        print(ckpt_line)
    peak = plan.peak().total(opts.recompute, opts.fused_logprobs)
    fits = gpu_gb is None or peak <= gpu_gb * GiB
    if gpu_src:
        print(gpu_src)
    if ok_line and fits:
        print(ok_line)
    elif ok_line:
        print(f"config valid but does NOT FIT: {where}: stage {plan.peak().stage} plans {peak / GiB:.2f} GiB per GPU "
              f"> {gpu_gb:g} GiB{' (the default)' if gpu_src else ''}" + ("" if args.strict else
                                                                          "; --strict exits 3 on this"))
    if problems:
        return 2
    if args.strict and not fits:
        return 3
    return 0


def gpu_memory(cluster) -> Tuple[Optional[float], Optional[str]]:
    """(GiB per GPU the plan is checked against, the line saying it is the default or None): ``cluster.gpu_memory_gb``
    (``--gpu-memory-gb``); else ``DEFAULT_GPU_MEMORY_GB`` for a CUDA job; a CPU job without it gets no verdict."""
    if cluster.gpu_memory_gb is not None:
        return cluster.gpu_memory_gb, None
    if cluster.device != "cuda":
        return None, ("fit: not checked (cluster.device cpu: the plan is host memory per rank; set "
                      "cluster.gpu_memory_gb to check it against a limit)")
    return DEFAULT_GPU_MEMORY_GB, (f"fit: checked against {DEFAULT_GPU_MEMORY_GB:g} GiB per GPU, the default: "
                                   f"cluster.gpu_memory_gb is not set (set it, or --gpu-memory-gb)")


def _prompt(args: argparse.Namespace, cfg, parts):
    """(run profile, prompt tokens the plan assumes, where they come from): ``--prompt-length``, else the
    task's longest prompt, else the default (``parts``: the plan's ``PlanParts``)."""
    prof = run_profile(parts.precision, cfg.actor, cfg.data, cfg.cluster.device)
    prompt = args.prompt_length if args.prompt_length is not None else prof.prompt_length
    prompt_src = "--prompt-length" if args.prompt_length is not None else prof.prompt_source
    if prompt is None:
        prompt, prompt_src = DEFAULT_PROMPT_LENGTH, f"default {DEFAULT_PROMPT_LENGTH}: {prof.prompt_source}; " \
                                                    f"pass --prompt-length"
    return prof, prompt, prompt_src


def _dtype(nbytes: int) -> str:
    return {4: "fp32", 2: "bf16"}.get(nbytes, f"{nbytes}-byte")


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: cluster.nodes of the config)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs (ranks) per node (default: cluster.gpus_per_node of the config)")
    p.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="GPU memory in GiB; warn when the plan exceeds it (default: cluster.gpu_memory_gb)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cluster.device of the config")
    p.add_argument("--prompt-length", type=int, default=None,
                   help="prompt tokens per sequence; sequence = this + rollout.max_new_tokens (default: the "
                        "longest prompt of the config's task / data file)")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default=None,
                   help="megatron's activation recomputation assumed for the total: none, selective (core "
                        "attention recomputed), full (uniform, one layer per group unless the job says otherwise). Default: "
                        "actor.recompute_granularity, else none")
    p.add_argument("--transformer-engine", action=argparse.BooleanOptionalAction, default=None,
                   help="plan (and validate) with / without Transformer Engine on the cluster; default: detected "
                        "on a CUDA machine, assumed installed when planning a CUDA job from a machine without CUDA")
    p.add_argument("--params-bytes", type=int, choices=(2, 4), default=None,
                   help="bytes per parameter (default: what the actor builds, 4 = fp32 today; 2 plans bf16)")
    p.add_argument("--grad-bytes", type=int, choices=(2, 4), default=4,
                   help="bytes per gradient element (4 = fp32 main grads, megatron's default)")
    p.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction, default=None,
                   help="plan the Adam state sharded over DP (--distributed-optimizer) or replicated "
                        "(--no-distributed-optimizer); default: what the actor's optimizer does")
    p.add_argument("--fused-logprobs", action="store_true",
                   help="plan the fused linear log-prob path (a chunk of logits) instead of the actor's "
                        "vocab-parallel path (logits + their gradient in the params dtype + a chunk)")
    p.add_argument("--strict", action="store_true",
                   help="exit 3 when the plan exceeds the GPU memory (cluster.gpu_memory_gb, default 80 GiB)")


def _split_rest(args: argparse.Namespace) -> argparse.Namespace:
    """Options may follow CONFIG and be mixed with overrides: re-parse what came after CONFIG."""
    inner = argparse.ArgumentParser(prog="megatron-rl check", usage="megatron-rl check CONFIG [options] [key.sub=value ...]")
    _add_options(inner)
    given = {k: v for k, v in vars(args).items()}
    ns, rest = inner.parse_known_args(args.rest, namespace=argparse.Namespace(**given))
    bad = [r for r in rest if r.startswith("-") or "=" not in r]
    if bad:
        inner.error(f"unrecognized arguments: {' '.join(bad)} (overrides are key.sub=value)")
    ns.overrides = rest
    return ns


def _main(args: argparse.Namespace) -> int:
    return _run(_split_rest(args))


def add_parser(subparsers) -> None:
    """Register ``check`` on the top-level subparsers."""
    p = subparsers.add_parser("check", help="validate a job config and print the per-rank memory plan",
                              description=__doc__.splitlines()[0],
                              usage="megatron-rl check CONFIG [options] [key.sub=value ...]")
    p.add_argument("config", help="job YAML (configs/*.yaml)")
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="key.sub=value",
                   help="dotted overrides (as for training), options may be mixed in")
    _add_options(p)
    p.set_defaults(func=_main)


def _judge_lines(cfg, problems: list) -> list:
    """``reward.judge``'s check lines; its problems appended to ``problems`` (nothing when off, or when the data /
    task / tokenizer already failed)."""
    if not cfg.reward.judge.enable or any(p.startswith(("reward.", "data.", "actor.load_hf")) for p in problems):
        return []
    try:
        task = build_task_for(cfg.data.task, load_tokenizer(cfg.actor.load_hf), path=cfg.data.path,
                              prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key,
                              task_kwargs=cfg.data.task_kwargs)
    except (OSError, ValueError) as e:
        problems.append(f"reward.judge: the task to render the template on did not build: {e}")
        return []
    more, lines = judge_check(cfg.reward.judge, task)
    problems += more
    return lines
