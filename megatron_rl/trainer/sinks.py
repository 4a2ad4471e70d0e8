"""Metric sinks: ``metrics.jsonl`` (always), console progress bar + compact table, TensorBoard, W&B.

Console (``trainer.progress``): one progress-bar line per step (step, elapsed, ETA, reward, ...), and every
``trainer.console_table_interval`` steps (and at the last step) one summary line of the steps since the
previous summary -- what the per-step lines do not show: the window's mean, min and max reward, its change
from the previous window, the mean step time and response length, its last validation reward
(``format_summary``). A validation (``val/*``) adds one line (``format_validation``): the mean reward over the set
and per data source; one before training has its own record (step 0) and only that line.

Only global rank 0 writes. ``metrics.jsonl`` holds one JSON object per step:
``{"step": int, "time": float, "<group>/<name>": float, ...}`` with groups ``reward``,
``response_length``, ``actor``, ``rollout_corr``, ``timing``, ``perf`` and ``val`` (validation) — the input of
``megatron-rl report``. TensorBoard / W&B are used when enabled in ``trainer`` and importable; when
enabled but not installed, a warning names the missing extra and the run continues. A resumed run continues its
W&B run (the id in ``run_dir/wandb_id``, ``trainer/wandb_run.py``).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_rl.trainer.val_samples import ValSample
from megatron_rl.trainer.wandb_run import wandb_init_kwargs

VAL_SAMPLES_FILE = "val_generations.jsonl"
"""Logged validation samples in the run directory (``trainer.val_log_samples``)."""

CONSOLE_KEYS = (
    ("reward/mean", "reward"), ("reward/raw_mean", "sampled"), ("response_length/mean", "len"), ("actor/pg_loss", "pg_loss"),
    ("actor/grad_norm", "gnorm"), ("rollout_corr/kl", "kl"), ("rollout_corr/rollout_is_mean", "is_mean"),
    ("rollout_corr/rollout_rs_masked_fraction", "rs_mask"), ("filter_groups/rounds", "rounds"),
    ("perf/tokens_per_s", "tok/s"),
)


DEFAULT_TABLE_INTERVAL = 10


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    m, sec = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


def _mean(values: List[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def format_summary(rows: List[Tuple[int, Dict[str, float]]], previous_reward: Optional[float] = None) -> str:
    """One line summarising the steps of ``rows`` ((step, metrics) pairs): reward mean / min / max over the
    window (and its change from ``previous_reward``, the previous window's mean), mean response length,
    mean step time and mean throughput, the window's last validation reward -- each only when logged."""
    first, last = rows[0][0], rows[-1][0]
    cells = []
    rewards = [m["reward/mean"] for _, m in rows if "reward/mean" in m]
    if rewards:
        mean = _mean(rewards)
        cell = f"reward mean {mean:.4g} (min {min(rewards):.4g}, max {max(rewards):.4g})"
        if previous_reward is not None and math.isfinite(previous_reward):
            cell += f", {mean - previous_reward:+.4g} vs previous"
        cells.append(cell)
    short = sum(1 for _, m in rows if m.get("filter_groups/exhausted", 0) > 0)
    if short:     # one warning said why at the first; the rest are counted here
        cells.append(f"dynamic sampling short of groups with signal on {short} of {len(rows)} step(s)")
    sampled = [m["reward/raw_mean"] for _, m in rows if "reward/raw_mean" in m]
    if sampled:   # dynamic sampling: reward/mean is the trained groups', this one every generated sample's
        cells.append(f"sampled reward mean {_mean(sampled):.4g} (every generated sample; reward: the trained groups)")
    for key, label, unit in (("response_length/mean", "len", ""), ("timing/step_s", "step", " s"),
                             ("perf/tokens_per_s", "tok/s", "")):
        vals = [m[key] for _, m in rows if key in m]
        if vals:
            cells.append(f"{label} {_mean(vals):.4g}{unit}")
    validated = [(s, m["val/reward_mean"]) for s, m in rows if "val/reward_mean" in m]
    if validated:
        cells.append(f"val reward {validated[-1][1]:.4g} (step {validated[-1][0]})")
    span = f"step {first}" if first == last else f"steps {first}-{last}"
    return f"[megatron-rl] {span} ({len(rows)} step(s)): " + ("; ".join(cells) if cells else "no metrics")


def format_validation(step: int, m: Dict[str, float]) -> str:
    """One console line of a validation's ``val/*`` metrics: the mean reward over the set, then per data source
    (``val/<source>/reward_mean``), the prompts and the mean response length."""
    per_source = [(k[len("val/"):-len("/reward_mean")], v) for k, v in m.items()
                  if k.startswith("val/") and k.endswith("/reward_mean") and k != "val/reward_mean"]
    cells = [f"reward {m.get('val/reward_mean', float('nan')):.4g}"]
    if len(per_source) > 1:
        cells.append("; ".join(f"{src} {v:.4g}" for src, v in sorted(per_source)))
    cells.append(f"{int(m.get('val/prompts', 0))} prompt(s), len {m.get('val/response_length_mean', float('nan')):.4g}")
    when = "before training" if step == 0 else f"after step {step}"
    return f"[megatron-rl] validation {when}: " + " | ".join(cells)


class MetricSinks:
    """Fan one step's metrics out to every enabled sink (a no-op on ranks other than 0)."""

    def __init__(self, run_dir: str, total_steps: int, enabled: bool = True, progress: bool = True,
                 tensorboard: bool = False, wandb: bool = False, wandb_project: str = "megatron-rl",
                 config: Optional[dict] = None, resume: bool = False, table_interval: Optional[int] = None) -> None:
        """``table_interval``: steps between console summary lines (0: none); default: the job config's
        ``trainer.console_table_interval`` (in ``config``), else ``DEFAULT_TABLE_INTERVAL``."""
        self.enabled = enabled
        self.total = total_steps
        self.progress = progress
        if table_interval is None:
            table_interval = ((config or {}).get("trainer") or {}).get("console_table_interval",
                                                                       DEFAULT_TABLE_INTERVAL)
        self.table_interval = int(table_interval)
        self._rows: List[Tuple[int, Dict[str, float]]] = []
        self._previous_reward: Optional[float] = None
        self._first_step: Optional[int] = None
        self._tb = self._wandb = None
        self._t0 = time.time()
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._fh = open(self.path, "a" if resume else "w")
        samples = os.path.join(run_dir, VAL_SAMPLES_FILE)
        if not resume and os.path.exists(samples):  # a run at step 0 (--resume without a checkpoint): starts empty
            os.remove(samples)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
            except Exception as exc:  # noqa: BLE001 - optional extra
                print(f"[megatron-rl] trainer.tensorboard: disabled ({exc}); pip install 'megatron-rl[tensorboard]'",
                      file=sys.stderr)
        if wandb:
            try:
                import wandb as _wandb

                kwargs, line = wandb_init_kwargs(run_dir, resumed=resume)
                self._wandb = _wandb.init(project=wandb_project, dir=run_dir, config=config or {}, **kwargs)
                print(line, flush=True)
            except Exception as exc:  # noqa: BLE001 - optional extra
                print(f"[megatron-rl] trainer.wandb: disabled ({exc}); pip install 'megatron-rl[wandb]'",
                      file=sys.stderr)

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        """Record ``metrics`` of ``step`` everywhere."""
        if not self.enabled:
            return
        clean = self._write(step, metrics)
        if self.progress:
            if self._first_step is None:
                self._first_step = step - 1
            print(self._line(step, clean), flush=True)
            if "val/reward_mean" in clean:
                print(format_validation(step, clean), flush=True)
            self._rows.append((step, clean))
            if self.table_interval > 0 and (step % self.table_interval == 0 or step >= self.total):
                print(format_summary(self._rows, self._previous_reward), flush=True)
                rewards = [m["reward/mean"] for _, m in self._rows if "reward/mean" in m]
                self._previous_reward = _mean(rewards) if rewards else None
                self._rows = []

    def log_validation(self, step: int, metrics: Dict[str, float]) -> None:
        """Record a validation outside a training step (before the first: ``step`` 0) everywhere: its own
        record, and one console line (``format_validation``) instead of a progress line."""
        if not self.enabled:
            return
        clean = self._write(step, metrics)
        if self.progress:
            print(format_validation(step, clean), flush=True)

    def log_val_samples(self, step: int, samples: Sequence[ValSample]) -> None:
        """Validation ``samples`` of ``step`` (``trainer.val_log_samples``): one record each in
        run_dir/val_generations.jsonl (``{"step", "input", "output", "score", "data_source"}``), and with W&B the
        table ``val/generations`` (one row per sample)."""
        if not self.enabled or not samples:
            return
        with open(os.path.join(self.run_dir, VAL_SAMPLES_FILE), "a") as fh:
            for s in samples:
                fh.write(json.dumps({"step": step, **s.to_dict()}, ensure_ascii=False) + "\n")
        if self._wandb is not None:
            import wandb as _wandb

            columns = ["step", "input", "output", "score", "data_source"]
            table = _wandb.Table(columns=columns, data=[[step, s.input, s.output, s.score, s.data_source]
                                                        for s in samples])
            self._wandb.log({"val/generations": table}, step=step)

    def _write(self, step: int, metrics: Dict[str, float]) -> Dict[str, float]:
        """The finite numbers of ``metrics`` as ``step``'s record in metrics.jsonl, TensorBoard and W&B."""
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
        rec = {"step": step, "time": time.time(), **clean}
        self._fh.write(json.dumps(rec) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        return clean

    def _line(self, step: int, m: Dict[str, float]) -> str:
        width = 20
        done = int(width * step / max(self.total, 1))
        bar = "#" * done + "." * (width - done)
        elapsed = time.time() - self._t0
        steps_done = step - (self._first_step or 0)
        eta = elapsed / steps_done * (self.total - step) if steps_done > 0 else float("nan")
        cells: List[str] = [f"{label}={m[k]:.4g}" for k, label in CONSOLE_KEYS if k in m]
        return (f"[{bar}] step {step}/{self.total} {elapsed:6.0f}s eta {_duration(eta)} | " + " ".join(cells))

    def close(self) -> None:
        if not self.enabled:
            return
        self._fh.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
