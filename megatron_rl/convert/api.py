"""HF <-> Megatron checkpoint conversion: the functions the CLI, the trainer and tests call.

All of it runs in one process without a process group (pure tensor slicing):

    convert_hf_to_mcore(hf_dir, out_dir, ShardLayout(tensor_model_parallel_size=2, ...))
    convert_mcore_to_hf(out_dir, hf_out_dir)                   # weights + config + tokenizer files
    sd = load_rank_state_dict(out_dir_or_hf_dir, layout, tp_rank=..., pp_rank=..., ep_rank=..., etp_rank=...)
    export_hf_from_full(full_sd, geometry, hf_out_dir, assets_dir)
    mcfg = model_config_for_checkpoint(hf_or_converted_dir, tensor_model_parallel_size=2)

``load_rank_state_dict`` reshards on the fly when the requested layout differs from the saved one, and
also accepts a HF directory directly (HF -> rank shard without an intermediate directory).
"""
from __future__ import annotations

import os
from typing import Dict, Mapping, Optional, Tuple

import torch

from megatron_rl.convert import storage
from megatron_rl.convert.checks import CheckpointFormatError
from megatron_rl.convert.geometry import HFGeometry
from megatron_rl.convert.hf_config import model_config_from_hf
from megatron_rl.convert.lora_export import export_full, read_lora_config
from megatron_rl.convert.slices import read_chunk_from_converted, read_chunk_shard
from megatron_rl.convert.mapping import hf_to_mcore, mcore_to_hf
from megatron_rl.convert.shard_files import (ShardLayout, dense_keys, dense_shard, expert_keys, expert_shard,
                                             rank_state_dict, unshard)
from megatron_rl.convert.torch_dist import is_torch_dist_checkpoint, read_torch_dist_model_state_dict
from megatron_rl.models.config import ModelConfig

Tensor = torch.Tensor


def read_hf_checkpoint(hf_dir: str) -> Tuple[HFGeometry, dict, Dict[str, Tensor]]:
    """(geometry, config.json dict, HF state dict) of a HF model directory; the geometry is checked
    (unsupported ``architectures`` raise) before any weight is read."""
    cfg = storage.read_hf_config(hf_dir)
    geom = HFGeometry.from_hf_config(cfg)
    return geom, cfg, storage.read_hf_state_dict(hf_dir)


def model_config_for_checkpoint(ckpt_dir: str, tensor_model_parallel_size: int = 1,
                                make_vocab_size_divisible_by: int = 1) -> ModelConfig:
    """``ModelConfig`` to build for a HF directory or a converted directory at this TP size: the vocab is
    padded like the converter pads it (multiple of make_vocab_size_divisible_by x TP)."""
    cfg = storage.read_hf_config(storage.hf_assets_dir(ckpt_dir))
    lay = ShardLayout(tensor_model_parallel_size=tensor_model_parallel_size,
                      make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    return model_config_from_hf(cfg, padded_vocab_size=lay.padded_vocab(int(cfg["vocab_size"])))


def convert_hf_to_mcore(hf_dir: str, out_dir: str, layout: ShardLayout, overwrite: bool = False) -> dict:
    """Import a HF safetensors checkpoint into per-rank Megatron shards in ``out_dir``.

    Checks (in this order, before writing anything): supported architecture and options, layout fits
    the model (divisibility by TP/PP/EP/ETP), ``out_dir`` empty (or ``overwrite``: then a previous converted
    checkpoint there is removed first — only files of this format), every tensor name and shape.
    Returns the metadata written.
    """
    hf_cfg = storage.read_hf_config(hf_dir)
    geom = HFGeometry.from_hf_config(hf_cfg)
    layout.validate(geom)
    model_config = model_config_from_hf(hf_cfg, padded_vocab_size=layout.padded_vocab(geom.vocab_size)).to_dict()
    storage.prepare_output_dir(out_dir, overwrite)
    hf_sd = storage.read_hf_state_dict(hf_dir)
    full = hf_to_mcore(hf_sd, geom)
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in full.values()})
    for tp, pp in dense_keys(layout):
        storage.write_safetensors(storage.dense_file(out_dir, tp, pp), dense_shard(full, geom, layout, tp, pp))
    for ep, etp, pp in expert_keys(geom, layout):
        storage.write_safetensors(storage.expert_file(out_dir, ep, etp, pp),
                                  expert_shard(full, geom, layout, ep, etp, pp))
    assets = storage.copy_hf_assets(hf_dir, os.path.join(out_dir, storage.ASSETS_DIR))
    meta = {
        "geometry": geom.to_dict(),
        "layout": layout.to_dict(),
        "padded_vocab_size": layout.padded_vocab(geom.vocab_size),
        "dtypes": dtypes,
        "hf_assets": assets,
        "source_hf_dir": os.path.abspath(hf_dir),
        "model_config": model_config,
    }
    storage.write_metadata(out_dir, meta)
    return meta


