"""Weight loading for the embedded engine: read an HF checkpoint directory's tensors and copy an HF-named state
dict into a live ``transformers`` model, all-or-nothing (every name and shape is checked before any copy).

Usage::

    sd = read_weight_update("/run/hf_export/step_3")          # model.safetensors, a sharded index or .bin
    load_state_dict_checked(model, sd, source="/run/hf_export/step_3")

``BucketLoader`` is the bucketed in-process receiver (``rollout.weight_sync: tensor``): the trainer streams
``weight_sync.buckets.Bucket`` objects and each is copied in as it arrives (never a full state dict); a delta
sync's ``delta.DeltaBucket`` is applied to the tensors of the version the engine holds.
"""
from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Mapping

import torch

from megatron_rl.convert.checks import CheckpointMismatchError, check_state_dict
from megatron_rl.convert.pieces import copy_into
from megatron_rl.weight_sync.endpoint import WeightReceiver, WeightSyncError
from megatron_rl.weight_sync.delta import DeltaBucket, apply_delta
from megatron_rl.weight_sync.in_process import InProcessSpec


def read_weight_update(hf_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of one ``update_weights(hf_dir, ...)``: every tensor of the HF checkpoint in ``hf_dir``
    (``model.safetensors``, a ``model.safetensors.index.json`` shard set, or ``pytorch_model.bin``). Any failure
    is a ``WeightSyncError`` naming the directory (the engine's contract), unlike the checkpoint converter's
    ``convert.storage.read_hf_state_dict`` (safetensors only, ``CheckpointFormatError``)."""
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


def _expert_target(own: Mapping[str, torch.Tensor], name: str):
    """The slice of transformers-5's fused expert tensors (``...mlp.experts.gate_up_proj [E, 2F, H]`` /
    ``...mlp.experts.down_proj [E, H, F]``) that per-expert HF tensor ``name`` fills, or None."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    pre, e, proj = m.group(1), int(m.group(2)), m.group(3)
    if proj == "down_proj":
        fused = own.get(f"{pre}down_proj")
        return None if fused is None else fused[e]
    fused = own.get(f"{pre}gate_up_proj")
    if fused is None:
        return None
    f = fused.shape[1] // 2
    return fused[e, :f] if proj == "gate_proj" else fused[e, f:]


_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _apply(d, dst: torch.Tensor) -> None:
    apply_delta(dst, d)


class BucketLoader(WeightReceiver):
    """In-process receiver of the embedded engine (``rollout.weight_sync: tensor``): each bucket's names and
    shapes are checked before any of it is copied; ``commit`` checks that every tensor of the model was
    loaded exactly once. Per-expert HF tensors go straight into the fused expert slices."""

    def __init__(self, engine, version: str, timeout_s: float = 600.0):
        self.engine = engine
        self.version = version
        self.timeout_s = timeout_s
        self.own = engine.model.state_dict()
        self.tied = engine.tied_lm_head
        self.expected = {k for k in self.own if not (k.endswith("rotary_emb.inv_freq") or
                                                     k.endswith("original_inv_freq"))}
        self.seen: dict[str, int] = {}
        self.fused_rows: dict[str, int] = {}
        self.held = engine.weight_version  # the version deltas must start from

    def _target(self, name: str) -> torch.Tensor | None:
        if name in self.own:
            return self.own[name]
        return _expert_target(self.own, name)

    def load(self, bucket) -> None:
        """A ``Bucket`` (copied in) or a ``delta.DeltaBucket`` (applied to the version the engine holds, which
        must be the delta's base)."""
        if isinstance(bucket, DeltaBucket):
            if bucket.base is not None and (bucket.base != self.held or self.engine._invalid is not None):
                raise WeightSyncError(f"weight delta to {self.version!r} is from {bucket.base!r}, but the engine "
                                      f"holds {self.held!r}" + (" (invalid)" if self.engine._invalid else ""))
            pairs = [(d.name, d.shape, functools.partial(_apply, d)) for d in bucket.deltas()]
        else:
            # (a ``Pieces``: each piece put in place)
            pairs = [(name, t.shape, functools.partial(copy_into, t)) for name, t in bucket.tensors()]
        errors = []
        for name, shape, _ in pairs:
            dst = self._target(name)
            if dst is None:
                errors.append(f"{name!r}: not a tensor of the engine's model")
            elif tuple(dst.shape) != tuple(shape):
                errors.append(f"{name!r}: shape {tuple(shape)} != engine's {tuple(dst.shape)}")
            elif name in self.seen:
                errors.append(f"{name!r}: sent twice")
        if errors:
            raise WeightSyncError(f"weight bucket for version {self.version!r} does not match the engine's model: "
                                  + "; ".join(errors))
        with torch.no_grad():
            for name, _, put in pairs:
                self.seen[name] = 1
                if self.tied and name == "lm_head.weight":
                    continue  # shares storage with the embedding, which is copied
                put(self._target(name))
                m = _EXPERT.match(name)
                if m is not None and name not in self.own:  # count the fused slices filled
                    fused = m.group(1) + ("down_proj" if m.group(3) == "down_proj" else "gate_up_proj")
                    self.fused_rows[fused] = self.fused_rows.get(fused, 0) + 1

    def commit(self) -> None:
        missing = []
        for k in sorted(self.expected):
            if k in self.seen or (self.tied and k == "lm_head.weight"):
                continue
            if k.endswith("gate_up_proj") or k.endswith("experts.down_proj"):
                need = self.own[k].shape[0] * (2 if k.endswith("gate_up_proj") else 1)
                if self.fused_rows.get(k, 0) == need:
                    continue
            missing.append(k)
        if missing:
            raise WeightSyncError(f"weight sync to version {self.version!r}: {len(missing)} tensor(s) of the engine's "
                                  f"model were not sent: {missing[:8]}")
        self.engine._mark_synced(self.version)

    def abort(self, reason: str) -> None:
        self.engine.invalidate_weights(f"weight sync to version {self.version!r} failed: {reason}")

    def channel(self) -> InProcessSpec:
        """Every sender's buckets come to rank 0's process, where this model lives (``in_process.InProcessSpec``)."""
        return InProcessSpec(self.timeout_s)
