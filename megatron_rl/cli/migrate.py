"""``megatron-rl migrate verl``: turn a verl config into this project's, listing every key it could not map.

    megatron-rl migrate verl verl_grpo.yaml -o job.yaml      # writes job.yaml, prints the report
    megatron-rl migrate verl verl_grpo.yaml                  # the YAML on stdout, the report on stderr
    megatron-rl migrate verl overrides.yaml --base verl/trainer/config/_generated_ppo_megatron_trainer.yaml
    megatron-rl check job.yaml                               # then plan it

Every key of the verl file (a full config, or the Hydra overrides of a run script written as YAML) is mapped
by the verl key table (:mod:`megatron_rl.config.verl_keys`) or listed with the reason it is not: "not supported
yet", "no meaning here", "the SGLang server's setting", "unresolved" (an interpolation that cannot be evaluated
in the file, or Hydra's ``???``), "conflict", "unknown". The written file starts with that list as comments.
With ``--base``, CONFIG holds a run script's overrides and the base file verl's full config they apply to
(verl's defaults then carry over too; without it, keys CONFIG does not set take this project's defaults). ``-v``
also lists the keys with nothing to carry over (null, this project's behaviour anyway, or without effect
in that verl config). Exit status: 2 when the file cannot be read or is not a verl config, else 0.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Dict

import yaml

from megatron_rl.config.load import yaml_load
from megatron_rl.config.migrate_verl import migrate_verl
from megatron_rl.config.verl_keys import is_verl_config


def merge_overrides(base: Dict[str, Any], overrides: Dict[str, Any]) -> Dict[str, Any]:
    """``base`` with every key of ``overrides`` put over it, level by level (what Hydra does with a run
    script's ``key.sub=value`` overrides on its config)."""
    out = dict(base)
    for k, v in overrides.items():
        out[k] = merge_overrides(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def render(source: str, migration, verbose: bool = False) -> str:
    """The migrated config as YAML, headed by the report as comments."""
    head = [f"# Migrated from the verl config {source} by `megatron-rl migrate verl`.",
            "# Keys this file does not set take this project's defaults (not verl's); check it with",
            "# `megatron-rl check THIS_FILE` before launching.", "#"]
    head += [f"# {line}" for line in migration.report(verbose=verbose)]
    body = yaml.safe_dump(migration.tree, sort_keys=False, default_flow_style=False, width=120)
    return "\n".join(head) + "\n\n" + body


def _run(args: argparse.Namespace) -> int:
    try:
        with open(args.config) as fh:
            tree = yaml_load(fh)
    except OSError as exc:
        print(f"error: cannot read {args.config}: {exc}", file=sys.stderr)
        return 2
    except yaml.YAMLError as exc:
        print(f"error: {args.config}: not valid YAML: {exc}", file=sys.stderr)
        return 2
    if args.base:
        try:
            with open(args.base) as fh:
                base = yaml_load(fh)
        except (OSError, yaml.YAMLError) as exc:
            print(f"error: --base {args.base}: {exc}", file=sys.stderr)
            return 2
        for name, given in ((f"--base {args.base}", base), (args.config, tree)):
            if given is not None and not isinstance(given, dict):
                print(f"error: {name}: not a verl config (a YAML mapping of sections), got a "
                      f"{type(given).__name__}", file=sys.stderr)
                return 2
        tree = merge_overrides(base or {}, tree or {})
    if not is_verl_config(tree):
        print(f"error: {args.config}: not a verl config (no actor_rollout_ref: section)", file=sys.stderr)
        return 2
    migration = migrate_verl(tree)
    text = render(args.config, migration, args.verbose)
    report = "\n".join(migration.report(verbose=args.verbose))
    if args.out:
        try:
            with open(args.out, "w") as fh:
                fh.write(text)
        except OSError as exc:
            print(f"error: cannot write {args.out}: {exc}", file=sys.stderr)
            return 2
        print(report)
        print(f"wrote {args.out}; next: megatron-rl check {args.out}")
    else:
        print(report, file=sys.stderr)
        sys.stdout.write(text)
    return 0


def add_parser(subparsers) -> None:
    """Register ``migrate`` (with its one source, ``verl``) on the top-level subparsers."""
    p = subparsers.add_parser("migrate", help="convert another framework's config (verl) to this project's",
                              description=__doc__.splitlines()[0])
    sources = p.add_subparsers(dest="source", metavar="SOURCE")
    sources.required = True
    v = sources.add_parser("verl", help="a verl config (actor_rollout_ref / algorithm / data / trainer / ...)",
                           description=__doc__.splitlines()[0])
    v.add_argument("config", help="verl YAML: a full config or run-script overrides written as YAML")
    v.add_argument("--base", default=None,
                   help="a full verl config (e.g. verl's verl/trainer/config/_generated_ppo_megatron_trainer.yaml) "
                        "that CONFIG's keys override, as a verl run script's overrides do its config")
    v.add_argument("-o", "--out", default=None, help="write the migrated config here (default: stdout)")
    v.add_argument("-v", "--verbose", action="store_true",
                   help="also list the keys with nothing to carry over")
    v.set_defaults(func=_run)