def _saved_layout(meta: dict) -> ShardLayout:
    lay = dict(meta["layout"])
    lay["padded_vocab_size"] = meta["padded_vocab_size"]
    return ShardLayout(**lay)


def read_mcore_checkpoint(mcore_dir: str) -> Tuple[HFGeometry, ShardLayout, dict]:
    """(geometry, saved layout, metadata) of a converted shard directory."""
    meta = storage.read_metadata(mcore_dir)
    return HFGeometry.from_dict(meta["geometry"]), _saved_layout(meta), meta


def read_full_mcore_state_dict(mcore_dir: str, count: Optional[storage.ReadCount] = None
                               ) -> Tuple[HFGeometry, Dict[str, Tensor]]:
    """Read every shard of a converted directory and glue them into the full Megatron state dict."""
    geom, layout, _ = read_mcore_checkpoint(mcore_dir)
    dense = {(tp, pp): storage.read_shard(storage.dense_file(mcore_dir, tp, pp), f"shard tp={tp} pp={pp}", count)
             for tp, pp in dense_keys(layout)}
    experts = {(ep, etp, pp): storage.read_shard(storage.expert_file(mcore_dir, ep, etp, pp),
                                                 f"expert shard ep={ep} etp={etp} pp={pp}", count)
               for ep, etp, pp in expert_keys(geom, layout)}
    return geom, unshard(dense, experts, geom, layout)


def read_full_state_dict(ckpt_dir: str, count: Optional[storage.ReadCount] = None
                         ) -> Tuple[HFGeometry, Dict[str, Tensor]]:
    """(geometry, full Megatron state dict with the HF vocab) of a HF directory or a converted directory."""
    if storage.is_converted_dir(ckpt_dir):
        return read_full_mcore_state_dict(ckpt_dir, count)
    geom = HFGeometry.from_hf_config(storage.read_hf_config(ckpt_dir))
    return geom, hf_to_mcore(storage.read_hf_state_dict(ckpt_dir, count), geom)


def export_hf_from_full(full: Mapping[str, Tensor], geom: HFGeometry, out_dir: str,
                        assets_dir: Optional[str] = None, max_shard_bytes: int = storage.DEFAULT_MAX_SHARD_BYTES,
                        config: Optional[dict] = None) -> list:
    """Write a full Megatron state dict as a HF model directory (weights + assets copied from
    ``assets_dir``; a config.json is required there, in ``config`` or already in ``out_dir``; weight files
    above ``max_shard_bytes`` are split with a ``model.safetensors.index.json``). Returns weight files."""
    return storage.write_hf_model_dir(out_dir, mcore_to_hf(full, geom), assets_dir, config, max_shard_bytes)


