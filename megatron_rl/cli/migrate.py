"""``megatron-rl migrate verl``: turn a verl config into this project's, carrying verl's meaning or saying where not.

    megatron-rl migrate verl verl_grpo.yaml -o job.yaml      # writes job.yaml, prints the report
    megatron-rl migrate verl verl_grpo.yaml                  # the YAML on stdout, the report on stderr
    megatron-rl migrate verl overrides.yaml --verl-version 0.9.1
    megatron-rl migrate verl overrides.yaml --base my_full_verl_config.yaml
    megatron-rl check job.yaml                               # then plan it

CONFIG (a full verl config, or a run script's Hydra overrides written as YAML) is read over verl's own defaults of
``--verl-version`` (bundled, newest by default; the Megatron or FSDP trainer's by the file's actor backend), or
over ``--base``. Every key is mapped by the verl key table (:mod:`megatron_rl.config.verl_keys`) or listed with
the reason it is not. Exit status: 2 when a file cannot be read or is not a verl config; 3 when a value's verl
behaviour is not carried (kinds "not supported yet", "unresolved", "conflict", "unknown": each line names the
key and what to decide) -- nothing is written then; ``--allow-changes`` writes it anyway (exit 0); else 0. ``-v`` also lists the keys
with nothing to carry over.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict

import yaml

from megatron_rl.config.load import yaml_load
from megatron_rl.config.migrate_verl import merge_overrides, migrate_verl, with_verl_defaults
from megatron_rl.config.verl_keys import is_verl_config
from megatron_rl.config.verl_versions import NEWEST, VERL_VERSIONS

__all__ = ["merge_overrides", "render", "add_parser"]

#: Exit status when values differ from verl's behaviour (2: a file cannot be read).
EXIT_DIFFERS = 3


def render(source: str, migration, verbose: bool = False) -> str:
    """The migrated config as YAML, headed by the report as comments."""
    head = [f"# Migrated from the verl config {source} by `megatron-rl migrate verl` (read as verl "
            f"{migration.version}).",
            "# verl's defaults were carried over; keys this file does not set are this project's defaults where",
            "# verl's mean the same. Check it with `megatron-rl check THIS_FILE` before launching.", "#"]
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
    said = ""
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
        tree, said = merge_overrides(base or {}, tree or {}), f"--base {args.base}"
    elif isinstance(tree, dict) and is_verl_config(tree):
        tree, said = with_verl_defaults(tree, args.verl_version)
    if not is_verl_config(tree):
        print(f"error: {args.config}: not a verl config (no actor_rollout_ref: section)", file=sys.stderr)
        return 2
    migration = migrate_verl(tree, args.verl_version, said, workdir=os.getcwd())
    text = render(args.config, migration, args.verbose)
    report = "\n".join(migration.report(verbose=args.verbose))
    differ = migration.differences()
    if differ and not args.allow_changes:
        print(report, file=sys.stderr)
        print(f"error: {len(differ)} value(s) of {args.config} would mean something else here; decide each "
              f"(the reason names what to set), then migrate again, or pass --allow-changes to write the file "
              f"anyway:", file=sys.stderr)
        for e in differ:
            print(f"  {e.key} = {e.value!r}: {e.detail}", file=sys.stderr)
        return EXIT_DIFFERS
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
    if differ:
        print(f"written with --allow-changes: {len(differ)} value(s) differ from verl's behaviour (listed above)",
              file=sys.stderr)
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
                   help="a full verl config that CONFIG's keys override, as a verl run script's overrides do its "
                        "config (default: verl's generated defaults of --verl-version)")
    v.add_argument("--verl-version", default=NEWEST, choices=VERL_VERSIONS,
                   help=f"the verl CONFIG was written for: its defaults fill the keys CONFIG does not set, and "
                        f"its objectives' behaviour is carried (default: {NEWEST}, the newest bundled)")
    v.add_argument("--allow-changes", action="store_true",
                   help="write the migrated config even when values differ from verl's behaviour (still listed; "
                        "exit status 0)")
    v.add_argument("-o", "--out", default=None, help="write the migrated config here (default: stdout)")
    v.add_argument("-v", "--verbose", action="store_true",
                   help="also list the keys with nothing to carry over")
    v.set_defaults(func=_run)
