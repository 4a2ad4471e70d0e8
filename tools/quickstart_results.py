"""The quickstart's results table, generated from a finished run: ``python tools/quickstart_results.py RUN_DIR``.

Reads ``RUN_DIR/metrics.jsonl`` (the reward curve, entropy, step times) and the newest COMPLETE checkpoint
under ``RUN_DIR/checkpoints`` (exported to ``RUN_DIR/hf_final`` with the project's own exporter; a LoRA run's
adapters merged into its base), then
evaluates the trained model GREEDILY (temperature 0, fp32, the project's ``EmbeddedEngine``) on every prompt of
the task, reported per operand length: on the held-out prompts of each length that has any — operand strings
the run never trained on (``data.task_kwargs.heldout_frac``, see ``megatron_rl.tasks.synthetic``) — and on
every string of each length (the rate strings drawn with uniform lengths measure, length by length). Writes the
markdown table to ``--out`` (default ``RUN_DIR/results.md``; never a tracked file unless asked: the project's
``docs/results.md`` is refreshed with ``--out docs/results.md``) and the numbers to ``--json`` (default
``RUN_DIR/results.json``), and prints the table; no number in it is typed by hand. tools/quickstart.sh runs it at
the end of every quickstart. The task and its options come from the config saved in the
checkpoint, so the evaluation matches what the run trained on.

Usage::

    bash tools/quickstart.sh trainer.run_dir=runs/qs
    .venv/bin/python tools/quickstart_results.py runs/qs                  # -> runs/qs/results.{md,json}
    .venv/bin/python tools/quickstart_results.py runs/qs --out docs/results.md    # the project's page
    .venv/bin/python tools/quickstart_results.py runs/qs --out /tmp/r.md --json /tmp/r.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

import torch

from megatron_rl.actor.checkpoint import META_FILE, resolve_checkpoint_dir
from megatron_rl.actor.hf_io import export_checkpoint_to_hf
from megatron_rl.ops.report import quarter_means, read_metrics, series
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.tasks import build_task
from megatron_rl.tokenizer import load_tokenizer
from megatron_rl.trainer.job import latest_checkpoint

#: Windows of the reward-curve summary (the run is cut into this many equal parts).
CURVE_WINDOWS = 10


def reward_key(records: Sequence[dict]) -> str:
    """The metric of the mean sampled reward: ``reward/raw_mean`` (every generated sample, every round) when the
    run used dynamic sampling (``filter_groups/rounds`` logged), whose ``reward/mean`` describes only the trained
    groups -- those whose samples did not all score alike, so solved prompts are left out of it; else
    ``reward/mean``."""
    return "reward/raw_mean" if any("filter_groups/rounds" in r for r in records) else "reward/mean"


def saved_config(ckpt: str) -> Dict:
    """The job config (as a dict) the RL loop saved with checkpoint ``ckpt``."""
    path = os.path.join(resolve_checkpoint_dir(ckpt), "extra_state.pt")
    extra = torch.load(path, weights_only=False) if os.path.isfile(path) else None
    cfg = extra.get("config") if isinstance(extra, dict) else None
    if not isinstance(cfg, dict):
        raise SystemExit(f"quickstart_results: {path} holds no saved job config (not written by the RL loop?)")
    return cfg


def is_lora_checkpoint(ckpt: str) -> bool:
    """Whether ``ckpt`` is a LoRA actor's checkpoint (adapters alone, its base named): it is evaluated merged."""
    with open(os.path.join(resolve_checkpoint_dir(ckpt), META_FILE)) as fh:
        return bool(json.load(fh).get("lora"))


