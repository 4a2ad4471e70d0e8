"""HF weights in and out of the live actor (via ``megatron_rl.convert``).

* ``load_hf_weights(chunks, hf_dir, model_cfg, parallel_cfg)``: this rank's shard of a HF checkpoint
  (safetensors) — or of a directory written by ``megatron-rl convert hf-to-mcore`` (any saved layout,
  resharded on the fly) — into its model chunk(s), at any TP/PP/EP/ETP (and VPP) layout.
* ``HFExporter.full_state_dict_hf(model)``: collective; every distinct shard (dense weights from DP/CP
  rank 0, expert weights from expert-DP rank 0) is gathered to global rank 0, unsharded
  (``megatron_rl.models.sharding.unshard_state_dicts``) and mapped to HF names
  (``megatron_rl.convert.mcore_to_hf``). ``export_hf(model, out_dir)`` also writes the directory
  (safetensors + config.json/tokenizer copied from ``load_hf``, or a generated config.json).
  The gather goes through ``gather_object`` (CPU copies): memory on rank 0 ~ one full model.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.actor.groups import ActorGroups

__all__ = ["load_hf_weights", "HFExporter", "infer_hf_model_type", "is_converted_dir", "hf_assets_dir"]


def is_converted_dir(path: str) -> bool:
    """True for a directory written by ``megatron_rl.convert.convert_hf_to_mcore`` (per-rank shards)."""
    from megatron_rl.convert.storage import METADATA_FILE

    return os.path.isfile(os.path.join(path, METADATA_FILE))


def hf_assets_dir(path: str) -> str:
    """Where config.json / tokenizer files of ``path`` live (``hf_assets/`` of a converted directory)."""
    from megatron_rl.convert.storage import ASSETS_DIR

    return os.path.join(path, ASSETS_DIR) if is_converted_dir(path) else path


def load_hf_weights(chunks: Sequence[torch.nn.Module], hf_dir: str, model_cfg, parallel_cfg) -> None:
    """Load ``hf_dir`` into this rank's chunk(s). Raises the converter's errors (naming tensors and
    shapes) on any mismatch between the checkpoint and the model config."""
    from megatron_rl.convert import (ShardLayout, hf_to_mcore, load_rank_state_dict, load_state_dict_into_model,
                                     read_hf_checkpoint)
    from megatron_rl.models.sharding import RankCoords, load_full_state_dict

    coords = RankCoords.from_parallel_state()
    if len(chunks) == 1:
        layout = ShardLayout(tensor_model_parallel_size=coords.tp_size, pipeline_model_parallel_size=coords.pp_size,
                             expert_model_parallel_size=coords.ep_size, expert_tensor_parallel_size=coords.etp_size,
                             padded_vocab_size=model_cfg.vocab_size)
        sd = load_rank_state_dict(hf_dir, layout, tp_rank=coords.tp_rank, pp_rank=coords.pp_rank,
                                  ep_rank=coords.ep_rank, etp_rank=coords.etp_rank)
        load_state_dict_into_model(chunks[0], sd, where=f"{hf_dir} -> {coords}")
        return
    if is_converted_dir(hf_dir):
        from megatron_rl.convert import read_full_mcore_state_dict

        geom, full = read_full_mcore_state_dict(hf_dir)
    else:
        geom, _, hf_sd = read_hf_checkpoint(hf_dir)
        full = hf_to_mcore(hf_sd, geom)
    V = model_cfg.vocab_size
    for k in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if k in full and full[k].shape[0] != V:
            if full[k].shape[0] < geom.vocab_size or V < geom.vocab_size:
                raise ValueError(f"{hf_dir}: {k} has {full[k].shape[0]} rows, model.vocab_size={V}, "
                                 f"checkpoint vocab_size={geom.vocab_size}")
            rows = full[k][: geom.vocab_size]
            full[k] = torch.cat([rows, rows.new_zeros(V - geom.vocab_size, rows.shape[1])])
    load_full_state_dict(list(chunks), full, model_cfg)


def infer_hf_model_type(model_cfg) -> str:
    """HF model_type for a ModelConfig without a source checkpoint: qwen3(_moe) with q/k norm,
    qwen2_moe with a shared expert, qwen2 with QKV bias, else llama / qwen3_moe."""
    if model_cfg.is_moe:
        if model_cfg.moe_shared_expert_intermediate_size:
            return "qwen2_moe"
        return "qwen3_moe"
    if model_cfg.qk_layernorm:
        return "qwen3"
    return "qwen2" if model_cfg.add_qkv_bias else "llama"


def _is_expert_param(name: str) -> bool:
    return ".mlp.experts." in name


class HFExporter:
    """Gathers the actor's shards and maps them to a HF checkpoint (see the module docstring)."""

    def __init__(self, model_cfg, parallel_cfg, groups: ActorGroups, hf_dir: Optional[str]) -> None:
        from megatron_rl.convert import HFGeometry
        from megatron_rl.convert.storage import read_hf_config
        from megatron_rl.models.hf_config import megatron_to_hf_config

        self.model_cfg, self.parallel_cfg, self.groups, self.hf_dir = model_cfg, parallel_cfg, groups, hf_dir
        if hf_dir:
            self.hf_config = read_hf_config(hf_assets_dir(hf_dir))
        else:
            self.hf_config = megatron_to_hf_config(model_cfg, infer_hf_model_type(model_cfg))
        self.geometry = HFGeometry.from_hf_config(self.hf_config)

    def _local_shards(self, model: Sequence[torch.nn.Module]) -> List[tuple]:
        from megatron_rl.convert import canonical_state_dict
        from megatron_rl.models.sharding import RankCoords

        g = self.groups
        send_dense = g.dp_rank == 0 and g.cp_rank == 0
        send_expert = g.edp_rank == 0
        out = []
        base = RankCoords.from_parallel_state()
        for i, chunk in enumerate(model):
            sd = canonical_state_dict(chunk.state_dict())
            keep = {k: v.detach().cpu().clone() for k, v in sd.items()
                    if (send_expert if _is_expert_param(k) else send_dense)}
            if keep:
                out.append((replace(base, vp_stage=i), keep))
        return out

    def full_mcore_state_dict(self, model: Sequence[torch.nn.Module]) -> Optional[Dict[str, torch.Tensor]]:
        """Collective: the full (TP1/PP1/EP1) Megatron state dict on global rank 0, None elsewhere."""
        from megatron_rl.models.sharding import unshard_state_dicts

        local = self._local_shards(model)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world == 1:
            gathered = [local]
        else:
            gathered = [None] * world if dist.get_rank() == 0 else None
            dist.gather_object(local, gathered, dst=0)
            if dist.get_rank() != 0:
                return None
        shards: Dict = {}
        for rank_shards in gathered:
            for coords, sd in rank_shards:
                shards.setdefault(coords, {}).update(sd)
        return unshard_state_dicts(shards, self.model_cfg, self.parallel_cfg)

    def full_state_dict_hf(self, model: Sequence[torch.nn.Module]) -> Optional[Dict[str, torch.Tensor]]:
        """Collective: {HF name: CPU tensor} on global rank 0, None elsewhere."""
        from megatron_rl.convert import mcore_to_hf

        full = self.full_mcore_state_dict(model)
        if full is None:
            return None
        V = self.geometry.vocab_size
        for k in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if k in full and full[k].shape[0] > V:  # drop padded vocab rows
                full[k] = full[k][:V].contiguous()
        return mcore_to_hf(full, self.geometry)

    def export_hf(self, model: Sequence[torch.nn.Module], out_dir: str) -> Optional[list]:
        """Collective: rank 0 writes the HF directory ``out_dir``; returns its weight files there."""
        from megatron_rl.convert.storage import copy_hf_assets, write_hf_state_dict

        sd = self.full_state_dict_hf(model)
        files = None
        if sd is not None:
            os.makedirs(out_dir, exist_ok=True)
            if self.hf_dir:
                copy_hf_assets(hf_assets_dir(self.hf_dir), out_dir)
            else:
                with open(os.path.join(out_dir, "config.json"), "w") as fh:
                    json.dump(self.hf_config, fh, indent=2, sort_keys=True)
            files = write_hf_state_dict(out_dir, sd)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        return files
