"""``megatron-rl check``: validate a job config at a given cluster size and print the per-rank memory plan.

    megatron-rl check configs/qwen2.5_7b_1x8.yaml --nodes 1 --gpus-per-node 8 --gpu-memory-gb 80
    megatron-rl check configs/deepseek_v3_scale_64x8.yaml --nodes 64 --gpus-per-node 8 --recompute full \\
        rollout.max_new_tokens=8192

The config is loaded exactly as the trainer loads it (``load_job_config`` with world size
nodes x gpus-per-node, overrides applied), so every error the trainer would raise at start-up is
raised here, naming the dotted key; exit status 2. Then the memory plan of
:mod:`megatron_rl.ops.memory` is printed (formulas in that module's docstring). Exit status 0 when
it fits (or no --gpu-memory-gb was given); with ``--strict`` a plan above --gpu-memory-gb exits 3.
"""
from __future__ import annotations

import argparse
import sys


def _run(args: argparse.Namespace) -> int:
    from megatron_rl.config import ConfigError, load_job_config
    from megatron_rl.ops.memory import GiB, MemoryOptions, format_plan, memory_plan

    for name in ("nodes", "gpus_per_node"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    world = args.nodes * args.gpus_per_node
    try:
        cfg = load_job_config(args.config, args.overrides, world_size=world)
    except ConfigError as exc:
        print(f"error: {args.config} at world size {world} ({args.nodes} node(s) x {args.gpus_per_node} GPU(s)):"
              f" {exc}", file=sys.stderr)
        return 2
    recompute = args.recompute
    if recompute is None:  # what the trainer will do: megatron's recompute_granularity passed via model.extra
        granularity = (cfg.model.extra or {}).get("recompute_granularity") if cfg.model else None
        recompute = "full" if granularity == "full" else "selective"
    opts = MemoryOptions(prompt_length=args.prompt_length, params_bytes=args.params_bytes,
                         grad_bytes=args.grad_bytes, distributed_optimizer=not args.no_distributed_optimizer,
                         recompute=recompute, fused_logprobs=args.fused_logprobs)
    try:
        plan = memory_plan(cfg, world, opts)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"config OK: {args.config} at world size {world} ({args.nodes} x {args.gpus_per_node})")
    print(format_plan(plan, args.gpu_memory_gb))
    peak = plan.peak().total(opts.recompute, opts.fused_logprobs)
    if args.strict and args.gpu_memory_gb is not None and peak > args.gpu_memory_gb * GiB:
        return 3
    return 0


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="GPU memory in GiB; warn when the plan exceeds it (e.g. 80)")
    p.add_argument("--prompt-length", type=int, default=1024,
                   help="prompt tokens per sequence; sequence = this + rollout.max_new_tokens (default 1024)")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default=None,
                   help="activation recomputation assumed for the total: none (attention scores stored), "
                        "selective (core attention not stored: flash attention or megatron's selective "
                        "recompute), full. Default: full if model.extra.recompute_granularity is 'full', "
                        "else selective")
    p.add_argument("--params-bytes", type=int, choices=(2, 4), default=2, help="bytes per parameter (2 = bf16)")
    p.add_argument("--grad-bytes", type=int, choices=(2, 4), default=4,
                   help="bytes per gradient element (4 = fp32 main grads, megatron's default)")
    p.add_argument("--no-distributed-optimizer", action="store_true",
                   help="Adam state replicated on every DP rank instead of sharded")
    p.add_argument("--fused-logprobs", action="store_true",
                   help="plan the fused linear log-prob path (a chunk of logits) instead of the actor's "
                        "vocab-parallel path (logits + their gradient in the params dtype + a chunk)")
    p.add_argument("--strict", action="store_true", help="exit 3 when the plan exceeds --gpu-memory-gb")


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
