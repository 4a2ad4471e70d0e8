"""Export a saved actor checkpoint (the ``actor/checkpoint.py`` layout the RL loop writes under
``trainer.run_dir/checkpoints/step_N``) to a HF directory that ``transformers`` loads and SGLang serves.

The live actor loads and exports through ``megatron_rl.convert.live`` directly; this module only adds
what a checkpoint on disk needs: find the iteration directory (``latest``), rebuild the model config it was
saved with, find the HF files to put beside the weights, and read the model tensors of its torch_dist
part in one process (any TP / PP / VPP / EP layout; optimizer state is skipped)::

    files = export_checkpoint_to_hf("runs/tiny_cpu/checkpoints/step_200", "runs/tiny_cpu/hf_step_200")

Config and tokenizer files come from ``assets_dir`` when given, else from the run's ``actor.load_hf``
(recorded in the checkpoint's extra state by the RL loop) when that directory still exists, else a
config.json is generated from the saved model config (no tokenizer files; a warning says so). Command
line: ``megatron-rl convert mcore-to-hf --mcore-dir runs/tiny_cpu/checkpoints/step_200 --out DIR``.
"""
from __future__ import annotations

import json
import os
import warnings
from typing import List, Optional

import torch

from megatron_rl.actor.checkpoint import LATEST_FILE, META_FILE, resolve_checkpoint_dir
from megatron_rl.convert import export_torch_dist_to_hf, hf_target
from megatron_rl.convert.checks import CheckpointMismatchError
from megatron_rl.convert.lora_export import export_adapter_checkpoint
from megatron_rl.convert.storage import hf_assets_dir
from megatron_rl.models.config import ModelConfig, model_config_from_dict

__all__ = ["is_actor_checkpoint", "export_checkpoint_to_hf"]

_DIST_DIR = "dist"               # megatron dist_checkpointing part of an iteration directory
_EXTRA_STATE_FILE = "extra_state.pt"


def is_actor_checkpoint(path: str) -> bool:
    """True for an actor checkpoint root (with ``latest``) or one of its ``iter_*`` directories."""
    return os.path.isfile(os.path.join(path, META_FILE)) or os.path.isfile(os.path.join(path, LATEST_FILE))


def _run_hf_dir(iter_dir: str) -> Optional[str]:
    """The run's ``actor.load_hf`` if the checkpoint's extra state records it and it still holds a config."""
    path = os.path.join(iter_dir, _EXTRA_STATE_FILE)
    if not os.path.isfile(path):
        return None
    extra = torch.load(path, weights_only=False)
    hf_dir = ((extra.get("config") or {}).get("actor") or {}).get("load_hf") if isinstance(extra, dict) else None
    if hf_dir and os.path.isfile(os.path.join(hf_assets_dir(hf_dir), "config.json")):
        return hf_dir
    return None


def export_checkpoint_to_hf(path: str, out_dir: str, assets_dir: Optional[str] = None,
                            merge: bool = False) -> List[str]:
    """Write the model of the actor checkpoint ``path`` (a root with ``latest`` or an ``iter_*``
    directory) as a HF directory ``out_dir``; returns the weight files. ``assets_dir``: HF (or converted)
    directory whose config / tokenizer files go beside the weights; it must match the saved model. A LoRA run
    is written as a PEFT adapter, or with ``merge`` as the merged model (``convert.lora_export.export_full``)."""
    iter_dir = resolve_checkpoint_dir(path)
    with open(os.path.join(iter_dir, META_FILE)) as fh:
        meta = json.load(fh)
    model_cfg: ModelConfig = model_config_from_dict(meta["model"])
    lora = meta.get("lora")  # a LoRA actor's checkpoint: the adapters alone, its base named
    source = assets_dir or (lora["base"]["path"] if lora else None) or _run_hf_dir(iter_dir)
    if source is None:
        warnings.warn(f"{iter_dir}: no HF directory to take config / tokenizer files from (pass --hf-assets-dir); "
                      f"writing a config.json generated from the saved model config, without tokenizer files",
                      stacklevel=2)
    target = hf_target(model_cfg, source)
    if lora:
        return export_adapter_checkpoint(os.path.join(iter_dir, _DIST_DIR), target.geometry, out_dir, lora, merge,
                                         base_dir=source, assets_dir=target.assets_dir, config=target.config)
    if merge:
        raise CheckpointMismatchError(f"--merge: {iter_dir} is not a LoRA run's checkpoint (no actor.lora recorded)")
    return export_torch_dist_to_hf(os.path.join(iter_dir, _DIST_DIR), out_dir, target.config, target.assets_dir)