def convert_mcore_to_hf(mcore_dir: str, out_dir: str, max_shard_bytes: int = storage.DEFAULT_MAX_SHARD_BYTES,
                        assets_dir: Optional[str] = None, merge: bool = False, lora: Optional[dict] = None) -> list:
    """Export a converted shard directory — or a megatron torch_dist (dist_checkpointing) checkpoint —
    to a HF safetensors directory. Config and tokenizer files come from ``assets_dir`` (default: the
    ``hf_assets`` copy kept at import time; required for torch_dist checkpoints without one). A checkpoint with
    LoRA adapters is written as a PEFT adapter, or with ``merge`` as the merged model (``lora_export.export_full``;
    ``lora``: its ``actor.lora`` section, default ``lora_config.json`` beside it). Returns the files written."""
    lora = lora or read_lora_config(mcore_dir)
    if assets_dir is None and os.path.isdir(os.path.join(mcore_dir, storage.ASSETS_DIR)):
        assets_dir = os.path.join(mcore_dir, storage.ASSETS_DIR)
    if is_torch_dist_checkpoint(mcore_dir):
        if assets_dir is None:
            raise CheckpointFormatError(
                f"{mcore_dir} is a torch_dist checkpoint without {storage.ASSETS_DIR}/: pass the original HF "
                f"directory as assets_dir / --hf-assets-dir (config.json + tokenizer)")
        return export_torch_dist_to_hf(mcore_dir, out_dir, storage.read_hf_config(assets_dir), assets_dir,
                                       max_shard_bytes, merge=merge, lora=lora)
    geom, full = read_full_mcore_state_dict(mcore_dir)
    return export_full(full, geom, out_dir, lora, merge, assets_dir, None, max_shard_bytes)


def export_torch_dist_to_hf(dist_dir: str, out_dir: str, hf_cfg: dict, assets_dir: Optional[str] = None,
                            max_shard_bytes: int = storage.DEFAULT_MAX_SHARD_BYTES, merge: bool = False,
                            lora: Optional[dict] = None) -> list:
    """Export the model tensors of a torch_dist checkpoint (any TP / PP / EP layout it was saved with) as
    the HF model ``hf_cfg`` describes: config / tokenizer files from ``assets_dir`` when given, else
    ``hf_cfg`` as config.json; LoRA adapters as in ``convert_mcore_to_hf``. Returns the files written."""
    geom = HFGeometry.from_hf_config(hf_cfg)
    full = read_torch_dist_model_state_dict(dist_dir, geom)
    return export_full(full, geom, out_dir, lora, merge, assets_dir, hf_cfg, max_shard_bytes)


def load_rank_state_dict(ckpt_dir: str, layout: ShardLayout, tp_rank: int = 0, pp_rank: int = 0,
                         ep_rank: int = 0, etp_rank: int = 0, count: Optional[storage.ReadCount] = None
                         ) -> Dict[str, Tensor]:
    """State dict of one rank of ``layout`` (local-spec names), from a converted directory or a HF directory;
    the bytes read are added to ``count``.

    Only this rank's positions are read: a converted directory saved with the same layout (and padded
    vocab) file-for-file, a HF directory or one converted for any other layout slice by slice (``slices``).
    """
    if not storage.is_converted_dir(ckpt_dir):
        geom = HFGeometry.from_hf_config(storage.read_hf_config(ckpt_dir))
        layout.validate(geom)
        coords = layout.coords(tp_rank, pp_rank, ep_rank, etp_rank)
        return read_chunk_shard(storage.SafetensorsReader.for_hf_dir(ckpt_dir, count), geom, coords,
                                layout.padded_vocab(geom.vocab_size))
    geom, saved, _ = read_mcore_checkpoint(ckpt_dir)
    layout.validate(geom)
    def key(lay: ShardLayout) -> tuple:
        return (lay.tp, lay.pp, lay.ep, lay.etp, lay.num_layers_in_first_pipeline_stage,
                lay.num_layers_in_last_pipeline_stage)

    same = key(saved) == key(layout) and \
        saved.padded_vocab(geom.vocab_size) == layout.padded_vocab(geom.vocab_size)
    if same:
        sd = storage.read_shard(storage.dense_file(ckpt_dir, tp_rank, pp_rank), f"shard tp={tp_rank} pp={pp_rank}",
                                count)
        if geom.is_moe:
            sd.update(storage.read_shard(storage.expert_file(ckpt_dir, ep_rank, etp_rank, pp_rank),
                                         f"expert shard ep={ep_rank} etp={etp_rank} pp={pp_rank}", count))
        return sd
    return read_chunk_from_converted(ckpt_dir, geom, saved, layout.coords(tp_rank, pp_rank, ep_rank, etp_rank),
                                     layout.padded_vocab(geom.vocab_size), count)
