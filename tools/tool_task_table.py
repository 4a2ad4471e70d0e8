"""docs/multi_turn.md's measured table of the tiny tool task, generated from a run: ``python tools/tool_task_table.py
RUN_DIR``. Means over 20-step windows of the run's metrics.jsonl (reward, tool calls and turns per trajectory, the
environments' share of response tokens, entropy), stamped with the commit the run was made on (the checkpoint's
saved config carries no commit: the stamp is this checkout's HEAD, so run it on the commit that trained). No number
is typed by hand.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

from megatron_rl.ops.report import read_metrics

COLUMNS = (("reward/mean", "reward"), ("multi_turn/tool_calls_per_traj", "tool calls / traj"),
           ("multi_turn/turns_mean", "turns"), ("multi_turn/env_token_frac", "env token share"),
           ("actor/entropy", "entropy"))
WINDOW = 20


def windows(records: Sequence[Dict], window: int = WINDOW) -> List[Dict]:
    """One row per ``window`` steps: ``{"steps": "a-b", <key>: mean}`` (a key absent from a window is left out)."""
    out = []
    for start in range(0, len(records), window):
        chunk = records[start:start + window]
        row = {"steps": f"{chunk[0]['step']}-{chunk[-1]['step']}"}
        for key, _ in COLUMNS:
            vals = [r[key] for r in chunk if key in r]
            if vals:
                row[key] = sum(vals) / len(vals)
        out.append(row)
    return out


def commit(root: str) -> str:
    r = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def render(run_dir: str, rows: Sequence[Dict], sha: str, step_s: Optional[float]) -> str:
    head = "| steps | " + " | ".join(label for _, label in COLUMNS) + " |"
    lines = [f"Measured at commit {sha} (`python tools/tool_task_table.py {run_dir}`; seed and ranks as the run's "
             f"config{'' if step_s is None else f'; {step_s:.2f} s/step'}; means over {WINDOW}-step windows):", "",
             head, "|" + "---|" * (len(COLUMNS) + 1)]
    for row in rows:
        lines.append(f"| {row['steps']} | " + " | ".join(f"{row[k]:.3f}" if k in row else "-" for k, _ in COLUMNS)
                     + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--commit", default=None, help="the commit the run was made on (default: this checkout's HEAD)")
    a = p.parse_args(argv)
    records = read_metrics(os.path.join(a.run_dir, "metrics.jsonl"))
    times = [r["timing/step_s"] for r in records if "timing/step_s" in r]
    page = render(a.run_dir, windows(records), a.commit or commit(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                  sum(times) / len(times) if times else None)
    print(page, end="")
    return page


if __name__ == "__main__":
    main()
    sys.exit(0)
