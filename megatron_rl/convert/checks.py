"""The converter's errors and its one strict name / shape check of a state dict.

Every road between a checkpoint and a model (HF <-> Megatron mapping, shard files, loading into a live
model) checks tensors with :func:`check_state_dict`, so a mismatch always reads the same: every missing,
unexpected and mis-shaped tensor is listed by name, with the place (``what``) it was found.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

__all__ = ["UnsupportedCheckpointError", "CheckpointMismatchError", "LayoutError", "CheckpointFormatError",
           "check_state_dict"]


class UnsupportedCheckpointError(ValueError):
    """A HF config.json with an architecture or an option this project cannot represent (names the key)."""


class CheckpointMismatchError(ValueError):
    """Tensor names or shapes do not match what the model / geometry requires."""


class LayoutError(ValueError):
    """The parallel layout does not fit the model geometry."""


class CheckpointFormatError(ValueError):
    """A checkpoint directory is missing files or has an unknown format."""


def check_state_dict(sd: Mapping[str, torch.Tensor], expected: Mapping[str, Sequence[int]], what: str,
                     optional: Iterable[str] = (), expected_name: str = "expected") -> None:
    """Raise CheckpointMismatchError naming ``what`` unless ``sd`` holds exactly the names of ``expected``
    (``{name: shape}``) with those shapes. Names in ``optional`` may be absent from ``sd`` (e.g. TE
    ``_extra_state``) and are not reported as unexpected either way. ``expected_name`` is how the error
    calls the expected side (e.g. ``model``)."""
    optional = set(optional)
    missing = sorted(n for n in expected if n not in sd and n not in optional)
    unexpected = sorted(n for n in sd if n not in expected and n not in optional)
    bad = [f"{n}: got {tuple(t.shape)}, {expected_name} {tuple(expected[n])}" for n, t in sd.items()
           if n in expected and tuple(t.shape) != tuple(expected[n])]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {missing}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {unexpected}")
    if bad:
        problems.append(f"{len(bad)} shape mismatch(es): {bad}")
    if problems:
        raise CheckpointMismatchError(f"{what}: " + "; ".join(problems))