def greedy_by_length(hf_dir: str, cfg: Dict) -> Dict:
    """Greedy exact-match rates of the model in ``hf_dir`` on the run's task, per operand length: on the
    held-out prompts of that length (strings never trained on) and on every string of that length (trained-on
    and held-out alike: what strings drawn with uniform lengths measure, length by length); plus the held-out
    rate over all lengths together (each length weighted by its number of held-out strings)."""
    data = cfg["data"]
    kwargs = dict(data.get("task_kwargs") or {})
    if not kwargs.get("heldout_frac"):
        raise SystemExit("quickstart_results: the run has no held-out split (data.task_kwargs.heldout_frac is 0 "
                         "or unset): every prompt may have been trained on, so there is nothing to evaluate")
    task = build_task(data["task"], load_tokenizer(hf_dir), task_kwargs=kwargs)
    prompts = task.every_prompt()
    engine = EmbeddedEngine(hf_dir, dtype="float32", seed=0)
    try:
        outs = engine.generate([p.prompt_ids for p in prompts],
                               SamplingParams(temperature=0.0, max_new_tokens=int(cfg["rollout"]["max_new_tokens"])))
    finally:
        engine.close()
    held: Dict[int, List[bool]] = {}
    every: Dict[int, List[bool]] = {}
    shown: Dict[int, List[str]] = {}
    for r in outs:
        p = prompts[r.prompt_index]
        k, out = task.operand_digits(p), task.tokenizer.decode(r.response_ids)
        ok = task.reward(p, r.response_ids) == 1.0
        every.setdefault(k, []).append(ok)
        if task.is_heldout(p):
            held.setdefault(k, []).append(ok)
            shown.setdefault(k, []).append(f"{p.text} -> {out!r} (held out)")
        elif k not in held:
            shown.setdefault(-k, []).append(f"{p.text} -> {out!r}")
    examples = [e for k in sorted(every) for e in (shown.get(k) or shown.get(-k, []))[::7][:3]]
    n_held = sum(len(v) for v in held.values())
    rates = {k: sum(v) / len(v) for k, v in every.items()}
    rates_held = {k: sum(v) / len(v) for k, v in held.items()}
    return {"n": n_held, "exact": sum(sum(v) for v in held.values()) / n_held,
            "examples": examples,
            "by_length": {k: {"heldout": (sum(held[k]), len(held[k])) if k in held else None,
                              "every": (sum(v), len(v))} for k, v in sorted(every.items())},
            "uniform_lengths": sum(rates.values()) / len(rates),
            "worst_length": min([*rates.values(), *rates_held.values()])}


def curve_summary(records: Sequence[dict], windows: int = CURVE_WINDOWS) -> List[tuple]:
    """(first step, last step, mean reward) of ``windows`` consecutive equal parts of the run."""
    xs, ys = series(records, reward_key(records))
    n = len(ys)
    out = []
    for i in range(min(windows, n)):
        a, b = i * n // windows, (i + 1) * n // windows
        if b > a:
            out.append((xs[a], xs[b - 1], sum(ys[a:b]) / (b - a)))
    return out


