"""Which validation samples are logged (``trainer.val_log_samples``, verl's ``trainer.log_val_generations``).

    rows = pick_val_samples(samples, n)   # samples: [ValSample]; the same n rows at every validation of a set

verl's rule (``RayPPOTrainer._maybe_log_val_generations``, verl/trainer/ppo/ray_trainer.py): sort the samples by
prompt text (stable), shuffle with ``numpy.random.RandomState(42)``, keep the first N -- so every validation logs
the same prompts and their responses can be compared across steps. The sinks write them
(``MetricSinks.log_val_samples``: run_dir/val_generations.jsonl, and a W&B table).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Sequence

import numpy as np

__all__ = ["ValSample", "pick_val_samples"]


@dataclass
class ValSample:
    """One validation response as logged."""

    input: str
    """The prompt's text (after the chat template)."""
    output: str
    """The response, decoded up to its first EOS (special tokens dropped)."""
    score: float
    """Its reward."""
    data_source: str
    """The prompt's data source (the ``val/<source>/*`` metrics)."""

    def to_dict(self) -> Dict[str, object]:
        """The sample as a JSON-able dict."""
        return asdict(self)


def pick_val_samples(samples: Sequence[ValSample], n: int) -> List[ValSample]:
    """The ``n`` samples verl's rule logs (module docstring); all of them when there are fewer."""
    if n <= 0:
        return []
    picked = sorted(samples, key=lambda s: s.input)
    np.random.RandomState(42).shuffle(picked)
    return picked[:n]
