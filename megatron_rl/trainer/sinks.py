"""Metric sinks: ``metrics.jsonl`` (always), console table + progress bar, TensorBoard, W&B.

Only global rank 0 writes. ``metrics.jsonl`` holds one JSON object per step:
``{"step": int, "time": float, "<group>/<name>": float, ...}`` with groups ``reward``,
``response_length``, ``actor``, ``rollout_corr``, ``timing`` and ``perf`` — the input of
``megatron-rl report``. TensorBoard / W&B are used when enabled in ``trainer`` and importable; when
enabled but not installed, a warning names the missing extra and the run continues.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Dict, List, Optional

CONSOLE_KEYS = (
    ("reward/mean", "reward"), ("response_length/mean", "len"), ("actor/pg_loss", "pg_loss"),
    ("actor/grad_norm", "gnorm"), ("rollout_corr/kl", "kl"), ("rollout_corr/rollout_is_mean", "is_mean"),
    ("rollout_corr/rollout_rs_masked_fraction", "rs_mask"), ("perf/tokens_per_s", "tok/s"),
)


class MetricSinks:
    """Fan one step's metrics out to every enabled sink (a no-op on ranks other than 0)."""

    def __init__(self, run_dir: str, total_steps: int, enabled: bool = True, progress: bool = True,
                 tensorboard: bool = False, wandb: bool = False, wandb_project: str = "megatron-rl",
                 config: Optional[dict] = None, resume: bool = False) -> None:
        self.enabled = enabled
        self.total = total_steps
        self.progress = progress
        self._tb = self._wandb = None
        self._t0 = time.time()
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._fh = open(self.path, "a" if resume else "w")
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

                self._wandb = _wandb.init(project=wandb_project, dir=run_dir, config=config or {},
                                          resume="allow" if resume else None)
            except Exception as exc:  # noqa: BLE001 - optional extra
                print(f"[megatron-rl] trainer.wandb: disabled ({exc}); pip install 'megatron-rl[wandb]'",
                      file=sys.stderr)

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        """Record ``metrics`` of ``step`` everywhere."""
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
        rec = {"step": step, "time": time.time(), **clean}
        self._fh.write(json.dumps(rec) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self.progress:
            print(self._line(step, clean), flush=True)

    def _line(self, step: int, m: Dict[str, float]) -> str:
        width = 20
        done = int(width * step / max(self.total, 1))
        bar = "#" * done + "." * (width - done)
        cells: List[str] = [f"{label}={m[k]:.4g}" for k, label in CONSOLE_KEYS if k in m]
        return f"[{bar}] step {step}/{self.total} {time.time() - self._t0:6.0f}s | " + " ".join(cells)

    def close(self) -> None:
        if not self.enabled:
            return
        self._fh.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