def run_facts(records: Sequence[dict]) -> Dict[str, float]:
    """Mean sampled reward (``reward_key``) quarters, end-of-run entropy, zero-gradient steps, seconds per step
    and wall time."""
    key = reward_key(records)
    first_q, last_q = quarter_means(records, key)
    _, ent = series(records, "actor/entropy")
    _, gn = series(records, "actor/grad_norm")
    _, step_s = series(records, "timing/step_s")
    _, times = series(records, "time")
    k = max(1, len(ent) // 10)
    return {"steps": len(records), "reward_first": series(records, key)[1][0],
            "reward_last": series(records, key)[1][-1], "first_quarter": first_q, "last_quarter": last_q,
            "entropy_start": sum(ent[:k]) / k if ent else float("nan"),
            "entropy_end": sum(ent[-k:]) / k if ent else float("nan"),
            "zero_grad_steps": sum(1 for g in gn if g == 0.0),
            "s_per_step": sum(step_s) / len(step_s) if step_s else float("nan"),
            "wall_s": (times[-1] - times[0] + step_s[0]) if times and step_s else float("nan")}


def git_commit() -> str:
    """The repository's HEAD commit (short) plus "+changes" when the tree differs, or "unknown"."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=20, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=20).stdout.strip()
        return head + (" +uncommitted changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _rate(hits_n) -> str:
    """``"h of n (p %)"``, or "none" for a length without such strings."""
    if hits_n is None:
        return "none held out"
    h, n = hits_n
    return f"{h} of {n} ({100 * h / n:.0f} %)"


def render(run_dir: str, cfg: Dict, facts: Dict, curve: List[tuple], ev: Dict, ckpt: str) -> str:
    """The markdown page."""
    par, ro, data, tr = cfg["parallel"], cfg["rollout"], cfg["data"], cfg["trainer"]
    lines = [
        "# Quickstart results",
        "",
        f"Generated by `tools/quickstart_results.py {run_dir}` from that run's `metrics.jsonl` and its final "
        "checkpoint; do not edit by hand. See [quickstart.md](quickstart.md) for what the job does and how to "
        "read these numbers.",
        "",
        f"Run: task `{data['task']}` {json.dumps(data.get('task_kwargs') or {})}, {data['prompts_per_step']} prompts "
        f"x {ro['n_samples_per_prompt']} samples per step, {facts['steps']} steps, seed {tr['seed']}, "
        f"TP{par.get('tensor_model_parallel_size', 1)} x PP{par.get('pipeline_model_parallel_size', 1)}, "
        f"engine {ro['engine']} ({ro['dtype']}); code at commit {git_commit()}; checkpoint `{ckpt}`.",
        "",
        "| metric | value |",
        "|---|---|",
        f"| mean sampled reward (every generated sample), first step -> last step | {facts['reward_first']:.3f} "
        f"-> {facts['reward_last']:.3f} |",
        f"| mean sampled reward, first quarter / last quarter of the steps | {facts['first_quarter']:.3f} / "
        f"{facts['last_quarter']:.3f} |",
        f"| greedy exact answers, all held-out prompts | {100 * ev['exact']:.1f} % ({round(ev['exact'] * ev['n'])} "
        f"of {ev['n']}) |",
        f"| greedy exact answers, lengths equally weighted (mean of the per-length rates on every string) | "
        f"{100 * ev['uniform_lengths']:.1f} % |",
        f"| greedy exact answers, worst length (held-out or every string) | {100 * ev['worst_length']:.1f} % |",
        "",
        "Greedy exact answers per operand length:",
        "",
        "| digits | held-out strings | every string of that length (trained-on and held-out) |",
        "|---|---|---|",
        *(f"| {k} | {_rate(v['heldout'])} | {_rate(v['every'])} |" for k, v in ev["by_length"].items()),
        "",
        "| metric | value |",
        "|---|---|",
        f"| policy entropy (nats/token), first / last 10 % of steps | {facts['entropy_start']:.3f} / "
        f"{facts['entropy_end']:.3f} |",
        f"| steps with zero gradient (every group's samples scored alike) | {facts['zero_grad_steps']} |",
        f"| seconds per step (mean) | {facts['s_per_step']:.2f} |",
        f"| wall time of the training steps | {facts['wall_s'] / 60:.1f} min |",
        "",
        "Reward curve (mean sampled reward per tenth of the run):",
        "",
        "| steps | " + " | ".join(f"{a}-{b}" for a, b, _ in curve) + " |",
        "|---|" + "---|" * len(curve),
        "| reward | " + " | ".join(f"{m:.2f}" for _, _, m in curve) + " |",
        "",
        "Greedy answers (a sample per length; held-out strings where the length has any):",
        "",
        *(f"    {e}" for e in ev["examples"]),
        "",
    ]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    """Command-line entry point; returns the numbers it wrote."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="the markdown page (default RUN_DIR/results.md)")
    p.add_argument("--json", default=None, help="the numbers as JSON (default RUN_DIR/results.json)")
    a = p.parse_args(argv)
    a.out = a.out or os.path.join(a.run_dir, "results.md")
    a.json = a.json or os.path.join(a.run_dir, "results.json")
    records = read_metrics(os.path.join(a.run_dir, "metrics.jsonl"))
    ckpt = latest_checkpoint(a.run_dir)
    if ckpt is None:
        raise SystemExit(f"quickstart_results: {a.run_dir}/checkpoints has no COMPLETE checkpoint")
    cfg = saved_config(ckpt)
    hf_dir = os.path.join(a.run_dir, "hf_final")
    export_checkpoint_to_hf(ckpt, hf_dir, merge=is_lora_checkpoint(ckpt))   # a LoRA run: base + adapters, merged
    ev = greedy_by_length(hf_dir, cfg)
    facts = run_facts(records)
    page = render(a.run_dir, cfg, facts, curve_summary(records), ev, os.path.relpath(ckpt, a.run_dir))
    with open(a.out, "w") as fh:
        fh.write(page)
    print(page)
    result = {**facts, "heldout_exact": ev["exact"], "heldout_n": ev["n"], "uniform_lengths": ev["uniform_lengths"],
              "worst_length": ev["worst_length"],
              "by_length": {str(k): v for k, v in ev["by_length"].items()}}
    with open(a.json, "w") as fh:
        json.dump(result, fh, indent=2)
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
