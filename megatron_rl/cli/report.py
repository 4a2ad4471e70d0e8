"""``megatron-rl report RUN_DIR``: plots and a health summary of a run from RUN_DIR/metrics.jsonl.

    megatron-rl report runs/qwen2.5_7b [--out DIR] [--strict]

Writes ``report.md`` and PNGs (see :mod:`megatron_rl.ops.report` for the plots and the health
thresholds) to ``RUN_DIR/report`` (or --out) and prints the findings. Exit status: 0, or 1 with
``--strict`` when a FAIL finding exists; 2 when metrics.jsonl is missing or malformed.
"""
from __future__ import annotations

import argparse
import os
import sys

from megatron_rl.ops.report import MetricsError, quarter_means, read_metrics, write_report


def _run(args: argparse.Namespace) -> int:
    try:
        md, findings, plots = write_report(args.run_dir, args.out)
    except MetricsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {md} and {len(plots)} plot(s): {', '.join(plots) or '-'}")
    records = read_metrics(os.path.join(args.run_dir, "metrics.jsonl"))
    for key in ("reward/mean", "reward/raw_mean", "rollout_corr/k3_kl"):
        q = quarter_means(records, key)
        if q is not None:
            print(f"{key}: first-quarter mean {q[0]:.4g} -> last-quarter mean {q[1]:.4g} ({len(records)} steps)")
    for f in findings:
        print(f"{f.severity}: {f.check}: {f.message}")
    if not [f for f in findings if f.severity != "INFO"]:
        print("healthy: no threshold crossed")
    return 1 if args.strict and any(f.severity == "FAIL" for f in findings) else 0


def add_parser(subparsers) -> None:
    """Register ``report`` on the top-level subparsers."""
    p = subparsers.add_parser("report", help="plots and a health summary of a run's metrics.jsonl",
                              description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="run directory holding metrics.jsonl")
    p.add_argument("--out", default=None, help="output directory (default RUN_DIR/report)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a FAIL finding exists")
    p.set_defaults(func=_run)
