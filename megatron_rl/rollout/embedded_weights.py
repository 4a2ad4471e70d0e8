"""Weight loading for the embedded engine: read an HF checkpoint directory's tensors and copy an HF-named state
dict into a live ``transformers`` model, all-or-nothing (every name and shape is checked before any copy).

Usage::

    sd = read_hf_state_dict("/run/hf_export/step_3")          # model.safetensors or a sharded index
    load_state_dict_checked(model, sd, source="/run/hf_export/step_3")
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

import torch

from megatron_rl.convert.checks import CheckpointMismatchError, check_state_dict
from megatron_rl.rollout.base import WeightSyncError


def read_hf_state_dict(hf_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of the HF checkpoint in ``hf_dir`` (``model.safetensors``, a ``model.safetensors.index.json``
    shard set, or ``pytorch_model.bin``); raises ``WeightSyncError`` naming the directory if none is readable."""
    d = Path(hf_dir)
    if not d.is_dir():
        raise WeightSyncError(f"update_weights: {str(d)!r} is not a directory")
    try:
        from safetensors.torch import load_file

        single = d / "model.safetensors"
        index = d / "model.safetensors.index.json"
        if single.is_file():
            return load_file(str(single))
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            out: dict[str, torch.Tensor] = {}
            for f in files:
                out.update(load_file(str(d / f)))
            return out
        binf = d / "pytorch_model.bin"
        if binf.is_file():
            return torch.load(str(binf), map_location="cpu", weights_only=True)
    except WeightSyncError:
        raise
    except Exception as e:  # corrupt file, missing shard, bad JSON
        raise WeightSyncError(f"update_weights: could not read the checkpoint in {str(d)!r}: "
                              f"{type(e).__name__}: {e}") from e
    raise WeightSyncError(f"update_weights: {str(d)!r} has no model.safetensors, "
                          "model.safetensors.index.json or pytorch_model.bin")


def load_state_dict_checked(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], source: str,
                            tied_lm_head: bool = False) -> None:
    """Copy ``state_dict`` (HF names) into ``model``'s parameters, casting to each parameter's dtype.

    Every key of the model must be present (``lm_head.weight`` may be absent when ``tied_lm_head``), no key may
    be unknown, every shape must match and every value must be a tensor; otherwise ``WeightSyncError`` names the
    offending keys (and ``source``) and the model is left unchanged."""
    own = model.state_dict()
    # Non-persistent or derived buffers never appear in checkpoints.
    expected = {k: v.shape for k, v in own.items()
                if not (k.endswith("rotary_emb.inv_freq") or k.endswith("original_inv_freq"))}
    given = set(state_dict)
    for k in sorted(given):
        if not isinstance(state_dict[k], torch.Tensor):
            raise WeightSyncError(f"weights from {source}: {k!r} is a {type(state_dict[k]).__name__}, not a tensor")
    try:
        check_state_dict(state_dict, expected, f"weights from {source}",
                         optional=("lm_head.weight",) if tied_lm_head else (), expected_name="engine's model")
    except CheckpointMismatchError as err:
        raise WeightSyncError(str(err)) from err
    with torch.no_grad():
        for k in sorted(given):
            if tied_lm_head and k == "lm_head.weight":
                continue  # shares storage with the embedding, which is copied
            own[k].copy_(state_dict[k].detach().to(device=own[k].device, dtype=own[k].dtype))
